"""Naive torch twins of the fused RMS-norm kernels (kernels/rmsnorm.py).

They are the forwards of ``bole.layers.norm.RMSNorm`` and ``GatedRMSNorm`` written as functions with
the kernels' signatures, roundings included:

    rms_norm:        y = x̂ · (1 + w), x̂ = x · rsqrt(mean(x²) + eps), all in fp32, cast to x.dtype once
    with residual:   s = x + residual (rounded to x.dtype, as torch's add does); returns (rms_norm(s), s)
    gated_rms_norm:  y = (w · x̂.to(dtype)) · silu(gate) — x̂ rounded to x.dtype first, w · x̂ computed in
                     the promoted dtype of w and x, the product with silu(gate.float()) in fp32
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x, weight, eps, residual=None, out=None, residual_out=None):
    """Zero-centred RMS norm of the rows of x [N, D] (weight [D] stored as offsets from one).

    Without residual returns y [N, D]; with residual returns (y, s), s = x + residual. When given,
    out and residual_out receive y and s and are returned in their place.
    """
    s = None
    if residual is not None:
        s = x + residual
        x = s
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (y * (1.0 + weight.float())).type_as(x)
    if out is not None:
        y = out.copy_(y)
    if s is None:
        return y
    if residual_out is not None:
        s = residual_out.copy_(s)
    return y, s


def gated_rms_norm_ref(x, gate, weight, eps, out=None):
    """GDN output norm: x [..., D] (one value head per row), gate with x's rows (reshaped to x.shape),
    plain weight [D]; returns y in x.shape and x.dtype (out, when given, receives y and is returned)."""
    dtype = x.dtype
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    y = (weight * y * F.silu(gate.float().reshape(x.shape))).to(dtype)
    if out is not None:
        y = out.copy_(y.reshape(out.shape))
    return y
