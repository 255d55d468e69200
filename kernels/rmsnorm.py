"""Fused RMS norms in Triton: one launch per norm instead of ~10 elementwise kernels (decode/verify hot path).

Twins: `bole.ops.norm.rms_norm_ref` and `gated_rms_norm_ref` (the forwards of `bole.layers.norm`).
Grid (N,): one program per row holds the whole row (BD = next_power_of_2(D) lanes, masked), so a row's
result never depends on which other rows are in the batch (the engine needs batch invariance), and
every row is read in full before any of it is written, so outputs may alias inputs (in-place use).
The kernels repeat the twins' roundings to the input dtype; they differ from them only in the order
of the fp32 sum of squares and in rsqrt/exp/div precision: bit-equal almost everywhere, rms_norm within
one fp16/bf16 ulp of the twin, gated_rms_norm within two (its twin rounds three times in a chain).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_D = 8192


@triton.jit
def rms_norm_kernel(
    x, res, w, y, s,                                  # [N, D] rows strided, [N, D], [D], [N, D], [N, D]
    stride_x, stride_r, stride_y, stride_s, eps,
    D: tl.constexpr, BD: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_x = tl.load(x + i_n * stride_x + o_d, mask=m_d, other=0).to(tl.float32)
    if HAS_RESIDUAL:
        # s = x + residual rounded to the input dtype (torch's add), then normed
        b_r = tl.load(res + i_n * stride_r + o_d, mask=m_d, other=0).to(tl.float32)
        b_s = (b_x + b_r).to(s.dtype.element_ty)
        tl.store(s + i_n * stride_s + o_d, b_s, mask=m_d)
        b_x = b_s.to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=0) / D + eps)
    b_w = tl.load(w + o_d, mask=m_d, other=0).to(tl.float32)
    b_y = b_x * b_rstd * (1.0 + b_w)  # zero-centred weight
    tl.store(y + i_n * stride_y + o_d, b_y.to(y.dtype.element_ty), mask=m_d)


@triton.jit
def gated_rms_norm_kernel(
    x, g, w, y,                                       # [N, D], [N / G1, G1, D] strided, [D], [N, D]
    stride_x, stride_g0, stride_g1, stride_y, G1, eps,
    D: tl.constexpr, BD: tl.constexpr, ROUND_WY: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_x = tl.load(x + i_n * stride_x + o_d, mask=m_d, other=0).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=0) / D + eps)
    b_xn = (b_x * b_rstd).to(x.dtype.element_ty).to(tl.float32)  # the twin rounds x̂ to x.dtype
    b_wy = tl.load(w + o_d, mask=m_d, other=0).to(tl.float32) * b_xn
    if ROUND_WY:  # weight and x share a half dtype: torch rounds w · x̂ to it
        b_wy = b_wy.to(y.dtype.element_ty).to(tl.float32)
    p_g = g + (i_n // G1) * stride_g0 + (i_n % G1) * stride_g1 + o_d
    b_g = tl.load(p_g, mask=m_d, other=0).to(tl.float32)
    b_y = b_wy * (b_g / (1.0 + tl.exp(-b_g)))  # silu as torch writes it
    tl.store(y + i_n * stride_y + o_d, b_y.to(y.dtype.element_ty), mask=m_d)


def _block(D: int):
    BD = triton.next_power_of_2(D)
    return BD, min(8, max(1, BD // 512))  # <= 32 fp32 lanes a thread at D = 8192


def launch_rms_norm(x, weight, eps, residual, out, residual_out):
    """Launcher: grid (N,), whole rows per program; x, residual, out, residual_out [N, D], unit last stride."""
    N, D = x.shape
    BD, num_warps = _block(D)
    has_res = residual is not None
    res, s = (residual, residual_out) if has_res else (x, out)  # dummies, never touched
    rms_norm_kernel[(N,)](
        x, res, weight, out, s, x.stride(0), res.stride(0), out.stride(0), s.stride(0), eps,
        D=D, BD=BD, HAS_RESIDUAL=has_res, num_warps=num_warps,
    )
    return (out, residual_out) if has_res else out


def launch_gated_rms_norm(x, gate, weight, eps, out):
    """Launcher: grid (N,); x, out [N, D] and gate [N / G1, G1, D], unit last strides."""
    N, D = x.shape
    BD, num_warps = _block(D)
    round_wy = weight.dtype == x.dtype and x.dtype != torch.float32
    gated_rms_norm_kernel[(N,)](
        x, gate, weight, out, x.stride(0), gate.stride(0), gate.stride(1), out.stride(0), gate.shape[1], eps,
        D=D, BD=BD, ROUND_WY=round_wy, num_warps=num_warps,
    )
    return out


def _check(name, t, shape, dtype, device):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if (t.dtype != dtype) if dtype is not None else (t.dtype not in _DTYPES):
        raise ValueError(f"{name} must be {dtype or 'float32/float16/bfloat16'}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, x on {device}")


def _check_x(x):
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"x must be a tensor [..., D], got {getattr(x, 'shape', type(x).__name__)}")
    _check("x", x, x.shape, None, x.device)
    if not 1 <= x.shape[-1] <= MAX_D:
        raise ValueError(f"row size D must be in [1, {MAX_D}], got {x.shape[-1]}")


def _unit_last(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(x, weight, eps, residual=None, out=None, residual_out=None):
    """Zero-centred RMS norm of each row, optionally after a residual add: y = x̂ · (1 + weight).

    Twin: `bole.ops.norm.rms_norm_ref`. Batch-invariant (one program per row).

    Args:
        x: [N, D] float32/float16/bfloat16, D <= 8192, any row stride (a non-unit last stride is copied).
        weight: [D] offsets from one (any of the three float dtypes).
        eps: added to mean(x²).
        residual: optional [N, D] in x.dtype. Then s = x + residual (rounded to x.dtype) is normed.
        out: optional [N, D] x.dtype with unit last stride, receives y (may be x itself).
        residual_out: optional [N, D] x.dtype with unit last stride, receives s (may be `residual`
            itself: the in-place residual update); only with residual. Default: a new tensor.
    Returns:
        y [N, D] in x.dtype, or (y, s) with residual.
    """
    _check_x(x)
    if x.dim() != 2:
        raise ValueError(f"x must be [N, D], got {tuple(x.shape)}")
    _check("weight", weight, x.shape[-1:], None, x.device)
    if residual is None and residual_out is not None:
        raise ValueError("residual_out is given without residual")
    if residual is not None:
        _check("residual", residual, x.shape, x.dtype, x.device)
        residual = _unit_last(residual)
        residual_out = x.new_empty(x.shape) if residual_out is None else residual_out
    out = x.new_empty(x.shape) if out is None else out  # row-major even when x is not
    for name, t in (("out", out), ("residual_out", residual_out)):
        if t is not None:
            _check(name, t, x.shape, x.dtype, x.device)
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must have a unit last stride, got strides {t.stride()}")
    if x.shape[0] == 0:
        return out if residual is None else (out, residual_out)
    return launch_rms_norm(_unit_last(x), weight.contiguous(), float(eps), residual, out, residual_out)


def gated_rms_norm(x, gate, weight, eps, out=None):
    """GDN output norm: y = (weight · x̂) · silu(gate), one value head per row, plain (not offset) weight.

    Twin: `bole.ops.norm.gated_rms_norm_ref`. Batch-invariant (one program per row).

    Args:
        x: [..., D] float32/float16/bfloat16, D <= 8192; rows N = x.numel() / D (reshaped, copied only
            when not viewable as [N, D]).
        gate: N rows of D (any float dtype): [N, D] or [A, B, D] with A·B = N, any row strides (the
            z projection viewed per head), or any shape with N rows of D (reshaped).
        weight: [D] any of the three float dtypes; w · x̂ is rounded to x.dtype when weight has it.
        eps: added to mean(x²).
        out: optional, x.shape and x.dtype, viewable as [N, D] with unit last stride (may be x).
    Returns:
        y in x.shape and x.dtype.
    """
    _check_x(x)
    D = x.shape[-1]
    N = x.numel() // D
    _check("weight", weight, (D,), None, x.device)
    if not isinstance(gate, torch.Tensor) or gate.dim() < 2 or gate.shape[-1] != D or gate.numel() != N * D:
        raise ValueError(f"gate must hold {N} rows of {D}, got {getattr(gate, 'shape', type(gate).__name__)}")
    _check("gate", gate, gate.shape, None, x.device)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _check("out", out, x.shape, x.dtype, x.device)
    try:
        out2 = out.view(N, D)
    except RuntimeError:
        out2 = None
    if out2 is None or out2.stride(1) != 1:
        raise ValueError(f"out must be viewable as [{N}, {D}] with a unit last stride, got strides {out.stride()}")
    if N == 0:
        return out
    gate = gate[:, None] if gate.dim() == 2 else gate.reshape(-1, gate.shape[-2], D)  # [N / G1, G1, D]
    launch_gated_rms_norm(_unit_last(x.reshape(N, D)), _unit_last(gate), weight.contiguous(), float(eps), out2)
    return out
