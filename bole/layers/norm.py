"""RMS norms of the Qwen3.5 / Qwen3-Next decoder.

``RMSNorm`` is zero-centred: y = x̂ · (1 + w), computed in fp32 and cast back (decoder norms, q/k
norms, MTP norms; weights are stored as offsets from one). With ``residual`` it first forms
s = x + residual and returns (norm(s), s): the decoder's residual add fused into its next norm.
``GatedRMSNorm`` is the GDN output norm: plain weight (not zero-centred), normalised per value head,
then multiplied by silu(z).

The math is ``bole.ops.norm`` (the twins); ``kernel`` / ``gated_kernel`` set by the model from its
backend (``bole.backend``: the Triton kernels of ``kernels.rmsnorm`` on the GPU, one launch per norm)
replace it with the same signature.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from bole.ops.norm import gated_rms_norm_ref, rms_norm_ref


class _Norm(nn.Module):
    """A norm's weight (``dim`` values of ``init``), eps and math (``kernel``: the twin until the model
    sets its backend's)."""

    def __init__(self, dim: int, eps: float, init: float, kernel: Callable):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((dim,), init))
        self.kernel: Callable = kernel


class RMSNorm(_Norm):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps, 0.0, rms_norm_ref)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., dim] -> normed x; with ``residual`` (x's shape) -> (norm(x + residual), x + residual)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if residual is None:
            return self.kernel(x2, self.weight, self.eps).view(shape)
        y, s = self.kernel(x2, self.weight, self.eps, residual.reshape(-1, shape[-1]))
        return y.view(shape), s.view(shape)


class GatedRMSNorm(_Norm):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps, 1.0, gated_rms_norm_ref)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., dim] (one value head per row)."""
        return self.kernel(x, gate, self.weight, self.eps)
