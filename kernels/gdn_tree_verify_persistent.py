"""Persistent closed-form GDN tree verification (DESIGN.md §2 eq. 2): `method="persistent"` of
`kernels.gdn_tree_verify.gdn_tree_verify`.

The one-pass kernel runs one program per (request, value head, value tile). At Qwen3.5-9B shapes and
batch 16 with BV = V a program holds 242 registers a thread (8 warps), so one program fits an SM, and
a program is three phases in a row: the tree relation (waiting on its loads), the K-loop (Q Kᵀ, K Kᵀ,
Q S_pre, K S_pre; memory-bound), and the T×T chain with the stores (no memory traffic). Nsight Compute
on the H200 (2026-12-02, batch 16, T = 64) put 18% / 33% / 47% of the warp samples in them, DRAM
throughput at 25% of peak: one SM's loads and its chain never overlap.

Here a grid of about one program per SM walks the work items (request, value head, value tile) in one
flattened loop over (item, K chunk). The tree-side epilogue runs inside that loop on the last chunk of
an item, so the software pipeline has already issued the next item's first K chunks (num_stages − 1
of them) when the epilogue starts: the next item's q/k/S_pre loads fly during this item's chain.

Per item the arithmetic is the one-pass kernel's `method="inverse"`: W = (I+G)⁻¹ in product form, M =
C W, U = W R, O = D_P Q S_pre + M R, with the same load and product options (LOWP_QK, LOWP_S, SPLIT_S,
LOWP_TT). Written here (not taken from a library) because no library verifies a tree.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels._checks import interpreting
from kernels.gdn_tree_tiles import load_anc_bits, s_dots, tree_relation


@triton.jit
def _item_epilogue(b_qk, b_kk, b_qs, b_ks, b_q2, b_k2, bos, T, i_h, i_v, g, beta, v, anc_bits, o, u, logp, scale,
                   HV: tl.constexpr, V: tl.constexpr, N_WORDS: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                   USE_L2NORM: tl.constexpr, PRECISION: tl.constexpr, N_SQUARINGS: tl.constexpr,
                   LOWP_TT: tl.constexpr):
    """The inverse method's epilogue for one item from its K-loop sums: normalisation, tree relation and
    decays, E, G, C, R, W, then U, O and logP stored."""
    o_t = tl.arange(0, BT)
    m_t = o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    b_w0, b_w1 = load_anc_bits(anc_bits, bos, o_t, m_t, N_WORDS, BT)
    b_g = tl.load(g + (bos + o_t) * HV + i_h, mask=m_t, other=0).to(tl.float32)
    b_beta = tl.load(beta + (bos + o_t) * HV + i_h, mask=m_t, other=0).to(tl.float32)
    p_v = ((bos + o_t[:, None]) * HV + i_h) * V + o_v[None, :]
    b_v = tl.load(v + p_v, mask=m_tv, other=0)
    if USE_L2NORM:
        b_rq = scale * tl.rsqrt(b_q2 + 1e-6)
        b_rk = tl.rsqrt(b_k2 + 1e-6)
        b_qk = b_qk * (b_rq[:, None] * b_rk[None, :])
        b_kk = b_kk * (b_rk[:, None] * b_rk[None, :])
        b_qs = b_qs * b_rq[:, None]
        b_ks = b_ks * b_rk[:, None]
    else:
        b_qk = b_qk * scale
        b_qs = b_qs * scale
    m_plus, m_minus = tree_relation(b_w0, b_w1, o_t, BT)
    b_lp = tl.sum(tl.where(m_plus, b_g[None, :], 0.0), axis=1)
    b_e = tl.exp(tl.where(m_plus, b_lp[:, None] - b_lp[None, :], float("-inf")))
    b_G = tl.where(m_minus, b_beta[:, None] * b_kk * b_e, 0.0)
    b_C = b_qk * b_e
    b_p = tl.exp(b_lp)
    b_r = b_beta[:, None] * (b_v.to(tl.float32) - b_p[:, None] * b_ks)
    # W = Π_s (I + A^{2^s}), A = −G (see gdn_tree_verify_kernel for LOWP_TT's bound)
    b_a = -b_G
    b_w = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0) + b_a
    for _ in tl.static_range(N_SQUARINGS):
        if LOWP_TT:
            b_a = tl.dot(b_a.to(tl.float16), b_a.to(tl.float16))
            b_w += tl.dot(b_w.to(tl.float16), b_a.to(tl.float16))
        else:
            b_a = tl.dot(b_a, b_a, input_precision=PRECISION)
            b_w += tl.dot(b_w, b_a, input_precision=PRECISION)
    if LOWP_TT:
        b_m = tl.dot(b_C.to(tl.float16), b_w.to(tl.float16))
    else:
        b_m = tl.dot(b_C, b_w, input_precision=PRECISION)
    b_u = tl.dot(b_w, b_r, input_precision=PRECISION)
    b_o = tl.dot(b_m, b_r, acc=b_p[:, None] * b_qs, input_precision=PRECISION)
    tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_tv)
    tl.store(u + p_v, b_u, mask=m_tv)
    if i_v == 0:
        tl.store(logp + (bos + o_t) * HV + i_h, b_lp, mask=m_t)


@triton.jit
def gdn_tree_verify_persistent_kernel(
    q, k, v, g, beta,               # [N, HK, K], [N, HK, K], [N, HV, V], [N, HV], [N, HV]
    h0, state_indices,              # pool [slots, HV, V, K], [B]
    cu_seqlens, anc_bits,           # [B+1], [N, N_WORDS] int64 ancestor-or-self bitmasks
    o, u, logp,                     # [N, HV, V] (v's dtype), [N, HV, V] fp32, [N, HV] fp32
    scale, n_items, n_iter,         # n_items = B · HV · ⌈V / BV⌉; n_iter = ⌈n_items / programs⌉ · ⌈K / BK⌉
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, N_WORDS: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2NORM: tl.constexpr, HAS_H0: tl.constexpr, HAS_INDICES: tl.constexpr,
    LOWP_QK: tl.constexpr, LOWP_S: tl.constexpr, SPLIT_S: tl.constexpr, PRECISION: tl.constexpr,
    N_SQUARINGS: tl.constexpr, LOWP_TT: tl.constexpr,
    N_ITER: tl.constexpr,           # the interpreter's static copy of n_iter (its loops need one); 0 on a GPU
):
    NVT: tl.constexpr = (V + BV - 1) // BV
    KT: tl.constexpr = (K + BK - 1) // BK
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    o_t = tl.arange(0, BT)
    b_qk = tl.zeros([BT, BT], dtype=tl.float32)
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    b_qs = tl.zeros([BT, BV], dtype=tl.float32)
    b_ks = tl.zeros([BT, BV], dtype=tl.float32)
    b_q2 = tl.zeros([BT], dtype=tl.float32)
    b_k2 = tl.zeros([BT], dtype=tl.float32)
    # items pid, pid + nprog, ...; item = (b · HV + h) · NVT + value tile (neighbours share q/k in L2).
    # Every program runs n_iter steps; a program with one item fewer runs its last round on T = 0, every
    # load and store masked off.
    for it in range(0, N_ITER if N_ITER > 0 else n_iter):
        i_k = it % KT
        item = pid + (it // KT) * nprog
        valid = item < n_items
        i_v = item % NVT
        i_h = (item // NVT) % HV
        i_b = tl.where(valid, item // (NVT * HV), 0)
        bos = tl.load(cu_seqlens + i_b).to(tl.int64)
        T = tl.where(valid, (tl.load(cu_seqlens + i_b + 1).to(tl.int64) - bos).to(tl.int32), 0)
        m_t = o_t < T
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        p_qk = ((bos + o_t[:, None]) * HK + i_h // (HV // HK)) * K + o_k[None, :]
        b_q = tl.load(q + p_qk, mask=m_t[:, None] & m_k[None, :], other=0)
        b_k = tl.load(k + p_qk, mask=m_t[:, None] & m_k[None, :], other=0)
        b_qf = b_q.to(tl.float32)
        b_kf = b_k.to(tl.float32)
        if USE_L2NORM:
            b_q2 += tl.sum(b_qf * b_qf, axis=1)
            b_k2 += tl.sum(b_kf * b_kf, axis=1)
        if LOWP_QK:  # fp16/bf16 products are exact in the fp32 accumulator
            b_qk += tl.dot(b_q, tl.trans(b_k))
            b_kk += tl.dot(b_k, tl.trans(b_k))
        else:
            b_qk += tl.dot(b_qf, tl.trans(b_kf), input_precision=PRECISION)
            b_kk += tl.dot(b_kf, tl.trans(b_kf), input_precision=PRECISION)
        if HAS_H0:
            if HAS_INDICES:
                i_slot = tl.load(state_indices + i_b).to(tl.int64)
            else:
                i_slot = i_b.to(tl.int64)
            o_v = i_v * BV + tl.arange(0, BV)
            b_s = tl.load(h0 + ((i_slot * HV + i_h) * V + o_v[:, None]) * K + o_k[None, :],
                          mask=(o_v < V)[:, None] & m_k[None, :], other=0)
            b_qs, b_ks = s_dots(b_q, b_k, b_s, b_qs, b_ks, LOWP_S, SPLIT_S, PRECISION)
        if i_k == KT - 1:
            _item_epilogue(b_qk, b_kk, b_qs, b_ks, b_q2, b_k2, bos, T, i_h, i_v, g, beta, v, anc_bits, o, u, logp,
                           scale, HV, V, N_WORDS, BT, BV, USE_L2NORM, PRECISION, N_SQUARINGS, LOWP_TT)
            b_qk = tl.zeros([BT, BT], dtype=tl.float32)
            b_kk = tl.zeros([BT, BT], dtype=tl.float32)
            b_qs = tl.zeros([BT, BV], dtype=tl.float32)
            b_ks = tl.zeros([BT, BV], dtype=tl.float32)
            b_q2 = tl.zeros([BT], dtype=tl.float32)
            b_k2 = tl.zeros([BT], dtype=tl.float32)


def launch_persistent(q, k, v, g, beta, forest, initial_state, state_indices, scale, use_qk_l2norm, o, u, logp,
                      *, BT: int, block_k: int, block_v: int, programs: int, num_warps: int, num_stages: int,
                      input_precision: str, n_squarings: int, lowp_qk: bool, lowp_s: bool, split_s,
                      lowp_tt: bool):
    """One launch of `programs` persistent programs (at most one per item) on contiguous [N, H, D] views."""
    _, N, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    has_h0 = initial_state is not None
    cu = forest.cu_seqlens
    qc = q[0].contiguous()
    n_items = forest.num_requests * HV * triton.cdiv(V, block_v)
    if n_items == 0:
        return o, u, logp
    programs = max(1, min(programs, n_items))
    n_iter = triton.cdiv(n_items, programs) * triton.cdiv(K, block_k)
    gdn_tree_verify_persistent_kernel[(programs,)](
        qc, k[0].contiguous(), v[0].contiguous(), g[0].contiguous(), beta[0].contiguous(),
        initial_state if has_h0 else qc, state_indices if state_indices is not None else cu,
        cu, forest.anc_bits.contiguous(),
        o[0], u, logp,
        float(scale), n_items, n_iter,
        HK=HK, HV=HV, K=K, V=V, N_WORDS=forest.anc_bits.shape[1], BT=BT, BK=block_k, BV=block_v,
        USE_L2NORM=bool(use_qk_l2norm), HAS_H0=has_h0, HAS_INDICES=state_indices is not None,
        LOWP_QK=lowp_qk, LOWP_S=lowp_s, SPLIT_S=split_s, PRECISION=input_precision, N_SQUARINGS=n_squarings,
        LOWP_TT=lowp_tt, N_ITER=n_iter if interpreting() else 0, num_warps=num_warps, num_stages=num_stages,
    )
    return o, u, logp
