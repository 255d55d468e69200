"""x @ W^T for a few rows and a wide weight, reading the weight once, in Triton.

Twin: `bole.ops.linear.few_rows_linear_ref` (``F.linear(x, weight)``). The drafter scores its frontier
with the lm_head at every level: 4-64 rows (batch x topk) against a 32k-248k-row weight. In the
9B-cost draft graph at batch 16 (64 rows a level, draft_vocab 32768, H100, 2026-12-05,
``profile_step.py --cases bole_phases``) cuBLAS ran 6 calls of a tile only 8 rows wide (nvjet
``512x8``) for 6.2 of the graph's 9.9 ms, 3.0 ms at batch 8 (32 rows), against 0.77 ms for 8 calls at
batch 1 (4 rows): time grows with the rows, as when every 8-row tile re-reads the weight, where
one read of the 268 MB weight is ~0.08 ms at the H100's 3.35 TB/s (an estimate, not a measurement).
Here one program owns a [BN] slice of the weight's rows and every row of x (up to 64 in
one tile; more rows take more tiles along the grid's second axis, one weight read per 64 rows),
so the weight streams through once at up to 64 rows. Half-precision inputs only: fp32 stays with
torch's GEMM, whose precision setting decides TF32 (``bole.backend.half_precision_only`` routes it there).

Status: correct against its twin and float64 (tests/kernels/test_few_rows_linear.py, the CPU
interpreter in fp16), not yet timed on a GPU: no device was lent after it was written. The engine
keeps torch's GEMM until benchmarks/draft_logits.py and profile_step.py's ``bole_phases_few_rows``
show it faster; the launch defaults (block_n 128, block_k 64, 4 warps, 4 stages) are a first guess
that the benchmark's ``--sweep`` checks.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._checks import check_tensor

MAX_BM = 64   # rows of x in one tile: the weight is read once per MAX_BM rows


@triton.jit
def few_rows_linear_kernel(x, w, out, M, N, stride_xm, stride_wn, stride_om, K: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    o_m = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    m_ok = o_m < M
    n_ok = o_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        o_k = kb * BK + tl.arange(0, BK)
        k_ok = o_k < K
        b_x = tl.load(x + o_m[:, None] * stride_xm + o_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b_w = tl.load(w + o_n[:, None] * stride_wn + o_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(b_x, tl.trans(b_w))
    tl.store(out + o_m[:, None] * stride_om + o_n[None, :], acc.to(out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, block_n: int = 128, block_k: int = 64,
                    num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """``x @ weight^T``: x [..., K] and weight [N, K], both float16 or both bfloat16, unit last stride
    for the weight; fp32 accumulation, output [..., N] in x's dtype.

    Twin: `bole.ops.linear.few_rows_linear_ref`. The block sizes are the launch's (powers of two >= 16).
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a tensor [..., K], got {getattr(x, 'shape', type(x).__name__)}")
    K = x.shape[-1]
    check_tensor("weight", weight, 2, (torch.float16, torch.bfloat16), x.device)
    if weight.dtype != x.dtype:
        raise ValueError(f"x ({x.dtype}) and weight ({weight.dtype}) must share a dtype")
    if weight.shape[1] != K:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x's last dimension K={K}")
    if weight.stride(-1) != 1:
        raise ValueError(f"weight needs a unit last stride, got strides {weight.stride()}")
    for name, v in (("block_n", block_n), ("block_k", block_k)):
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v!r}")
    M, N = math.prod(x.shape[:-1]), weight.shape[0]
    if K == 0:  # an empty sum, as F.linear
        return torch.zeros(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    x2 = x.reshape(M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        BM = min(MAX_BM, max(16, triton.next_power_of_2(M)))
        grid = (triton.cdiv(N, block_n), triton.cdiv(M, BM))
        few_rows_linear_kernel[grid](x2, weight, out, M, N, x2.stride(0), weight.stride(0), out.stride(0), K=K,
                                     BM=BM, BN=block_n, BK=block_k, num_warps=num_warps, num_stages=num_stages)
    return out.view(*x.shape[:-1], N)
