"""Paged tree attention in Triton: many query rows per request, each with its own mask over the
request's paged keys, in one launch (verify-mode attention: the target's verify forward and the
drafter's per-level forwards; with no mask, causal rows: a short prefill chunk).

Replaces GatedAttention's batched verify path where it is set (``GatedAttention.tree_attention``):
gather every request's keys into a padded [B, Hkv, L, D] buffer, scatter the queries into padded rows,
expand the mask, one SDPA call, gather the rows back: about a dozen launches around the attention
kernel, which at the drafter's sizes (a few dozen nodes, a few hundred keys) cost more than the
attention itself, and, in a CUDA graph, keys gathered up to the KV bucket's length, not the row's.
Here a program reads its keys straight from the paged cache through ``kv_index`` and its mask rows
from ``mask``, and writes the flat output rows.

    pass 1  grid (B, Hkv, ceil(tq / BM) * S): program (b, h, m, s) owns BM tree rows t0..t0+BM of
            request b and the REP query heads of kv head h, as one [BM * REPP, D] tile (row r: tree row
            t0 + r // REPP, head h * REP + r % REPP; REPP = REP rounded up to a power of two, extra heads
            masked), and split s of the keys its mask can show, [0, num_cached[b] + T_b) (the committed
            prefix and the tree; S near-equal chunks of whole BN-key blocks, a split past them empty).
            Online softmax in fp32; scores masked by ``mask[b, 0, t, p]``. With S == 1 it writes the
            output rows, else its normalised partial rows and their log2-sum-exp.
    pass 2  (S > 1) grid (N, Hq): kernels.paged_decode_attention's combine over the S partials.

Splitting the keys (flash-decoding) is what keeps the target's verify forward near its decode step at
long prefixes: without it a request's tile streams its whole prefix alone (B · Hkv · ceil(tq / BM)
programs: 8 at batch 1 on the 9B shapes, on 132 SMs), and the graphed path it replaces (gather into
[B, Hkv, Lc, D], one masked SDPA call) also pays for the KV bucket's padding Lc, not the row's length.

Key position p of request b is the slot ``kv_index[b, p]``; request b's rows are the flat tokens
``cu_seqlens[b]:cu_seqlens[b+1]`` (T_b of them, T_b <= tq), tree row t = flat row cu_seqlens[b] + t.
K/V are cast to q's dtype before the Q·Kᵀ dot (as the layer's ``.to(dtype)``); P stays fp32 for P·V.
A row that sees no key gets zeros (the engine never makes one). The grid depends on shapes only and
nothing is read back to the host: CUDA-graph capturable. Twin: bole.ops.attention.tree_attention_ref.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._checks import attention_out, check_attention_inputs, check_index, check_keys, interpreting
from kernels.paged_decode_attention import _default_num_splits, paged_decode_combine_kernel

_PRECISIONS = ("ieee", "tf32")


@triton.jit
def _attend_block(b_q, b_m, b_l, b_acc, p_i, p_k, p_v, p_m, m_r, last, start, hi, stride_in, stride_kn, stride_vn,
                  stride_ml, qk_scale, o_d, m_d, BN: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys [start, start + BN) ∩ [., hi) into the running (max, sum, acc) of a tile, masked per row (by the
    mask rows ``p_m``, or with CAUSAL by each row's last visible key ``last``)."""
    o_n = start + tl.arange(0, BN)
    m_n = o_n < hi
    m_nd = m_n[:, None] & m_d[None, :]
    i_slot = tl.load(p_i + o_n * stride_in, mask=m_n, other=0).to(tl.int64)
    b_k = tl.load(p_k + i_slot[:, None] * stride_kn + o_d[None, :], mask=m_nd, other=0).to(b_q.dtype)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * qk_scale
    if CAUSAL:
        vis = (o_n[None, :] <= last[:, None]) & m_n[None, :]
    else:
        vis = tl.load(p_m[:, None] + o_n[None, :] * stride_ml, mask=m_r[:, None] & m_n[None, :], other=0) != 0
    b_s = tl.where(vis, b_s, float("-inf"))
    b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))
    b_ref = tl.where(b_mn == float("-inf"), 0.0, b_mn)   # nothing visible yet: weights 0, not NaN
    b_p = tl.exp2(b_s - b_ref[:, None])
    b_alpha = tl.exp2(b_m - b_ref)
    # masked keys load 0, never the cache: NaN or garbage in unused slots cannot reach 0 · v
    b_v = tl.load(p_v + i_slot[:, None] * stride_vn + o_d[None, :], mask=m_nd, other=0).to(tl.float32)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p, b_v, input_precision=PRECISION)
    return b_mn, b_l * b_alpha + tl.sum(b_p, axis=1), b_acc


