"""The routed experts of a sparse MoE block in Triton, with no host read: CUDA graphs can capture it.

Twin: `bole.ops.moe.moe_experts_ref`, which loops over the experts a batch routes to and so reads the
expert list on the host (``torch.unique(...).tolist()``); a graph cannot hold that, so MoE models ran
eagerly. Here every size is a function of the token count, the top-k and the expert count alone:

    1. route (torch ops, on the device): the N·k (token, slot) pairs p = n·k + slot sorted by expert, each
       expert's run padded to a multiple of BLOCK_M rows; ``pairs`` [NB·BLOCK_M] holds pair ids (N·k for a
       padding row), ``block_expert`` [NB] each block's expert (E for a block past the used ones).
       NB = ceil(N·k / BLOCK_M) + min(E, N·k) bounds the blocks any routing needs.
    2. ``_gate_up_act_kernel``, grid (NB, I / BN): a block of one expert's pairs, their tokens' rows of x
       against that expert's gate and up rows, fp32 accumulators, silu(gate)·up, one rounding into h [N·k, I].
    3. ``_down_kernel``, grid (NB, H / BN): h's rows against the expert's down_proj, times the pair's routing
       weight, into y [N·k, H] (fp32).
    4. out = y.view(N, k, H).sum(1), one rounding into x's dtype.

A block reads its expert's weight tile once for up to BLOCK_M pairs; a program whose block is past the used
ones returns before loading anything. The pair order within an expert is the pairs' order (a stable sort),
so the result does not depend on the launch. fp32 inputs take IEEE products (exact as the twin's fp32 GEMMs
up to summation order); half inputs accumulate in fp32.

Status: correct against the twin and float64 on the CPU interpreter (tests/kernels/test_moe_experts.py);
not yet compiled or timed on a GPU (no device was lent after it was written).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_tensor

BLOCK_M = 16  # pairs a block holds (tl.dot's smallest M)


@triton.jit
def _gate_up_act_kernel(x, w, h, pairs, block_expert, P, E, I, stride_x, stride_we, stride_w, stride_h,
                        TOPK: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    e = tl.load(block_expert + b)
    if e >= E:
        return
    rows = tl.load(pairs + b * BM + tl.arange(0, BM))
    ok = rows < P
    tok = (rows // TOPK).to(tl.int64)
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = o_n < I
    w_e = w + e.to(tl.int64) * stride_we
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        o_k = kb * BK + tl.arange(0, BK)
        k_ok = o_k < K
        a = tl.load(x + tok[:, None] * stride_x + o_k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        wmask = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(w_e + o_n[:, None].to(tl.int64) * stride_w + o_k[None, :], mask=wmask, other=0.0)
        wu = tl.load(w_e + (o_n[:, None] + I).to(tl.int64) * stride_w + o_k[None, :], mask=wmask, other=0.0)
        if IEEE:
            acc_g += tl.dot(a, tl.trans(wg), input_precision="ieee")
            acc_u += tl.dot(a, tl.trans(wu), input_precision="ieee")
        else:
            acc_g += tl.dot(a, tl.trans(wg))
            acc_u += tl.dot(a, tl.trans(wu))
    out = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h + rows[:, None].to(tl.int64) * stride_h + o_n[None, :], out.to(h.dtype.element_ty),
             mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h, w, y, weights, pairs, block_expert, P, E, H, stride_h, stride_we, stride_w, stride_y,
                 K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    e = tl.load(block_expert + b)
    if e >= E:
        return
    rows = tl.load(pairs + b * BM + tl.arange(0, BM))
    ok = rows < P
    r64 = rows.to(tl.int64)
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = o_n < H
    w_e = w + e.to(tl.int64) * stride_we
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        o_k = kb * BK + tl.arange(0, BK)
        k_ok = o_k < K
        a = tl.load(h + r64[:, None] * stride_h + o_k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        wd = tl.load(w_e + o_n[:, None].to(tl.int64) * stride_w + o_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                     other=0.0)
        if IEEE:
            acc += tl.dot(a, tl.trans(wd), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(wd))
    wt = tl.load(weights + r64, mask=ok, other=0.0).to(tl.float32)
    tl.store(y + r64[:, None] * stride_y + o_n[None, :], acc * wt[:, None], mask=ok[:, None] & n_ok[None, :])


def _route(top_idx: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [NB·block_m] int32, block_expert [NB] int32) of the routing ``top_idx`` [N, k] (step 1 of the
    module docstring): device ops of static sizes, no host read."""
    flat = top_idx.reshape(-1).long()
    P, dev = flat.numel(), flat.device
    NB = triton.cdiv(P, block_m) + min(num_experts, P)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(P, device=dev) - (torch.cumsum(counts, 0) - counts)[expert]
    pairs = torch.full((NB * block_m,), P, dtype=torch.int32, device=dev)
    pairs[(block_end - blocks)[expert] * block_m + rank] = order.to(torch.int32)
    block_expert = torch.searchsorted(block_end, torch.arange(NB, device=dev), right=True).to(torch.int32)
    return pairs, block_expert


