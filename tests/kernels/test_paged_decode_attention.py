"""The paged decode attention kernel (kernels/paged_decode_attention.py) against its twin
(bole/ops/attention.py) and against GatedAttention's gather + SDPA static decode path.

Caches are real ``PagedKVCache`` objects (layer 1 of 2); each row owns random blocks (a random
permutation: keys are not contiguous), and every cache entry that is not one of a row's valid keys is
NaN, so a key read past kv_len, or from the other layer, fails. Positions past kv_len point either to
NaN slots or to out-of-range slot ids (they must not be read at all). q is a head-strided view of a
[q | gate] projection whose gate half is NaN. Outputs are NaN-poisoned before the run. Under
TRITON_INTERPRET (CPU) bf16 activations are left to the GPU tests (the interpreter's bf16 tl.dot).
"""

import pytest
import torch
from numerics import rel_err

from bole.cache.kv_cache import PagedKVCache
from bole.layers.attention import sdpa
from bole.ops.attention import paged_decode_attention_ref
from kernels.paged_decode_attention import paged_decode_attention


def attn_inputs(device, lens, HQ, HKV, D, L, dtype, cache_dtype, seed, block_size=16, junk=float("nan")):
    """q [B, HQ, D] view, k/v [slots, HKV, D] views of layer 1, kv_index [B, L], kv_len [B], cache."""
    gen = torch.Generator().manual_seed(seed)
    B, nb = len(lens), -(-L // block_size)
    cache = PagedKVCache(2, B * nb + 3, block_size, HKV, D, dtype=cache_dtype, device=device)
    cache.kv.fill_(junk)
    perm = torch.randperm(cache.num_blocks, generator=gen)[:B * nb].view(B, nb)
    pos = torch.arange(L)
    kv_index = perm[:, pos // block_size] * block_size + pos % block_size                  # [B, L]
    valid = pos[None, :] < torch.tensor(lens)[:, None]
    slots = kv_index[valid]
    k = torch.randn(slots.numel(), HKV, D, generator=gen)
    v = torch.randn(slots.numel(), HKV, D, generator=gen)
    cache.write(1, slots.to(device), k.to(device), v.to(device))
    kv_index[1::2][~valid[1::2]] = 10 ** 9  # odd rows: slot ids past the cache where masked
    qg = torch.full((B, HQ, 2 * D), float("nan"))
    qg[..., :D] = torch.randn(B, HQ, D, generator=gen)
    q = qg.to(device, dtype)[..., :D]                        # as the layer's chunk of [q | gate]
    kc, vc = cache.k(1).flatten(0, 1), cache.v(1).flatten(0, 1)
    return q, kc, vc, kv_index.to(device), torch.tensor(lens, device=device), cache


def run_both(q, kc, vc, kv_index, kv_len, scale=None, **kw):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    o_k = paged_decode_attention(q, kc, vc, kv_index, kv_len, scale, out=out, **kw)
    assert o_k is out and o_k.dtype == q.dtype
    return o_k, paged_decode_attention_ref(q, kc, vc, kv_index, kv_len, scale)


def static_decode_sdpa(q, cache, layer, kv_index, kv_len):
    """GatedAttention._static_decode as it stands (gather at padded length, masked SDPA, grouped heads)."""
    B, HQ, D = q.shape
    HKV = cache.num_kv_heads
    kv_valid = torch.arange(kv_index.shape[1], device=q.device)[None, :] < kv_len[:, None]
    kb, vb = cache.gather(layer, kv_index)
    kb, vb = kb.to(q.dtype).transpose(1, 2), vb.to(q.dtype).transpose(1, 2)
    o = sdpa(q.reshape(B, HKV, HQ // HKV, D), kb, vb, kv_valid[:, None, None, :], D ** -0.5)
    return o.reshape(B, HQ, D)


TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 5e-3}  # o rounded once to q's dtype


@pytest.mark.parametrize("lens,HQ,HKV,D,L", [
    ([1], 4, 2, 64, 16),                # the tiny test model, batch 1, one key
    ([1, 7, 100], 4, 2, 64, 100),       # lengths 1 / 7 / 100, L = 100 not a multiple of the block
    ([100, 1, 7], 4, 4, 32, 100),       # no GQA
    ([7, 100, 57], 8, 2, 64, 128),      # GQA 4, rows shorter than the bucket
    ([33, 64], 6, 2, 40, 64),           # GQA 3, head dim not a power of two
])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_twin(device, lens, HQ, HKV, D, L, dtype, cache_dtype, seed):
    q, kc, vc, kv_index, kv_len, _ = attn_inputs(device, lens, HQ, HKV, D, L, dtype, cache_dtype, seed)
    o_k, o_t = run_both(q, kc, vc, kv_index, kv_len)
    assert rel_err(o_k, o_t) <= TOL[dtype]


@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (3, 16), (8, 16), (5, 32), (32, 16)])
def test_splits_and_blocks(device, num_splits, block_n):
    # 32 splits of <= 100 keys in blocks of 16: most are empty and must drop out of the combine
    q, kc, vc, kv_index, kv_len, _ = attn_inputs(device, [1, 7, 100], 8, 2, 64, 100, torch.float32,
                                                 torch.float32, seed=2)
    o_k, o_t = run_both(q, kc, vc, kv_index, kv_len, scale=0.37, num_splits=num_splits, block_n=block_n)
    assert rel_err(o_k, o_t) <= TOL[torch.float32]


@pytest.mark.parametrize("num_splits", [1, 4])
def test_empty_and_overlong_rows(device, num_splits):
    # kv_len 0 gives zeros; kv_len past L and int32 lengths / indices behave as their clamped values
    q, kc, vc, kv_index, kv_len, _ = attn_inputs(device, [0, 5, 40], 4, 2, 32, 40, torch.float32,
                                                 torch.float32, seed=3)
    kv_len = torch.tensor([0, 5, 1000], dtype=torch.int32, device=device)
    o_k, o_t = run_both(q, kc, vc, kv_index[:, :40].int(), kv_len, num_splits=num_splits, block_n=16)
    assert torch.equal(o_k[0], torch.zeros_like(o_k[0]))
    assert rel_err(o_k, o_t) <= TOL[torch.float32]


def test_matches_static_decode_path(device):
    # the layer's current path on the tiny model's heads; junk past kv_len is finite (as in the
    # engine's pad block) since SDPA reads it; kv_index stays in range for the gather
    q, _, _, kv_index, kv_len, cache = attn_inputs(device, [1, 9, 70], 4, 2, 64, 80, torch.float32,
                                                   torch.float32, seed=4, junk=3.0)
    kv_index = kv_index.clamp_max(cache.num_blocks * cache.block_size - 1)
    o_k = paged_decode_attention(q, cache.k(1).flatten(0, 1), cache.v(1).flatten(0, 1), kv_index, kv_len)
    assert rel_err(o_k, static_decode_sdpa(q, cache, 1, kv_index, kv_len)) <= 1e-5


BAD_CASES = ["q_rank", "q_dtype", "q_stride", "k_dim", "gqa", "v_shape", "k_stride",
             "idx_dtype", "idx_rows", "len_rows", "len_dtype", "head_dim", "block_n",
             "block_small", "splits", "out_dtype", "out_shape"]
# the forward context's checks (checked=True skips them; sizes are still compared)
SHARED_CASES = ("idx_dtype", "len_dtype")


@pytest.mark.parametrize("case,checked", [(c, False) for c in BAD_CASES]
                         + [(c, True) for c in BAD_CASES if c not in SHARED_CASES])
def test_bad_inputs_raise(device, case, checked):
    q, kc, vc, kv_index, kv_len, _ = attn_inputs(device, [3, 5, 2], 4, 2, 16, 16, torch.float32,
                                                 torch.float32, seed=0)
    kw = dict(q=q, k_cache=kc, v_cache=vc, kv_index=kv_index, kv_len=kv_len)
    z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=device)
    bad = {"q_rank": dict(q=q[None]), "q_dtype": dict(q=q.double()), "q_stride": dict(q=q.transpose(1, 2)),
           "k_dim": dict(k_cache=kc[..., :8]), "gqa": dict(k_cache=z(20, 3, 16), v_cache=z(20, 3, 16)),
           "v_shape": dict(v_cache=vc[:-1]), "k_stride": dict(k_cache=kc.transpose(1, 2)),
           "idx_dtype": dict(kv_index=kv_index.float()), "idx_rows": dict(kv_index=kv_index[:2]),
           "len_rows": dict(kv_len=kv_len[:1]), "len_dtype": dict(kv_len=kv_len.float()),
           "head_dim": dict(q=z(3, 4, 512), k_cache=z(20, 2, 512), v_cache=z(20, 2, 512)),
           "block_n": dict(block_n=24), "block_small": dict(block_n=8), "splits": dict(num_splits=0),
           "out_dtype": dict(out=z(3, 4, 16, dt=torch.float16)), "out_shape": dict(out=z(3, 2, 16))}
    kw.update(bad[case])
    with pytest.raises(ValueError):
        paged_decode_attention(**kw, checked=checked)


