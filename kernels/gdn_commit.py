"""Factorized commit of the accepted path (Bole Algorithm 2, DESIGN.md §2 eq. 10) in Triton.

For every GDN layer l and request b with accepted path a_1 … a_n (root first, a = a_n):

    S_new = P_a S_pre + Σ_j (P_a / P_j) k_j u_jᵀ,   P_a / P_j = exp(logP_a − logP_j)

stored transposed in the pool ([V, K], K contiguous): S_newᵀ = P_a S_preᵀ + (U ⊙ w)ᵀ K_path.
One launch covers all layers and requests: grid (L·B, HV, V / BV); each program owns the
[BV, K] tile of one (layer, slot, head), reads it once and writes it once, in place. Keys are the
raw keys of the verified nodes, L2-normalised here exactly as the verifier does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_STATE_DTYPES = (torch.float32, torch.bfloat16)
_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)
_PRECISIONS = ("ieee", "tf32", "tf32x3")


@triton.jit
def gdn_commit_kernel(
    state, k, u, logp, accepted, state_indices,   # [L, slots, HV, V, K], [L, N, HK, K], [L, N, HV, V],
    out, out_indices,                             # [L, N, HV], [B, D], [B]; the output pool and its slots
    B, N, SLOTS, OUT_SLOTS,                       # (state and state_indices when in place)
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, D: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2NORM: tl.constexpr, PRECISION: tl.constexpr,
):
    i_lb, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_l = (i_lb // B).to(tl.int64)
    i_b = i_lb % B
    i_hk = i_h // (HV // HK)

    o_d = tl.arange(0, BD)
    b_nodes = tl.load(accepted + i_b.to(tl.int64) * D + o_d, mask=o_d < D, other=-1).to(tl.int64)
    m_j = b_nodes >= 0
    n = tl.sum(m_j.to(tl.int32), axis=0)
    if n > 0:
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        row = i_l * N + b_nodes  # [BD] row of each path node in the [L, N, ...] factor buffers

        # w_j = P_a / P_j, masked before exp; a is the path's last node
        b_lp = tl.load(logp + row * HV + i_h, mask=m_j, other=0).to(tl.float32)
        lp_a = tl.sum(tl.where(o_d == n - 1, b_lp, 0.0), axis=0)
        b_w = tl.exp(tl.where(m_j, lp_a - b_lp, float("-inf")))

        b_k = tl.load(k + (row[:, None] * HK + i_hk) * K + o_k[None, :],
                      mask=m_j[:, None] & m_k[None, :], other=0).to(tl.float32)  # [BD, BK]
        if USE_L2NORM:
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
        b_u = tl.load(u + (row[:, None] * HV + i_h) * V + o_v[None, :],
                      mask=m_j[:, None] & m_v[None, :], other=0).to(tl.float32)  # [BD, BV]
        b_uw = b_u * b_w[:, None]

        i_slot = tl.load(state_indices + i_b).to(tl.int64)
        p_s = state + ((i_l * SLOTS + i_slot) * HV + i_h) * V * K + o_v[:, None] * K + o_k[None, :]
        m_s = m_v[:, None] & m_k[None, :]
        b_s = tl.load(p_s, mask=m_s, other=0).to(tl.float32)  # S_preᵀ tile [BV, BK]
        b_s = tl.dot(tl.trans(b_uw), b_k, acc=b_s * tl.exp(lp_a), input_precision=PRECISION)
        i_out = tl.load(out_indices + i_b).to(tl.int64)
        p_o = out + ((i_l * OUT_SLOTS + i_out) * HV + i_h) * V * K + o_v[:, None] * K + o_k[None, :]
        tl.store(p_o, b_s.to(out.dtype.element_ty), mask=m_s)


def launch_gdn_commit(state_pool, k, u, logp, accepted_nodes, state_indices, use_qk_l2norm,
                      block_v: int, num_warps: int, input_precision: str, out_pool=None, out_indices=None):
    """Launcher: grid (L·B, HV, V / BV), whole K rows per program (K ≤ 256)."""
    L, slots, HV, V, K = state_pool.shape
    N, HK = k.shape[1], k.shape[2]
    B, D = accepted_nodes.shape
    BD = max(16, triton.next_power_of_2(D))  # tl.dot needs an inner dim >= 16; padding is masked
    BK = max(16, triton.next_power_of_2(K))
    grid = (L * B, HV, triton.cdiv(V, block_v))
    out_pool = state_pool if out_pool is None else out_pool
    out_indices = state_indices if out_indices is None else out_indices
    gdn_commit_kernel[grid](
        state_pool, k.contiguous(), u.contiguous(), logp.contiguous(),
        accepted_nodes.to(torch.int32).contiguous(), state_indices.contiguous(),
        out_pool, out_indices.contiguous(),
        B, N, slots, out_pool.shape[1],
        HK=HK, HV=HV, K=K, V=V, D=D, BD=BD, BK=BK, BV=block_v,
        USE_L2NORM=bool(use_qk_l2norm), PRECISION=input_precision, num_warps=num_warps,
    )
    return out_pool


def gdn_commit(state_pool, k, u, logp, accepted_nodes, state_indices, use_qk_l2norm=False, out_pool=None,
               out_indices=None, *, block_v: int | None = None, num_warps: int = 4, input_precision: str = "ieee"):
    """Commit each request's accepted path into the GDN state pool, all layers in one launch (eq. 10).

    Twin: `bole.ops.gdn.gdn_commit_ref`. Slots of requests with a non-empty path must be distinct.

    Args:
        state_pool: [L, slots, HV, V, K] fp32 or bf16, contiguous; updated in place.
        k: [L, N, HK, K] raw keys of the verified nodes (fp32/fp16/bf16), L2-normalised here if
            use_qk_l2norm (the verifier's normalisation).
        u: [L, N, HV, V] fp32 and logp: [L, N, HV] fp32: the verifier's factors.
        accepted_nodes: int32/int64 [B, D] global node indices of each accepted path, root first,
            padded with -1; an all -1 row leaves that request's state untouched.
        state_indices: int32/int64 [B] pool slot of each request.
        block_v: value tile (power of two >= 16; default 32 for K <= 128, else 16, so a [BV, K] fp32
            tile stays at <= 32 registers/thread with 4 warps).
        input_precision: precision of the fp32 tl.dot, "ieee" (exact, default), "tf32" or "tf32x3".
        out_pool, out_indices: optional pool of state_pool's layout and dtype and int [B] slots that
            receive the committed states instead (state_pool is then read only: a prefix-cache
            checkpoint of a path prefix); both or neither. Requests with an empty path write nothing.
    Returns:
        state_pool (or out_pool).
    """
    if not isinstance(state_pool, torch.Tensor) or state_pool.dim() != 5:
        raise ValueError(f"state_pool must be [L, slots, HV, V, K], got {getattr(state_pool, 'shape', None)}")
    if state_pool.dtype not in _STATE_DTYPES:
        raise ValueError(f"state_pool must be float32 or bfloat16, got {state_pool.dtype}")
    if not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous (it is updated in place)")
    L, slots, HV, V, K = state_pool.shape
    if K > 256 or V > 256:
        raise ValueError(f"head dims K={K}, V={V} exceed 256")
    if k.dim() != 4 or k.shape[0] != L or k.shape[3] != K:
        raise ValueError(f"k must be [{L}, N, HK, {K}], got {tuple(k.shape)}")
    if k.dtype not in _FLOAT_INPUTS:
        raise ValueError(f"k must be float32/float16/bfloat16, got {k.dtype}")
    N, HK = k.shape[1], k.shape[2]
    if HV % HK != 0:
        raise ValueError(f"value heads HV={HV} must be a multiple of key heads HK={HK}")
    if tuple(u.shape) != (L, N, HV, V) or u.dtype != torch.float32:
        raise ValueError(f"u must be float32 [{L}, {N}, {HV}, {V}], got {u.dtype} {tuple(u.shape)}")
    if tuple(logp.shape) != (L, N, HV) or logp.dtype != torch.float32:
        raise ValueError(f"logp must be float32 [{L}, {N}, {HV}], got {logp.dtype} {tuple(logp.shape)}")
    if accepted_nodes.dim() != 2 or accepted_nodes.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"accepted_nodes must be int32/int64 [B, D], got {accepted_nodes.dtype} "
                         f"{tuple(accepted_nodes.shape)}")
    B = accepted_nodes.shape[0]
    if state_indices.dim() != 1 or state_indices.numel() != B:
        raise ValueError(f"{B} paths but state_indices has shape {tuple(state_indices.shape)}")
    if state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"state_indices must be int32/int64, got {state_indices.dtype}")
    for name, t in (("k", k), ("u", u), ("logp", logp), ("accepted_nodes", accepted_nodes),
                    ("state_indices", state_indices)):
        if t.device != state_pool.device:
            raise ValueError(f"{name} is on {t.device}, state_pool on {state_pool.device}")
    if input_precision not in _PRECISIONS:
        raise ValueError(f"input_precision must be one of {_PRECISIONS}, got {input_precision!r}")
    if block_v is None:
        block_v = 32 if K <= 128 else 16
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    if (out_pool is None) != (out_indices is None):
        raise ValueError("pass out_pool and out_indices together")
    if out_pool is not None:
        if out_pool.dim() != 5 or out_pool.shape[0] != L or tuple(out_pool.shape[2:]) != (HV, V, K) \
                or out_pool.dtype != state_pool.dtype or not out_pool.is_contiguous() \
                or out_pool.device != state_pool.device:
            raise ValueError(f"out_pool must be a contiguous {state_pool.dtype} [{L}, slots, {HV}, {V}, {K}] "
                             f"tensor on {state_pool.device}, got {out_pool.dtype} {tuple(out_pool.shape)}")
        if out_indices.dim() != 1 or out_indices.numel() != B or out_indices.dtype not in (torch.int32, torch.int64) \
                or out_indices.device != state_pool.device:
            raise ValueError(f"out_indices must be int32/int64 [{B}] on {state_pool.device}, got "
                             f"{out_indices.dtype} {tuple(out_indices.shape)}")
    if B == 0 or accepted_nodes.shape[1] == 0:
        return state_pool if out_pool is None else out_pool
    return launch_gdn_commit(state_pool, k, u, logp, accepted_nodes, state_indices, use_qk_l2norm,
                             block_v, num_warps, input_precision, out_pool, out_indices)
