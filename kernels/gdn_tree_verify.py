"""Parallel closed-form GDN tree verification (Bole Algorithm 1, DESIGN.md §2 eq. 2) in Triton.

One program per (request b, value head h, value tile of BV columns). Everything that depends only on
the tree, Q/K and the gates is built on chip from the packed forest:

    M⁺[i, j] = bit j of anc_bits[i]               (j is an ancestor of i, or i itself)
    logP     = M⁺ g                               (path log decay)
    E[i, j]  = exp(logP_i − logP_j) on M⁺, else 0 (masked BEFORE exp: the ratio P_i / P_j, never divided)
    G = D_β [(K Kᵀ) ⊙ E ⊙ M⁻],   C = (Q Kᵀ) ⊙ E
    R = D_β (V − D_P K S_pre),   U = Σ_{m<d} (−G)^m R,   O = D_P Q S_pre + C U

``method="neumann"`` evaluates U by Horner's rule (U ← R − G U, d−1 times; d = the request's depth).
``method="inverse"`` forms W = (I+G)⁻¹ = Π_k (I + (−G)^{2^k}) in ⌈log₂ d⌉ squarings and C W once per
program, then U = W R and O = D_P Q S_pre + (C W) R: fewer T×T×BV products when BV is large.
``method="two_pass"`` (kernels/gdn_tree_verify_2pass.py) forms W and C W once per (request, head) in a
first kernel and applies them per value tile in a second: no T×T work is repeated per tile.
``method="grouped"`` (kernels/gdn_tree_verify_grouped.py) keeps that on chip instead: one program per
(request, group of value heads sharing a key head, chunk of value tiles) forms Q Kᵀ / K Kᵀ once for the
group and W, C W once per value head, then loops over its value tiles.

With ``block_v == V`` there is one program per (request, head), so G and C are formed once per head,
as the design asks; with BV < V they are recomputed per tile (Q Kᵀ and K Kᵀ on tensor cores for
half-precision q/k, plus T² elementwise work) in exchange for V/BV times more programs, which is what
fills the GPU at batch 1 and keeps the fp32 tiles in registers. `default_config` picks BV per batch.

q/k L2 normalisation and the q scale are applied after the K-loop as diagonal scalings
(diag(r_q) Q Kᵀ diag(r_k) etc.), so the raw q/k tiles enter tl.dot unchanged: with fp16/bf16 q/k
on a GPU their products are exact in the fp32 accumulator and Q Kᵀ / K Kᵀ run on tensor cores.
Every other product is fp32 with the caller's ``input_precision``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bole.ops.gdn import check_gdn_inputs
from bole.spec.tree import MAX_TREE_NODES, PackedForest
from kernels.gdn_tree_tiles import load_anc_bits, s_dots, tree_relation
from kernels.gdn_tree_verify_2pass import launch_two_pass, workspace_numel
from kernels.gdn_tree_verify_grouped import launch_grouped

MAX_NODES = MAX_TREE_NODES
L2NORM_EPS = 1e-6
_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_PRECISIONS = ("ieee", "tf32", "tf32x3")
_METHODS = ("neumann", "inverse", "two_pass", "grouped")


@triton.jit
def _relation_and_decay(b_w0, b_w1, b_g, o_t, BT: tl.constexpr):
    """(M⁺, M⁻, logP = M⁺ g) from the ancestor bitmask words (`load_anc_bits`)."""
    m_plus, m_minus = tree_relation(b_w0, b_w1, o_t, BT)
    return m_plus, m_minus, tl.sum(tl.where(m_plus, b_g[None, :], 0.0), axis=1)


@triton.jit
def gdn_tree_verify_kernel(
    q, k, v, g, beta,               # [N, HK, K], [N, HK, K], [N, HV, V], [N, HV], [N, HV]
    h0, state_indices,              # pool [slots, HV, V, K], [B]
    cu_seqlens, anc_bits,           # [B+1], [N, N_WORDS] int64 ancestor-or-self bitmasks
    o, u, logp,                     # [N, HV, V] (v's dtype), [N, HV, V] fp32, [N, HV] fp32
    scale,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, N_WORDS: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2NORM: tl.constexpr, HAS_H0: tl.constexpr, HAS_INDICES: tl.constexpr,
    INVERSE: tl.constexpr, LOWP_QK: tl.constexpr, LOWP_S: tl.constexpr, SPLIT_S: tl.constexpr,
    PRECISION: tl.constexpr,
    N_ROUNDS: tl.constexpr,         # Neumann terms (Horner steps + 1)
    N_SQUARINGS: tl.constexpr,      # inverse method: squarings until 2^(s+1) >= N_ROUNDS
    EARLY: tl.constexpr,            # issue the tree/gate/v loads before the K-loop, use them after it
    LOWP_TT: tl.constexpr,          # inverse: fp16 operands for the bounded T×T products (see below)
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

    # ---- tree relation M⁺ (bit j of i's ancestor mask: one [BT] load per word, no gather), gates,
    # path log decays logP = M⁺ g. Every load here depends only on bos; with EARLY they are all in
    # flight during the K-loop (the masks, logP and v are used after it), which at small batch takes
    # dependent DRAM round trips off the critical path at the cost of registers held through the loop.
    b_w0, b_w1 = load_anc_bits(anc_bits, bos, o_t, m_t, N_WORDS, BT)
    b_g = tl.load(g + (bos + o_t) * HV + i_h, mask=m_t, other=0).to(tl.float32)
    b_beta = tl.load(beta + (bos + o_t) * HV + i_h, mask=m_t, other=0).to(tl.float32)
    p_v = ((bos + o_t[:, None]) * HV + i_h) * V + o_v[None, :]
    if EARLY:
        b_v = tl.load(v + p_v, mask=m_tv, other=0)
    else:
        m_plus, m_minus, b_lp = _relation_and_decay(b_w0, b_w1, b_g, o_t, BT)

    # ---- one pass over K: Q Kᵀ, K Kᵀ [BT, BT]; Q S_pre, K S_pre [BT, BV]; sums of squares [BT]
    b_qk = tl.zeros([BT, BT], dtype=tl.float32)
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    b_qs = tl.zeros([BT, BV], dtype=tl.float32)
    b_ks = tl.zeros([BT, BV], dtype=tl.float32)
    b_q2 = tl.zeros([BT], dtype=tl.float32)
    b_k2 = tl.zeros([BT], dtype=tl.float32)
    if HAS_INDICES:
        i_slot = tl.load(state_indices + i_b).to(tl.int64)
    else:
        i_slot = i_b.to(tl.int64)
    p_h0 = h0 + (i_slot * HV + i_h) * V * K
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
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
        if HAS_H0:
            # S_preᵀ tile [BV, BK] (the pool holds Sᵀ, K contiguous): read once per program
            b_s = tl.load(p_h0 + o_v[:, None] * K + o_k[None, :], mask=m_v[:, None] & m_k[None, :], other=0)
            b_qs, b_ks = s_dots(b_q, b_k, b_s, b_qs, b_ks, LOWP_S, SPLIT_S, PRECISION)

    # normalisation and scale as diagonal scalings: r_q = scale / ||q||, r_k = 1 / ||k||
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

    if EARLY:
        m_plus, m_minus, b_lp = _relation_and_decay(b_w0, b_w1, b_g, o_t, BT)
    else:
        b_v = tl.load(v + p_v, mask=m_tv, other=0)

    # ---- E = P_i / P_j on M⁺ (masked before exp), G, C, R
    b_e = tl.exp(tl.where(m_plus, b_lp[:, None] - b_lp[None, :], float("-inf")))
    b_G = tl.where(m_minus, b_beta[:, None] * b_kk * b_e, 0.0)
    b_C = b_qk * b_e
    b_p = tl.exp(b_lp)
    b_r = b_beta[:, None] * (b_v.to(tl.float32) - b_p[:, None] * b_ks)

    if INVERSE:
        # W = Π_k (I + A^{2^k}), A = −G: after the loop W = Σ_{m<n} A^m with n ≥ d, exact as A^d = 0.
        # LOWP_TT (the launcher sets it for tf32 with q/k normalised and depth <= 16): |A_ij| <=
        # β |k̂_i·k̂_j| P_i/P_j <= 1 (unit k, β <= 1, decays <= 1), so (A^m)_ij sums at most C(d−1, m−1)
        # chains of such factors, |W_ij| < 2^(d−1) <= 2^15, and |C_ij| <= scale: fp16 holds A, W and C
        # with tf32's 10-bit mantissa (fp32 accumulation), and its tensor cores run at twice the tf32
        # rate. R (from v and the state) has no such bound and stays tf32.
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
            b_wh = b_w.to(tl.float16)
            b_m = tl.dot(b_C.to(tl.float16), b_wh)
        else:
            b_m = tl.dot(b_C, b_w, input_precision=PRECISION)
        b_u = tl.dot(b_w, b_r, input_precision=PRECISION)
        b_o = tl.dot(b_m, b_r, acc=b_p[:, None] * b_qs, input_precision=PRECISION)
    else:
        # Horner: U ← R − G U, N_ROUNDS − 1 times gives Σ_{m<N_ROUNDS} (−G)^m R. N_ROUNDS is the
        # forest's depth: a shallower tree's rows are already final after its own depth (G is
        # structurally nilpotent, so the extra steps recompute them from identical operands).
        # Compile-time trip counts: data-dependent `while` loops around tl.dot miscompiled on the
        # H200 with triton 3.6 for some BT=32 launch configurations (benchmarks/results/
        # kernel_check_t32.json: wrong U and NaN O that the interpreter never shows).
        b_u = b_r
        for _ in range(N_ROUNDS - 1):
            b_u = b_r - tl.dot(b_G, b_u, input_precision=PRECISION)
        b_o = tl.dot(b_C, b_u, acc=b_p[:, None] * b_qs, input_precision=PRECISION)

    tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_tv)
    tl.store(u + p_v, b_u, mask=m_tv)
    if i_v == 0:
        tl.store(logp + (bos + o_t) * HV + i_h, b_lp, mask=m_t)


@dataclass(frozen=True)
class VerifyConfig:
    """Launch configuration: K chunk, value tile, warps and pipeline stages of one program; for
    method="grouped" also the value heads (of one GQA group) and value tiles each program loops over."""

    block_k: int
    block_v: int
    num_warps: int = 4
    num_stages: int = 1
    heads_per_program: int = 1
    tiles_per_program: int = 1
    early_loads: bool = False  # one-pass methods: tree, gate and v loads issued before the K-loop


# Every configuration the benchmark may sweep (filtered per shape by `configs_for`).
CONFIGS = [VerifyConfig(bk, bv, w, s) for bk in (32, 64, 128) for bv in (16, 32, 64, 128)
           for w in (4, 8) for s in (1, 2, 3)]

# Defaults keyed by the tree tile BT: (block_k, widest block_v, num_warps); K and V clamp them.
# Chosen from ptxas -v on sm_90a (Qwen3.5-9B heads, bf16 q/k, fp32 pool, ieee), not from timings:
# at BT=64 every 4-warp program spills; with 8 warps BV=16 uses 197 registers and no spill, BV=32
# spills ~300 B, BV=64 ~600 B, BV=128 ~1.9 KB (the fp32 FMA dots hold whole K strips of their
# operands in registers). BK=32 spills least. BT=32 with BV=64 and 8 warps spills 16 B.
_DEFAULTS = {16: (64, 64, 4), 32: (64, 64, 8), 64: (32, 64, 8), 128: (32, 32, 8)}
# method="grouped": every (value heads, value tiles) per program on top of a smaller tile grid.
GROUPED_CONFIGS = [VerifyConfig(bk, bv, w, s, ng, nvt) for bk in (32, 64) for bv in (32, 64, 128)
                   for w in (4, 8) for s in (1, 2) for ng in (1, 2, 4) for nvt in (1, 2, 4)]
# method="two_pass", pass 2 (pass 1 is fixed by `factor_launch_params`): a program holds Q S_pre, K S_pre
# [BT, BV] fp32, a K chunk of q/k and S (plus S's 3 bf16 parts), then W', M' [BT, BT] fp32 and X, U, O.
# ptxas -v on sm_90a at BT=64, BK=64, 8 warps (bf16 q/k, fp32 pool): ieee (split S) spills 0 / 56 / 680 /
# 3400 B at BV = 16 / 32 / 64 / 128; tf32 0 / 0 / 0 / 176 B; tf32x3 0 / 0 / 60 / 460 B. 4 warps spill
# from BV=16 (ieee 36 B, BV=64 3.7 KB). BK=32 spills about the same.
_DEFAULTS_TWO_PASS = {16: (64, 64, 4), 32: (64, 64, 4), 64: (64, 64, 8), 128: (32, 32, 8)}
_SMEM_BUDGET = 160 * 1024  # bytes of pipelined K-chunk operands per program (H200: 228 KB/SM)


def _defaults(BT: int, method: str = "neumann") -> tuple[int, int, int]:
    return (_DEFAULTS_TWO_PASS if method == "two_pass" else _DEFAULTS)[BT]


def configs_for(K: int, V: int, BT: int, method: str | None = None) -> list[VerifyConfig]:
    """The configurations worth trying for one shape (`GROUPED_CONFIGS` for method="grouped", else
    `CONFIGS`): BV ≤ V, BK ≤ K (rounded up), a K loop long enough for the stages, q/k/S_pre chunks (fp32
    worst case) within shared memory, for "grouped" no value tile of a program wholly past V, and 8 warps
    at BT ≥ 128: a [128, 128] fp32 tile is 128 registers per thread in 4 warps, and the inverse holds
    several, a spill-bound compile that did not finish within a minute on the H200 (2026-12-01)."""
    vmax = triton.next_power_of_2(V)
    kmax = max(16, triton.next_power_of_2(K))
    smem = lambda c: c.num_stages * (2 * BT * c.block_k + c.block_v * c.block_k) * 4
    out: list[VerifyConfig] = []
    for c in (GROUPED_CONFIGS if method == "grouped" else CONFIGS):
        c = dataclasses.replace(c, block_k=min(c.block_k, kmax))
        if (c.block_v <= vmax and (c.num_stages == 1 or c.num_stages <= kmax // c.block_k)
                and smem(c) <= _SMEM_BUDGET and c.block_v * c.tiles_per_program <= vmax
                and (BT < 128 or c.num_warps >= 8) and c not in out):
            out.append(c)
    return out


def default_config(K: int, V: int, BT: int, num_heads_x_requests: int | None = None,
                   block_v: int | None = None, method: str = "neumann") -> VerifyConfig:
    """Pick a launch configuration (see `_DEFAULTS` / `_DEFAULTS_TWO_PASS` for the register reasoning).

    block_v: explicit value tile. By default the table's widest tile (64 at BT=64: G and C are then
    formed once per two value tiles at Qwen3.5 shapes), halved down to 16 while the grid would have
    fewer than ~2 programs per SM: at batch 1 Qwen3.5-9B has only 32 (request, head) pairs for 132
    SMs, so BV=16 gives 256 programs; at batch 16, BV=64 gives 1024.
    """
    if method == "grouped":
        return _default_grouped(K, V, BT, num_heads_x_requests, block_v)
    vmax = triton.next_power_of_2(V)
    kmax = max(16, triton.next_power_of_2(K))
    bk, bv_max, num_warps = _defaults(BT, method)
    if block_v is None:
        block_v = max(16, min(vmax, bv_max))
        if num_heads_x_requests is not None and torch.cuda.is_available():
            target = 2 * torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            while block_v > 16 and num_heads_x_requests * triton.cdiv(V, block_v) < target:
                block_v //= 2
    bk = min(bk, kmax)
    return VerifyConfig(block_k=bk, block_v=block_v, num_warps=num_warps, num_stages=2 if K > bk else 1)


def _default_grouped(K: int, V: int, BT: int, num_heads_x_requests: int | None,
                     block_v: int | None) -> VerifyConfig:
    """method="grouped": two value heads and every value tile per program while the grid still has
    about one program per SM, sharing less (first tiles, then heads) below that."""
    vmax = triton.next_power_of_2(V)
    kmax = max(16, triton.next_power_of_2(K))
    bv = min(vmax, 64 if block_v is None else block_v)
    ng, nvt = 2, triton.cdiv(vmax, bv)
    if num_heads_x_requests is not None and torch.cuda.is_available():
        target = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        programs = lambda: triton.cdiv(num_heads_x_requests, ng) * triton.cdiv(triton.cdiv(V, bv), nvt)
        while nvt > 1 and programs() < target:
            nvt //= 2
        while ng > 1 and programs() < target:
            ng //= 2
    bk = min(32, kmax)
    return VerifyConfig(bk, bv, 8 if BT >= 64 else 4, 2 if K > bk else 1, ng, nvt)


def group_heads(heads_per_program: int, HV: int, HK: int) -> int:
    """The value heads a grouped program takes: the largest divisor of the GQA group size HV / HK that
    is at most ``heads_per_program`` (a program's heads must share one key head)."""
    group = HV // HK
    return max(d for d in range(1, min(heads_per_program, group) + 1) if group % d == 0)


# The engine's dispatch for half-precision q/k (``gdn_tree_verify(..., tuned=True)``): the fastest
# validated configuration per tree tile BT and grid size (requests x value heads), measured on the H200
# at Qwen3.5-9B shapes (HV=32, K=V=128, bf16 q/k, fp32 pool). BT=64: benchmarks/verify_ablation.py
# (results/verify_ablation_h200.json, 2026-12-01: inverse with fp16 T×T products, 3 stages; loads
# issued before the K-loop up to 256 pairs); other BT: benchmarks/gdn_verify.py (results/
# gdn_verify_h200.json, bole_config). rel_err <= 7e-3 against SGLang's serial O, within bf16 input
# rounding. Rows: (max requests x heads, config, method, input_precision).
# tf32 products err by ~2^-11 relative, below the bf16 rounding of q/k/v themselves (2^-9); fp32
# activations take ``_TUNED_FP32`` below instead.
_TUNED_LOWP = {
    16: [(128, VerifyConfig(64, 32, 4, 2), "neumann", "tf32"), (256, VerifyConfig(64, 64, 4, 2), "neumann", "ieee"),
         (None, VerifyConfig(64, 64, 4, 2), "inverse", "ieee")],
    32: [(128, VerifyConfig(64, 16, 4, 2), "neumann", "tf32"), (None, VerifyConfig(64, 64, 8, 2), "inverse", "ieee")],
    64: [(32, VerifyConfig(32, 32, 4, 3, early_loads=True), "inverse", "tf32"),
         (256, VerifyConfig(32, 128, 8, 3, early_loads=True), "inverse", "tf32"),
         (None, VerifyConfig(32, 128, 8, 3), "inverse", "tf32")],
    128: [(None, VerifyConfig(32, 32, 8, 2), "neumann", "tf32")],
}


# The engine's dispatch for fp32 q/k (the embedded model's engine runs): "tf32x3" products (3xTF32: a
# TF32 product plus the two cross terms of the split low words, on tensor cores), which validated at
# rel_err <= 5e-7 against the float64 closed form, as fp32 "ieee" does (2e-7), and ran up to 4x faster
# than the previous fp32 default: the FMA dots of a latency-bound program were its time. Measured on the
# H200 at the embedded model's shapes (HK=4, HV=8, K=V=64, trees of depth 16; results/
# verify_fp32_h200.json, 2026-12-01, benchmarks/verify_fp32.py); other shapes take the same rows untested.
_TUNED_FP32 = {
    16: [(None, VerifyConfig(64, 32, 4, 1), "inverse", "tf32x3")],
    32: [(32, VerifyConfig(64, 16, 4, 1), "inverse", "tf32x3"), (64, VerifyConfig(64, 32, 4, 1), "inverse", "tf32x3"),
         (None, VerifyConfig(64, 64, 4, 1), "inverse", "tf32x3")],
    64: [(32, VerifyConfig(64, 16, 4, 1), "neumann", "tf32x3"),
         (None, VerifyConfig(64, 32, 4, 1), "neumann", "tf32x3")],
}  # BT = 128 was not measured: the fp32 default ("ieee", ``default_config``)


def tuned_launch(BT: int, num_heads_x_requests: int, K: int, V: int,
                 table: dict | None = None) -> tuple[VerifyConfig, str, str]:
    """(config, method, input_precision) from ``table`` (default ``_TUNED_LOWP``, for half-precision q/k;
    ``_TUNED_FP32`` for fp32); tiles clamped to K and V."""
    rows = (_TUNED_LOWP if table is None else table)[BT]
    _, cfg, method, precision = next(row for row in rows if row[0] is None or num_heads_x_requests <= row[0])
    vmax, kmax = max(16, triton.next_power_of_2(V)), max(16, triton.next_power_of_2(K))
    bk = min(cfg.block_k, kmax)
    return dataclasses.replace(cfg, block_k=bk, block_v=min(cfg.block_v, vmax),
                               num_stages=cfg.num_stages if K > bk else 1), method, precision


def squarings_for(n_rounds: int) -> int:
    """Squarings of the product-form inverse for a series of ``n_rounds`` terms: the least s with
    2^(s+1) >= n_rounds."""
    n_squarings, terms = 0, 2
    while terms < n_rounds:
        terms, n_squarings = terms * 2, n_squarings + 1
    return n_squarings


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_gdn_tree_verify(q, k, v, g, beta, forest: PackedForest, initial_state, state_indices, scale,
                           use_qk_l2norm, num_rounds, o, u, logp, config: VerifyConfig,
                           input_precision: str, method: str, workspace=None):
    """Launcher: contiguous [N, H, D] views, grid (B, HV, V / BV). Outputs are preallocated."""
    _, N, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    B = forest.num_requests
    BT = max(16, triton.next_power_of_2(forest.max_nodes))
    BV, BK = config.block_v, config.block_k
    lowp_qk = q.dtype == k.dtype and q.dtype in (torch.float16, torch.bfloat16) and not _interpreting()
    has_h0 = initial_state is not None
    lowp_s = lowp_qk and has_h0 and initial_state.dtype == q.dtype
    # bf16 q/k with an fp32 pool: split S into 3 bf16 terms unless plain tf32 was asked for (cheaper)
    split_s = (lowp_qk and has_h0 and not lowp_s and q.dtype == torch.bfloat16
               and initial_state.dtype == torch.float32 and input_precision != "tf32")
    # fp16 T×T products where tf32 was asked for and the kernel's bound on them holds (see the kernel)
    lowp_tt = input_precision == "tf32" and bool(use_qk_l2norm) and int(forest.max_depth) <= 16
    grid = (B, HV, triton.cdiv(V, BV))
    # Exact series length: the deepest tree of the forest (or the caller's num_rounds).
    n_rounds = int(forest.max_depth) if num_rounds is None else int(num_rounds)
    n_squarings = squarings_for(n_rounds)
    if method == "grouped":
        return launch_grouped(q, k, v, g, beta, forest, initial_state, state_indices, scale, use_qk_l2norm,
                              o, u, logp, BT=BT, block_k=BK, block_v=BV,
                              heads_per_program=group_heads(config.heads_per_program, HV, HK),
                              tiles_per_program=config.tiles_per_program, num_warps=config.num_warps,
                              num_stages=config.num_stages, input_precision=input_precision,
                              n_squarings=n_squarings, lowp_qk=lowp_qk, lowp_s=lowp_s, split_s=split_s)
    if method == "two_pass":
        return launch_two_pass(q, k, v, g, beta, forest, initial_state, state_indices, scale, use_qk_l2norm,
                               o, u, logp, BT=BT, block_k=BK, block_v=BV, num_warps=config.num_warps,
                               num_stages=config.num_stages, input_precision=input_precision,
                               n_squarings=n_squarings, lowp_qk=lowp_qk, lowp_s=lowp_s, split_s=split_s,
                               workspace=workspace)
    gdn_tree_verify_kernel[grid](
        q[0].contiguous(), k[0].contiguous(), v[0].contiguous(), g[0].contiguous(), beta[0].contiguous(),
        initial_state if has_h0 else q, state_indices if state_indices is not None else forest.cu_seqlens,
        forest.cu_seqlens, forest.anc_bits.contiguous(),
        o[0], u, logp,
        float(scale),
        HK=HK, HV=HV, K=K, V=V, N_WORDS=forest.anc_bits.shape[1], BT=BT, BK=BK, BV=BV,
        USE_L2NORM=bool(use_qk_l2norm), HAS_H0=has_h0, HAS_INDICES=state_indices is not None,
        INVERSE=method == "inverse", LOWP_QK=lowp_qk, LOWP_S=lowp_s, SPLIT_S=split_s,
        PRECISION=input_precision, N_ROUNDS=n_rounds, N_SQUARINGS=n_squarings,
        EARLY=config.early_loads, LOWP_TT=method == "inverse" and lowp_tt,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return o, u, logp


def _check_out(name, t, shape, dtype, device):
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {tuple(shape)} on {device}, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}"
                         + ("" if t.is_contiguous() else " (not contiguous)"))
    return t


