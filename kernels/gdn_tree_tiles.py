"""On-chip building blocks of the tree verifiers: the ancestor masks from the forest's bitmasks (all
three kernels), one K chunk of the S_pre products (all three), and, for the verifiers that form the
tree-side matrices apart from the value tiles (`gdn_tree_verify_2pass.py`, `gdn_tree_verify_grouped.py`),
Q Kᵀ / K Kᵀ with the q/k norms, W = (I+G)⁻¹ in product form and the per-tile Q S_pre / K S_pre K-loop.

The one-pass kernel (`gdn_tree_verify.py`, the engine's) keeps its own fused K-loop, which forms Q Kᵀ,
K Kᵀ and the S_pre products in one pass over q/k.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_anc_bits(anc_bits, bos, o_t, m_t, N_WORDS: tl.constexpr, BT: tl.constexpr):
    """The ancestor-or-self bitmask words [BT] int64 of each node (``PackedForest.anc_bits``, bit j of
    word j // 64): word 0, and word 1 when BT > 64 (else word 0 again, unused). One load per word."""
    b_w0 = tl.load(anc_bits + (bos + o_t) * N_WORDS, mask=m_t, other=0)
    if BT > 64:
        b_w1 = tl.load(anc_bits + (bos + o_t) * N_WORDS + 1, mask=m_t, other=0)
    else:
        b_w1 = b_w0
    return b_w0, b_w1


@triton.jit
def tree_relation(b_w0, b_w1, o_t, BT: tl.constexpr):
    """(M⁺, M⁻) [BT, BT] from `load_anc_bits`'s words: M⁺[i, j] iff j is an ancestor of i or i itself,
    M⁻ the strict part."""
    o_j = o_t[None, :]
    if BT > 64:
        b_word = tl.where(o_j < 64, b_w0[:, None], b_w1[:, None])
    else:
        b_word = b_w0[:, None]
    m_plus = ((b_word >> (o_j % 64).to(tl.int64)) & 1) != 0  # arithmetic shift: bit 63 still reads 1
    return m_plus, m_plus & (o_t[:, None] != o_j)


@triton.jit
def qk_kk_norms(q, k, bos, o_t, m_t, i_hk, scale, HK: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                BK: tl.constexpr, USE_L2NORM: tl.constexpr, LOWP_QK: tl.constexpr, PRECISION: tl.constexpr):
    """Raw Q Kᵀ, K Kᵀ [BT, BT] of one key head over K in chunks of BK, and the row scalings r_q, r_k [BT]
    (scale / ‖q‖ and 1 / ‖k‖ with USE_L2NORM, else scale and 1) that normalise them afterwards."""
    b_qk = tl.zeros([BT, BT], dtype=tl.float32)
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    b_q2 = tl.zeros([BT], dtype=tl.float32)
    b_k2 = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        p_qk = ((bos + o_t[:, None]) * HK + i_hk) * K + o_k[None, :]
        b_q = tl.load(q + p_qk, mask=m_tk, other=0)
        b_k = tl.load(k + p_qk, mask=m_tk, other=0)
        b_qf = b_q.to(tl.float32)
        b_kf = b_k.to(tl.float32)
        if USE_L2NORM:
            b_q2 += tl.sum(b_qf * b_qf, axis=1)
            b_k2 += tl.sum(b_kf * b_kf, axis=1)
        if LOWP_QK:
            # fp16/bf16 products are exact in the fp32 accumulator: tensor cores at no loss
            b_qk += tl.dot(b_q, tl.trans(b_k))
            b_kk += tl.dot(b_k, tl.trans(b_k))
        else:
            b_qk += tl.dot(b_qf, tl.trans(b_kf), input_precision=PRECISION)
            b_kk += tl.dot(b_kf, tl.trans(b_kf), input_precision=PRECISION)
    if USE_L2NORM:
        b_rq = scale * tl.rsqrt(b_q2 + 1e-6)
        b_rk = tl.rsqrt(b_k2 + 1e-6)
    else:
        b_rq = tl.zeros([BT], dtype=tl.float32) + scale
        b_rk = tl.zeros([BT], dtype=tl.float32) + 1.0
    return b_qk, b_kk, b_rq, b_rk


@triton.jit
def unit_lower_inverse(b_a, o_t, N_SQUARINGS: tl.constexpr, PRECISION: tl.constexpr):
    """W = (I + G)⁻¹ for A = −G: W = Π_{s<S} (I + A^{2^s}) = Σ_{m<2^{S+1}} A^m, exact once 2^{S+1} ≥ the
    tree depth (A strictly lower triangular in tree order, so A^depth = 0). Starts from W_0 = I + A and
    squares: W_{s+1} = W_s + W_s A^{2^{s+1}}."""
    b_w = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0) + b_a
    for _ in tl.static_range(N_SQUARINGS):
        b_a = tl.dot(b_a, b_a, input_precision=PRECISION)
        b_w += tl.dot(b_w, b_a, input_precision=PRECISION)
    return b_w


