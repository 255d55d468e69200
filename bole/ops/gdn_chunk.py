"""Chunked Gated DeltaNet over sequences in torch: the CPU prefill path (WY / UT form, chunk 64).

Same signature and conventions as ``bole.ops.gdn.gdn_recurrent_ref`` (flash-linear-attention layout,
state stored transposed as [V, K]), plus ``chunk_size``. Within a chunk of C tokens with cumulative
log decay c_t (from the chunk start) and the state S (K×V) entering the chunk:

    A = D_β [(K Kᵀ) ⊙ E ⊙ strict-lower],  E_ij = exp(c_i − c_j) for j ≤ i (masked before exp)
    U = (I + A)⁻¹ D_β (V − D_exp(c) K S)        (UT transform: one unit-triangular solve)
    O = D_exp(c) Q S + [(Q Kᵀ) ⊙ E ⊙ lower] U
    S ← exp(c_C) S + Σ_j exp(c_C − c_j) k_j u_jᵀ

which is eq. (2) / (10) of DESIGN.md §2 on a chain. When every sequence has one token (decode),
a batched single-step recurrence over all requests runs instead of the per-sequence loop.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from bole.ops.gdn import _prepare, checkpoint_ends

DEFAULT_CHUNK_SIZE = 64


def _chunk_sequence(q, k, v, g, beta, S, chunk_size):
    """One sequence. q, k [HV, T, K]; v [HV, T, V]; g, beta [HV, T]; S [HV, K, V] -> (o [HV, T, V], S)."""
    HV, T, _ = q.shape
    o = torch.empty(HV, T, v.shape[-1], dtype=q.dtype, device=q.device)
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        C = e - s
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e]
        c = g[:, s:e].cumsum(-1)  # [HV, C]
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        diff = c[:, :, None] - c[:, None, :]
        E = torch.where(lower, diff, torch.full_like(diff, -torch.inf)).exp()  # [HV, C, C]
        strict = lower & ~torch.eye(C, dtype=torch.bool, device=q.device)
        A = bc[:, :, None] * (kc @ kc.transpose(1, 2)) * E * strict
        decay = c.exp()[:, :, None]  # [HV, C, 1]
        R = bc[:, :, None] * (vc - decay * (kc @ S))
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        U = torch.linalg.solve_triangular(A + eye, R, upper=False, unitriangular=True)
        o[:, s:e] = decay * (qc @ S) + ((qc @ kc.transpose(1, 2)) * E) @ U
        last = c[:, -1:]  # [HV, 1]
        S = last.exp()[:, :, None] * S + (kc * (last - c).exp()[:, :, None]).transpose(1, 2) @ U
    return o, S


def _single_step(qf, kf, vf, gf, bf, S):
    """All sequences of length 1. qf, kf [B, HV, K]; vf [B, HV, V]; S [B, HV, V, K] (transposed)."""
    S = S * gf.exp()[:, :, None, None]
    u = bf[:, :, None] * (vf - torch.einsum("bhvk,bhk->bhv", S, kf))
    S = S + u[:, :, :, None] * kf[:, :, None, :]
    o = torch.einsum("bhvk,bhk->bhv", S, qf)
    return o, S


def _initial_states(initial_state, state_indices, B: int, vf, kf, dt) -> torch.Tensor:
    """[B, HV, V, K] starting states in the compute dtype: pool slots ``state_indices`` (default 0..B-1)
    of ``initial_state``, or zeros."""
    HV, V, K = vf.shape[1], vf.shape[2], kf.shape[2]
    if initial_state is None:
        return torch.zeros(B, HV, V, K, dtype=dt, device=kf.device)
    idx = torch.arange(B, device=kf.device) if state_indices is None else \
        torch.as_tensor(state_indices, device=initial_state.device).long()
    return initial_state[idx].to(dt)


def gdn_decode(q, k, v, g, beta, scale=None, initial_state=None, state_indices=None, cu_seqlens=None,
               use_qk_l2norm=False):
    """One token per sequence (N sequences of length 1): the single-step recurrence ``gdn_chunk`` runs
    for a decode batch, without reading ``cu_seqlens`` (ignored) or any device value on the host, so a
    CUDA graph can capture it. Same signature and results as ``gdn_chunk`` on such a batch.
    """
    qf, kf, vf, gf, bf, dt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    init = _initial_states(initial_state, state_indices, kf.shape[0], vf, kf, dt)
    o, final = _single_step(qf, kf, vf, gf, bf, init)
    return o.to(v.dtype)[None], final


def gdn_chunk(q, k, v, g, beta, scale=None, initial_state=None, state_indices=None,
              cu_seqlens=None, use_qk_l2norm=False, chunk_size=DEFAULT_CHUNK_SIZE, *, ckpt_state=None,
              ckpt_ends=None, ckpt_slots=None):
    """Chunked gated delta rule over variable-length sequences (equal to ``gdn_recurrent``).

    Args:
        q, k: [1, N, HK, K]; v: [1, N, HV, V]; g, beta: [1, N, HV] (g = log decay <= 0).
        initial_state: [slots, HV, V, K] or None (zeros). Read only.
        state_indices: [B] slot of each sequence (default: sequence b uses slot b).
        cu_seqlens: int [B+1] offsets (default: one sequence of N tokens).
        ckpt_state, ckpt_ends, ckpt_slots: optional checkpoint pool [slots, HV, V, K]; the state after
            the first ckpt_ends[b] tokens of sequence b (0: none) goes to its slot ckpt_slots[b]: the
            sequence is chunked in two parts, split there, as two forwards would.
    Returns:
        o [1, N, HV, V] (v's dtype), final_state [B, HV, V, K] (compute dtype).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    qf, kf, vf, gf, bf, dt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    N, HV, K = kf.shape
    V = vf.shape[-1]
    cu = [0, N] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    B = len(cu) - 1
    if cu[0] != 0 or cu[-1] != N or any(b < a for a, b in pairwise(cu)):
        raise ValueError(f"cu_seqlens {cu} does not partition {N} tokens")
    init = _initial_states(initial_state, state_indices, B, vf, kf, dt)
    ckpt = checkpoint_ends(ckpt_ends, ckpt_slots, B) if ckpt_state is not None else {}
    if B == N and not ckpt and all(b - a == 1 for a, b in pairwise(cu)):
        o, final = _single_step(qf, kf, vf, gf, bf, init)
        return o.to(v.dtype)[None], final
    o = torch.empty(N, HV, V, dtype=dt, device=q.device)
    finals = []
    for b in range(B):
        s, e = cu[b], cu[b + 1]
        S = init[b].transpose(1, 2)  # [HV, K, V]
        cut = s + ckpt[b][0] if b in ckpt else s
        for lo, hi in ((s, cut), (cut, e)):
            if hi > lo:
                ob, S = _chunk_sequence(qf[lo:hi].transpose(0, 1), kf[lo:hi].transpose(0, 1),
                                        vf[lo:hi].transpose(0, 1), gf[lo:hi].T, bf[lo:hi].T, S, chunk_size)
                o[lo:hi] = ob.transpose(0, 1)
            if hi == cut and b in ckpt:
                ckpt_state[ckpt[b][1]] = S.transpose(1, 2).to(ckpt_state.dtype)
        finals.append(S.transpose(1, 2))
    return o.to(v.dtype)[None], torch.stack(finals).contiguous()