# the key length and the strides that follow it are not specialised on (divisibility by 16, == 1): an
# eager call at a new key length then reuses the compiled kernel instead of compiling a variant
@triton.jit(do_not_specialize=["L", "stride_ib", "stride_mb", "stride_mt"])
def tree_attention_kernel(
    q, k_cache, v_cache, kv_index, mask, cu_seqlens, num_cached, o, o_part, lse_part,
    L, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ib, stride_in,
    stride_mb, stride_mt, stride_ml, stride_on, stride_oh, qk_scale,
    HQ: tl.constexpr, REP: tl.constexpr, REPP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, S: tl.constexpr, NB: tl.constexpr, DYNAMIC_LOOP: tl.constexpr, PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    i_b, i_hk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_m, i_s = tl.program_id(2) // S, tl.program_id(2) % S
    bos = tl.load(cu_seqlens + i_b).to(tl.int64)
    T = (tl.load(cu_seqlens + i_b + 1).to(tl.int64) - bos).to(tl.int32)
    o_r = tl.arange(0, BM * REPP)
    o_t = i_m * BM + o_r // REPP                                               # tree row of tile row r
    o_j = o_r % REPP
    m_r = (o_t < T) & (o_j < REP)
    i_hq = i_hk * REP + o_j                                                    # its query head
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_rd = m_r[:, None] & m_d[None, :]
    p_row = bos + o_t                                                          # flat row
    b_q = tl.load(q + p_row[:, None] * stride_qn + i_hq[:, None] * stride_qh + o_d[None, :], mask=m_rd, other=0)
    # keys the mask can show: the committed prefix and the request's tree; none for a tile past T
    P = tl.load(num_cached + i_b).to(tl.int32)
    hi = tl.where(i_m * BM < T, tl.minimum(P + T, L), 0)
    last = P + o_t                                   # CAUSAL: row t sees keys p <= P + t
    if CAUSAL:
        hi = tl.minimum(hi, P + (i_m + 1) * BM)       # the tile's last row's keys
    chunk = tl.cdiv(tl.cdiv(hi, S), BN) * BN          # split s: keys [lo, hi) of the tile's [0, hi)
    lo = i_s * chunk
    hi = tl.minimum(lo + chunk, hi)

    b_m = tl.full([BM * REPP], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    b_l = tl.zeros([BM * REPP], dtype=tl.float32)                # running Σ 2^(s - m)
    b_acc = tl.zeros([BM * REPP, BD], dtype=tl.float32)          # running Σ 2^(s - m) v
    p_i = kv_index + i_b * stride_ib
    p_k, p_v = k_cache + i_hk * stride_kh, v_cache + i_hk * stride_vh
    p_m = mask + i_b * stride_mb + o_t * stride_mt                             # [BM * REPP] mask rows
    if DYNAMIC_LOOP:  # compiled: the row's own key blocks only
        for start in range(lo, hi, BN):
            b_m, b_l, b_acc = _attend_block(b_q, b_m, b_l, b_acc, p_i, p_k, p_v, p_m, m_r, last, start, hi,
                                            stride_in, stride_kn, stride_vn, stride_ml, qk_scale, o_d, m_d, BN,
                                            PRECISION, CAUSAL)
    else:  # the interpreter cannot take tensor loop bounds: NB blocks, those past hi fully masked
        for i_n in range(NB):
            b_m, b_l, b_acc = _attend_block(b_q, b_m, b_l, b_acc, p_i, p_k, p_v, p_m, m_r, last, lo + i_n * BN, hi,
                                            stride_in, stride_kn, stride_vn, stride_ml, qk_scale, o_d, m_d, BN,
                                            PRECISION, CAUSAL)
    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]   # an empty split: 0, not 0 / 0
    if S == 1:
        tl.store(o + p_row[:, None] * stride_on + i_hq[:, None] * stride_oh + o_d[None, :],
                 b_o.to(o.dtype.element_ty), mask=m_rd)
    else:  # [N, HQ, S, D] partials in paged_decode_combine_kernel's layout, lse -inf when empty
        i_part = (p_row * HQ + i_hq) * S + i_s
        tl.store(o_part + i_part[:, None] * D + o_d[None, :], b_o, mask=m_rd)
        b_lse = tl.where(b_l > 0, b_m + tl.log2(tl.where(b_l > 0, b_l, 1.0)), float("-inf"))
        tl.store(lse_part + i_part, b_lse, mask=m_r)


def tree_attention(q, k_cache, v_cache, kv_index, mask, cu_seqlens, num_cached, scale=None, out=None, *,
                   precision: str | None = None, block_n: int = 64, num_splits: int | None = None,
                   num_warps: int = 4, checked: bool = False):
    """softmax(q kᵀ · scale + mask) v for the tree rows of every request over its paged keys.

    Twin: `bole.ops.attention.tree_attention_ref`. No host read of a device value.

    Args:
        q: [N, Hq, D] fp32/fp16/bf16 flat rows (request b's are cu_seqlens[b]:cu_seqlens[b+1]), last dim
            contiguous (any row / head strides), D <= 256.
        k_cache, v_cache: [num_slots, Hkv, D] flat views of one layer's paged cache, last dim contiguous;
            Hq a multiple of Hkv (query head h reads kv head h // (Hq / Hkv)).
        kv_index: int32/int64 [B, L] the slot of key position p of request b; positions at or past
            num_cached[b] + T_b are never read.
        mask: bool [B, 1, tq, L] (``PaddedAttention.mask``): key p visible to tree row t of request b; or
            None for causal rows (a prefill chunk): row t sees the keys p <= num_cached[b] + t.
        cu_seqlens: int32/int64 [B + 1] row offsets (T_b = cu_seqlens[b+1] - cu_seqlens[b] <= tq).
        num_cached: int32/int64 [B] committed keys of request b.
        scale: score scale (default D ** -0.5).
        out: optional [N, Hq, D] in q's dtype, last dim contiguous.
        precision: fp32 dot precision, "ieee" (default) or "tf32" (the drafter's fast math).
        block_n: keys per block (power of two >= 16).
        num_splits: key splits per tile (default: about two waves of pass-1 programs, at most 32 and
            no more than the key blocks of L).
        checked: the caller checked kv_index, mask, cu_seqlens and num_cached once for the whole forward
            (`kernels._checks.check_forward_inputs`): only their sizes are compared.
    Returns:
        o [N, Hq, D] in q's dtype.
    """
    N, HQ, D, HKV = check_attention_inputs(q, k_cache, v_cache)
    dev = q.device
    B, L = check_keys(kv_index, None, dev, mask, checked=checked)
    check_index("cu_seqlens", cu_seqlens, B + 1, dev, checked)
    check_index("num_cached", num_cached, B, dev, checked)
    precision = precision or "ieee"
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    out = attention_out(out, q, N, HQ, D)
    tq = mask.shape[2] if mask is not None else N       # causal: no request has more rows than N
    if N == 0 or B == 0 or tq == 0:
        return out
    rep = HQ // HKV
    repp = triton.next_power_of_2(rep)
    bm = max(1, 32 // repp)               # 32 tile rows (at least 16 for tl.dot)
    bm = max(bm, triton.cdiv(16, repp))
    tiles = triton.cdiv(tq, bm)
    S = num_splits or _default_num_splits(B * HKV * tiles, L, block_n, dev)
    dynamic = not interpreting()
    o_part = lse_part = out  # unused with S == 1
    if S > 1:
        o_part = torch.empty(N, HQ, S, D, dtype=torch.float32, device=dev)
        lse_part = torch.empty(N, HQ, S, dtype=torch.float32, device=dev)
    # causal: the mask pointer is never read (kv_index stands in)
    m, m_strides = (mask.view(torch.uint8), (mask.stride(0), mask.stride(2), mask.stride(3))) if mask is not None \
        else (kv_index, (0, 0, 0))
    BD = max(16, triton.next_power_of_2(D))
    tree_attention_kernel[(B, HKV, tiles * S)](
        q, k_cache, v_cache, kv_index, m, cu_seqlens, num_cached, out, o_part, lse_part,
        L, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        kv_index.stride(0), kv_index.stride(1), *m_strides,
        out.stride(0), out.stride(1), float(D ** -0.5 if scale is None else scale) * math.log2(math.e),
        HQ=HQ, REP=rep, REPP=repp, D=D, BD=BD, BM=bm, BN=block_n, S=S,
        NB=1 if dynamic else triton.cdiv(triton.cdiv(L, S), block_n), DYNAMIC_LOOP=dynamic,  # NB: interpreter only
        PRECISION=precision if q.dtype == torch.float32 else "tf32", CAUSAL=mask is None, num_warps=num_warps,
    )
    if S > 1:  # rows of a request past its T_b hold no partials; only real rows (N of them) are combined
        paged_decode_combine_kernel[(N, HQ)](o_part, lse_part, out, out.stride(0), out.stride(1),
                                             HQ=HQ, D=D, S=S, BD=BD, num_warps=num_warps)
    return out
