"""Naive torch twin of the few-rows linear (kernels/few_rows_linear.py): the drafter's lm_head."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def few_rows_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` [..., N] for x [..., K] and weight [N, K]: ``F.linear(x, weight)``."""
    return F.linear(x, weight)
