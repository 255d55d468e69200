"""The drafter's top-k of log-softmax(logits) in one launch per level, in Triton.

Twin: `bole.ops.topk.log_softmax_topk_ref` (``log_softmax(x.float()).topk(k)``). The drafter takes
the ``topk`` most likely children of every frontier node at every level; torch does that as a
log-softmax kernel writing [rows, V] and a radix-select top-k (plus a sort): about 16 µs per level on
the H200 for the embedded model's 8192-token vocabulary (results/profile_h200.json, 2026-12-01, the
draft graph's gatherTopK / softmax kernels). Here one program holds one row in registers, forms its
log-sum-exp, and takes the k largest by k arg-max passes (k is small: the drafter's topk), writing
only [rows, k]. Since log-softmax is x - lse(x) with one lse per row, the top-k of the logits is the
top-k of the log-probabilities. Ties go to the lowest index (torch leaves their order unspecified).
Rows wider than ``MAX_V`` are refused (``bole.backend`` sends them to the twin).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_tensor

MAX_V = 32768
MAX_K = 64


@triton.jit
def log_softmax_topk_kernel(x, vals, idx, V, stride_x, K: tl.constexpr, BV: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    o_v = tl.arange(0, BV)
    b_x = tl.load(x + r * stride_x + o_v, mask=o_v < V, other=float("-inf")).to(tl.float32)
    b_max = tl.max(b_x, 0)
    lse = b_max + tl.log(tl.sum(tl.exp(b_x - b_max), 0))
    free = o_v < V  # lanes not taken yet (and inside the row): ids stay distinct with -inf entries
    for j in tl.static_range(K):
        best = tl.max(tl.where(free, b_x, float("-inf")), 0)
        at = tl.minimum(tl.min(tl.where(free & (b_x == best), o_v, BV), 0), V - 1)  # a NaN row: in range
        tl.store(vals + r * K + j, best - lse)
        tl.store(idx + r * K + j, at.to(tl.int64))
        free = free & (o_v != at)


def log_softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values fp32, indices int64), each [..., k]: the k largest log-probabilities of every row of
    ``logits`` [..., V] (float32/float16/bfloat16, unit last stride) and their token ids, descending.

    Twin: `bole.ops.topk.log_softmax_topk_ref`. V > MAX_V or k > MAX_K is refused: ``bole.backend``
    sends those rows to the twin.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise ValueError(f"logits must be a tensor [..., V], got {getattr(logits, 'shape', type(logits).__name__)}")
    V = logits.shape[-1]
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= V:
        raise ValueError(f"k must be an int in [1, V={V}], got {k!r}")
    if V > MAX_V or k > MAX_K:
        raise ValueError(f"rows of V={V} > {MAX_V} or k={k} > {MAX_K} exceed the kernel's tile")
    x = logits.reshape(-1, V)
    check_tensor("logits", x, 2, (torch.float32, torch.float16, torch.bfloat16), logits.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    R = x.shape[0]
    vals = torch.empty(R, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(R, k, dtype=torch.int64, device=x.device)
    if R:
        BV = max(16, triton.next_power_of_2(V))
        log_softmax_topk_kernel[(R,)](x, vals, idx, V, x.stride(0), K=k, BV=BV,
                                      num_warps=max(1, min(16, BV // 512)))
    shape = (*logits.shape[:-1], k)
    return vals.view(shape), idx.view(shape)
