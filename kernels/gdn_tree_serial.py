"""The serial tree verifier with per-node state snapshots: the `serial_tree` baseline on the GPU.

What SGLang does today (DESIGN.md §7, the paper's "SGLang-Tree"): one program per (request, value
head, value tile) walks the request's T nodes in topological order; node i starts from its parent's
snapshot (the committed state for children of the root), applies the delta rule (eq. 1) and writes
its own full state tile back, so the commit can copy the accepted node's snapshot. It exists so the
engine's `serial_tree` mode is a fair, compiled baseline for `bole`; the twin is
`bole.ops.gdn.gdn_tree_serial_ref`.

The node loop has a compile-time bound (the forest's padded tree size) and skips nodes past the
request's own count: data-dependent loop bounds are avoided on purpose (see gdn_tree_verify.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_forest, check_gdn_inputs


@triton.jit
def gdn_tree_serial_kernel(
    q, k, v, g, beta,               # [N, HK, K], [N, HK, K], [N, HV, V], [N, HV], [N, HV]
    h0, state_indices,              # pool [slots, HV, V, K], [B]
    cu_seqlens, parents,            # [B+1], [N] local parent (-1 = committed root)
    o, snaps,                       # [N, HV, V] (v's dtype), [N, HV, V, K] fp32
    scale,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
):
    i_b, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // HK)
    bos = tl.load(cu_seqlens + i_b).to(tl.int64)
    T = tl.load(cu_seqlens + i_b + 1).to(tl.int64) - bos
    i_slot = tl.load(state_indices + i_b).to(tl.int64)

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_vk = m_v[:, None] & m_k[None, :]
    p_tile = o_v[:, None] * K + o_k[None, :]  # [BV, BK] offsets inside one [V, K] state
    p_root = h0 + (i_slot * HV + i_h) * V * K
    for i in range(0, BT):
        if i < T:
            n = bos + i
            par = tl.load(parents + n).to(tl.int64)
            # Sᵀ tile [BV, K] of the parent: the committed state or the parent's snapshot
            b_s = tl.load(p_root + p_tile, mask=m_vk & (par < 0), other=0).to(tl.float32)
            b_s += tl.load(snaps + ((bos + par) * HV + i_h) * V * K + p_tile, mask=m_vk & (par >= 0), other=0)
            b_q = tl.load(q + (n * HK + i_hk) * K + o_k, mask=m_k, other=0).to(tl.float32)
            b_k = tl.load(k + (n * HK + i_hk) * K + o_k, mask=m_k, other=0).to(tl.float32)
            if USE_L2NORM:
                b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
                b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
            b_q = b_q * scale
            b_v = tl.load(v + (n * HV + i_h) * V + o_v, mask=m_v, other=0).to(tl.float32)
            b_g = tl.load(g + n * HV + i_h).to(tl.float32)
            b_beta = tl.load(beta + n * HV + i_h).to(tl.float32)
            # eq. (1) on the transposed state: S ← γS;  u = β(v − S k);  S ← S + u kᵀ;  o = S q
            b_s = b_s * tl.exp(b_g)
            b_u = b_beta * (b_v - tl.sum(b_s * b_k[None, :], axis=1))
            b_s = b_s + b_u[:, None] * b_k[None, :]
            b_o = tl.sum(b_s * b_q[None, :], axis=1)
            tl.store(o + (n * HV + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
            tl.store(snaps + (n * HV + i_h) * V * K + p_tile, b_s, mask=m_vk)
            tl.debug_barrier()  # later nodes of this program read the snapshot back


def gdn_tree_serial(q, k, v, g, beta, forest, initial_state, state_indices=None, scale=None,
                    use_qk_l2norm=False, snapshots_out=None, o_out=None, *, block_v: int = 16):
    """Serial tree verification with per-node snapshots; twin: `bole.ops.gdn.gdn_tree_serial_ref`.

    Args:
        q, k: [1, N, HK, K]; v: [1, N, HV, V]; g, beta: [1, N, HV] (fp32, fp16 or bf16).
        forest: the packed trees (N nodes). initial_state: the pool [slots, HV, V, K] (fp32 or bf16),
            read only. state_indices: int [B] slot per request (default: request b reads slot b).
        snapshots_out: optional preallocated fp32 [N, HV, V, K]; o_out: optional [1, N, HV, V].
        block_v: value tile per program (SGLang uses 8; a power of two >= 8 here).
    Returns:
        o [1, N, HV, V] in v's dtype and snapshots [N, HV, V, K] fp32 (node i's state Sᵢᵀ).
    """
    N, HK, HV, K, V = check_gdn_inputs(q, k, v, g, beta)
    check_forest(forest)
    if forest.num_nodes != N:
        raise ValueError(f"forest has {forest.num_nodes} nodes but the inputs have {N} tokens")
    if initial_state is None or tuple(initial_state.shape[1:]) != (HV, V, K) or initial_state.dim() != 4:
        raise ValueError(f"initial_state must be a pool [slots, {HV}, {V}, {K}], got "
                         f"{None if initial_state is None else tuple(initial_state.shape)}")
    if initial_state.dtype not in (torch.float32, torch.bfloat16) or not initial_state.is_contiguous():
        raise ValueError(f"initial_state must be a contiguous float32/bfloat16 pool, got {initial_state.dtype}")
    if block_v < 8 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 8, got {block_v}")
    B, dev = forest.num_requests, q.device
    if state_indices is None:
        state_indices = torch.arange(B, device=dev)
    state_indices = torch.as_tensor(state_indices, device=dev)
    if state_indices.numel() != B:
        raise ValueError(f"state_indices has {state_indices.numel()} entries for {B} requests")
    snaps = snapshots_out if snapshots_out is not None else torch.empty(N, HV, V, K, dtype=torch.float32,
                                                                        device=dev)
    if tuple(snaps.shape) != (N, HV, V, K) or snaps.dtype != torch.float32 or not snaps.is_contiguous():
        raise ValueError(f"snapshots_out must be a contiguous float32 [{N}, {HV}, {V}, {K}] tensor")
    o = o_out if o_out is not None else torch.empty(1, N, HV, V, dtype=v.dtype, device=dev)
    BT = triton.next_power_of_2(max(forest.max_nodes, 1))
    grid = (B, HV, triton.cdiv(V, block_v))
    gdn_tree_serial_kernel[grid](
        q[0].contiguous(), k[0].contiguous(), v[0].contiguous(), g[0].contiguous(), beta[0].contiguous(),
        initial_state, state_indices, forest.cu_seqlens, forest.parents, o[0], snaps,
        float(K ** -0.5 if scale is None else scale),
        HK=HK, HV=HV, K=K, V=V, BT=BT, BK=triton.next_power_of_2(K), BV=block_v,
        USE_L2NORM=bool(use_qk_l2norm), num_warps=4,
    )
    return o, snaps
