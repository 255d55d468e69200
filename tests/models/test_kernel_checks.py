"""The kernels' checks of a forward's shared arguments (state slots, positions, KV slots, forest, token
offsets, committed lengths, key layouts) run once per ForwardContext (``ForwardContext.check_kernel_inputs``),
not once per layer, and still refuse a bad argument by name; the "triton" backend's per-layer kernels then
skip them (``checked=True``), interpreted on CPU here.
"""

import dataclasses

import pytest
import torch
from conftest import Runner

import bole.models.context as context
import kernels._checks as checks
from bole.models.loader import load_model
from bole.spec.tree import PackedForest, random_tree


def counting(monkeypatch, name, *modules):
    """Count the calls of ``name`` (still running it) through each of ``modules``, which import it."""
    calls = []
    inner = getattr(modules[0], name)

    def wrapped(*args, **kw):
        calls.append(args)
        return inner(*args, **kw)
    for module in modules:
        monkeypatch.setattr(module, name, wrapped)
    return calls


def verify_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(n, 3, generator=gen) for n in (7, 4)]
    return {b: (list(t.parents), torch.randint(0, 128, (t.num_nodes,), generator=gen).tolist())
            for b, t in enumerate(trees)}


def prefilled(model):
    r = Runner(model)
    for rid in (0, 1):
        r.add(rid)
    r.step("prefill", {0: list(range(3, 16)), 1: [4, 5, 6]})
    return r


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_context_checks_run_once_per_forward(checkpoints, monkeypatch, backend):
    model = load_model(checkpoints("dense").path, dtype="float32", backend=backend)
    layers = model.config.num_hidden_layers
    assert layers >= 4
    shared = counting(monkeypatch, "check_forward_inputs", context)
    forest_checks = counting(monkeypatch, "check_forest", checks)   # what check_forest_inputs runs unless checked
    r = prefilled(model)
    assert len(shared) == 1
    r.step("decode", {0: [7], 1: [8]})
    assert len(shared) == 2
    out, _, ctx = r.verify(verify_batch(0))
    assert len(shared) == 3                    # one verify forward over every layer: once
    assert shared[-1][3] is ctx.state_slots and shared[-1][6] is ctx.forest
    # the GDN layers' tree conv and verifier skipped the forest / slot checks the context ran: the only
    # forest check of the forward is the context's own
    assert len(forest_checks) == 1
    with torch.no_grad():
        model(torch.zeros(ctx.num_tokens, dtype=torch.long), ctx)
    assert len(shared) == 3                    # a second forward over the same context: memoised
    assert torch.isfinite(out).all()


SHARED = ("state_indices", "positions", "slot_mapping", "cu_seqlens", "num_cached", "kv_index", "mask", "kv_len")


def test_shared_tensors_are_checked_once_per_forward(checkpoints, monkeypatch):
    # the short prefill's kernels (causal conv, recurrence, causal tree attention) and the decode's take
    # the context's offsets / slots / key index as checked: each is type-checked once per forward, by the
    # context, whatever the layer count
    import kernels.causal_conv1d
    import kernels.gdn_decode
    import kernels.gdn_tree_conv
    import kernels.qk_norm_rope
    model = load_model(checkpoints("dense").path, dtype="float32", backend="triton")
    calls = counting(monkeypatch, "check_tensor", checks, kernels.causal_conv1d, kernels.gdn_decode,
                     kernels.gdn_tree_conv, kernels.qk_norm_rope)
    per_name = lambda: {n: sum(1 for a in calls if a[0] == n) for n in SHARED}
    r = prefilled(model)
    want = dict.fromkeys(SHARED, 1) | {"mask": 0, "kv_len": 0}   # causal rows: no mask; no static decode
    assert per_name() == want
    calls.clear()
    r.step("decode", {0: [7], 1: [8]})
    assert all(c <= 1 for c in per_name().values()), str(per_name())
    assert per_name()["state_indices"] == 1


@pytest.mark.parametrize("case,name", [
    ("slots_len", "state_indices"), ("slots_dtype", "state_indices"), ("positions_len", "positions"),
    ("slot_mapping_dtype", "slot_mapping"), ("forest_requests", "forest"), ("forest_type", "forest"),
    ("cu_len", "cu_seqlens"), ("cu_dtype", "cu_seqlens"), ("cached_len", "num_cached"),
    ("keys_dtype", "kv_index"), ("padded_mask", "mask"), ("padded_rows", "kv_index")])
def test_bad_context_argument_is_refused(checkpoints, case, name):
    model = load_model(checkpoints("dense").path, dtype="float32", backend="triton")
    r = prefilled(model)
    batch = verify_batch(1)
    forest = PackedForest.from_trees([batch[b][0] for b in batch])
    ctx = r.context("verify", list(batch), [len(batch[b][0]) for b in batch], forest)
    pa = ctx.padded_attention()
    bad = {"slots_len": dict(state_slots=ctx.state_slots[:1]),
           "slots_dtype": dict(state_slots=ctx.state_slots.float()),
           "positions_len": dict(positions=ctx.positions[:-1]),
           "slot_mapping_dtype": dict(slot_mapping=ctx.slot_mapping.double()),
           "forest_requests": dict(forest=PackedForest.from_trees([batch[0][0]] * 3)),
           "forest_type": dict(forest=object()),
           "cu_len": dict(cu_seqlens=ctx.cu_seqlens[:-1]), "cu_dtype": dict(cu_seqlens=ctx.cu_seqlens.float()),
           "cached_len": dict(num_cached=ctx.num_cached[:1]),
           # key layouts a graph set in the memo (graphs/prefill.py, graphs/tree.py)
           "keys_dtype": dict(_memo={"keys": ctx.key_index().float()}),
           "padded_mask": dict(_memo={"padded": dataclasses.replace(pa, mask=pa.mask.int())}),
           "padded_rows": dict(_memo={"padded": dataclasses.replace(pa, kv_index=pa.kv_index[:1])})}[case]
    ids = torch.tensor([t for b in batch for t in batch[b][1]])
    with pytest.raises(ValueError, match=name), torch.no_grad():
        model(ids, dataclasses.replace(ctx, **({"_memo": {}} | bad)))
