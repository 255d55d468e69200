"""The attention prologue kernel (kernels/qk_norm_rope.py) against its twin (bole/ops/rope.py).

Inputs are the views GatedAttention passes: q interleaved with the gate per head and k, v column slices
of one qkv GEMM output, the buffer's spare columns NaN so that a read outside a view fails. The caches
are one layer of an all-layer cache, NaN-poisoned: written slots must match the twin, every other slot
must stay NaN, as must the other layer. Under TRITON_INTERPRET (CPU) bf16 is left to the GPU test: the
interpreter truncates fp32 -> bf16 casts.
"""

import pytest
import torch
from test_rmsnorm import check

from bole.layers.rotary import RotaryEmbedding
from bole.ops.norm import rms_norm_ref
from bole.ops.rope import apply_rope, qk_norm_rope_store_ref, rope_cos_sin
from kernels.qk_norm_rope import qk_norm_rope_store

EPS = 1e-6


def make_inputs(device, N, H, Hkv, D, R, dtype, seed, cache_dtype=None, positions=None, slots=None):
    gen = torch.Generator().manual_seed(seed)
    width = 2 * H * D + 2 * Hkv * D
    qkv = torch.full((N, width + 3), float("nan"))
    qkv[:, 1:1 + width] = torch.randn(N, width, generator=gen) * 3
    qkv = qkv.to(device, dtype)
    qg, k, v = qkv[:, 1:1 + width].split([2 * H * D, Hkv * D, Hkv * D], dim=-1)
    q, gate = qg.view(N, H, 2 * D).chunk(2, dim=-1)
    w_q, w_k = (torch.randn(D, generator=gen) * 0.2 for _ in range(2))
    if positions is None:
        positions = torch.randint(0, 5000, (N,), generator=gen)
    num_slots = N + 5
    if slots is None:
        slots = torch.randperm(num_slots, generator=gen)[:N]
    inv_freq = RotaryEmbedding(R, 10000.0).inv_freq(device)
    cache = torch.full((2, 2, num_slots, Hkv, D), float("nan"), dtype=cache_dtype or dtype, device=device)
    return dict(q=q, k=k.view(N, Hkv, D), v=v.view(N, Hkv, D), q_weight=w_q.to(device, dtype),
                k_weight=w_k.to(device, dtype), positions=positions.to(device), inv_freq=inv_freq, eps=EPS,
                k_cache=cache[0, 1], v_cache=cache[1, 1], slot_mapping=slots.to(device)), cache


def run_both(inputs, cache):
    """(kernel q, kernel cache), (twin q, twin cache); the kernel's q_out NaN-poisoned."""
    cache_t = cache.clone()
    q_out = torch.full(inputs["q"].shape, float("nan"), dtype=inputs["q"].dtype, device=cache.device)
    q = qk_norm_rope_store(**inputs, q_out=q_out)
    assert q is q_out
    q_t = qk_norm_rope_store_ref(**dict(inputs, k_cache=cache_t[0, 1], v_cache=cache_t[1, 1]))
    return (q, cache), (q_t, cache_t)


def check_all(inputs, cache, max_ulps=1):
    (q, c), (q_t, c_t) = run_both(inputs, cache)
    check(q, q_t, max_ulps)
    slots = inputs["slot_mapping"].long()
    check(c[0, 1, slots], c_t[0, 1, slots], max_ulps)
    assert torch.equal(c[1, 1, slots], c_t[1, 1, slots])  # v: a copy (one cast at most)
    untouched = torch.ones(c.shape[2], dtype=torch.bool, device=c.device)
    untouched[slots] = False
    assert c[:, 1, untouched].isnan().all() and c[:, 0].isnan().all()


