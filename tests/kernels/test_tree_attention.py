"""The paged tree attention kernel (kernels/tree_attention.py) against its twin (bole/ops/attention.py)
and against GatedAttention's batched verify path (gather, padded rows, masked SDPA).

Caches are real ``PagedKVCache`` objects (layer 1 of 2); each request owns random blocks (a random
permutation), and every cache entry that is not one of a request's keys (its prefix and its tree) is
NaN, so a key read past num_cached + T, or from the other layer, fails. Masks are laid out as
``ForwardContext.padded_attention`` lays them (prefix visible, ancestor-or-self among the tree, padding
rows see key 0). q is a head-strided view of a [q | gate] projection whose gate half is NaN; outputs
are NaN-poisoned. Under TRITON_INTERPRET bf16 activations are left to the GPU test.
"""

import pytest
import torch
from numerics import rel_err

from bole.cache.kv_cache import PagedKVCache
from bole.layers.attention import sdpa
from bole.ops.attention import tree_attention_ref
from bole.spec.tree import PackedForest, random_tree
from kernels.tree_attention import tree_attention


def tree_inputs(device, prefixes, sizes, HQ, HKV, D, dtype, cache_dtype, seed, L=None, tq=None,
                block_size=16, junk=float("nan")):
    """q [N, HQ, D] view, k/v [slots, HKV, D] views, kv_index [B, L], mask [B, 1, tq, L], cu_seqlens,
    num_cached, the cache."""
    gen = torch.Generator().manual_seed(seed)
    B = len(prefixes)
    L = L or max(p + t for p, t in zip(prefixes, sizes))
    tq = tq or max(sizes)
    nb = -(-L // block_size)
    cache = PagedKVCache(2, B * nb + 3, block_size, HKV, D, dtype=cache_dtype, device=device)
    cache.kv.fill_(junk)
    perm = torch.randperm(cache.num_blocks, generator=gen)[:B * nb].view(B, nb)
    pos = torch.arange(L)
    kv_index = perm[:, pos // block_size] * block_size + pos % block_size                  # [B, L]
    hi = torch.tensor([p + t for p, t in zip(prefixes, sizes)])
    valid = pos[None, :] < hi[:, None]
    slots = kv_index[valid]
    cache.write(1, slots.to(device), torch.randn(slots.numel(), HKV, D, generator=gen).to(device),
                torch.randn(slots.numel(), HKV, D, generator=gen).to(device))
    kv_index[1::2][~valid[1::2]] = 10 ** 9  # odd rows: slot ids past the cache where never read
    trees = [random_tree(t, 6, generator=gen) for t in sizes]
    forest = PackedForest.from_trees([t.parents for t in trees])
    mask = torch.zeros(B, 1, tq, L, dtype=torch.bool)
    for b, (P, T) in enumerate(zip(prefixes, sizes)):
        mask[b, 0, :T, :P] = True
        mask[b, 0, :T, P:P + T] = forest.ancestor_mask(b)
        mask[b, 0, T:, 0] = True
    N = sum(sizes)
    qg = torch.full((N, HQ, 2 * D), float("nan"))
    qg[..., :D] = torch.randn(N, HQ, D, generator=gen)
    q = qg.to(device, dtype)[..., :D]
    cu = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32, device=device)
    kc, vc = cache.k(1).flatten(0, 1), cache.v(1).flatten(0, 1)
    return (q, kc, vc, kv_index.to(device), mask.to(device), cu, torch.tensor(prefixes, device=device)), cache


def run_both(args, **kw):
    q = args[0]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    o_k = tree_attention(*args, out=out, **kw)
    assert o_k is out and o_k.dtype == q.dtype
    return o_k, tree_attention_ref(*args, scale=kw.get("scale"))


TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 5e-3}


@pytest.mark.parametrize("prefixes,sizes,HQ,HKV,D", [
    ([5], [1], 4, 2, 64),                    # the tiny model, one node (a decode-like row)
    ([40, 3, 0], [7, 16, 2], 4, 2, 64),      # uneven prefixes, an empty prefix, tq = 16
    ([17, 60], [23, 5], 8, 2, 32),           # GQA 4, more rows than a tile
    ([9, 30], [12, 3], 6, 2, 40),            # GQA 3 (heads padded), head dim not a power of two
    ([64], [33], 4, 4, 16),                  # no GQA
])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                               (torch.float32, torch.bfloat16)])
def test_matches_twin(device, prefixes, sizes, HQ, HKV, D, dtype, cache_dtype):
    args, _ = tree_inputs(device, prefixes, sizes, HQ, HKV, D, dtype, cache_dtype, seed=len(sizes) + D)
    o_k, o_t = run_both(args)
    assert rel_err(o_k, o_t) <= TOL[dtype]


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_key_splits(device, num_splits, causal):
    """Split keys (flash-decoding: partials, then the combine) equal the twin: splits that end inside the
    tree, splits past a request's keys (empty: the 8-way split of 20 keys), an empty prefix, a long one
    over several blocks per split, tiles past a request's rows."""
    args, _ = tree_inputs(device, [150, 0, 12], [9, 20, 1], 8, 2, 32, torch.float32, torch.float32, seed=11,
                          L=192, tq=24)
    if causal:
        args = args[:4] + (None,) + args[5:]
    o_k, o_t = run_both(args, num_splits=num_splits, block_n=16)
    assert rel_err(o_k, o_t) <= TOL[torch.float32]
    assert torch.isfinite(o_k).all()


