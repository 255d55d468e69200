"""Parallel closed-form GDN tree verification (Bole Algorithm 1, eq. 2) in Triton; twin
``bole.ops.gdn.gdn_tree_verify_ref``.

One program per (request b, value head h, value tile of BV columns). Everything that depends only on
the tree, Q/K and the gates is built on chip from the packed forest:

    M⁺[i, j] = bit j of anc_bits[i]               (j is an ancestor of i, or i itself)
    logP     = M⁺ g                               (path log decay)
    E[i, j]  = exp(logP_i − logP_j) on M⁺, else 0 (masked BEFORE exp: the ratio P_i / P_j, never divided)
    G = D_β [(K Kᵀ) ⊙ E ⊙ M⁻],   C = (Q Kᵀ) ⊙ E
    R = D_β (V − D_P K S_pre),   U = (I + G)⁻¹ R,   O = D_P Q S_pre + C U

Trees of up to 256 nodes are processed in chunks of BC = min(BT, 64) rows (node order is topological,
so a chunk's ancestors lie in it or in earlier chunks): chunk c solves

    X_c = R_c − Σ_{c' < c} G_{c c'} U_{c'},   U_c = (I + G_cc)⁻¹ X_c,   O_c = D_P Q_c S_pre + Σ_{c' ≤ c} C_{c c'} U_{c'}

(block forward substitution), reading the earlier chunks' U and logP back from the outputs it has
just written. With BC = 64 the ancestors of chunk c's rows inside chunk c' are exactly bitmask word c'.

The diagonal solve, two methods (both are forward substitution in a different order):
    "horner":  U by level-scheduled substitution on the value tile: U ← X − G U, updating at step s only
               the rows at in-chunk depth s + 1 (their ancestors are final by then). (d−1) T×T×BV products.
    "blocked": W = (I + G_cc)⁻¹ first, then U = W X and O += (C W) X. W by level-scheduled substitution
               inside diagonal blocks of BS rows (W ← I − G_blk W, rows at in-block depth s + 1 at step s),
               then log₂(BC/BS) doubling merges W ← W − W (G_off W), where G_off couples the two halves
               of each 2·BS... block (the inverse of [[A, 0], [B, D]] is [[A⁻¹, 0], [−D⁻¹ B A⁻¹, D⁻¹]]).
               ``gdn_tree_verify_launch.solve_plan`` picks BS from the depth: (min(d, BS) − 1) + 2 log₂(BC/BS)
               T×T products.

Error analysis (why this replaces the product-form inverse Π_k (I + (−G)^{2^k})). For unit keys
(use_qk_l2norm), β ∈ (0, 1] and decays γ ∈ (0, 1], the solve is the recurrence itself: the state after
node i is S_i = Σ_{l ⪯ i} Φ_{i,l} k_l r_lᵀ with Φ_{i,l} = Π_{m ∈ (l, i]} γ_m (I − β_m k_m k_mᵀ), whose
2-norm is ≤ P_i / P_l ≤ 1, and u_i = r_i − β_i γ_i k_iᵀ S_{π(i)}. Hence

    |G_ij| ≤ β_i P_i / P_j |k_i·k_j| ≤ 1   and   |W_ij| = |((I + G)⁻¹)_ij| ≤ β_i P_i / P_j ≤ 1

for every key correlation and depth, and the same holds for W of any diagonal block (the recurrence on
that sub-forest). The product form instead forms the powers G^m, whose entries grow like C(d−1, m)·c^m
for key cosine c (3·10⁸ on a 32-chain at c = 0.9) before they cancel: its fp32 error grew to 1.0 and
its tf32 error to 10¹² on the adversarial inputs (issue 23's table). Here no product ever has an
operand outside the bounds above: the masked level steps leave rows not yet due at their start value
(e_i, resp. X_i) instead of forming the unbounded partial sums of the series (which overflow fp16 at
once and fp32 on deep chains), and a merge multiplies bounded blocks (|G_off W| ≤ BS·... ≤ BC). So:
    - the T×T operands fit fp16 (|x| ≤ 64 < 65504). Rounded to fp16 or tf32 (unit roundoff u = 2⁻¹¹),
      each level step / merge commits an absolute error ≤ 2u·n_anc(i) per entry of W (n_anc ≤ d
      ancestors, each term ≤ 1), and substitution propagates errors through W itself (entries ≤ 1):
      |ΔW_ij| ≤ 2u·d(d−1)/2 + O(u²) in the worst case, |ΔU_i| ≤ (|ΔW| d + 2u d) max|X|. This bound is
      independent of key correlation and of β, γ → 1; it is a worst case (all errors aligned): measured
      errors on adversarial inputs (tests/kernels/test_gdn_verify_adversarial.py) stay at the bf16
      output rounding (≤ 5e-3), as SGLang's serial kernel does.
    - fp32 inputs take 3xTF32 products (unit roundoff ~2⁻²²) or ieee everywhere: fp32-grade results.
The fp16 T×T operands are used only where that bound holds: input_precision "tf32" with
use_qk_l2norm (unnormalised keys have no bound on G). R, U and the S_pre products have no such bound
and use the caller's input_precision; Q Kᵀ and K Kᵀ of fp16/bf16 q/k are exact (fp32 accumulation).

q/k L2 normalisation and the q scale are applied after the K-loop as diagonal scalings
(diag(r_q) Q Kᵀ diag(r_k) etc.), so the raw q/k tiles enter tl.dot unchanged.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels._checks import check_out, check_verify_inputs, interpreting
from kernels.gdn_tree_verify_launch import (
    METHODS,
    TUNED_FP32,
    TUNED_LOWP,
    VerifyConfig,
    chunk_tile,
    default_config,
    solve_plan,
    tuned_launch,
)

_PRECISIONS = ("ieee", "tf32", "tf32x3")


@triton.jit
def _tt_dot(a, b, TT: tl.constexpr):
    """A T×T product of bounded operands (see the module docstring): fp16 operands or fp32 at TT."""
    if TT == "fp16":
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        return tl.dot(a, b, input_precision=TT)


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


@triton.jit
def _bits(b_w, o_c):
    """[BC, BC] bool: bit j of each row's word (arithmetic shift: bit 63 still reads 1)."""
    return ((b_w[:, None] >> o_c[None, :].to(tl.int64)) & 1) != 0


