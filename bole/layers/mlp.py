"""Dense SwiGLU MLP: down(silu(gate(x)) * up(x)).

Tensor parallel: gate_proj / up_proj are column parallel (intermediate dim split), down_proj row
parallel; the caller all-reduces the output (``tp_reduce``).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from bole.layers.linear import FusedLinear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: FusedLinear | None = None

    def fuse_projections(self) -> None:
        """One GEMM for gate_proj | up_proj (``bole.layers.linear``)."""
        self.gate_up = FusedLinear([self.gate_proj, self.up_proj])

    def forward(self, x):
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)