@pytest.mark.gpu
@pytest.mark.parametrize("lens,HQ,HKV,D,L", [([1, 7, 100], 4, 2, 64, 100), ([7, 100, 57], 8, 2, 64, 128),
                                             ([33, 64], 6, 2, 40, 64), ([1, 250, 129], 16, 4, 256, 256)])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_gpu_bf16(device, lens, HQ, HKV, D, L, cache_dtype):
    q, kc, vc, kv_index, kv_len, _ = attn_inputs(device, lens, HQ, HKV, D, L, torch.bfloat16, cache_dtype,
                                                 seed=len(lens))
    o_k, o_t = run_both(q, kc, vc, kv_index, kv_len)
    assert rel_err(o_k, o_t) <= TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[1000], [5, 1000, 333, 64], [999] * 16])
def test_gpu_qwen35_9b_matches_static_decode(device, lens):
    # Qwen3.5-9B's attention heads (Hq 16, Hkv 4, D 256), bf16, a 1024-key bucket
    q, kc, vc, kv_index, kv_len, cache = attn_inputs(device, lens, 16, 4, 256, 1024, torch.bfloat16,
                                                     torch.bfloat16, seed=len(lens), junk=0.5)
    kv_index = kv_index.clamp_max(cache.num_blocks * cache.block_size - 1)
    o_k = paged_decode_attention(q, kc, vc, kv_index, kv_len)
    assert rel_err(o_k, static_decode_sdpa(q, cache, 1, kv_index, kv_len)) <= 1e-2  # SDPA rounds P to bf16
    assert rel_err(o_k, paged_decode_attention_ref(q, kc, vc, kv_index, kv_len)) <= 5e-3


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(device):
    # captured once, replayed with new lengths and slots written in place: no host read, same result
    base = [1000, 3, 500, 64]
    q, kc, vc, kv_index, kv_len, _ = attn_inputs(device, base, 16, 4, 256, 1024, torch.bfloat16,
                                                 torch.bfloat16, seed=5)
    idx0, out = kv_index.clone(), torch.empty_like(q)
    paged_decode_attention(q, kc, vc, kv_index, kv_len, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        paged_decode_attention(q, kc, vc, kv_index, kv_len, out=out)
    # (rows rolled by shift, lengths within the keys each rolled row has written)
    for shift, lens in ((0, base), (0, [1, 1, 1, 1]), (2, [400, 64, 1000, 2]), (1, [64, 999, 3, 500])):
        kv_index.copy_(idx0.roll(shift, dims=0))
        kv_len.copy_(torch.tensor(lens, device=device))
        out.fill_(float("nan"))
        g.replay()
        assert rel_err(out, paged_decode_attention_ref(q, kc, vc, kv_index, kv_len)) <= TOL[torch.bfloat16]