def moe_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, top_idx: torch.Tensor,
                top_w: torch.Tensor, block_n: int = 64, block_k: int = 64, num_warps: int = 4) -> torch.Tensor:
    """Σ_k top_w[n, k] · expert_{top_idx[n, k]}(x[n]) [N, H], expert_e(x) = down_e(silu(gate_e x) · up_e x).

    x [N, H]; gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I] in x's dtype, unit
    last strides; top_idx [N, k] int (values in [0, E)), top_w [N, k] float. Output in x's dtype. Twin:
    `bole.ops.moe.moe_experts_ref`. Expert ids are not range-checked on the device (that would read them on
    the host): the router's top-k produces them.
    """
    floats = (torch.float32, torch.float16, torch.bfloat16)
    check_tensor("x", x, 2, floats, x.device if isinstance(x, torch.Tensor) else None)
    N, H = x.shape
    check_tensor("gate_up_proj", gate_up_proj, 3, (x.dtype,), x.device)
    E, I2, _ = gate_up_proj.shape
    if gate_up_proj.shape[2] != H or I2 % 2 or E < 1:
        raise ValueError(f"gate_up_proj must be [E >= 1, 2I, {H}], got {tuple(gate_up_proj.shape)}")
    I = I2 // 2
    check_tensor("down_proj", down_proj, 3, (x.dtype,), x.device)
    if tuple(down_proj.shape) != (E, H, I):
        raise ValueError(f"down_proj must be [{E}, {H}, {I}], got {tuple(down_proj.shape)}")
    check_tensor("top_idx", top_idx, 2, (torch.int32, torch.int64), x.device)
    k = top_idx.shape[1]
    if top_idx.shape[0] != N or not 1 <= k <= E:
        raise ValueError(f"top_idx must be [{N}, k] with 1 <= k <= {E}, got {tuple(top_idx.shape)}")
    check_tensor("top_w", top_w, 2, floats, x.device)
    if top_w.shape != top_idx.shape:
        raise ValueError(f"top_w {tuple(top_w.shape)} must match top_idx {tuple(top_idx.shape)}")
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} needs a unit last stride, got strides {t.stride()}")
    for name, v in (("block_n", block_n), ("block_k", block_k)):
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v!r}")
    if N == 0 or H == 0 or I == 0:
        return torch.zeros_like(x)
    x = x if x.stride(1) == 1 else x.contiguous()
    P = N * k
    pairs, block_expert = _route(top_idx, E)
    NB = block_expert.numel()
    weights = top_w.reshape(-1).contiguous()
    ieee = x.dtype == torch.float32
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    _gate_up_act_kernel[(NB, triton.cdiv(I, block_n))](
        x, gate_up_proj, h, pairs, block_expert, P, E, I, x.stride(0), gate_up_proj.stride(0),
        gate_up_proj.stride(1), h.stride(0), TOPK=k, K=H, BM=BLOCK_M, BN=block_n, BK=block_k, IEEE=ieee,
        num_warps=num_warps)
    y = torch.empty(P, H, dtype=torch.float32, device=x.device)
    _down_kernel[(NB, triton.cdiv(H, block_n))](
        h, down_proj, y, weights, pairs, block_expert, P, E, H, h.stride(0), down_proj.stride(0),
        down_proj.stride(1), y.stride(0), K=I, BM=BLOCK_M, BN=block_n, BK=block_k, IEEE=ieee, num_warps=num_warps)
    return y.view(N, k, H).sum(1).to(x.dtype)
