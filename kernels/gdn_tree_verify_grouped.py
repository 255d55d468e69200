"""Grouped closed-form GDN tree verification (DESIGN.md §2 eq. 2): no tree-side work repeated per tile.

`method="grouped"` of `kernels.gdn_tree_verify.gdn_tree_verify`. One program per (request, group of NG
value heads that share one key head, chunk of NVT value tiles of BV columns):

    once per program    Q Kᵀ, K Kᵀ and the q/k norms (they depend on the KEY head only, so the NG
                        value heads of a GQA group share them; Qwen3.5 has HV = 2·HK or 4·HK)
    per value head      logP, E, G, C, W = (I+G)⁻¹ = Π_s (I + A^{2^s}) (A = −G, exact once
                        2^{S+1} ≥ depth), M = C W
    per value tile      Q S_pre, K S_pre over K, R = D_β (V − D_P K S_pre),
                        U = W R, O = D_P Q S_pre + M R

The one-pass kernel (`gdn_tree_verify_kernel`) recomputes Q Kᵀ, K Kᵀ and W in every (value head, value
tile) program; `two_pass` avoids that through a global-memory workspace and a second launch, which
cost more than they saved (benchmarks/README.md). Here the T×T work stays on chip and is amortised by
looping: at Qwen3.5-9B shapes (HV = 2·HK, V = 128, T = 64) with NG = 2 and two tiles of 64, a program
forms Q Kᵀ / K Kᵀ once instead of four times and W twice instead of four times, i.e. ~9 instead of
~15 MFLOP per value head. The price is fewer programs: (B, HV/NG, V/(BV·NVT)), so NG = NVT = 1 (no
sharing, the most parallelism) stays available for batch 1.

Written here (not taken from a library) because no library verifies a tree: flash-linear-attention's
chunk kernels assume a sequence (a lower-triangular causal mask), not an ancestor mask with path
decays.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.gdn_tree_tiles import load_anc_bits, qk_kk_norms, s_products, tree_relation, unit_lower_inverse


@triton.jit
def gdn_tree_verify_grouped_kernel(
    q, k, v, g, beta,               # [N, HK, K], [N, HK, K], [N, HV, V], [N, HV], [N, HV]
    h0, state_indices,              # pool [slots, HV, V, K], [B]
    cu_seqlens, anc_bits,           # [B+1], [N, N_WORDS] int64 ancestor-or-self bitmasks
    o, u, logp,                     # [N, HV, V] (v's dtype), [N, HV, V] fp32, [N, HV] fp32
    scale,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, N_WORDS: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NG: tl.constexpr,               # value heads per program (one GQA group or part of one)
    NVT: tl.constexpr,              # value tiles per program
    USE_L2NORM: tl.constexpr, HAS_H0: tl.constexpr, HAS_INDICES: tl.constexpr,
    LOWP_QK: tl.constexpr, LOWP_S: tl.constexpr, SPLIT_S: tl.constexpr, PRECISION: tl.constexpr,
    N_SQUARINGS: tl.constexpr,      # squarings until 2^(s+1) >= the forest's depth
):
    i_b, i_hg, i_vc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = (i_hg * NG) // (HV // HK)
    bos = tl.load(cu_seqlens + i_b).to(tl.int64)
    T = (tl.load(cu_seqlens + i_b + 1).to(tl.int64) - bos).to(tl.int32)

    o_t = tl.arange(0, BT)
    m_t = o_t < T
    b_w0, b_w1 = load_anc_bits(anc_bits, bos, o_t, m_t, N_WORDS, BT)
    m_plus, m_minus = tree_relation(b_w0, b_w1, o_t, BT)

    # ---- once per program: Q Kᵀ, K Kᵀ of the key head, normalised (and q scaled) as diagonal scalings
    b_qk, b_kk, b_rq, b_rk = qk_kk_norms(q, k, bos, o_t, m_t, i_hk, scale, HK, K, BT, BK, USE_L2NORM, LOWP_QK,
                                         PRECISION)
    b_qk = b_qk * (b_rq[:, None] * b_rk[None, :])
    b_kk = b_kk * (b_rk[:, None] * b_rk[None, :])

    if HAS_INDICES:
        i_slot = tl.load(state_indices + i_b).to(tl.int64)
    else:
        i_slot = i_b.to(tl.int64)

    # unrolled over the heads, so Q Kᵀ / K Kᵀ die after the last head's use (registers); looped over tiles
    for i_g in tl.static_range(NG):
        i_h = i_hg * NG + i_g
        # ---- per value head: gates, logP = M⁺ g, E (masked before exp), G, C, W, M = C W
        b_g = tl.load(g + (bos + o_t) * HV + i_h, mask=m_t, other=0).to(tl.float32)
        b_beta = tl.load(beta + (bos + o_t) * HV + i_h, mask=m_t, other=0).to(tl.float32)
        b_lp = tl.sum(tl.where(m_plus, b_g[None, :], 0.0), axis=1)
        b_e = tl.exp(tl.where(m_plus, b_lp[:, None] - b_lp[None, :], float("-inf")))
        b_w = unit_lower_inverse(tl.where(m_minus, -b_beta[:, None] * b_kk * b_e, 0.0), o_t,  # A = −G
                                 N_SQUARINGS, PRECISION)
        b_m = tl.dot(b_qk * b_e, b_w, input_precision=PRECISION)
        b_p = tl.exp(b_lp)
        if i_vc == 0:
            tl.store(logp + (bos + o_t) * HV + i_h, b_lp, mask=m_t)
        p_h0 = h0 + (i_slot * HV + i_h) * V * K

        for i_t in range(NVT):
            # ---- per value tile: R, U = W R, O = D_P Q S_pre + M R
            o_v = (i_vc * NVT + i_t) * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            p_v = ((bos + o_t[:, None]) * HV + i_h) * V + o_v[None, :]
            b_x = tl.load(v + p_v, mask=m_tv, other=0).to(tl.float32)
            if HAS_H0:
                b_qs, b_ks = s_products(q, k, p_h0, bos, o_t, m_t, o_v, m_v, i_hk, HK, K, BT, BK, BV,
                                        LOWP_S, SPLIT_S, PRECISION)
                b_x = b_x - (b_p * b_rk)[:, None] * b_ks
                b_acc = (b_p * b_rq)[:, None] * b_qs
            else:
                b_acc = tl.zeros([BT, BV], dtype=tl.float32)
            b_r = b_beta[:, None] * b_x
            b_u = tl.dot(b_w, b_r, input_precision=PRECISION)
            b_o = tl.dot(b_m, b_r, acc=b_acc, input_precision=PRECISION)
            tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_tv)
            tl.store(u + p_v, b_u, mask=m_tv)


def launch_grouped(q, k, v, g, beta, forest, initial_state, state_indices, scale, use_qk_l2norm, o, u, logp,
                   *, BT: int, block_k: int, block_v: int, heads_per_program: int, tiles_per_program: int,
                   num_warps: int, num_stages: int, input_precision: str, n_squarings: int, lowp_qk: bool,
                   lowp_s: bool, split_s: bool):
    """One launch on contiguous [N, H, D] views, grid (B, HV / NG, ⌈⌈V / BV⌉ / NVT⌉)."""
    _, N, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NG, NVT = heads_per_program, tiles_per_program
    if NG < 1 or (HV // HK) % NG:
        raise ValueError(f"heads_per_program={NG} must divide the GQA group size HV/HK = {HV // HK}")
    if NVT < 1:
        raise ValueError(f"tiles_per_program must be >= 1, got {NVT}")
    has_h0 = initial_state is not None
    cu = forest.cu_seqlens
    qc = q[0].contiguous()
    grid = (forest.num_requests, HV // NG, triton.cdiv(triton.cdiv(V, block_v), NVT))
    gdn_tree_verify_grouped_kernel[grid](
        qc, k[0].contiguous(), v[0].contiguous(), g[0].contiguous(), beta[0].contiguous(),
        initial_state if has_h0 else qc, state_indices if state_indices is not None else cu,
        cu, forest.anc_bits.contiguous(),
        o[0], u, logp,
        float(scale),
        HK=HK, HV=HV, K=K, V=V, N_WORDS=forest.anc_bits.shape[1], BT=BT, BK=block_k, BV=block_v,
        NG=NG, NVT=NVT,
        USE_L2NORM=bool(use_qk_l2norm), HAS_H0=has_h0, HAS_INDICES=state_indices is not None,
        LOWP_QK=lowp_qk, LOWP_S=lowp_s, SPLIT_S=split_s, PRECISION=input_precision, N_SQUARINGS=n_squarings,
        num_warps=num_warps, num_stages=num_stages,
    )
    return o, u, logp