def gdn_tree_verify(q, k, v, g, beta, forest: PackedForest, initial_state, state_indices=None,
                    scale=None, use_qk_l2norm=False, num_rounds=None, u_out=None, logp_out=None,
                    o_out=None, *, block_v: int | None = None, config: VerifyConfig | None = None,
                    input_precision: str = "ieee", method: str = "neumann",
                    workspace: torch.Tensor | None = None, tuned: bool = False):
    """Closed-form parallel GDN tree verification (Theorem 1, eq. 2); twin: `bole.ops.gdn.gdn_tree_verify`.

    Args:
        q, k: [1, N, HK, K] (fp32, fp16 or bf16); v: [1, N, HV, V]; g (log decay), beta: [1, N, HV].
        forest: the packed draft trees (N nodes, at most 128 per tree), on q's device.
        initial_state: the state pool [slots, HV, V, K] (fp32 or bf16, K contiguous), read by slot,
            never written; None means zero states.
        state_indices: int [B] pool slot of each request (default: request b reads slot b).
        scale: q scale (default K ** -0.5). use_qk_l2norm: L2-normalise q and k in the kernel.
        num_rounds: Neumann terms (default: the forest's depth, exact for every tree). Neumann only.
        u_out, logp_out, o_out: optional preallocated outputs (e.g. slices of the all-layer factor
            buffer [L, N, HV, V] / [L, N, HV]); they must be contiguous with the shapes below.
        block_v: value tile BV (power of two); default: see `default_config`.
        config: a `VerifyConfig` (overrides the default; `block_v` still overrides its tile).
        input_precision: fp32 tl.dot precision, "ieee" (exact, default), "tf32" or "tf32x3" (GPU only).
        method: "neumann" (Horner on the finite series), "inverse" (product-form (I+G)⁻¹ per program),
            "two_pass" (W' = (I+G)⁻¹ D_β and M' = C W' once per (request, head), then applied per
            value tile; `config` is the second pass's) or "grouped" (Q Kᵀ, K Kᵀ once per GQA group and
            W, C W once per value head, on chip; `config.heads_per_program` / `tiles_per_program`).
        workspace: two_pass only, optional fp32 scratch of at least `two_pass_workspace_numel(B, HV, max_nodes)`
            elements; allocated per call if None.
        tuned: without an explicit config, take config, method and precision from a measured table
            (`tuned_launch`): `_TUNED_LOWP` for fp16/bf16 q and k (tf32 products for most shapes),
            `_TUNED_FP32` for fp32 (3xTF32 products, fp32-grade): the engine's setting.
    Returns:
        o [1, N, HV, V] in v's dtype, u [N, HV, V] fp32 and logp [N, HV] fp32 (the commit's factors).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor) or t.dtype not in _FLOAT_INPUTS:
            raise ValueError(f"{name} must be a float32/float16/bfloat16 tensor, got "
                             f"{getattr(t, 'dtype', type(t))}")
    N, HK, HV, K, V = check_gdn_inputs(q, k, v, g, beta)  # the twin's shape rules
    if K > 256 or V > 256:
        raise ValueError(f"head dims K={K}, V={V} exceed 256")
    if not isinstance(forest, PackedForest):
        raise ValueError(f"forest must be a PackedForest, got {type(forest)}")
    if forest.num_nodes != N:
        raise ValueError(f"forest has {forest.num_nodes} nodes but the inputs have {N} tokens")
    if forest.max_nodes > MAX_NODES:
        raise ValueError(f"a tree of {forest.max_nodes} nodes exceeds the kernel's limit of {MAX_NODES}")
    dev = q.device
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("forest", forest.parents)):
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, q on {dev}")
    B = forest.num_requests
    if initial_state is not None:
        if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != (HV, V, K):
            raise ValueError(f"initial_state must be [slots, {HV}, {V}, {K}], "
                             f"got {tuple(initial_state.shape)}")
        if initial_state.dtype not in _STATE_DTYPES:
            raise ValueError(f"initial_state must be float32 or bfloat16, got {initial_state.dtype}")
        if not initial_state.is_contiguous():
            raise ValueError("initial_state must be contiguous (K fastest)")
        if initial_state.device != dev:
            raise ValueError(f"initial_state is on {initial_state.device}, q on {dev}")
        if state_indices is None and initial_state.shape[0] < B:
            raise ValueError(f"{B} requests but only {initial_state.shape[0]} state slots")
    if state_indices is not None:
        if state_indices.dim() != 1 or state_indices.numel() != B:
            raise ValueError(f"state_indices must be [{B}] (one slot per request), "
                             f"got {tuple(state_indices.shape)}")
        if state_indices.dtype not in (torch.int32, torch.int64) or state_indices.device != dev:
            raise ValueError(f"state_indices must be int32/int64 on {dev}, got {state_indices.dtype} "
                             f"on {state_indices.device}")
    if input_precision not in _PRECISIONS:
        raise ValueError(f"input_precision must be one of {_PRECISIONS}, got {input_precision!r}")
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if method != "neumann" and num_rounds is not None:
        raise ValueError("num_rounds applies to method='neumann' only")
    if workspace is not None and method != "two_pass":
        raise ValueError("workspace applies to method='two_pass' only")
    if num_rounds is not None and int(num_rounds) < 1:
        raise ValueError(f"num_rounds must be >= 1, got {num_rounds}")

    BT = max(16, triton.next_power_of_2(forest.max_nodes))
    if tuned and config is None and block_v is None and num_rounds is None and workspace is None:
        table = _TUNED_LOWP if q.dtype in (torch.float16, torch.bfloat16) else _TUNED_FP32
        if BT in table:
            config, method, input_precision = tuned_launch(BT, B * HV, K, V, table)
    if config is None:
        config = default_config(K, V, BT, B * HV, block_v, method)
    elif block_v is not None:
        config = dataclasses.replace(config, block_v=block_v)
    if config.block_v < 16 or config.block_v & (config.block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {config.block_v}")
    if config.block_k < 16 or config.block_k & (config.block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {config.block_k}")
    if config.heads_per_program < 1 or config.tiles_per_program < 1:
        raise ValueError(f"heads_per_program and tiles_per_program must be >= 1, got "
                         f"{config.heads_per_program} and {config.tiles_per_program}")

    o = _check_out("o_out", o_out, (1, N, HV, V), v.dtype, dev)
    u = _check_out("u_out", u_out, (N, HV, V), torch.float32, dev)
    logp = _check_out("logp_out", logp_out, (N, HV), torch.float32, dev)
    scale = K ** -0.5 if scale is None else float(scale)
    return launch_gdn_tree_verify(q, k, v, g, beta, forest, initial_state, state_indices, scale,
                                  use_qk_l2norm, num_rounds, o, u, logp, config, input_precision, method,
                                  workspace)


def two_pass_workspace_numel(num_requests: int, HV: int, max_nodes: int) -> int:
    """fp32 elements `gdn_tree_verify(..., method="two_pass", workspace=...)` needs."""
    return workspace_numel(num_requests, HV, max(16, triton.next_power_of_2(max_nodes)))
