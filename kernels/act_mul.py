"""Gated activation in Triton: y = x · act(gate) in one launch (the MLP's silu(gate) · up, the attention
output gate o · sigmoid(gate)) instead of an activation kernel, a multiply and often a copy.

Twin: `bole.ops.activation.act_mul_ref`. Inputs are [N, C] or [N, H, D] with any strides (the column
halves of a fused gate|up GEMM output, the per-head gate interleaved with q in the q projection, a
broadcast [N, 1] gate expanded), so no input is copied. Grid (N, H, D / BD); each element is
independent, so the result does not depend on the batch. The kernel repeats the twin's roundings:
act(gate) computed in fp32 and rounded to the dtype, then the product rounded; it differs only in
exp / division precision (fp32 within ~1e-6 relative, half dtypes within one ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_tensor

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ACTIVATIONS = {"silu": 0, "sigmoid": 1}
MAX_BLOCK = 1024


@triton.jit
def act_mul_kernel(
    x, g, y,                                          # [N, H, D] strided, [N, H, D] strided, [N, H, D]
    stride_xn, stride_xh, stride_xd, stride_gn, stride_gh, stride_gd, stride_yn, stride_yh, D,
    BD: tl.constexpr, SIGMOID: tl.constexpr,
):
    i_n, i_h, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    b_g = tl.load(g + i_n * stride_gn + i_h * stride_gh + o_d * stride_gd, mask=m_d, other=0).to(tl.float32)
    if SIGMOID:
        b_a = 1.0 / (1.0 + tl.exp(-b_g))
    else:
        b_a = b_g / (1.0 + tl.exp(-b_g))  # silu as torch writes it
    b_a = b_a.to(y.dtype.element_ty).to(tl.float32)  # torch rounds act(gate) to the dtype
    b_x = tl.load(x + i_n * stride_xn + i_h * stride_xh + o_d * stride_xd, mask=m_d, other=0).to(tl.float32)
    tl.store(y + i_n * stride_yn + i_h * stride_yh + o_d, (b_x * b_a).to(y.dtype.element_ty), mask=m_d)


def launch_act_mul(x, gate, out, sigmoid: bool):
    """Launcher: x, gate, out [N, H, D] (out with a unit last stride); grid (N, H, D / BD)."""
    N, H, D = x.shape
    BD = min(triton.next_power_of_2(D), MAX_BLOCK)
    act_mul_kernel[(N, H, triton.cdiv(D, BD))](
        x, gate, out, *x.stride(), *gate.stride(), out.stride(0), out.stride(1), D,
        BD=BD, SIGMOID=sigmoid, num_warps=4 if BD >= 512 else 1,
    )
    return out


def act_mul(x, gate, activation, out=None):
    """y = x · act(gate), act = silu or sigmoid, elementwise.

    Twin: `bole.ops.activation.act_mul_ref`.

    Args:
        x: [N, C] or [N, H, D] float32/float16/bfloat16, any strides.
        gate: x's shape and dtype, any strides (stride 0 broadcasts: ``g[:, :1].expand_as(x)``).
        activation: "silu" or "sigmoid".
        out: optional, x's shape and dtype, unit last stride (may be x itself). Default: contiguous.
    Returns:
        y in x's shape and dtype.
    """
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
        raise ValueError(f"x must be [N, C] or [N, H, D], got {getattr(x, 'shape', type(x).__name__)}")
    check_tensor("x", x, x.dim(), _DTYPES, x.device)
    check_tensor("gate", gate, x.dim(), (x.dtype,), x.device)
    if gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    check_tensor("out", out, x.dim(), (x.dtype,), x.device)
    if out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(x.shape)} with a unit last stride, got {tuple(out.shape)} "
                         f"strides {out.stride()}")
    if x.numel() == 0:
        return out
    as3 = (lambda t: t[:, None]) if x.dim() == 2 else (lambda t: t)  # [N, C] as [N, 1, C]
    launch_act_mul(as3(x), as3(gate), as3(out), _ACTIVATIONS[activation] == 1)
    return out