@triton.jit
def gdn_tree_verify_kernel(
    q, k, v, g, beta,               # [N, HK, K], [N, HK, K], [N, HV, V], [N, HV], [N, HV]
    h0, state_indices,              # pool [slots, HV, V, K], [B]
    cu_seqlens, anc_bits,           # [B+1], [N, N_WORDS] int64 ancestor-or-self bitmasks
    o, u, logp,                     # [N, HV, V] (v's dtype), [N, HV, V] fp32, [N, HV] fp32
    scale,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, N_WORDS: tl.constexpr,
    BC: tl.constexpr,               # rows per chunk: min(BT, 64)
    NC: tl.constexpr,               # chunks: BT / BC
    BK: tl.constexpr, BV: tl.constexpr,
    USE_L2NORM: tl.constexpr, HAS_H0: tl.constexpr, HAS_INDICES: tl.constexpr,
    LOWP_QK: tl.constexpr, LOWP_S: tl.constexpr, SPLIT_S: tl.constexpr,
    PRECISION: tl.constexpr,        # products with unbounded operands (S_pre, R, U)
    TT: tl.constexpr,               # T×T products of bounded operands: "fp16" or a precision
    BLOCKED: tl.constexpr,          # method "blocked" (W first), else "horner"
    BS: tl.constexpr,               # blocked: rows of the diagonal blocks solved by level steps
    N_LEVEL: tl.constexpr,          # level steps: min(depth, BS or BC) - 1
    N_MERGES: tl.constexpr,         # blocked: log2(BC / BS)
    EARLY: tl.constexpr,            # issue the gate / v loads before the K-loop
):
    i_b, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // HK)
    bos = tl.load(cu_seqlens + i_b).to(tl.int64)
    T = (tl.load(cu_seqlens + i_b + 1).to(tl.int64) - bos).to(tl.int32)
    o_c = tl.arange(0, BC)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    if HAS_INDICES:
        i_slot = tl.load(state_indices + i_b).to(tl.int64)
    else:
        i_slot = i_b.to(tl.int64)
    p_h0 = h0 + (i_slot * HV + i_h) * V * K
    eye = o_c[:, None] == o_c[None, :]

    for c in tl.static_range(NC):
        o_r = c * BC + o_c
        m_r = o_r < T
        m_rv = m_r[:, None] & m_v[None, :]
        p_v = ((bos + o_r[:, None]) * HV + i_h) * V + o_v[None, :]
        b_g = tl.load(g + (bos + o_r) * HV + i_h, mask=m_r, other=0).to(tl.float32)
        b_beta = tl.load(beta + (bos + o_r) * HV + i_h, mask=m_r, other=0).to(tl.float32)
        if EARLY:
            b_v = tl.load(v + p_v, mask=m_rv, other=0)
        # M⁺ inside the chunk (word c: BC == 64 whenever NC > 1), logP = M⁺ g over this and earlier chunks
        m_plus = _bits(tl.load(anc_bits + (bos + o_r) * N_WORDS + c, mask=m_r, other=0), o_c)
        b_lp = tl.sum(tl.where(m_plus, b_g[None, :], 0.0), axis=1)
        for c2 in tl.static_range(c):
            o_r2 = c2 * BC + o_c
            b_g2 = tl.load(g + (bos + o_r2) * HV + i_h, mask=o_r2 < T, other=0).to(tl.float32)
            m_c2 = _bits(tl.load(anc_bits + (bos + o_r) * N_WORDS + c2, mask=m_r, other=0), o_c)
            b_lp += tl.sum(tl.where(m_c2, b_g2[None, :], 0.0), axis=1)

        # ---- one pass over K: Q Kᵀ, K Kᵀ [BC, BC]; Q S_pre, K S_pre [BC, BV]; sums of squares [BC]
        b_qk = tl.zeros([BC, BC], dtype=tl.float32)
        b_kk = tl.zeros([BC, BC], dtype=tl.float32)
        b_qs = tl.zeros([BC, BV], dtype=tl.float32)
        b_ks = tl.zeros([BC, BV], dtype=tl.float32)
        b_q2 = tl.zeros([BC], dtype=tl.float32)
        b_k2 = tl.zeros([BC], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            p_qk = ((bos + o_r[:, None]) * HK + i_hk) * K + o_k[None, :]
            b_q = tl.load(q + p_qk, mask=m_r[:, None] & m_k[None, :], other=0)
            b_k = tl.load(k + p_qk, mask=m_r[:, None] & m_k[None, :], other=0)
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
            if HAS_H0:
                # S_preᵀ tile [BV, BK] (the pool holds Sᵀ, K contiguous)
                b_s = tl.load(p_h0 + o_v[:, None] * K + o_k[None, :], mask=m_v[:, None] & m_k[None, :], other=0)
                b_qs, b_ks = s_dots(b_q, b_k, b_s, b_qs, b_ks, LOWP_S, SPLIT_S, PRECISION)
        # normalisation and scale as diagonal scalings: r_q = scale / ||q||, r_k = 1 / ||k||
        if USE_L2NORM:
            b_rq = scale * tl.rsqrt(b_q2 + 1e-6)
            b_rk = tl.rsqrt(b_k2 + 1e-6)
        else:
            b_rq = tl.zeros([BC], dtype=tl.float32) + scale
            b_rk = tl.zeros([BC], dtype=tl.float32) + 1.0
        b_qk = b_qk * (b_rq[:, None] * b_rk[None, :])
        b_kk = b_kk * (b_rk[:, None] * b_rk[None, :])
        if not EARLY:
            b_v = tl.load(v + p_v, mask=m_rv, other=0)

        # ---- E = P_i / P_j on M⁺ (masked before exp), G, C, R
        b_e = tl.exp(tl.where(m_plus, b_lp[:, None] - b_lp[None, :], float("-inf")))
        b_G = tl.where(m_plus & ~eye, b_beta[:, None] * b_kk * b_e, 0.0)
        b_C = b_qk * b_e
        b_p = tl.exp(b_lp)
        b_x = b_beta[:, None] * (b_v.to(tl.float32) - b_p[:, None] * (b_ks * b_rk[:, None]))
        b_o = b_p[:, None] * (b_qs * b_rq[:, None])

        # ---- earlier chunks c2 < c: X_c −= G_{c c2} U_c2, O_c += C_{c c2} U_c2 (their U and logP were
        # written by this program before the barrier that ended their iteration)
        for c2 in tl.static_range(c):
            o_r2 = c2 * BC + o_c
            m_r2 = o_r2 < T
            b_w2 = tl.load(anc_bits + (bos + o_r) * N_WORDS + c2, mask=m_r, other=0)
            if tl.sum((b_w2 != 0).to(tl.int32), axis=0) > 0:   # no ancestor in chunk c2: nothing to add
                m_c2 = _bits(b_w2, o_c)
                b_qk2 = tl.zeros([BC, BC], dtype=tl.float32)
                b_kk2 = tl.zeros([BC, BC], dtype=tl.float32)
                b_k22 = tl.zeros([BC], dtype=tl.float32)
                for i_k in range(0, tl.cdiv(K, BK)):
                    o_k = i_k * BK + tl.arange(0, BK)
                    m_k = o_k < K
                    p_qk = ((bos + o_r[:, None]) * HK + i_hk) * K + o_k[None, :]
                    p_k2 = ((bos + o_r2[:, None]) * HK + i_hk) * K + o_k[None, :]
                    b_q = tl.load(q + p_qk, mask=m_r[:, None] & m_k[None, :], other=0)
                    b_k = tl.load(k + p_qk, mask=m_r[:, None] & m_k[None, :], other=0)
                    b_kc = tl.load(k + p_k2, mask=m_r2[:, None] & m_k[None, :], other=0)
                    if USE_L2NORM:
                        b_kcf = b_kc.to(tl.float32)
                        b_k22 += tl.sum(b_kcf * b_kcf, axis=1)
                    if LOWP_QK:
                        b_qk2 += tl.dot(b_q, tl.trans(b_kc))
                        b_kk2 += tl.dot(b_k, tl.trans(b_kc))
                    else:
                        b_qk2 += tl.dot(b_q.to(tl.float32), tl.trans(b_kc.to(tl.float32)), input_precision=PRECISION)
                        b_kk2 += tl.dot(b_k.to(tl.float32), tl.trans(b_kc.to(tl.float32)), input_precision=PRECISION)
                if USE_L2NORM:
                    b_rk2 = tl.rsqrt(b_k22 + 1e-6)
                else:
                    b_rk2 = tl.zeros([BC], dtype=tl.float32) + 1.0
                b_lp2 = tl.load(logp + (bos + o_r2) * HV + i_h, mask=m_r2, other=0)
                b_e2 = tl.exp(tl.where(m_c2, b_lp[:, None] - b_lp2[None, :], float("-inf")))
                b_u2 = tl.load(u + ((bos + o_r2[:, None]) * HV + i_h) * V + o_v[None, :],
                               mask=m_r2[:, None] & m_v[None, :], other=0)
                b_G2 = b_beta[:, None] * (b_kk2 * (b_rk[:, None] * b_rk2[None, :])) * b_e2
                b_C2 = (b_qk2 * (b_rq[:, None] * b_rk2[None, :])) * b_e2
                b_x -= tl.dot(b_G2, b_u2, input_precision=PRECISION)
                b_o += tl.dot(b_C2, b_u2, input_precision=PRECISION)

        # ---- the diagonal solve
        if BLOCKED:
            same = (o_c[:, None] // BS) == (o_c[None, :] // BS)
            b_gb = tl.where(same, b_G, 0.0)
            depth = tl.sum(tl.where(m_plus & same, 1, 0), axis=1)     # in-block depth [BC]
            b_id = tl.where(eye, 1.0, 0.0)
            b_w = b_id
            for s in range(1, N_LEVEL + 1):
                b_w = tl.where((depth == s + 1)[:, None], b_id - _tt_dot(b_gb, b_w, TT), b_w)
            for i_m in tl.static_range(N_MERGES):
                half = BS * (1 << i_m)   # a constexpr per unrolled merge
                off = ((o_c[:, None] // (2 * half)) == (o_c[None, :] // (2 * half))) & \
                    ((o_c[:, None] // half) != (o_c[None, :] // half))
                b_w = b_w - _tt_dot(b_w, _tt_dot(tl.where(off, b_G, 0.0), b_w, TT), TT)
            b_u = tl.dot(b_w, b_x, input_precision=PRECISION)
            b_m = _tt_dot(b_C, b_w, TT)
            b_o = tl.dot(b_m, b_x, acc=b_o, input_precision=PRECISION)
        else:
            depth = tl.sum(tl.where(m_plus, 1, 0), axis=1)            # in-chunk depth [BC]
            b_u = b_x
            for s in range(1, N_LEVEL + 1):
                b_u = tl.where((depth == s + 1)[:, None], b_x - tl.dot(b_G, b_u, input_precision=PRECISION), b_u)
            b_o = tl.dot(b_C, b_u, acc=b_o, input_precision=PRECISION)

        tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_rv)
        tl.store(u + p_v, b_u, mask=m_rv)
        # every value tile stores the same logP (identical arithmetic): later chunks read it back
        tl.store(logp + (bos + o_r) * HV + i_h, b_lp, mask=m_r)
        if NC > 1:
            tl.debug_barrier()


def launch_gdn_tree_verify(q, k, v, g, beta, forest, initial_state, state_indices, scale,
                           use_qk_l2norm, o, u, logp, config: VerifyConfig, input_precision: str, method: str):
    """Launcher: contiguous [N, H, D] views, grid (B, HV, V / BV). Outputs are preallocated."""
    _, N, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    B = forest.num_requests
    BC, NC = chunk_tile(forest.max_nodes)
    lowp_qk = q.dtype == k.dtype and q.dtype in (torch.float16, torch.bfloat16) and not interpreting()
    has_h0 = initial_state is not None
    lowp_s = lowp_qk and has_h0 and initial_state.dtype == q.dtype
    # bf16 q/k with an fp32 pool: split S into 3 bf16 terms unless plain tf32 was asked for (cheaper)
    split_s = (lowp_qk and has_h0 and not lowp_s and q.dtype == torch.bfloat16
               and initial_state.dtype == torch.float32 and input_precision != "tf32")
    # fp16 T×T operands where tf32 was asked for and the bound on them holds (module docstring)
    tt = "fp16" if input_precision == "tf32" and bool(use_qk_l2norm) else input_precision
    bs, n_level, n_merges = solve_plan(method, forest.max_depth, BC)
    grid = (B, HV, triton.cdiv(V, config.block_v))
    gdn_tree_verify_kernel[grid](
        q[0].contiguous(), k[0].contiguous(), v[0].contiguous(), g[0].contiguous(), beta[0].contiguous(),
        initial_state if has_h0 else q, state_indices if state_indices is not None else forest.cu_seqlens,
        forest.cu_seqlens, forest.anc_bits.contiguous(),
        o[0], u, logp,
        float(scale),
        HK=HK, HV=HV, K=K, V=V, N_WORDS=forest.anc_bits.shape[1], BC=BC, NC=NC,
        BK=config.block_k, BV=config.block_v,
        USE_L2NORM=bool(use_qk_l2norm), HAS_H0=has_h0, HAS_INDICES=state_indices is not None,
        LOWP_QK=lowp_qk, LOWP_S=lowp_s, SPLIT_S=split_s, PRECISION=input_precision, TT=tt,
        BLOCKED=method == "blocked", BS=bs, N_LEVEL=n_level, N_MERGES=n_merges, EARLY=config.early_loads,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return o, u, logp


def gdn_tree_verify(q, k, v, g, beta, forest, initial_state, state_indices=None,
                    scale=None, use_qk_l2norm=False, u_out=None, logp_out=None, o_out=None, *,
                    block_v: int | None = None, config: VerifyConfig | None = None,
                    input_precision: str = "ieee", method: str = "blocked", tuned: bool = False,
                    checked: bool = False):
    """Closed-form parallel GDN tree verification (Theorem 1, eq. 2); twin: `bole.ops.gdn.gdn_tree_verify_ref`.

    Args:
        q, k: [1, N, HK, K] (fp32, fp16 or bf16); v: [1, N, HV, V]; g (log decay, ≤ 0), beta ([0, 1]):
            [1, N, HV].
        forest: the packed draft trees (N nodes, at most 256 per tree, any depth), on q's device.
        initial_state: the state pool [slots, HV, V, K] (fp32 or bf16, K contiguous), read by slot,
            never written; None means zero states.
        state_indices: int [B] pool slot of each request (default: request b reads slot b).
        scale: q scale (default K ** -0.5). use_qk_l2norm: L2-normalise q and k in the kernel.
        u_out, logp_out, o_out: optional preallocated outputs (e.g. slices of the all-layer factor
            buffer [L, N, HV, V] / [L, N, HV]); they must be contiguous with the shapes below.
        block_v: value tile BV (power of two); default: see `default_config`.
        config: a `VerifyConfig` (overrides the default; `block_v` still overrides its tile).
        input_precision: fp32 tl.dot precision, "ieee" (exact, default), "tf32" or "tf32x3" (GPU only).
        method: "blocked" (W = (I+G)⁻¹ per chunk by blocked substitution, then applied) or "horner"
            (level-scheduled substitution on the value tile); both exact and stable (module docstring).
        tuned: without an explicit config, take config, method and precision from a measured table
            (`tuned_launch`): `TUNED_LOWP` for fp16/bf16 q and k, `TUNED_FP32` for fp32 (3xTF32
            products, fp32-grade): the engine's setting.
        checked: the caller checked ``forest`` and ``state_indices`` once for the whole forward
            (`kernels._checks.check_forward_inputs`, run by ``bole.models.context.ForwardContext``);
            only their sizes are compared with the other inputs here.
    Returns:
        o [1, N, HV, V] in v's dtype, u [N, HV, V] fp32 and logp [N, HV] fp32 (the commit's factors).
    """
    N, HK, HV, K, V = check_verify_inputs(q, k, v, g, beta, forest, initial_state, state_indices, checked)
    B, dev = forest.num_requests, q.device
    if input_precision not in _PRECISIONS:
        raise ValueError(f"input_precision must be one of {_PRECISIONS}, got {input_precision!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")

    BC, NC = chunk_tile(forest.max_nodes)
    if tuned and config is None and block_v is None:
        table = TUNED_LOWP if q.dtype in (torch.float16, torch.bfloat16) else TUNED_FP32
        config, method, input_precision = tuned_launch(BC * NC, B * HV, K, V, table)
    if config is None:
        config = default_config(K, V, BC, B * HV, block_v)
    elif block_v is not None:
        config = dataclasses.replace(config, block_v=block_v)
    if config.block_v < 16 or config.block_v & (config.block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {config.block_v}")
    if config.block_k < 16 or config.block_k & (config.block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {config.block_k}")

    o = check_out("o_out", o_out, (1, N, HV, V), v.dtype, dev)
    u = check_out("u_out", u_out, (N, HV, V), torch.float32, dev)
    logp = check_out("logp_out", logp_out, (N, HV), torch.float32, dev)
    scale = K ** -0.5 if scale is None else float(scale)
    return launch_gdn_tree_verify(q, k, v, g, beta, forest, initial_state, state_indices, scale,
                                  use_qk_l2norm, o, u, logp, config, input_precision, method)
