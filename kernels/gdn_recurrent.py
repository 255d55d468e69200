"""Short GDN prefills in Triton: the recurrence (eq. 1) token by token, the state on chip.

Twin: `bole.ops.gdn.gdn_recurrent_ref`. A prefill of a few tokens (a short prompt, the tail of a chunked
one) went through the torch chunk (``bole.ops.gdn_chunk``): dozens of small launches per layer, ~2 ms
of host time per layer for the embedded model's 13-token prompt on the H200 (benchmarks/profile_step.py
--cases bole_tiny_generate, 2026-12-01), where the GPU work is a few microseconds. Here one launch per
layer: a program per (sequence, value head, value tile) loads its Sᵀ tile [BV, K] from the pool slot,
walks the sequence's tokens (g, beta already gated; q/k normalised in the kernel as the twin does)
and writes o per token and the final state once: read once, never snapshotted, the pool untouched.
With a checkpoint (``ckpt_*``: the prefix cache's boundary inside a prompt, ``bole.cache.prefix_cache``)
the program also stores its tile of the state after the sequence's first ``ckpt_ends[b]`` tokens into
checkpoint slot ``ckpt_slots[b]``: the state the prompt's chunk up to the boundary would have left, so
the prompt needs one forward rather than a chunk and then its tail (0: no checkpoint for the sequence).
The loop is serial in the tokens, so it is for short prefills: the backend sends eager ones of < 65
tokens here, longer ones to flash-linear-attention, except with fp32 activations, which all come here:
fla's chunk takes TF32 products for fp32 inputs (bole/backend.py). Captured prefills of up to 256
tokens come here too (``GDNBackend.prefill_sync_free``): fla plans on the host, so cannot be captured.
On the GPU the loop runs to the sequence's length; under the interpreter to a static bound (the next
power of two of all the launch's tokens; the tokens past a sequence's end change nothing: g = beta = 0 there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_checkpoint, check_gdn_inputs, interpreting


@triton.jit
def gdn_recurrent_kernel(
    q, k, v, g, beta,                # [N, HK, K], [N, HK, K], [N, HV, V], [N, HV], [N, HV]
    h0, state_indices, cu_seqlens,   # pool [slots, HV, V, K], [B], [B+1]
    o, final,                        # [N, HV, V] (v's dtype), [B, HV, V, K] fp32
    ck_state, ck_ends, ck_slots,     # checkpoint pool [slots, HV, V, K], [B] tokens to it (0: none), [B]
    scale,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, USE_L2NORM: tl.constexpr, HAS_H0: tl.constexpr, HAS_INDICES: tl.constexpr,
    DYNAMIC: tl.constexpr, HAS_CKPT: tl.constexpr,
):
    i_b, i_h, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // HK)
    bos = tl.load(cu_seqlens + i_b).to(tl.int64)
    eos = tl.load(cu_seqlens + i_b + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_s = m_v[:, None] & m_k[None, :]
    p_tile = (i_h * V + o_v[:, None]).to(tl.int64) * K + o_k[None, :]
    if HAS_H0:
        i_slot = i_b
        if HAS_INDICES:
            i_slot = tl.load(state_indices + i_b).to(tl.int64)
        b_s = tl.load(h0 + i_slot * HV * V * K + p_tile, mask=m_s, other=0).to(tl.float32)  # Sᵀ [BV, BK]
    else:
        b_s = tl.zeros([BV, BK], dtype=tl.float32)
    ck_end = 0
    p_ck = ck_state
    if HAS_CKPT:
        ck_end = tl.load(ck_ends + i_b).to(tl.int64)
        p_ck = ck_state + tl.load(ck_slots + i_b).to(tl.int64) * HV * V * K + p_tile
    # GPU: the sequence's own length; the interpreter's loops need a static bound (BT, the tokens past
    # the sequence's end idle)
    for i in range(0, (eos - bos) if DYNAMIC else BT):
        t = bos + i
        m_t = t < eos
        b_q = tl.load(q + (t * HK + i_hk) * K + o_k, mask=m_k & m_t, other=0).to(tl.float32)
        b_k = tl.load(k + (t * HK + i_hk) * K + o_k, mask=m_k & m_t, other=0).to(tl.float32)
        if USE_L2NORM:  # bole.ops.gdn.l2norm: x · rsqrt(Σx² + 1e-6)
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
        b_g = tl.load(g + t * HV + i_h, mask=m_t, other=0).to(tl.float32)        # past T: g = beta = 0,
        b_beta = tl.load(beta + t * HV + i_h, mask=m_t, other=0).to(tl.float32)  # the state unchanged
        b_v = tl.load(v + (t * HV + i_h) * V + o_v, mask=m_v & m_t, other=0).to(tl.float32)
        b_s = b_s * tl.exp(b_g)
        b_u = b_beta * (b_v - tl.sum(b_s * b_k[None, :], axis=1))
        b_s = b_s + b_u[:, None] * b_k[None, :]
        b_o = tl.sum(b_s * (b_q * scale)[None, :], axis=1)
        tl.store(o + (t * HV + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v & m_t)
        if HAS_CKPT:
            if i + 1 == ck_end:   # the state after the boundary's token (ck_end <= the sequence's length)
                tl.store(p_ck, b_s.to(ck_state.dtype.element_ty), mask=m_s)
    tl.store(final + i_b * HV * V * K + p_tile, b_s, mask=m_s)


def gdn_recurrent(q, k, v, g, beta, scale=None, initial_state=None, state_indices=None, cu_seqlens=None,
                  use_qk_l2norm=False, *, ckpt_state=None, ckpt_ends=None, ckpt_slots=None,
                  block_v: int | None = None, checked: bool = False):
    """Serial recurrence over variable-length sequences, one launch; twin `bole.ops.gdn.gdn_recurrent_ref`.

    Args:
        q, k: [1, N, HK, K]; v: [1, N, HV, V]; g, beta: [1, N, HV] (fp32, fp16 or bf16; gated already).
        initial_state: the pool [slots, HV, V, K] (fp32 or bf16), read only, or None (zeros).
        state_indices: int [B] slot per sequence (default: sequence b reads slot b).
        cu_seqlens: int [B+1] offsets (default: one sequence of N tokens).
        ckpt_state: optional checkpoint pool [slots, HV, V, K] (fp32 or bf16, contiguous), with
            ckpt_ends int [B] (checkpoint after this many of sequence b's tokens, 1 .. its length - 1
            by the caller's plan; 0: none) and ckpt_slots int [B] (its slot; read where the end is > 0).
        block_v: value tile per program (a power of two >= 16; default by grid size).
        checked: the caller checked cu_seqlens and state_indices once for the whole forward
            (`kernels._checks.check_forward_inputs`): only their sizes are compared.
    Returns:
        o [1, N, HV, V] in v's dtype, final_state [B, HV, V, K] fp32.
    """
    N, HK, HV, K, V = check_gdn_inputs(q, k, v, g, beta)
    dev = q.device
    if K > 256 or V > 256:
        raise ValueError(f"head dims K={K}, V={V} exceed 256")
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, N], dtype=torch.int32, device=dev)
    if cu_seqlens.numel() < 2 or (not checked and (cu_seqlens.dim() != 1 or cu_seqlens.device != dev)):
        raise ValueError(f"cu_seqlens must be a 1-d int tensor [B+1] on {dev}, got {tuple(cu_seqlens.shape)} "
                         f"on {cu_seqlens.device}")
    B = cu_seqlens.numel() - 1
    if initial_state is not None:
        if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != (HV, V, K):
            raise ValueError(f"initial_state must be [slots, {HV}, {V}, {K}], "
                             f"got {tuple(initial_state.shape)}")
        if not initial_state.is_contiguous() or initial_state.device != dev:
            raise ValueError("initial_state must be contiguous and on q's device")
        if state_indices is None and initial_state.shape[0] < B:
            raise ValueError(f"{B} sequences but only {initial_state.shape[0]} state slots")
    if state_indices is not None and ((not checked and state_indices.dim() != 1) or state_indices.numel() != B):
        raise ValueError(f"state_indices must be [{B}] (one slot per sequence), got {tuple(state_indices.shape)}")
    has_ckpt = ckpt_state is not None
    if has_ckpt:
        check_checkpoint(ckpt_state, ckpt_ends, ckpt_slots, (HV, V, K), B, dev)
    if block_v is None:
        block_v = 16 if B * HV * triton.cdiv(V, 32) < 256 else 32
    if not isinstance(block_v, int) or block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    block_v = min(block_v, max(16, triton.next_power_of_2(V)))
    scale = K ** -0.5 if scale is None else float(scale)
    o = torch.empty(1, N, HV, V, dtype=v.dtype, device=dev)
    final = torch.empty(B, HV, V, K, dtype=torch.float32, device=dev)
    if B:
        gdn_recurrent_kernel[(B, HV, triton.cdiv(V, block_v))](
            q[0].contiguous(), k[0].contiguous(), v[0].contiguous(), g[0].contiguous(), beta[0].contiguous(),
            initial_state if initial_state is not None else final, state_indices if state_indices is not None
            else cu_seqlens, cu_seqlens, o[0], final,
            ckpt_state if has_ckpt else final, ckpt_ends if has_ckpt else cu_seqlens,
            ckpt_slots if has_ckpt else cu_seqlens, scale,
            HK=HK, HV=HV, K=K, V=V, DYNAMIC=not interpreting(),
            BT=16 if not interpreting() else max(16, triton.next_power_of_2(N)),
            BK=max(16, triton.next_power_of_2(K)), BV=block_v,
            USE_L2NORM=bool(use_qk_l2norm), HAS_H0=initial_state is not None,
            HAS_INDICES=state_indices is not None, HAS_CKPT=has_ckpt, num_warps=4,
        )
    return o, final
