"""Comparison helpers shared by the kernel tests (importable: tests/ is on the path, as checkpoints.py)."""

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; ``a`` (the kernel's output) must be finite (an unwritten output?)."""
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values (an unwritten output?)"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
