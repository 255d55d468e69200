"""Argument checks shared by the kernels' public functions (STYLE 7: ValueError naming the value)."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def check_tensor(name: str, t, dim: int, dtypes, device) -> None:
    """``t`` must be a ``dim``-d tensor of one of ``dtypes`` on ``device``."""
    if not isinstance(t, torch.Tensor) or t.dim() != dim:
        raise ValueError(f"{name} must be a {dim}-d tensor, got {getattr(t, 'shape', type(t))}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be one of {dtypes}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