def test_twin_is_rotate_half_rope():
    """The twin against the rotation written out in float64: dims j and j + R/2 (j < R/2) turn by
    position · theta^(-2j/R) (that product in fp32); dims R.. pass through; q, k are normed with (1 + w)
    first."""
    N, H, Hkv, D, R = 4, 3, 1, 20, 12
    inputs, cache = make_inputs("cpu", N, H, Hkv, D, R, torch.float32, seed=0,
                                positions=torch.tensor([0, 1, 77, 4000]), slots=torch.tensor([3, 0, 8, 2]))
    q = qk_norm_rope_store_ref(**inputs)

    def expected(x, w):
        x = x.double()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (1 + w.double())
        # [N, R/2]; the angle itself is fp32, as the model's: its rounding is the convention, not an error
        ang = (inputs["positions"].float()[:, None] * inputs["inv_freq"]).double()
        j = torch.arange(R // 2, dtype=torch.float64)
        torch.testing.assert_close(inputs["inv_freq"].double(), 10000.0 ** (-2 * j / R))
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., :R // 2], x[..., R // 2:R]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., R:]], dim=-1)

    torch.testing.assert_close(q.double(), expected(inputs["q"], inputs["q_weight"]), rtol=1e-5, atol=1e-5)
    k = cache[0, 1, inputs["slot_mapping"]]
    torch.testing.assert_close(k.double(), expected(inputs["k"], inputs["k_weight"]), rtol=1e-5, atol=1e-5)
    assert torch.equal(cache[1, 1, inputs["slot_mapping"]], inputs["v"])
    cos, sin = rope_cos_sin(inputs["positions"], inputs["inv_freq"])
    assert cos.shape == sin.shape == (N, R)
    assert torch.equal(apply_rope(q, torch.ones_like(cos), torch.zeros_like(sin)), q)  # position 0: identity


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N,H,Hkv,D,R", [
    (1, 4, 2, 64, 16),     # the tiny model's attention, batch 1
    (3, 16, 4, 256, 64),   # Qwen3.5-9B shapes
    (5, 3, 1, 40, 12),     # odd heads, D and R / 2 not powers of two
    (2, 5, 3, 100, 100),   # R = D: every dim rotates
    (4, 1, 1, 6, 2),       # the smallest rotation
])
def test_qk_norm_rope_store(device, dtype, N, H, Hkv, D, R):
    for seed in range(2):
        check_all(*make_inputs(device, N, H, Hkv, D, R, dtype, seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_positions_small_and_large(device, dtype):
    positions = torch.tensor([0, 1, 2, 31, 4095, 65_537, 262_143, 1_000_003, 2**24 + 1])
    N = positions.numel()
    for index_dtype in (torch.int64, torch.int32):
        inputs, cache = make_inputs(device, N, 4, 2, 64, 16, dtype, seed=3, positions=positions.to(index_dtype),
                                    slots=torch.randperm(N + 5, generator=torch.Generator().manual_seed(1))[:N]
                                    .to(index_dtype))
        check_all(inputs, cache)


def test_cache_dtype_and_batch_invariance(device):
    # fp32 activations into a half cache: k, v rounded once more, as the twin's .to(cache dtype)
    check_all(*make_inputs(device, 6, 4, 2, 64, 16, torch.float32, seed=5, cache_dtype=torch.float16))
    inputs, cache = make_inputs(device, 7, 4, 2, 64, 16, torch.float32, seed=6)
    (q, c), _ = run_both(inputs, cache)
    for i in (0, 3, 6):  # a row alone gives what it gives in the batch
        one = {n: (t[i:i + 1] if n in ("q", "k", "v", "positions", "slot_mapping") else t) for n, t in inputs.items()}
        c1 = torch.full_like(cache, float("nan"))
        q1 = qk_norm_rope_store(**dict(one, k_cache=c1[0, 1], v_cache=c1[1, 1]))
        assert torch.equal(q1, q[i:i + 1])
        s = int(inputs["slot_mapping"][i])
        assert torch.equal(c1[:, 1, s], c[:, 1, s])
    empty = {n: (t[:0] if n in ("q", "k", "v", "positions", "slot_mapping") else t) for n, t in inputs.items()}
    assert qk_norm_rope_store(**empty).shape == (0, 4, 64)


def test_unfused_projections(device):
    # contiguous q (separate q_proj): the other layout the layer passes
    inputs, cache = make_inputs(device, 3, 4, 2, 64, 16, torch.float32, seed=8)
    inputs["q"] = inputs["q"].contiguous()
    inputs["k"], inputs["v"] = inputs["k"].contiguous(), inputs["v"].contiguous()
    check_all(inputs, cache)


BAD = ["q_rank", "q_dtype", "q_stride", "too_wide", "k_dtype", "k_shape", "v_shape", "v_stride", "w_len",
       "w_int", "pos_len", "pos_float", "slots_len", "inv_freq_dtype", "inv_freq_long", "cache_heads",
       "cache_stride", "v_cache_shape", "q_out_shape", "q_out_dtype", "device"]


@pytest.mark.parametrize("case", BAD)
def test_bad_inputs_raise(device, case):
    inputs, cache = make_inputs(device, 3, 4, 2, 16, 8, torch.float32, seed=0)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    inputs.update({
        "q_rank": dict(q=q[0]), "q_dtype": dict(q=q.double()), "q_stride": dict(q=q.transpose(1, 2)),
        "too_wide": dict(q=torch.zeros(3, 4, 4097, device=device)),
        "k_dtype": dict(k=k.half()), "k_shape": dict(k=k[:2]), "v_shape": dict(v=v[:, :, :8]),
        "v_stride": dict(v=torch.zeros(3, 2, 32, device=device)[:, :, ::2]),
        "w_len": dict(q_weight=inputs["q_weight"][:8]), "w_int": dict(k_weight=inputs["k_weight"].int()),
        "pos_len": dict(positions=inputs["positions"][:2]), "pos_float": dict(positions=inputs["positions"].float()),
        "slots_len": dict(slot_mapping=inputs["slot_mapping"][:2]),
        "inv_freq_dtype": dict(inv_freq=inputs["inv_freq"].double()),
        "inv_freq_long": dict(inv_freq=torch.ones(9, device=device)),
        "cache_heads": dict(k_cache=cache[0, 1, :, :1]), "cache_stride": dict(k_cache=cache[0, 1].transpose(1, 2)),
        "v_cache_shape": dict(v_cache=cache[1, 1, :3]),
        "q_out_shape": dict(q_out=torch.empty(3, 4, 8, device=device)),
        "q_out_dtype": dict(q_out=torch.empty(3, 4, 16, dtype=torch.float16, device=device)),
        "device": dict(positions=inputs["positions"].to("meta")),
    }[case])
    with pytest.raises(ValueError):
        qk_norm_rope_store(**inputs)


def accurate_twin(inputs):
    """(q, k) by the twin's op sequence, except cos / sin of the fp32 angles: correctly rounded (float64,
    then fp32), where the twin takes torch's fp32 cos / sin of the device it runs on."""
    N, H, D = inputs["q"].shape
    q = rms_norm_ref(inputs["q"].reshape(-1, D), inputs["q_weight"], EPS).view(N, H, D)
    k = rms_norm_ref(inputs["k"].reshape(-1, D), inputs["k_weight"], EPS).view(N, -1, D)
    ang = inputs["positions"].float()[:, None] * inputs["inv_freq"][None, :]
    emb = torch.cat([ang, ang], dim=-1).double()
    cos, sin = emb.cos().float(), emb.sin().float()
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


@pytest.mark.gpu
@pytest.mark.parametrize("N,H,Hkv,D,R", [(1, 16, 4, 256, 64), (37, 16, 4, 256, 64), (9, 4, 2, 64, 16)])
def test_gpu_bf16(device, N, H, Hkv, D, R):
    # bf16 as the engine runs it, at positions up to 3e5: the kernel must repeat every rounding of the
    # twin's op sequence with correctly rounded cos / sin (``accurate_twin``) to one ulp, and be hardly further
    # from it than the torch twin. Compiled with FMA contraction (before 2026-12-07) the kernel differed
    # from that sequence in ~5.8% of elements (up to 15224 ulps where RoPE's two terms cancel; presumably
    # a product and the sum after it fused into one FMA, skipping a rounding the twin keeps), and this
    # test failed.
    # Without it (H100, 2026-12-07) every element is within one ulp and 2.6e-5 of them (N = 37; none at
    # N = 1 and 9) differ where torch's do not: the norm's fp32 sum (a tree here, torch's order there),
    # tl.rsqrt and the fp32 division may differ from torch's in the last fp32 bit, which moves a bf16
    # rounding about once in 10^4-10^5 elements. Hence the 5e-4 allowance, over 100x below the FMA defect.
    positions = torch.randint(0, 300_000, (N,), generator=torch.Generator().manual_seed(N))
    inputs, cache = make_inputs(device, N, H, Hkv, D, R, torch.bfloat16, seed=N, positions=positions)
    (q, c), (q_t, c_t) = run_both(inputs, cache)
    slots = inputs["slot_mapping"].long()
    q_a, k_a = accurate_twin(inputs)
    check(q, q_a, max_ulps=1)
    check(c[0, 1, slots], k_a, max_ulps=1)
    for got, twin, acc in ((q, q_t, q_a), (c[0, 1, slots], c_t[0, 1, slots], k_a)):
        kernel_off = (got != acc).float().mean().item()
        twin_off = (twin != acc).float().mean().item()
        assert kernel_off <= twin_off + 5e-4, (f"kernel differs from the accurate twin in {kernel_off:.4%}, "
                                               f"torch's in {twin_off:.4%}")
    assert torch.equal(c[1, 1, slots], c_t[1, 1, slots])