def test_default_splits_match_one_split(device):
    # the default split count (two waves of programs) against S = 1 on a long prefix, to summation order
    args, _ = tree_inputs(device, [300], [17], 4, 2, 32, torch.float32, torch.float32, seed=12)
    one = tree_attention(*args, num_splits=1)
    assert rel_err(tree_attention(*args), one) <= 2e-6
    assert rel_err(one, tree_attention_ref(*args)) <= TOL[torch.float32]


@pytest.mark.parametrize("block_n", [16, 32])
def test_padded_bucket_and_int32(device, block_n):
    # a key bucket past every request's keys, a mask wider than the widest tree, int32 indices, a scale
    args, _ = tree_inputs(device, [20, 2], [9, 4], 4, 2, 32, torch.float32, torch.float32, seed=3, L=96, tq=16)
    q, kc, vc, kv_index, mask, cu, nc = args
    o_k, o_t = run_both((q, kc, vc, kv_index.clamp_max(2 ** 30).int(), mask, cu, nc.int()), scale=0.3,
                        block_n=block_n)
    assert rel_err(o_k, o_t) <= TOL[torch.float32]


@pytest.mark.parametrize("prefixes,sizes,HQ,HKV", [([0], [13], 4, 2), ([30, 0, 5], [1, 40, 17], 4, 2),
                                                  ([8, 3], [20, 9], 6, 2)])
def test_causal_rows(device, prefixes, sizes, HQ, HKV):
    # mask=None: a prefill chunk's causal rows, each over its prefix and the chunk up to itself
    args, _ = tree_inputs(device, prefixes, sizes, HQ, HKV, 32, torch.float32, torch.float32, seed=sum(sizes))
    q, kc, vc, kv_index, mask, cu, nc = args
    causal = torch.zeros_like(mask)
    for b, (P, T) in enumerate(zip(prefixes, sizes)):
        causal[b, 0, :T, :P + T] = torch.ones(T, P + T, dtype=torch.bool, device=device).tril(P)
    o_k, o_t = run_both((q, kc, vc, kv_index, None, cu, nc))
    assert rel_err(o_k, o_t) <= TOL[torch.float32]
    assert rel_err(o_t, tree_attention_ref(q, kc, vc, kv_index, causal, cu, nc)) <= 1e-6  # the twin's causal rows


def padded_verify_sdpa(q, cache, layer, kv_index, mask, cu, D):
    """GatedAttention._padded as it stands: padded rows, gathered keys, masked SDPA, grouped heads."""
    N, HQ, _ = q.shape
    B, L = kv_index.shape
    HKV, tq = cache.num_kv_heads, mask.shape[2]
    rep = HQ // HKV
    counts = (cu[1:] - cu[:-1]).long().cpu()
    req = torch.repeat_interleave(torch.arange(B), counts)
    rows = (req * tq + torch.arange(N) - cu[:-1].long().cpu()[req]).to(q.device)
    kb, vb = cache.gather(layer, kv_index)
    kb, vb = kb.to(q.dtype).transpose(1, 2), vb.to(q.dtype).transpose(1, 2)
    qp = q.new_zeros(B * tq, HQ, D)
    qp[rows] = q
    qg = qp.view(B, tq, HKV, rep, D).permute(0, 2, 3, 1, 4).reshape(B, HKV, rep * tq, D)
    o = sdpa(qg, kb, vb, mask.expand(B, rep, tq, L).reshape(B, 1, rep * tq, L), D ** -0.5)
    return o.view(B, HKV, rep, tq, D).permute(0, 3, 1, 2, 4).reshape(B * tq, HQ, D)[rows]


def test_matches_padded_verify_path(device):
    # finite junk (SDPA reads every gathered key) and in-range slots for the gather
    args, cache = tree_inputs(device, [30, 4, 11], [10, 16, 1], 4, 2, 64, torch.float32, torch.float32,
                              seed=4, junk=3.0)
    q, kc, vc, kv_index, mask, cu, nc = args
    kv_index = kv_index.clamp_max(cache.num_blocks * cache.block_size - 1)
    o_k = tree_attention(q, kc, vc, kv_index, mask, cu, nc)
    assert rel_err(o_k, padded_verify_sdpa(q, cache, 1, kv_index, mask, cu, 64)) <= 1e-5


BAD_CASES = ["q_rank", "q_dtype", "q_stride", "gqa", "v_shape", "idx_dtype", "mask_dtype",
             "mask_shape", "cu_rows", "nc_rows", "precision", "block_n", "splits", "out_shape"]
# the forward context's checks (checked=True skips them; sizes are still compared)
SHARED_CASES = ("idx_dtype", "mask_dtype")


