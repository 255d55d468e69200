"""Naive torch twin of the gated activation kernel (kernels/act_mul.py): y = x · act(gate).

    "silu":     the SwiGLU MLP's silu(gate) · up (dense MLP, MoE experts; vLLM's SiluAndMul)
    "sigmoid":  gated attention's output gate o · sigmoid(gate), the MoE shared expert's gate

As torch computes it in x's dtype: act(gate) rounded to the dtype, then the product rounded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}


def act_mul_ref(x: torch.Tensor, gate: torch.Tensor, activation: str, out=None) -> torch.Tensor:
    """x, gate of one shape and dtype -> x · act(gate) in that shape (written into ``out`` when given)."""
    y = x * ACTIVATIONS[activation](gate)
    if out is None:
        return y
    return out.copy_(y)
