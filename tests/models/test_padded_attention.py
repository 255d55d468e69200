"""Batched verify / decode attention (one SDPA call per layer over padded keys) against the per-request
reference path, on random trees and uneven prefixes."""

import pytest
import torch
from conftest import Runner

import bole.layers.attention as attention
from bole.models.loader import load_model
from bole.spec.tree import random_tree

PREFIX = (21, 9, 3)


@pytest.fixture(scope="module")
def setup(checkpoints):
    ck = checkpoints("dense")
    model = load_model(ck.path, dtype="float32", backend="torch")
    gen = torch.Generator().manual_seed(5)
    r = Runner(model)
    for rid, n in enumerate(PREFIX):
        r.add(rid)
        r.step("prefill", {rid: torch.randint(0, 128, (n,), generator=gen).tolist()})
    return model, r, gen


def _both(fn):
    outs = []
    for batched in (True, False):
        attention.BATCHED_VERIFY_DECODE = batched
        try:
            outs.append(fn())
        finally:
            attention.BATCHED_VERIFY_DECODE = True
    return outs


def test_padded_layout_equals_per_request_masks(setup):
    _, r, gen = setup
    trees = [random_tree(n, 5, generator=gen) for n in (7, 1, 12)]
    from bole.spec.tree import PackedForest

    forest = PackedForest.from_trees([t.parents for t in trees])
    ctx = r.context("verify", [0, 1, 2], [t.num_nodes for t in trees], forest)
    pa = ctx.padded_attention()
    assert pa.tq == 12 and pa.mask.shape == (3, 1, 12, max(p + t.num_nodes for p, t in zip(PREFIX, trees)))
    for b, (P, t) in enumerate(zip(PREFIX, trees)):
        T = t.num_nodes
        want = torch.zeros(pa.tq, pa.mask.shape[-1], dtype=torch.bool)
        want[:T, :P] = True
        want[:T, P:P + T] = ctx.tree_mask(b)
        want[T:, 0] = True  # padding rows see one key, never none
        assert torch.equal(pa.mask[b, 0], want), b
        assert torch.equal(pa.kv_index[b, :P + T], ctx.kv_slots[b])
        assert torch.equal(pa.rows[ctx.cu_host[b]:ctx.cu_host[b + 1]], b * pa.tq + torch.arange(T))


def test_batched_verify_matches_per_request(setup):
    _, r, gen = setup
    trees = [random_tree(n, 4, generator=gen) for n in (9, 16, 2)]
    batch = {b: (list(t.parents), torch.randint(0, 128, (t.num_nodes,), generator=gen).tolist())
             for b, t in enumerate(trees)}
    fast, ref = _both(lambda: r.verify(batch)[0])
    assert torch.allclose(fast, ref, atol=1e-5, rtol=1e-5), (fast - ref).abs().max()


@torch.no_grad()
def test_batched_decode_matches_per_request(setup):
    model, r, gen = setup
    ids = torch.randint(0, 128, (3,), generator=gen)
    ctx = r.context("decode", [0, 1, 2], [1, 1, 1])
    saved = (r.pool.ssm.clone(), r.pool.conv.clone())

    def run():
        r.pool.ssm.copy_(saved[0])
        r.pool.conv.copy_(saved[1])
        return model.compute_logits(model(ids, ctx))

    fast, ref = _both(run)
    assert torch.allclose(fast, ref, atol=1e-5, rtol=1e-5), (fast - ref).abs().max()
