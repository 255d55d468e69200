"""Paged decode attention in Triton (flash-decoding): one query token per row, K/V read in place.

Replaces the static decode path of GatedAttention (gather every row's keys into a padded
[B, L, Hkv, D] buffer, then a masked SDPA call): a program reads its keys straight from the paged
cache through the flat slot list ``kv_index`` and never touches key positions >= kv_len.

    pass 1  grid (B, Hkv, S): program (b, h, s) owns the query heads of kv head h as one
            [rep, D] tile (GQA: rep = Hq / Hkv rows, padded to >= 16 for tl.dot) and split s of
            row b's keys [0, kv_len[b]) (S near-equal chunks, whole blocks of BN keys each; a split
            past the row's keys is empty). Online softmax in fp32 over its blocks; writes its
            normalised partial output and log2-sum-exp (-inf when empty).
    pass 2  grid (B, Hq): combines the S partials, o = Σ_s 2^(lse_s - M) o_s / Σ_s 2^(lse_s - M).
            With S == 1 pass 1 writes o directly and pass 2 is skipped.

The grid depends on shapes only (B, Hkv, L, block_n) and lengths are read on the device, so a call
is CUDA-graph capturable; splits follow the row's own length, so short rows of a long KV bucket
still spread over all S programs. K/V are cast to q's dtype before the dots (as the layer's
``.to(dtype)``); scores, softmax, accumulation and the P·V dot are fp32 (flash / memory-efficient
SDPA round P to the value dtype first; decode attention reads memory, so the exact form costs nothing
measurable and stays closer to the twin's fp32 result). A row with kv_len <= 0 has no
keys and gets zeros (the engine never makes one: the new token is always a key).
Twin: bole.ops.attention.paged_decode_attention_ref.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kernels._checks import attention_out, check_attention_inputs, check_keys, interpreting


@triton.jit
def _attend_block(b_q, b_m, b_l, b_acc, p_i, p_k, p_v, start, hi, stride_in, stride_kn, stride_vn,
                  qk_scale, o_d, m_d, BN: tl.constexpr, PRECISION: tl.constexpr):
    """One block of BN keys [start, start + BN) ∩ [., hi) into the running (max, sum, acc) of a tile."""
    o_n = start + tl.arange(0, BN)
    m_n = o_n < hi
    m_nd = m_n[:, None] & m_d[None, :]
    i_slot = tl.load(p_i + o_n * stride_in, mask=m_n, other=0).to(tl.int64)
    b_k = tl.load(p_k + i_slot[:, None] * stride_kn + o_d[None, :], mask=m_nd, other=0).to(b_q.dtype)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * qk_scale   # [BH, BN], log2 units
    b_s = tl.where(m_n[None, :], b_s, float("-inf"))
    b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))
    b_ref = tl.where(b_mn == float("-inf"), 0.0, b_mn)       # nothing valid yet: weights 0, not NaN
    b_p = tl.exp2(b_s - b_ref[:, None])
    b_alpha = tl.exp2(b_m - b_ref)
    # masked rows load 0, never the cache: NaN or garbage past kv_len cannot reach 0 · v
    # P stays fp32 for P·V (exact fp32 products): no half-precision rounding of the probabilities,
    # which flash kernels take; decode attention reads memory, the extra FMA work is free
    b_v = tl.load(p_v + i_slot[:, None] * stride_vn + o_d[None, :], mask=m_nd, other=0).to(tl.float32)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p, b_v, input_precision="ieee")
    return b_mn, b_l * b_alpha + tl.sum(b_p, axis=1), b_acc


@triton.jit(do_not_specialize=["L", "stride_ib"])  # a new key length compiles nothing (kernels.tree_attention)
def paged_decode_attention_kernel(
    q, k_cache, v_cache, kv_index, kv_len, o, o_part, lse_part,
    L, stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ib, stride_in,
    stride_lb, stride_ob, stride_oh, qk_scale,
    HQ: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, S: tl.constexpr, BH: tl.constexpr,
    BD: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, DYNAMIC_LOOP: tl.constexpr, PRECISION: tl.constexpr,
):
    i_b, i_hk, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    o_h = tl.arange(0, BH)
    m_h = o_h < REP
    i_hq = i_hk * REP + o_h                                                    # [BH] query heads
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_hd = m_h[:, None] & m_d[None, :]
    b_q = tl.load(q + i_b * stride_qb + i_hq[:, None] * stride_qh + o_d[None, :], mask=m_hd, other=0)

    # split s covers keys [lo, hi) of this row: ceil(len / S) rounded up to whole blocks
    b_len = tl.minimum(tl.maximum(tl.load(kv_len + i_b * stride_lb), 0), L).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(b_len, S), BN) * BN
    lo = i_s * chunk
    hi = tl.minimum(lo + chunk, b_len)

    b_m = tl.full([BH], float("-inf"), dtype=tl.float32)   # running max of the scores (log2 units)
    b_l = tl.zeros([BH], dtype=tl.float32)                  # running Σ 2^(s - m)
    b_acc = tl.zeros([BH, BD], dtype=tl.float32)            # running Σ 2^(s - m) v
    p_i = kv_index + i_b * stride_ib
    p_k, p_v = k_cache + i_hk * stride_kh, v_cache + i_hk * stride_vh
    if DYNAMIC_LOOP:  # compiled: the split's own blocks only
        for start in range(lo, hi, BN):
            b_m, b_l, b_acc = _attend_block(b_q, b_m, b_l, b_acc, p_i, p_k, p_v, start, hi, stride_in,
                                            stride_kn, stride_vn, qk_scale, o_d, m_d, BN, PRECISION)
    else:  # the interpreter cannot take tensor loop bounds: NB blocks, those past hi fully masked
        for i_n in range(NB):
            b_m, b_l, b_acc = _attend_block(b_q, b_m, b_l, b_acc, p_i, p_k, p_v, lo + i_n * BN, hi, stride_in,
                                            stride_kn, stride_vn, qk_scale, o_d, m_d, BN, PRECISION)

    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]     # an empty split: 0, not 0 / 0
    if S == 1:
        tl.store(o + i_b * stride_ob + i_hq[:, None] * stride_oh + o_d[None, :],
                 b_o.to(o.dtype.element_ty), mask=m_hd)
    else:
        i_part = (i_b * HQ + i_hq) * S + i_s                                  # [BH] into [B, HQ, S]
        tl.store(o_part + i_part[:, None] * D + o_d[None, :], b_o, mask=m_hd)
        b_lse = tl.where(b_l > 0, b_m + tl.log2(tl.where(b_l > 0, b_l, 1.0)), float("-inf"))  # -inf: empty
        tl.store(lse_part + i_part, b_lse, mask=m_h)


@triton.jit
def paged_decode_combine_kernel(
    o_part, lse_part, o, stride_ob, stride_oh,
    HQ: tl.constexpr, D: tl.constexpr, S: tl.constexpr, BD: tl.constexpr,
):
    i_b, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    i_row = (i_b * HQ + i_h) * S
    b_mx = tl.full([1], float("-inf"), dtype=tl.float32)
    b_den = tl.zeros([1], dtype=tl.float32)
    b_acc = tl.zeros([BD], dtype=tl.float32)
    for i_s in range(S):
        b_lse = tl.load(lse_part + i_row + i_s + tl.zeros([1], dtype=tl.int32))
        b_os = tl.load(o_part + (i_row + i_s) * D + o_d, mask=m_d, other=0)
        b_new = tl.maximum(b_mx, b_lse)
        b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)  # all empty so far: weights 0, no NaN
        b_alpha, b_w = tl.exp2(b_mx - b_ref), tl.exp2(b_lse - b_ref)
        b_acc = b_acc * b_alpha + b_w * b_os
        b_den = b_den * b_alpha + b_w
        b_mx = b_new
    b_o = b_acc / tl.where(b_den > 0, b_den, 1.0)
    tl.store(o + i_b * stride_ob + i_h * stride_oh + o_d, b_o.to(o.dtype.element_ty), mask=m_d)


def launch_paged_decode_attention(q, k_cache, v_cache, kv_index, kv_len, scale: float, out,
                                  block_n: int, num_splits: int, num_warps: int):
    """Launcher: pass 1 over grid (B, Hkv, S), then the combine over (B, Hq) when S > 1."""
    B, HQ, D = q.shape
    HKV, L = k_cache.shape[1], kv_index.shape[1]
    BD = max(16, triton.next_power_of_2(D))
    S = num_splits
    dynamic_loop = not interpreting()
    o_part = lse_part = out  # unused with S == 1
    if S > 1:
        o_part = torch.empty(B, HQ, S, D, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(B, HQ, S, dtype=torch.float32, device=q.device)
    paged_decode_attention_kernel[(B, HKV, S)](
        q, k_cache, v_cache, kv_index, kv_len, out, o_part, lse_part,
        L, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), kv_index.stride(0), kv_index.stride(1), kv_len.stride(0),
        out.stride(0), out.stride(1), float(scale) * math.log2(math.e),
        HQ=HQ, REP=HQ // HKV, D=D, S=S, BH=max(16, triton.next_power_of_2(HQ // HKV)), BD=BD,
        BN=block_n, NB=1 if dynamic_loop else triton.cdiv(triton.cdiv(L, S), block_n),
        DYNAMIC_LOOP=dynamic_loop, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps,
    )
    if S > 1:
        paged_decode_combine_kernel[(B, HQ)](o_part, lse_part, out, out.stride(0), out.stride(1),
                                             HQ=HQ, D=D, S=S, BD=BD, num_warps=num_warps)
    return out


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 off CUDA: the interpreter's grids stay small); the
    split counts of this kernel and kernels.tree_attention aim at about two waves of programs."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _default_num_splits(programs: int, L: int, block_n: int, device: torch.device) -> int:
    """Key splits for ``programs`` pass-1 programs per split (this kernel: B x HKV; kernels.tree_attention:
    B x HKV x row tiles): about two waves, at least one key block per split, at most 32 splits, rounded
    down to a power of two. S is a compile-time constant of both kernels, so it may take only a few values
    (1, 2, 4, .., 32): an eager call at a key length or batch not seen before (the drafter's catch-up in
    serving) must not compile a new kernel, a 1-2 s stall at 9B shapes (measured on an H100, 2026-12-05)."""
    s = max(1, min(triton.cdiv(L, block_n), triton.cdiv(2 * _num_sms(device), programs), 32))
    return 1 << (s.bit_length() - 1)


def paged_decode_attention(q, k_cache, v_cache, kv_index, kv_len, scale=None, out=None, *,
                           block_n: int | None = None, num_splits: int | None = None, num_warps: int = 4,
                           checked: bool = False):
    """softmax(q kᵀ · scale) v for one query token per row over its first kv_len[b] paged keys.

    Twin: `bole.ops.attention.paged_decode_attention_ref`. No host read of a device value.

    Args:
        q: [B, Hq, D] fp32/fp16/bf16, last dim contiguous (any row / head strides), D <= 256.
        k_cache, v_cache: [num_slots, Hkv, D] per-layer flat views of the paged cache (e.g.
            ``cache.k(layer).flatten(0, 1)``), fp32/fp16/bf16, last dim contiguous, any slot /
            head strides; Hq a multiple of Hkv (query head h reads kv head h // (Hq / Hkv)).
        kv_index: int32/int64 [B, L] flat slot of key position p of row b (any strides); entries
            at p >= kv_len[b] are never read, so they may hold anything.
        kv_len: int32/int64 [B] keys of row b (clamped to [0, L]); 0 gives a zero output row.
        scale: score scale (default D ** -0.5).
        out: optional [B, Hq, D] in q's dtype, last dim contiguous.
        block_n: keys per block (power of two >= 16; default 64, 32 when D > 128).
        num_splits: key splits per (row, kv head) (default: about two waves of programs).
        checked: the caller checked kv_index and kv_len once for the whole forward
            (`kernels._checks.check_forward_inputs`): only their sizes are compared.
    Returns:
        o [B, Hq, D] in q's dtype.
    """
    B, HQ, D, HKV = check_attention_inputs(q, k_cache, v_cache)
    dev = q.device
    _, L = check_keys(kv_index, B, dev, kv_len=kv_len, checked=checked)
    if block_n is None:
        block_n = 32 if D > 128 else 64
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is None:
        num_splits = _default_num_splits(B * HKV, L, block_n, q.device)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    out = attention_out(out, q, B, HQ, D)
    if B == 0 or HQ == 0:
        return out
    if L == 0:
        return out.zero_()
    scale = D ** -0.5 if scale is None else scale
    return launch_paged_decode_attention(q, k_cache, v_cache, kv_index, kv_len, scale, out, block_n,
                                         num_splits, num_warps)
