"""The fused RMS norms (kernels/rmsnorm.py) against their twins (bole/ops/norm.py) and the layer modules.

On CPU (Triton interpreter) only float32 and float16 are checked: the interpreter truncates fp32 -> bf16
casts instead of rounding, so bf16 exactness is a GPU test. Half results must lie within one ulp of the
twin (the kernel repeats every rounding of the twin; only the fp32 sum order and rsqrt/exp differ).
"""

import pytest
import torch

from bole.layers.norm import GatedRMSNorm, RMSNorm
from bole.ops.norm import gated_rms_norm_ref, rms_norm_ref
from kernels.rmsnorm import gated_rms_norm, rms_norm

EPS = 1e-6


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between same-dtype float tensors (bit patterns made monotonic)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    int_t, sign = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.float16: (torch.int16, 0x7FFF),
                   torch.bfloat16: (torch.int16, 0x7FFF)}[a.dtype]
    ia, ib = a.contiguous().view(int_t).long(), b.contiguous().view(int_t).long()
    ia, ib = torch.where(ia < 0, -(ia & sign), ia), torch.where(ib < 0, -(ib & sign), ib)
    return (ia - ib).abs()


def check(a: torch.Tensor, b: torch.Tensor, max_ulps: int = 1):
    """Kernel a against twin b: fp32 to rtol 1e-5; half dtypes within max_ulps and bit-equal almost
    everywhere (a skipped intermediate rounding of the twin shows as ~25% of elements one ulp off)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.isfinite(a).all()
    if a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    else:
        d = ulps(a, b)
        assert d.max().item() <= max_ulps
        assert (d > 0).sum().item() <= max(1, 0.01 * d.numel())


def rand(*shape, dtype, gen, device, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)


def test_twins_are_the_modules():
    gen = torch.Generator().manual_seed(0)
    x, z = rand(3, 2, 64, dtype=torch.bfloat16, gen=gen, device="cpu"), torch.randn(3, 2, 64, generator=gen)
    norm, gated = RMSNorm(64, EPS), GatedRMSNorm(64, EPS).to(torch.bfloat16)
    norm.weight.data.normal_(0, 0.1, generator=gen)
    gated.weight.data.normal_(1, 0.1, generator=gen)
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(x[0], norm.weight, EPS), norm(x[0]))
        assert torch.equal(gated_rms_norm_ref(x, z, gated.weight, EPS), gated(x, z))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [1, 63, 100, 256, 1000])
def test_rms_norm(device, dtype, D):
    for seed, N in enumerate((1, 3, 17)):
        gen = torch.Generator().manual_seed(seed)
        x = rand(N, D, dtype=dtype, gen=gen, device=device, scale=3.0)
        w = rand(D, dtype=torch.float32, gen=gen, device=device, scale=0.2)
        check(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS))
        out = torch.full_like(x, float("nan"))
        assert rms_norm(x, w, EPS, out=out) is out
        check(out, rms_norm_ref(x, w, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_residual(device, dtype):
    for seed, (N, D) in enumerate(((1, 100), (3, 63), (17, 256))):
        gen = torch.Generator().manual_seed(seed)
        x, r = (rand(N, D, dtype=dtype, gen=gen, device=device) for _ in range(2))
        w = rand(D, dtype=dtype, gen=gen, device=device, scale=0.2)
        y_t, s_t = rms_norm_ref(x, w, EPS, residual=r)
        y, s = rms_norm(x, w, EPS, residual=r)
        assert torch.equal(s, s_t)  # one rounded add, as torch does it
        check(y, y_t)
        # NaN-poisoned outputs; then fully in place: y over x, s over residual
        out, s_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        res = rms_norm(x, w, EPS, residual=r, out=out, residual_out=s_out)
        assert res[0] is out and res[1] is s_out and torch.equal(s_out, s_t)
        check(out, y_t)
        x2, r2 = x.clone(), r.clone()
        rms_norm(x2, w, EPS, residual=r2, out=x2, residual_out=r2)
        assert torch.equal(r2, s_t)
        check(x2, y_t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_strided(device, dtype):
    # column slices of wider buffers: x and residual read with a row stride, y and s written into slices
    gen = torch.Generator().manual_seed(7)
    N, D, W = 5, 100, 160
    wide = rand(N, W, dtype=dtype, gen=gen, device=device)
    wide_r = rand(N, W, dtype=dtype, gen=gen, device=device)
    x, r = wide[:, 7:7 + D], wide_r[:, 50:50 + D]
    w = rand(D, dtype=torch.float32, gen=gen, device=device, scale=0.2)
    check(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS))
    buf = torch.full((N, 2, W), float("nan"), dtype=dtype, device=device)
    out, s_out = buf[:, 0, 3:3 + D], buf[:, 1, 30:30 + D]
    rms_norm(x, w, EPS, residual=r, out=out, residual_out=s_out)
    y_t, s_t = rms_norm_ref(x, w, EPS, residual=r)
    check(out, y_t)
    assert torch.equal(s_out, s_t)
    assert buf[:, 0, :3].isnan().all() and buf[:, 0, 3 + D:].isnan().all()  # nothing outside the slices
    assert buf[:, 1, :30].isnan().all() and buf[:, 1, 30 + D:].isnan().all()
    # a non-unit last stride is copied, not misread
    xt = rand(D, N, dtype=dtype, gen=gen, device=device).t()
    check(rms_norm(xt, w, EPS), rms_norm_ref(xt, w, EPS))


def test_rms_norm_batch_invariant_and_wide(device):
    gen = torch.Generator().manual_seed(3)
    x = rand(9, 8192, dtype=torch.float32, gen=gen, device=device)
    w = rand(8192, dtype=torch.float32, gen=gen, device=device, scale=0.2)
    y = rms_norm(x, w, EPS)
    check(y, rms_norm_ref(x, w, EPS))
    for i in (0, 4, 8):  # a row's result does not depend on its batch
        assert torch.equal(rms_norm(x[i:i + 1], w, EPS), y[i:i + 1])
    assert rms_norm(x[:0], w, EPS).shape == (0, 8192)


@pytest.mark.parametrize("dtype,w_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                           (torch.float16, torch.float32)])
@pytest.mark.parametrize("D", [63, 100, 128])
def test_gated_rms_norm(device, dtype, w_dtype, D):
    for seed, (T, H) in enumerate(((1, 1), (3, 1), (1, 17), (3, 4))):
        gen = torch.Generator().manual_seed(seed)
        x = rand(T, H, D, dtype=dtype, gen=gen, device=device, scale=2.0)
        # gate: the z half of a projection [T, 2·H·D], viewed per head: row strides (2·H·D, D)
        z = rand(T, 2 * H * D, dtype=dtype, gen=gen, device=device, scale=2.0)[:, H * D:].view(T, H, D)
        w = rand(D, dtype=w_dtype, gen=gen, device=device, scale=0.3) + 1
        y_t = gated_rms_norm_ref(x, z, w, EPS)
        out = torch.full_like(x, float("nan"))
        assert gated_rms_norm(x, z, w, EPS, out=out) is out
        check(out, y_t)
        # flat [N, D] rows with the gate a strided 2-D column slice
        g2 = rand(T * H, D + 9, dtype=dtype, gen=gen, device=device)[:, 5:5 + D]
        x2 = x.reshape(T * H, D)
        y2 = gated_rms_norm(x2, g2, w, EPS)
        assert y2.shape == (T * H, D)
        check(y2, gated_rms_norm_ref(x2, g2, w, EPS))
        check(gated_rms_norm(x2, z, w, EPS), gated_rms_norm_ref(x2, z, w, EPS))  # [N, D] x, [T, H, D] gate


def test_gated_rms_norm_batch_invariant(device):
    gen = torch.Generator().manual_seed(4)
    x = rand(6, 4, 128, dtype=torch.float16, gen=gen, device=device)
    z = rand(6, 4, 128, dtype=torch.float16, gen=gen, device=device)
    w = rand(128, dtype=torch.float16, gen=gen, device=device, scale=0.3) + 1
    y = gated_rms_norm(x, z, w, EPS)
    assert torch.equal(gated_rms_norm(x[2:3], z[2:3], w, EPS), y[2:3])
    assert gated_rms_norm(x[:0], z[:0], w, EPS).shape == (0, 4, 128)


def _rms_kwargs(case, device):
    x = torch.zeros(3, 16, device=device)
    kw = dict(x=x, weight=torch.zeros(16, device=device), eps=EPS)
    bad = {
        "x_rank": dict(x=x[0]), "x_dtype": dict(x=x.double()), "x_int": dict(x=x.int()),
        "too_wide": dict(x=torch.zeros(1, 8193, device=device), weight=torch.zeros(8193, device=device)),
        "weight_len": dict(weight=torch.zeros(15, device=device)), "weight_dtype": dict(weight=kw["weight"].double()),
        "res_shape": dict(residual=x[:2]), "res_dtype": dict(residual=x.half()),
        "out_shape": dict(out=x[:, :8]), "out_dtype": dict(out=x.half()),
        "out_stride": dict(out=torch.zeros(16, 3, device=device).t()),
        "res_out_alone": dict(residual_out=x.clone()), "res_out_dtype": dict(residual=x, residual_out=x.half()),
        "device": dict(weight=torch.zeros(16, device="meta")),
    }
    kw.update(bad[case])
    return kw


@pytest.mark.parametrize("case", ["x_rank", "x_dtype", "x_int", "too_wide", "weight_len", "weight_dtype",
                                  "res_shape", "res_dtype", "out_shape", "out_dtype", "out_stride",
                                  "res_out_alone", "res_out_dtype", "device"])
def test_rms_norm_bad_inputs_raise(device, case):
    with pytest.raises(ValueError):
        rms_norm(**_rms_kwargs(case, device))


@pytest.mark.parametrize("case", ["x_rank", "x_dtype", "gate_rows", "gate_dim", "gate_dtype", "weight_len",
                                  "out_shape", "out_dtype", "out_stride", "device"])
def test_gated_rms_norm_bad_inputs_raise(device, case):
    x = torch.zeros(2, 3, 16, device=device)
    kw = dict(x=x, gate=torch.zeros(6, 16, device=device), weight=torch.ones(16, device=device), eps=EPS)
    kw.update({
        "x_rank": dict(x=x[0, 0]), "x_dtype": dict(x=x.double()), "gate_rows": dict(gate=kw["gate"][:5]),
        "gate_dim": dict(gate=torch.zeros(6, 8, device=device)), "gate_dtype": dict(gate=kw["gate"].double()),
        "weight_len": dict(weight=torch.ones(8, device=device)), "out_shape": dict(out=torch.zeros(6, 16)),
        "out_dtype": dict(out=x.half()), "out_stride": dict(out=torch.zeros(16, 3, 2, device=device).permute(2, 1, 0)),
        "device": dict(gate=torch.zeros(6, 16, device="meta")),
    }[case])
    with pytest.raises(ValueError):
        gated_rms_norm(**kw)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [100, 128, 2048, 4096, 5120, 8192])
def test_gpu_bf16_exact(device, D):
    # bf16 as the engine runs it: bit-equal to the twin almost everywhere. rms_norm rounds once, so it is
    # within one ulp; the gated twin rounds three times (x̂, w·x̂, y), and when the fp32 sum order flips
    # x̂ by one ulp the next rounding can widen that to two (seen on ~1e-5 of the elements at D = 8192)
    gen = torch.Generator().manual_seed(D)
    N = 64
    x, r = (rand(N, D, dtype=torch.bfloat16, gen=gen, device=device, scale=4.0) for _ in range(2))
    w = rand(D, dtype=torch.bfloat16, gen=gen, device=device, scale=0.2)
    y, s = rms_norm(x, w, EPS, residual=r)
    y_t, s_t = rms_norm_ref(x, w, EPS, residual=r)
    assert torch.equal(s, s_t)
    check(y, y_t)
    check(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS))
    z = rand(N, 2 * D, dtype=torch.bfloat16, gen=gen, device=device, scale=3.0)[:, D:]
    for wg in (w + 1, (w + 1).float()):
        check(gated_rms_norm(x, z, wg, EPS), gated_rms_norm_ref(x, z, wg, EPS), max_ulps=2)