@triton.jit
def s_products(q, k, p_h0, bos, o_t, m_t, o_v, m_v, i_hk,
               HK: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               LOWP_S: tl.constexpr, SPLIT_S: tl.constexpr, PRECISION: tl.constexpr):
    """Raw Q S_pre and K S_pre [BT, BV] for one value tile, over K in chunks of BK (the pool holds Sᵀ,
    K contiguous). LOWP_S: the pool has q's half dtype; SPLIT_S: bf16 q/k against an fp32 pool, S split
    into three bf16 parts (8 + 8 + 8 mantissa bits, each product exact); else fp32 dots at PRECISION."""
    b_qs = tl.zeros([BT, BV], dtype=tl.float32)
    b_ks = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        p_qk = ((bos + o_t[:, None]) * HK + i_hk) * K + o_k[None, :]
        b_q = tl.load(q + p_qk, mask=m_tk, other=0)
        b_k = tl.load(k + p_qk, mask=m_tk, other=0)
        b_s = tl.load(p_h0 + o_v[:, None] * K + o_k[None, :], mask=m_v[:, None] & m_k[None, :], other=0)
        b_qs, b_ks = s_dots(b_q, b_k, b_s, b_qs, b_ks, LOWP_S, SPLIT_S, PRECISION)
    return b_qs, b_ks


@triton.jit
def s_dots(b_q, b_k, b_s, b_qs, b_ks, LOWP_S: tl.constexpr, SPLIT_S: tl.constexpr, PRECISION: tl.constexpr):
    """One K chunk of Q S_pre and K S_pre: b_q, b_k [BT, BK] (q's dtype), b_s the S_preᵀ chunk [BV, BK]
    (the pool's dtype), accumulated into b_qs, b_ks [BT, BV] fp32. LOWP_S: the pool has q's half dtype;
    SPLIT_S: bf16 q/k against an fp32 pool, S = hi + mid + lo in bf16 (8 + 8 + 8 mantissa bits) makes
    each product exact, so three bf16 MMAs reproduce the fp32 product; else fp32 dots at PRECISION."""
    if LOWP_S:
        b_qs += tl.dot(b_q, tl.trans(b_s))
        b_ks += tl.dot(b_k, tl.trans(b_s))
    elif SPLIT_S:
        b_sf = b_s.to(tl.float32)
        b_hi = b_sf.to(tl.bfloat16)
        b_rem = b_sf - b_hi.to(tl.float32)
        b_mid = b_rem.to(tl.bfloat16)
        b_lo = (b_rem - b_mid.to(tl.float32)).to(tl.bfloat16)
        b_qs += tl.dot(b_q, tl.trans(b_hi))
        b_qs += tl.dot(b_q, tl.trans(b_mid))
        b_qs += tl.dot(b_q, tl.trans(b_lo))
        b_ks += tl.dot(b_k, tl.trans(b_hi))
        b_ks += tl.dot(b_k, tl.trans(b_mid))
        b_ks += tl.dot(b_k, tl.trans(b_lo))
    else:
        b_sf = tl.trans(b_s.to(tl.float32))
        b_qs += tl.dot(b_q.to(tl.float32), b_sf, input_precision=PRECISION)
        b_ks += tl.dot(b_k.to(tl.float32), b_sf, input_precision=PRECISION)
    return b_qs, b_ks
