"""Sparse MoE block of Qwen3.5-MoE / Qwen3-Next: routed top-k experts plus a gated shared expert.

    probs = softmax(x Wgᵀ) (fp32);  top-k;  renormalise the k weights when norm_topk_prob
    y = Σ_k w_k · expert_k(x) + sigmoid(x w_sᵀ) · shared_expert(x)

Experts are stored fused, as transformers holds them: ``experts.gate_up_proj`` [E, 2I, H] (gate rows
then up rows) and ``experts.down_proj`` [E, H, I]; the loader stacks per-expert checkpoint tensors.
The routed experts run through the backend's ``moe_experts`` (bole.ops.moe's loop over the routed experts,
or kernels.moe_experts, which reads nothing on the host, so graphs capture it); the shared expert's
sigmoid gate goes through ``act_mul`` (bole.ops.activation or kernels.act_mul). Tensor parallel: each
expert's intermediate dim is split (gate_up column, down row parallel), the router and the shared-expert
gate are replicated.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from bole.layers.mlp import MLP
from bole.ops.activation import act_mul_ref
from bole.ops.moe import moe_experts_ref


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.dispatch: Callable = moe_experts_ref  # the backend's moe_experts (set by the model)

    def forward(self, x, top_idx, top_w):
        """x [N, H]; top_idx, top_w [N, k] -> [N, H]."""
        return self.dispatch(x, self.gate_up_proj, self.down_proj, top_idx, top_w)


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, moe_intermediate_size: int,
                 shared_intermediate_size: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, moe_intermediate_size)
        self.shared_expert = MLP(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_intermediate_size else None
        self.act_mul: Callable = act_mul_ref  # the backend's (set by the model)

    def forward(self, x):
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        out = self.experts(x, top_idx, top_w)  # fp32 weights: k of them sum to one (a widened MoE's identity)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out = out + self.act_mul(shared, self.shared_expert_gate(x).expand_as(shared), "sigmoid")
        return out