@pytest.mark.parametrize("case,checked", [(c, False) for c in BAD_CASES]
                         + [(c, True) for c in BAD_CASES if c not in SHARED_CASES])
def test_bad_inputs_raise(device, case, checked):
    args, _ = tree_inputs(device, [3, 5], [2, 4], 4, 2, 16, torch.float32, torch.float32, seed=0)
    q, kc, vc, kv_index, mask, cu, nc = args
    kw = dict(q=q, k_cache=kc, v_cache=vc, kv_index=kv_index, mask=mask, cu_seqlens=cu, num_cached=nc)
    z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=device)
    bad = {"q_rank": dict(q=q[None]), "q_dtype": dict(q=q.double()), "q_stride": dict(q=q.transpose(1, 2)),
           "gqa": dict(k_cache=z(20, 3, 16), v_cache=z(20, 3, 16)), "v_shape": dict(v_cache=vc[:-1]),
           "idx_dtype": dict(kv_index=kv_index.float()), "mask_dtype": dict(mask=mask.int()),
           "mask_shape": dict(mask=mask[:, :, :, :-1]), "cu_rows": dict(cu_seqlens=cu[:-1]),
           "nc_rows": dict(num_cached=nc[:1]), "precision": dict(precision="fp8"), "block_n": dict(block_n=24),
           "splits": dict(num_splits=0),
           "out_shape": dict(out=z(6, 2, 16))}
    kw.update(bad[case])
    with pytest.raises(ValueError):
        tree_attention(**kw, checked=checked)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,cache_dtype,precision", [(torch.bfloat16, torch.bfloat16, None),
                                                         (torch.bfloat16, torch.float32, None),
                                                         (torch.float32, torch.float32, "tf32")])
def test_gpu_half_and_tf32(device, dtype, cache_dtype, precision):
    args, _ = tree_inputs(device, [40, 3, 200], [28, 16, 59], 4, 2, 64, dtype, cache_dtype, seed=9, L=320, tq=64)
    o_k, o_t = run_both(args, precision=precision)
    assert rel_err(o_k, o_t) <= (TOL[torch.bfloat16] if precision is None else 2e-3)


class _Launches:
    """Stands in for a ``@triton.jit`` kernel: records each launch's compile-time constants."""

    def __init__(self):
        self.constants = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.constants.append(tuple(sorted(kw.items())))


def test_compiled_variants_bounded_over_key_lengths_and_rows(monkeypatch):
    """A compiled kernel's constants may not follow the step's sizes: each new value compiles a kernel
    (1-2 s at 9B shapes, on the serving path's eager drafter catch-up). Over every key length up to 4096
    and 1-64 causal rows of 1-16 requests, on a 132-SM GPU's split counts, the launches use at most the six
    power-of-two split counts; the old constants (NB from the key length, any split count up to 32) made
    hundreds."""
    import kernels.paged_decode_attention as pda
    import kernels.tree_attention as ta
    fake, combine = _Launches(), _Launches()
    monkeypatch.setattr(ta, "tree_attention_kernel", fake)
    monkeypatch.setattr(ta, "paged_decode_combine_kernel", combine)
    monkeypatch.setattr(ta, "interpreting", lambda: False)
    monkeypatch.setattr(pda, "_num_sms", lambda device: 132)
    HQ, HKV, D = 16, 4, 256
    kc = vc = torch.zeros(8, HKV, D)
    for B in (1, 3, 16):
        for rows in (1, 5, 33, 64):
            N = B * rows
            q = torch.zeros(N, HQ, D)
            cu = torch.arange(B + 1, dtype=torch.int32) * rows
            for L in list(range(rows, 300)) + list(range(300, 4097, 37)):
                kv_index = torch.zeros(B, L, dtype=torch.long)
                tree_attention(q, kc, vc, kv_index, None, cu, torch.zeros(B, dtype=torch.long), checked=True)
    splits = {dict(c)["S"] for c in fake.constants}
    assert splits <= {1, 2, 4, 8, 16, 32} and len(set(fake.constants)) == len(splits)
    assert {dict(c)["S"] for c in combine.constants} <= splits - {1}


@pytest.mark.gpu
def test_gpu_no_new_compile_for_new_key_lengths(device):
    """On the GPU: after one call per split count, calls at 40 other key lengths and row counts compile
    nothing new (counted in the JIT's cache)."""
    import kernels.tree_attention as ta

    def compiled() -> int:
        return sum(len(c[0]) for c in ta.tree_attention_kernel.device_caches.values())

    def call(prefix, rows, B=2):
        args, _ = tree_inputs(device, [prefix] * B, [rows] * B, 16, 4, 128, torch.bfloat16, torch.bfloat16,
                              seed=prefix + rows)
        q, kc, vc, kv_index, _, cu, nc = args
        tree_attention(q, kc, vc, kv_index, None, cu, nc)

    for prefix in (8, 100, 300, 700, 1500, 3000, 6000):  # reaches every split count of this launch
        call(prefix, 4)
    before = compiled()
    for i in range(40):
        call(50 + 97 * i, 1 + i % 16)
    assert compiled() == before
