"""RMS norms of the Qwen3.5 / Qwen3-Next decoder.

``RMSNorm`` is zero-centred: y = x̂ · (1 + w), computed in fp32 and cast back (decoder norms, q/k
norms, MTP norms; weights are stored as offsets from one). ``GatedRMSNorm`` is the GDN output norm:
plain weight (not zero-centred), normalised per value head, then multiplied by silu(z).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., dim] (one value head per row)."""
        dtype = x.dtype
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * y * F.silu(gate.float())).to(dtype)
