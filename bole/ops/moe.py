"""Naive torch twin of the routed experts (kernels/moe_experts.py): a loop over the routed experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bole.ops.activation import act_mul_ref


def moe_experts_ref(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, top_idx: torch.Tensor,
                    top_w: torch.Tensor) -> torch.Tensor:
    """Σ_k top_w[n, k] · expert_{top_idx[n, k]}(x[n]) [N, H] for x [N, H], gate_up_proj [E, 2I, H] (gate rows
    then up rows), down_proj [E, H, I], top_idx / top_w [N, k]; expert_e(x) = down_e(silu(gate_e x) · up_e x).
    Each expert the batch routes to runs once over its tokens; the expert list is read on the host, so a
    CUDA graph cannot capture this (the kernel's reason to exist)."""
    out = torch.zeros_like(x)
    for e in torch.unique(top_idx).tolist():
        tok, slot = torch.where(top_idx == e)
        gate, up = F.linear(x[tok], gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(act_mul_ref(up, gate, "silu"), down_proj[e])
        out.index_add_(0, tok, (y * top_w[tok, slot, None]).to(out.dtype))
    return out
