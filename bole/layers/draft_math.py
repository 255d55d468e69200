"""Tensor-core products for the drafter's fp32 forwards.

The MTP drafter only proposes tokens: acceptance against the target's own logits decides every
emitted token, so the drafter's rounding cannot change an output (greedy stays token-identical to
``ar``, sampling stays distribution-exact); it can only change which drafts are proposed, i.e. MAT.
On fp32 activations (the embedded model's engine runs) its products therefore need not be exact
fp32: inside ``draft_math(True)`` cuBLAS GEMMs may use TF32 (``torch.set_float32_matmul_precision
("high")``) and ``bole.layers.attention.sdpa`` runs in bf16 (fp32 SDPA on CUDA is a SIMT kernel;
the bf16 one uses tensor cores). Both are set at call time, so a CUDA graph captured inside the
context replays the faster kernels. The target's forwards never enter it.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_BF16_ATTENTION = contextvars.ContextVar("bole_draft_bf16_attention", default=False)


def bf16_attention() -> bool:
    """Whether ``sdpa`` may run fp32 inputs in bf16 (inside ``draft_math(True)``)."""
    return _BF16_ATTENTION.get()


def _matmul_precision() -> str | None:
    """The legacy fp32 matmul precision, or None where the process sets TF32 through torch's newer
    per-backend API (``torch.backends.cuda.matmul.fp32_precision``): the legacy getter then raises on
    the mix, so the drafter leaves that process's GEMM setting alone rather than mixing the two."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


@contextlib.contextmanager
def draft_math(enabled: bool):
    """Inside: TF32 GEMMs (legacy ``set_float32_matmul_precision("high")``, restored on exit, also on
    an exception) and bf16 SDPA for fp32 CUDA inputs. The context is process-wide for the GEMM setting:
    one engine thread drafts at a time. The legacy setter pins the newer per-backend values, so a later
    ``torch.backends.fp32_precision`` change no longer reaches cuBLAS matmuls (set the per-backend one)."""
    if not enabled:
        yield
        return
    prev = _matmul_precision()
    token = _BF16_ATTENTION.set(True)
    if prev is not None:
        torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        if prev is not None:
            torch.set_float32_matmul_precision(prev)
        _BF16_ATTENTION.reset(token)
