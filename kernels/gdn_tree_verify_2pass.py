"""Two-pass closed-form GDN tree verification (DESIGN.md §2 eq. 2): factor once per head, apply per tile.

Everything in eq. (2) that depends only on the tree, Q/K and the gates is formed ONCE per (request,
value head) by pass 1; pass 2 runs per (request, value head, value tile of BV columns) and only does
the work that involves the state S_pre and V:

pass 1 (`gdn_tree_factor_kernel`, grid (B, HV)):
    Q Kᵀ, K Kᵀ over K (raw q/k, L2 norm and the q scale applied afterwards as diagonal scalings),
    M⁺ / M⁻ from the packed ancestor bitmasks, logP = M⁺ g, E = exp(logP_i − logP_j) on M⁺ (masked
    before exp), G = D_β [(K Kᵀ) ⊙ E ⊙ M⁻], C = (Q Kᵀ) ⊙ E,
    W = (I+G)⁻¹ = Π_{s<S} (I + A^{2^s}), A = −G: after S squarings W = Σ_{m<2^{S+1}} A^m, exact
        once 2^{S+1} ≥ depth because G is strictly lower triangular in tree order (A^depth = 0),
    W' = W D_β,  M' = C W D_β   (β folded into the columns: pass 2 never needs β),
    c_q = P ⊙ r_q,  c_k = P ⊙ r_k  (P = exp(logP); r_q = scale/‖q‖, r_k = 1/‖k‖ or scale, 1),
    and writes W', M' ([BT, BT] fp32 each), c_q, c_k ([BT]) to a workspace, logP to the output.

pass 2 (`gdn_tree_apply_kernel`, grid (B, HV, V/BV)):
    Q S_pre, K S_pre over K from the raw q/k (same LOWP_S / SPLIT_S / fp32 paths as the one-pass
    kernel), X = V − D_{c_k} (K S_pre) (so R = D_β X), U = W' X, O = D_{c_q} (Q S_pre) + M' X.

Nothing T×T×K or T×T×T is recomputed per value tile; pass 2 does two T×T×BV products per tile.
Every fp32 product uses the caller's ``input_precision``, except that pass 1 at BT = 128 turns "ieee"
into "tf32x3" on a GPU (see `launch_two_pass`: the FMA path does not fit in shared memory there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gdn_tree_tiles import load_anc_bits, qk_kk_norms, s_products, tree_relation, unit_lower_inverse


@triton.jit
def gdn_tree_factor_kernel(
    q, k, g, beta,                  # [N, HK, K], [N, HK, K], [N, HV], [N, HV]
    cu_seqlens, anc_bits,           # [B+1], [N, N_WORDS] int64 ancestor-or-self bitmasks
    ws_w, ws_m, ws_c,               # [B, HV, BT, BT] fp32 ×2, [B, HV, 2, BT] fp32
    logp,                           # [N, HV] fp32
    scale,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, N_WORDS: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr,
    USE_L2NORM: tl.constexpr, LOWP_QK: tl.constexpr, PRECISION: tl.constexpr,
    N_SQUARINGS: tl.constexpr,
):
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // HK)
    bos = tl.load(cu_seqlens + i_b).to(tl.int64)
    T = (tl.load(cu_seqlens + i_b + 1).to(tl.int64) - bos).to(tl.int32)

    o_t = tl.arange(0, BT)
    m_t = o_t < T
    b_w0, b_w1 = load_anc_bits(anc_bits, bos, o_t, m_t, N_WORDS, BT)
    m_plus, m_minus = tree_relation(b_w0, b_w1, o_t, BT)

    # ---- gates and path log decays (logP = M⁺ g); padded nodes get β = 0
    b_g = tl.load(g + (bos + o_t) * HV + i_h, mask=m_t, other=0).to(tl.float32)
    b_beta = tl.load(beta + (bos + o_t) * HV + i_h, mask=m_t, other=0).to(tl.float32)
    b_lp = tl.sum(tl.where(m_plus, b_g[None, :], 0.0), axis=1)

    # ---- Q Kᵀ, K Kᵀ over K from the raw q/k, and the L2-norm / scale row factors
    b_qk, b_kk, b_rq, b_rk = qk_kk_norms(q, k, bos, o_t, m_t, i_hk, scale, HK, K, BT, BK, USE_L2NORM, LOWP_QK,
                                         PRECISION)

    # ---- E = P_i / P_j on M⁺ (masked before exp), G (strictly lower), C
    b_e = tl.exp(tl.where(m_plus, b_lp[:, None] - b_lp[None, :], float("-inf")))
    b_C = b_qk * (b_rq[:, None] * b_rk[None, :]) * b_e
    b_a = tl.where(m_minus, -(b_beta * b_rk)[:, None] * b_kk * b_rk[None, :] * b_e, 0.0)  # A = −G

    # ---- W = Π_s (I + A^{2^s})
    b_w = unit_lower_inverse(b_a, o_t, N_SQUARINGS, PRECISION)
    b_w = b_w * b_beta[None, :]                      # W' = W D_β (padded columns: β = 0)
    b_m = tl.dot(b_C, b_w, input_precision=PRECISION)  # M' = C W D_β

    o_ws = (i_b * HV + i_h).to(tl.int64)
    p_tt = o_ws * BT * BT + o_t[:, None] * BT + o_t[None, :]
    tl.store(ws_w + p_tt, b_w)
    tl.store(ws_m + p_tt, b_m)
    b_p = tl.exp(b_lp)
    tl.store(ws_c + o_ws * 2 * BT + o_t, b_p * b_rq)
    tl.store(ws_c + o_ws * 2 * BT + BT + o_t, b_p * b_rk)
    tl.store(logp + (bos + o_t) * HV + i_h, b_lp, mask=m_t)


@triton.jit
def gdn_tree_apply_kernel(
    q, k, v,                        # [N, HK, K], [N, HK, K], [N, HV, V]
    h0, state_indices,              # pool [slots, HV, V, K], [B]
    cu_seqlens,                     # [B+1]
    ws_w, ws_m, ws_c,               # pass 1's workspace
    o, u,                           # [N, HV, V] (v's dtype), [N, HV, V] fp32
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, HAS_INDICES: tl.constexpr,
    LOWP_S: tl.constexpr, SPLIT_S: tl.constexpr, PRECISION: tl.constexpr,
):
    i_b, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // HK)
    bos = tl.load(cu_seqlens + i_b).to(tl.int64)
    T = (tl.load(cu_seqlens + i_b + 1).to(tl.int64) - bos).to(tl.int32)

    o_t = tl.arange(0, BT)
    m_t = o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]
    o_ws = (i_b * HV + i_h).to(tl.int64)

    p_v = ((bos + o_t[:, None]) * HV + i_h) * V + o_v[None, :]
    b_x = tl.load(v + p_v, mask=m_tv, other=0).to(tl.float32)
    if HAS_H0:
        # ---- Q S_pre, K S_pre [BT, BV] over K (raw q/k; the row scalings come from pass 1)
        if HAS_INDICES:
            i_slot = tl.load(state_indices + i_b).to(tl.int64)
        else:
            i_slot = i_b.to(tl.int64)
        p_h0 = h0 + (i_slot * HV + i_h) * V * K
        b_qs, b_ks = s_products(q, k, p_h0, bos, o_t, m_t, o_v, m_v, i_hk, HK, K, BT, BK, BV, LOWP_S, SPLIT_S,
                                PRECISION)
        b_cq = tl.load(ws_c + o_ws * 2 * BT + o_t)
        b_ck = tl.load(ws_c + o_ws * 2 * BT + BT + o_t)
        b_x = b_x - b_ck[:, None] * b_ks
        b_acc = b_cq[:, None] * b_qs
    else:
        b_acc = tl.zeros([BT, BV], dtype=tl.float32)

    # ---- U = W' X, O = D_{c_q} Q S_pre + M' X
    p_tt = o_ws * BT * BT + o_t[:, None] * BT + o_t[None, :]
    b_w = tl.load(ws_w + p_tt)
    b_u = tl.dot(b_w, b_x, input_precision=PRECISION)
    b_m = tl.load(ws_m + p_tt)
    b_o = tl.dot(b_m, b_x, acc=b_acc, input_precision=PRECISION)
    tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_tv)
    tl.store(u + p_v, b_u, mask=m_tv)


def workspace_numel(num_requests: int, HV: int, BT: int) -> int:
    """fp32 elements of the two-pass workspace: W' and M' [B, HV, BT, BT], c_q and c_k [B, HV, 2, BT]."""
    return num_requests * HV * (2 * BT * BT + 2 * BT)


def factor_launch_params(K: int, BT: int) -> tuple[int, int, int]:
    """Pass 1's (block_k, num_warps, num_stages): it is latency bound and holds several [BT, BT] fp32
    tiles (Q Kᵀ, K Kᵀ, E, A, W, C) at once. ptxas -v on sm_90a (Qwen3.5-9B heads, bf16 q/k): BT=64 with
    8 warps uses 255 registers and spills 1064 B (ieee), 0 B (tf32), 436 B (tf32x3); with 4 warps 5.8 KB
    (ieee). BT=32: 213 registers, no spill with 8 warps, 255 with 4. BT=16: no spill either way."""
    kmax = max(16, triton.next_power_of_2(K))
    bk = min(64, kmax)
    return bk, (8 if BT >= 32 else 4), (2 if K > bk else 1)


def launch_two_pass(q, k, v, g, beta, forest, initial_state, state_indices, scale, use_qk_l2norm,
                    o, u, logp, *, BT: int, block_k: int, block_v: int, num_warps: int, num_stages: int,
                    input_precision: str, n_squarings: int, lowp_qk: bool, lowp_s: bool, split_s: bool,
                    workspace: torch.Tensor | None = None):
    """Both passes on contiguous [N, H, D] views. ``workspace``: optional fp32 buffer of at least
    `workspace_numel` elements (else allocated per call)."""
    _, N, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    B = forest.num_requests
    need = workspace_numel(B, HV, BT)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=q.device)
    elif (workspace.dtype != torch.float32 or workspace.device != q.device or not workspace.is_contiguous()
          or workspace.numel() < need):
        raise ValueError(f"workspace must be a contiguous float32 tensor of >= {need} elements on {q.device}")
    flat = workspace.reshape(-1)
    ws_w = flat[: B * HV * BT * BT]
    ws_m = flat[B * HV * BT * BT: 2 * B * HV * BT * BT]
    ws_c = flat[2 * B * HV * BT * BT: need]
    qc, kc = q[0].contiguous(), k[0].contiguous()
    cu = forest.cu_seqlens
    has_h0 = initial_state is not None
    bk1, w1, st1 = factor_launch_params(K, BT)
    # ieee (FMA) products of [128, 128] fp32 tiles stage their operands in 256 KB of shared memory (Triton
    # 3.6, sm_90a), more than an H200 block may have: pass 1 then uses tf32x3 (about fp32 accuracy).
    p1_precision = input_precision
    if BT >= 128 and input_precision == "ieee" and q.is_cuda:
        p1_precision = "tf32x3"
    gdn_tree_factor_kernel[(B, HV)](
        qc, kc, g[0].contiguous(), beta[0].contiguous(), cu, forest.anc_bits.contiguous(),
        ws_w, ws_m, ws_c, logp, float(scale),
        HK=HK, HV=HV, K=K, N_WORDS=forest.anc_bits.shape[1], BT=BT, BK=bk1,
        USE_L2NORM=bool(use_qk_l2norm), LOWP_QK=lowp_qk, PRECISION=p1_precision, N_SQUARINGS=n_squarings,
        num_warps=w1, num_stages=st1,
    )
    gdn_tree_apply_kernel[(B, HV, triton.cdiv(V, block_v))](
        qc, kc, v[0].contiguous(),
        initial_state if has_h0 else qc, state_indices if state_indices is not None else cu, cu,
        ws_w, ws_m, ws_c, o[0], u,
        HK=HK, HV=HV, K=K, V=V, BT=BT, BK=block_k, BV=block_v,
        HAS_H0=has_h0, HAS_INDICES=state_indices is not None, LOWP_S=lowp_s, SPLIT_S=split_s,
        PRECISION=input_precision,
        num_warps=num_warps, num_stages=num_stages,
    )
    return o, u, logp
