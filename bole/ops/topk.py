"""Naive torch twin of the drafter's fused log-softmax top-k (kernels/logits_topk.py)."""

from __future__ import annotations

import torch


def log_softmax_topk_ref(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values fp32, indices int64), each [..., k]: ``log_softmax(logits.float(), -1).topk(k, -1)``,
    sorted by value, descending."""
    return torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
