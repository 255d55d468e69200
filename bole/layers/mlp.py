"""Dense SwiGLU MLP: down(silu(gate(x)) * up(x)).

silu(gate) * up is one call, ``act_mul`` (bole.ops.activation; kernels.act_mul on the "triton"
backend, reading the two column halves of the fused gate|up GEMM output in place).
Tensor parallel: gate_proj / up_proj are column parallel (intermediate dim split), down_proj row
parallel; the caller all-reduces the output (``tp_reduce``).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from bole.layers.linear import FusedLinear
from bole.ops.activation import act_mul_ref


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: FusedLinear | None = None
        self.act_mul: Callable = act_mul_ref  # the backend's (set by the model)

    def fuse_projections(self) -> None:
        """One GEMM for gate_proj | up_proj (``bole.layers.linear``)."""
        self.gate_up = FusedLinear([self.gate_proj, self.up_proj])

    def forward(self, x):
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(self.act_mul(up, gate, "silu"))
