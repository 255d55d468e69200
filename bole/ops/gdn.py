"""Naive torch twins of the Gated DeltaNet kernels: the executable specification.

Conventions (flash-linear-attention's, DESIGN.md §4):
    q, k:  [1, N, HK, K]      v: [1, N, HV, V]      g, beta: [1, N, HV]
    g is the log decay (g <= 0), beta the write gate. HV is a multiple of HK (GQA): value head h
    reads key head h // (HV // HK).
    The recurrent state is stored transposed, as the pools of SGLang and vLLM hold it:
    state[slot, h] is Sᵀ with shape [V, K] (K contiguous). In the maths S is K×V.

All twins compute in float64 when any input is float64, else in float32, and return O in v's dtype
(float64 stays float64). Per-node factors U and logP are returned in the compute dtype.

One GDN head, eq. (1):  S̃_t = γ_t S_{t-1};  u_t = β_t (v_t − S̃_tᵀ k_t);  S_t = S̃_t + k_t u_tᵀ;
                        o_t = S_tᵀ q_t   (q already scaled by d_k^-1/2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bole.spec.tree import PackedForest
from kernels._checks import check_gdn_inputs


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x²) + eps) over the last dim (fla's and transformers' definition)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gating(a, b, A_log, dt_bias) -> tuple[torch.Tensor, torch.Tensor]:
    """The GDN gates from the raw in_proj_a / in_proj_b outputs a, b [..., HV] and A_log, dt_bias [HV].

    g = -exp(A_log) softplus(a + dt_bias) in fp32 (the log decay); beta = sigmoid(b) in b's dtype
    (the layer's rounding, which the kernels reproduce).
    """
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """Flatten to [N, HV, *] in the compute dtype, with GQA expanded, q scaled, q/k normalised."""
    N, HK, HV, K, V = check_gdn_inputs(q, k, v, g, beta)
    dt = compute_dtype(q, k, v, g, beta)
    scale = K ** -0.5 if scale is None else scale
    qf, kf = q[0].to(dt), k[0].to(dt)
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    rep = HV // HK
    qf = qf.repeat_interleave(rep, dim=1) * scale  # [N, HV, K]
    kf = kf.repeat_interleave(rep, dim=1)  # [N, HV, K]
    return qf, kf, v[0].to(dt), g[0].to(dt), beta[0].to(dt), dt


def _initial(initial_state, state_indices, b, HV, V, K, dt, device):
    if initial_state is None:
        return torch.zeros(HV, V, K, dtype=dt, device=device)
    slot = b if state_indices is None else int(state_indices[b])
    return initial_state[slot].to(dt)


def checkpoint_ends(ckpt_ends, ckpt_slots, B: int) -> dict[int, tuple[int, int]]:
    """{sequence: (tokens to its checkpoint, checkpoint slot)} of a prefill's checkpoint arguments (the
    twins' host view; ends of 0 are no checkpoint)."""
    if ckpt_ends is None:
        return {}
    ends, slots = [int(x) for x in ckpt_ends], [int(x) for x in ckpt_slots]
    if len(ends) != B or len(slots) != B:
        raise ValueError(f"ckpt_ends / ckpt_slots must have {B} entries, got {len(ends)} / {len(slots)}")
    return {b: (e, sl) for b, (e, sl) in enumerate(zip(ends, slots)) if e > 0}


def gdn_recurrent_ref(q, k, v, g, beta, scale=None, initial_state=None, state_indices=None,
                  cu_seqlens=None, use_qk_l2norm=False, *, ckpt_state=None, ckpt_ends=None, ckpt_slots=None):
    """Serial recurrence (eq. 1) over variable-length sequences.

    Args:
        initial_state: [slots, HV, V, K] or None (zeros). Read only.
        state_indices: [B] slot of each sequence (default: sequence b uses slot b).
        cu_seqlens: int [B+1] offsets (default: one sequence of N tokens).
        ckpt_state, ckpt_ends, ckpt_slots: optional checkpoint pool [slots, HV, V, K]; the state after
            the first ckpt_ends[b] tokens of sequence b (0: none) is written to its slot ckpt_slots[b].
    Returns:
        o [1, N, HV, V] (v's dtype), final_state [B, HV, V, K] (compute dtype).
    """
    qf, kf, vf, gf, bf, dt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    N, HV, K = kf.shape
    V = vf.shape[-1]
    cu = [0, N] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    o = torch.empty(N, HV, V, dtype=dt, device=q.device)
    finals = []
    ckpt = checkpoint_ends(ckpt_ends, ckpt_slots, len(cu) - 1) if ckpt_state is not None else {}
    for b in range(len(cu) - 1):
        S = _initial(initial_state, state_indices, b, HV, V, K, dt, q.device)  # Sᵀ: [HV, V, K]
        for t in range(cu[b], cu[b + 1]):
            S = S * gf[t].exp()[:, None, None]
            u = bf[t][:, None] * (vf[t] - torch.einsum("hvk,hk->hv", S, kf[t]))
            S = S + u[:, :, None] * kf[t][:, None, :]
            o[t] = torch.einsum("hvk,hk->hv", S, qf[t])
            if b in ckpt and t + 1 - cu[b] == ckpt[b][0]:
                ckpt_state[ckpt[b][1]] = S.to(ckpt_state.dtype)
        finals.append(S)
    return o.to(v.dtype)[None], torch.stack(finals)


def gdn_tree_serial_ref(q, k, v, g, beta, forest: PackedForest, initial_state, state_indices=None,
                    scale=None, use_qk_l2norm=False):
    """Serial tree recurrence with a state snapshot per node (the SGLang-style baseline).

    Each node starts from its parent's snapshot (the committed state for children of the root).
    Returns o [1, N, HV, V] and snapshots [N, HV, V, K] (compute dtype): node i's state S_i.
    """
    qf, kf, vf, gf, bf, dt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    N, HV, K = kf.shape
    V = vf.shape[-1]
    _check_forest(forest, N)
    gpar = forest.global_parents().tolist()
    rid = forest.request_ids.tolist()
    o = torch.empty(N, HV, V, dtype=dt, device=q.device)
    snaps = torch.empty(N, HV, V, K, dtype=dt, device=q.device)
    for i in range(N):
        if gpar[i] < 0:
            S = _initial(initial_state, state_indices, rid[i], HV, V, K, dt, q.device)
        else:
            S = snaps[gpar[i]]
        S = S * gf[i].exp()[:, None, None]
        u = bf[i][:, None] * (vf[i] - torch.einsum("hvk,hk->hv", S, kf[i]))
        S = S + u[:, :, None] * kf[i][:, None, :]
        snaps[i] = S
        o[i] = torch.einsum("hvk,hk->hv", S, qf[i])
    return o.to(v.dtype)[None], snaps


def _check_forest(forest: PackedForest, N: int):
    if forest.num_nodes != N:
        raise ValueError(f"forest has {forest.num_nodes} nodes but the inputs have {N} tokens")


def path_log_decay(g_nodes: torch.Tensor, anc_mask: torch.Tensor) -> torch.Tensor:
    """logP_i = Σ_{r ∈ A(i) ∪ {i}} g_r.   g_nodes [T, HV], anc_mask [T, T] (M⁺) -> [T, HV]."""
    return anc_mask.to(g_nodes.dtype) @ g_nodes


def _into(out, t: torch.Tensor, name: str) -> torch.Tensor:
    """``t``, or ``t`` copied into the caller's buffer ``out`` (cast to its dtype; the shapes must agree)."""
    if out is None:
        return t
    if tuple(out.shape) != tuple(t.shape):
        raise ValueError(f"{name} must have shape {tuple(t.shape)}, got {tuple(out.shape)}")
    return out.copy_(t)


def gdn_tree_verify_ref(q, k, v, g, beta, forest: PackedForest, initial_state, state_indices=None,
                    scale=None, use_qk_l2norm=False, u_out=None, logp_out=None, o_out=None):
    """Closed-form parallel tree verification (Theorem 1, eq. 2).

    G = D_β D_P [(K Kᵀ) ⊙ M⁻] D_P⁻¹,  C = D_P [(Q Kᵀ) ⊙ M⁺] D_P⁻¹,  R = D_β (V − D_P K S_pre),
    U = (I + G)⁻¹ R,  O = D_P Q S_pre + C U.
    Ratios P_i / P_j are formed as exp(logP_i − logP_j) only where j is an ancestor of i.

    U is a unit lower-triangular solve (forward substitution in node order), not the power series
    Σ_{m<d} (−G)^m R it equals in exact arithmetic: with correlated keys the powers of G grow like
    binomial coefficients while (I+G)⁻¹ stays bounded by 1 entrywise (kernels/gdn_tree_verify.py
    derives the bound), and summing them cancels catastrophically, in float64 too on deep chains.
    Forward substitution is the serial recurrence's own arithmetic and as stable.

    Args:
        initial_state: the pool [slots, HV, V, K], read only.
        state_indices: [B] slot of each request.
        u_out, logp_out, o_out: optional buffers [N, HV, V], [N, HV], [1, N, HV, V] the results are
            copied into (the kernel writes them in place: e.g. slices of the all-layer factor buffer).
    Returns:
        o [1, N, HV, V] (v's dtype), u [N, HV, V] and logp [N, HV] (compute dtype): the factors
        the commit (eq. 10) needs besides k; the given out buffers instead, in their dtypes.
    """
    qf, kf, vf, gf, bf, dt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    N, HV, K = kf.shape
    V = vf.shape[-1]
    _check_forest(forest, N)
    cu = forest.cu_seqlens.tolist()
    o = torch.empty(N, HV, V, dtype=dt, device=q.device)
    u_all = torch.empty(N, HV, V, dtype=dt, device=q.device)
    logp_all = torch.empty(N, HV, dtype=dt, device=q.device)
    for b in range(forest.num_requests):
        s, e = cu[b], cu[b + 1]
        Mp = forest.ancestor_mask(b).to(q.device)  # M⁺ [T, T]
        Mm = Mp & ~torch.eye(e - s, dtype=torch.bool, device=q.device)
        S = _initial(initial_state, state_indices, b, HV, V, K, dt, q.device)  # [HV, V, K]
        Q, Kn, Vn = qf[s:e].transpose(0, 1), kf[s:e].transpose(0, 1), vf[s:e].transpose(0, 1)
        beta_b = bf[s:e].T  # [HV, T]
        logp = path_log_decay(gf[s:e], Mp).T  # [HV, T]
        diff = logp[:, :, None] - logp[:, None, :]  # logP_i − logP_j
        E = torch.where(Mp, diff, torch.full_like(diff, -torch.inf)).exp()  # masked before exp
        KK = Kn @ Kn.transpose(1, 2)  # [HV, T, T]
        G = beta_b[:, :, None] * KK * E * Mm
        C = (Q @ Kn.transpose(1, 2)) * E
        Pd = logp.exp()[:, :, None]
        R = beta_b[:, :, None] * (Vn - Pd * (Kn @ S.transpose(1, 2)))  # [HV, T, V]
        eye = torch.eye(e - s, dtype=dt, device=q.device)
        U = torch.linalg.solve_triangular(eye + G, R, upper=False, unitriangular=True)
        O = Pd * (Q @ S.transpose(1, 2)) + C @ U
        o[s:e] = O.transpose(0, 1)
        u_all[s:e] = U.transpose(0, 1)
        logp_all[s:e] = logp.T
    return (_into(o_out, o.to(v.dtype)[None], "o_out"), _into(u_out, u_all, "u_out"),
            _into(logp_out, logp_all, "logp_out"))


def gdn_commit_ref(state_pool, k, u, logp, accepted_nodes, state_indices, use_qk_l2norm=False, out_pool=None,
               out_indices=None):
    """Factorized commit (eq. 10) for every GDN layer and request, in place on the pool (or into
    ``out_pool``'s slots ``out_indices``, the pool read only: a prefix-cache checkpoint).

    S_new = P_a S_pre + Σ_{j ∈ path(a)} (P_a / P_j) k_j u_jᵀ   (stored transposed: u_j k_jᵀ).

    Args:
        state_pool: [L, slots, HV, V, K] (fp32 or bf16), updated in place.
        k: [L, N, HK, K] raw keys of the verified nodes (normalised here if use_qk_l2norm).
        u: [L, N, HV, V] and logp: [L, N, HV]: the verifier's factors.
        accepted_nodes: int [B, D] global node indices of each accepted path, root first,
            padded with -1; an all -1 row leaves that request's state untouched.
        state_indices: int [B] pool slot of each request.
        out_pool, out_indices: optional [L, slots', HV, V, K] pool and int [B] slots receiving the
            committed states (requests with an empty path leave theirs untouched); both or neither.
    """
    L, slots, HV, V, K = state_pool.shape
    if (out_pool is None) != (out_indices is None):
        raise ValueError("pass out_pool and out_indices together")
    out_pool = state_pool if out_pool is None else out_pool
    out_indices = state_indices if out_indices is None else out_indices
    if k.dim() != 4 or k.shape[0] != L or u.shape[:1] != (L,) or logp.shape[:1] != (L,):
        raise ValueError(f"factor shapes k{tuple(k.shape)} u{tuple(u.shape)} logp{tuple(logp.shape)} "
                         f"do not match {L} layers")
    if accepted_nodes.shape[0] != state_indices.shape[0]:
        raise ValueError(f"{accepted_nodes.shape[0]} paths for {state_indices.shape[0]} state slots")
    HK = k.shape[2]
    rep = HV // HK
    dt = torch.float64 if state_pool.dtype == torch.float64 else torch.float32
    for b in range(accepted_nodes.shape[0]):
        path = [int(x) for x in accepted_nodes[b] if int(x) >= 0]
        if not path:
            continue
        slot = int(state_indices[b])
        for layer in range(L):
            kl = k[layer, path].to(dt)
            if use_qk_l2norm:
                kl = l2norm(kl)
            kl = kl.repeat_interleave(rep, dim=1)  # [P, HV, K]
            lp = logp[layer, path].to(dt)  # [P, HV]
            w = (lp[-1][None] - lp).exp()  # P_a / P_j, [P, HV]
            S = state_pool[layer, slot].to(dt) * lp[-1].exp()[:, None, None]
            S = S + torch.einsum("ph,phv,phk->hvk", w, u[layer, path].to(dt), kl)
            out_pool[layer, int(out_indices[b])] = S.to(out_pool.dtype)
    return out_pool
