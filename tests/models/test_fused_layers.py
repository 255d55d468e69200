"""The layers on the attention prologue, gated activation, prefill conv and routed-expert kernels
(kernels/qk_norm_rope.py, kernels/act_mul.py, kernels/causal_conv1d.py, kernels/moe_experts.py, and
kernels/tree_attention.py for short prefills' attention, interpreted on CPU) against the same layers on
their torch twins, in fp32.

The kernels are swapped in alone (the torch backend with only ``qk_norm_rope_store``, ``act_mul``,
``prefill_conv``, ``tree_attention`` and ``moe_experts`` replaced), so every difference is theirs: each
GatedAttention, MLP and SparseMoE output is compared module by module through prefill, decode, tree verification and
the commit, and the KV caches slot by slot. The backend wiring itself (model -> layers) is checked for
the "triton" and "torch" backends.
"""

import dataclasses
import functools

import pytest
import torch
from conftest import Runner, rel_err

from bole.backend import resolve_backend
from bole.layers.attention import GatedAttention
from bole.layers.mlp import MLP
from bole.layers.moe import Experts, SparseMoE
from bole.models.loader import load_model
from bole.ops.activation import act_mul_ref
from bole.ops.moe import moe_experts_ref
from bole.ops.rope import qk_norm_rope_store_ref
from bole.spec.tree import random_tree

TOL = 1e-5
FUSED = (GatedAttention, MLP, SparseMoE)


def kernels_backend():
    from kernels.act_mul import act_mul
    from kernels.causal_conv1d import causal_conv1d_varlen
    from kernels.moe_experts import moe_experts
    from kernels.qk_norm_rope import qk_norm_rope_store
    from kernels.tree_attention import tree_attention

    return dataclasses.replace(resolve_backend("torch"), name="torch+fused", qk_norm_rope_store=qk_norm_rope_store,
                               act_mul=act_mul, prefill_conv=causal_conv1d_varlen, tree_attention=tree_attention,
                               moe_experts=moe_experts)


def record(model):
    """Every fused module's outputs, in call order (its forward hook)."""
    outs = []
    for name, m in model.named_modules():
        if isinstance(m, FUSED):
            m.register_forward_hook(lambda m, a, y, name=name: outs.append((name, y.detach().clone())))
    return outs


def drive(model, gen_seed):
    """Prefill two requests, decode twice, verify a tree per request and commit: (runner, logits per step)."""
    gen = torch.Generator().manual_seed(gen_seed)
    r = Runner(model)
    logits = []
    prompts = {0: torch.randint(0, 128, (13,), generator=gen).tolist(),
               1: torch.randint(0, 128, (5,), generator=gen).tolist()}
    for rid in prompts:
        r.add(rid)
    logits.append(r.step("prefill", prompts)[0])
    for _ in range(2):
        logits.append(r.step("decode", {0: [int(torch.randint(0, 128, (1,), generator=gen))], 1: [3]})[0])
    trees = [random_tree(n, 3, generator=gen) for n in (7, 4)]
    batch = {b: (list(t.parents), torch.randint(0, 128, (t.num_nodes,), generator=gen).tolist())
             for b, t in enumerate(trees)}
    out, _, ctx = r.verify(batch)
    logits.append(out)
    r.commit(ctx, [0, 1], [trees[0].num_nodes - 1, 0])
    logits.append(r.step("decode", {0: [5], 1: [6]})[0])
    return r, logits


@pytest.mark.parametrize("kind", ["dense", "next"])  # next: dense MLP, MoE experts and shared expert
def test_layers_on_kernels_match_twins(checkpoints, kind):
    if torch.cuda.is_available():
        pytest.skip("CPU tensors cannot reach compiled Triton kernels; tests/models/test_gpu.py covers CUDA")
    ck = checkpoints(kind)
    models = [load_model(ck.path, dtype="float32", backend=b) for b in ("torch", kernels_backend())]
    recs = [record(m) for m in models]
    runs = [drive(m, 7) for m in models]
    (r_t, logits_t), (r_k, logits_k) = runs
    assert len(recs[0]) == len(recs[1]) > 0
    kinds = set()
    for (name, a), (name_k, b) in zip(*recs, strict=True):
        assert name == name_k
        kinds.add(type(models[0].get_submodule(name)).__name__)
        assert rel_err(b, a) <= TOL, name
    assert kinds == ({"GatedAttention", "MLP"} if kind == "dense" else {"GatedAttention", "MLP", "SparseMoE"})
    for a, b in zip(logits_t, logits_k, strict=True):
        assert rel_err(b, a) <= TOL
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert rel_err(r_k.kv.kv, r_t.kv.kv) <= TOL


def kernel_of(f):
    """(function, bound keywords) of a backend entry: the triton backend binds ``checked=True`` to the
    kernels whose shared arguments the forward context checks (bole.backend.context_checked)."""
    return (f.func, f.keywords) if isinstance(f, functools.partial) else (f, {})


def test_backend_kernels_reach_the_layers(checkpoints):
    ck = checkpoints("next")
    torch_model = load_model(ck.path, dtype="float32", backend="torch")
    triton_model = load_model(ck.path, dtype="float32", backend="triton")
    from kernels.act_mul import act_mul
    from kernels.moe_experts import moe_experts
    from kernels.qk_norm_rope import qk_norm_rope_store

    for model, (prologue, act, experts) in (
            (torch_model, ((qk_norm_rope_store_ref, {}), act_mul_ref, moe_experts_ref)),
            (triton_model, ((qk_norm_rope_store, {"checked": True}), act_mul, moe_experts))):
        mods = [m for m in model.modules() if isinstance(m, (GatedAttention, MLP, SparseMoE))]
        assert {type(m) for m in mods} == {GatedAttention, MLP, SparseMoE}
        assert all(m.act_mul is act for m in mods)
        routed = [m for m in model.modules() if isinstance(m, Experts)]
        assert routed and all(m.dispatch is experts for m in routed)  # the MTP layer's too
        attn = [m for m in mods if isinstance(m, GatedAttention)]
        assert len(attn) == 2 and all(kernel_of(m.qk_norm_rope_store) == prologue for m in attn)  # the MTP layer's too
    # verify-mode attention (the target's and the drafter's): kernels.tree_attention on "triton", SDPA on "torch"
    from kernels.tree_attention import tree_attention

    for model, want in ((torch_model, None), (triton_model, (tree_attention, {"checked": True}))):
        of = lambda f: None if f is None else kernel_of(f)
        for m in model.modules():
            if isinstance(m, GatedAttention):
                assert of(m.tree_attention) == want
                assert of(m.prefill_attention) == want   # short prefill chunks, every attention layer
