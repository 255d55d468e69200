"""The one-launch forest layout (kernels/tree_layout.py) against its twin (bole/ops/tree_layout.py),
and the twin against the definition (ancestor walks in plain Python).

Inputs are the views a graph step passes: parents, num_cached and block tables as strided slices of
wider buffers. Outputs are poisoned before the run (every element must be written).
"""

import random

import pytest
import torch

from bole.ops.tree_layout import tree_layout_ref
from bole.spec.tree import PackedForest
from kernels.tree_layout import tree_layout


def random_parents(B, T, D, rng, deep=False):
    """parents [B, T] local (-1: child of the request root), each parent before its child; depth <= D
    unless ``deep``."""
    par = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):
        depth = []
        for t in range(T):
            opts = [-1] + [j for j in range(t) if deep or depth[j] < D]
            p = rng.choice(opts) if rng.random() < 0.7 else (opts[-1] if opts else -1)
            par[b, t] = p
            depth.append(1 if p < 0 else depth[p] + 1)
    return par


def outputs(B, T, L, D, device, poison=True):
    f = PackedForest.full_padded(torch.full((B, T), -1, dtype=torch.long, device=device), D)
    z = lambda *s, dtype=torch.long: torch.full(s, -7 if poison else 0, dtype=dtype, device=device)
    if poison:
        for t in (f.parents, f.depth, f.anc, f.anc_bits):
            t.fill_(-7)
    return dict(forest=f, positions=z(B * T), kv_positions=z(B * T), slot_mapping=z(B * T), kv_index=z(B, L),
                mask=torch.ones(B, 1, T, L, dtype=torch.bool, device=device) if poison else
                torch.zeros(B, 1, T, L, dtype=torch.bool, device=device),
                num_cached_out=z(B), state_slots_out=z(B))


def inputs(B, T, L, bs, D, seed, device, deep=False):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    par = random_parents(B, T, D, rng, deep)
    wide = torch.full((B, T + 3), 99, dtype=torch.long)
    wide[:, 2:T + 2] = par
    nblk = (L + bs - 1) // bs + 2
    rows = torch.zeros(B, 3 + nblk, dtype=torch.long)
    rows[:, 1] = torch.randint(0, max(1, L - T), (B,), generator=gen)   # num_cached
    rows[:, 2] = torch.randperm(50, generator=gen)[:B]                  # state slots
    rows[:, 3:] = torch.randperm(max(1000, B * nblk), generator=gen)[:B * nblk].view(B, nblk)
    wide, rows = wide.to(device), rows.to(device)
    return wide[:, 2:T + 2], rows[:, 1], rows[:, 3:], rows[:, 2]


def assert_same(a, b):
    fa, fb = a["forest"], b["forest"]
    for name in ("parents", "depth", "anc", "anc_bits"):
        assert torch.equal(getattr(fa, name).cpu(), getattr(fb, name).cpu()), name
    for name in ("positions", "kv_positions", "slot_mapping", "kv_index", "mask", "num_cached_out",
                 "state_slots_out"):
        assert torch.equal(a[name].cpu(), b[name].cpu()), name


@pytest.mark.parametrize("B,T,L,bs,D", [(1, 8, 256, 16, 5), (3, 53, 300, 16, 9), (2, 128, 512, 32, 16),
                                        (1, 256, 400, 16, 16), (1, 200, 300, 16, 12),
                                        (4, 1, 64, 8, 1), (2, 65, 200, 16, 3)])
def test_kernel_matches_twin(B, T, L, bs, D):
    for seed in range(2):
        par, nc, tab, slots = inputs(B, T, L, bs, D, seed, "cpu", deep=seed == 1)
        ref, got = outputs(B, T, L, D, "cpu"), outputs(B, T, L, D, "cpu")
        tree_layout_ref(par, nc, tab, bs, state_slots=slots, **ref)
        tree_layout(par, nc, tab, bs, state_slots=slots, **got)
        assert_same(ref, got)


def test_twin_matches_definition():
    B, T, L, bs, D = 2, 20, 64, 8, 6
    par, nc, tab, slots = inputs(B, T, L, bs, D, 3, "cpu")
    out = outputs(B, T, L, D, "cpu")
    tree_layout_ref(par, nc, tab, bs, state_slots=slots, **out)
    f = out["forest"]
    for b in range(B):
        n0 = int(nc[b])
        for t in range(T):
            chain, c = [], t
            while c >= 0 and len(chain) < D:
                chain.append(c)
                c = int(par[b, c])
            chain = chain[::-1]
            i = b * T + t
            assert f.depth[i] == len(chain)
            assert f.anc[i].tolist() == chain + [-1] * (D - len(chain))
            assert int(f.anc_bits[i, 0]) == sum(1 << a for a in chain)
            assert out["positions"][i] == n0 + len(chain) - 1
            assert out["kv_positions"][i] == n0 + t
            p = n0 + t
            assert out["slot_mapping"][i] == tab[b, p // bs] * bs + p % bs
            want = [p < n0 or (p - n0) in chain for p in range(L)]
            assert out["mask"][b, 0, t].tolist() == want
        assert out["kv_index"][b].tolist() == [int(tab[b, p // bs]) * bs + p % bs for p in range(L)]
    assert torch.equal(out["state_slots_out"], slots)


def test_without_state_slots_leaves_them():
    par, nc, tab, _ = inputs(2, 8, 64, 16, 4, 0, "cpu")
    out = outputs(2, 8, 64, 4, "cpu")
    tree_layout(par, nc, tab, 16, **out)
    assert (out["state_slots_out"] == -7).all()
    assert torch.equal(out["num_cached_out"], nc)


def test_bad_inputs():
    par, nc, tab, slots = inputs(2, 8, 64, 16, 4, 0, "cpu")
    out = outputs(2, 8, 64, 4, "cpu")
    with pytest.raises(ValueError, match="parents"):
        tree_layout(par.float(), nc, tab, 16, **out)
    with pytest.raises(ValueError, match="300 nodes"):
        tree_layout(torch.zeros(2, 300, dtype=torch.long), nc, tab, 16, **outputs(2, 300, 64, 4, "cpu"))
    with pytest.raises(ValueError, match="cannot cover"):
        tree_layout(par, nc, tab[:, :2], 16, **out)
    with pytest.raises(ValueError, match="positions"):
        tree_layout(par, nc, tab, 16, **{**out, "positions": out["positions"][:3]})
    with pytest.raises(ValueError, match="block_size"):
        tree_layout(par, nc, tab, 0, **out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,T,L,D", [(1, 64, 1024, 9), (16, 128, 2048, 16), (8, 31, 512, 5), (4, 256, 1024, 16)])
def test_kernel_matches_twin_cuda(B, T, L, D):
    par, nc, tab, slots = inputs(B, T, L, 16, D, 1, "cuda")
    ref, got = outputs(B, T, L, D, "cuda"), outputs(B, T, L, D, "cuda")
    tree_layout_ref(par, nc, tab, 16, state_slots=slots, **ref)
    tree_layout(par, nc, tab, 16, state_slots=slots, **got)
    assert_same(ref, got)
