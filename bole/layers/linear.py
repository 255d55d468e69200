"""One GEMM for several projections of the same input (GDN in_proj q|k|v|z|b|a, attention q|k|v, MLP
gate|up): at decode batch sizes each projection is a memory-bound GEMV whose launch and tail cost as
much as its bytes, so one concatenated matrix saves launches and reads x once.

``fuse_linears`` builds the matrix and re-points every original ``nn.Linear`` at its rows (views: no
extra memory, checkpoint names and tensor-parallel slicing unchanged). Layers call it from their
``fuse_projections`` after the weights are loaded; until then they run the separate projections.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinear:
    """The concatenated projection: ``__call__(x)`` returns the per-projection outputs (column views)."""

    def __init__(self, linears: list[nn.Linear]):
        ins = {lin.in_features for lin in linears}
        if len(ins) != 1:
            raise ValueError(f"projections to fuse must share their input size, got {sorted(ins)}")
        if len({lin.bias is None for lin in linears}) != 1:
            raise ValueError("projections to fuse must all have a bias or none")
        with torch.no_grad():
            self.weight = torch.cat([lin.weight for lin in linears])
            self.bias = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
        self.splits = [lin.out_features for lin in linears]
        off = 0
        for lin, n in zip(linears, self.splits, strict=True):
            lin.weight = nn.Parameter(self.weight[off:off + n], requires_grad=False)
            if self.bias is not None:
                lin.bias = nn.Parameter(self.bias[off:off + n], requires_grad=False)
            off += n

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.splits, dim=-1)
