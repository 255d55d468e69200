"""Naive torch twins of the GDN depthwise causal conv1d: over sequences and over draft trees.

Layouts:
    x:          [N, C]  the mixed q/k/v projections of N tokens (or tree nodes), C = conv_dim
    weight:     [C, W]  depthwise kernel (W = 4 in Qwen3.5); weight[:, W-1] multiplies the current
                token, weight[:, W-1-j] the token j steps back (torch.nn.Conv1d with left padding W-1)
    conv_state: [slots, C, W-1]  the last W-1 inputs of the committed sequence, oldest first
                (a slice of the pool [num_gdn_layers, slots, C, W-1], DESIGN.md §4)

On a tree, node i's window is its own input, then its ancestors' inputs along the path, then the
committed conv state: never the previous rows of the packed batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bole.ops.gdn import checkpoint_ends, gdn_gating
from bole.spec.tree import PackedForest


def _act(y, activation):
    if activation in (None, "identity"):
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r}")


def causal_conv1d(x, weight, bias, conv_state, state_indices, cu_seqlens=None, activation="silu", *,
                  ckpt_conv=None, ckpt_ends=None, ckpt_slots=None):
    """Causal conv over variable-length sequences that continue from conv_state; updates it in place.

    Returns y [N, C] in x's dtype. conv_state[state_indices[b]] becomes the last W-1 inputs of
    sequence b (the old state shifted in when the sequence is shorter than W-1). With a checkpoint
    pool ``ckpt_conv`` [slots, C, W-1], slot ckpt_slots[b] gets the window after the first ckpt_ends[b]
    tokens of sequence b (0: none).
    """
    N, C = x.shape
    W = weight.shape[1]
    if weight.shape[0] != C or conv_state.shape[1:] != (C, W - 1):
        raise ValueError(f"shapes x{tuple(x.shape)} weight{tuple(weight.shape)} "
                         f"conv_state{tuple(conv_state.shape)} disagree")
    cu = [0, N] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    y = torch.empty_like(x)
    ckpt = checkpoint_ends(ckpt_ends, ckpt_slots, len(cu) - 1) if ckpt_conv is not None else {}
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        slot = int(state_indices[b])
        window = torch.cat([conv_state[slot].to(x.dtype), x[s:e].T], dim=1)  # [C, W-1+T]
        out = F.conv1d(window[None], weight[:, None, :].to(x.dtype), bias, groups=C)[0]  # [C, T]
        y[s:e] = _act(out, activation).T
        if b in ckpt:
            end, ck_slot = ckpt[b]
            ckpt_conv[ck_slot] = window[:, end:end + W - 1].to(ckpt_conv.dtype)   # inputs end-(W-1) .. end-1
        conv_state[slot] = window[:, -(W - 1):].to(conv_state.dtype)
    return y


def causal_conv1d_varlen_ref(x, weight, conv_state, state_indices, cu_seqlens, bias=None, activation="silu",
                             out=None, *, cu_host=None, slots_host=None, **ckpt):
    """The backend's prefill conv (kernels.causal_conv1d.causal_conv1d_varlen's signature) on the twin:
    ``causal_conv1d`` over the host copies of the offsets and slots when given (the twin loops over the
    sequences on the host; reading the device tensors there would synchronise on every layer)."""
    y = causal_conv1d(x, weight, bias, conv_state, slots_host if slots_host else state_indices,
                      cu_host if cu_host else cu_seqlens, activation, **ckpt)
    return y if out is None else out.copy_(y)


def causal_conv1d_decode(x, weight, bias, conv_state, state_indices, activation="silu"):
    """One new token per sequence (row b continues slot ``state_indices[b]``); updates conv_state in place.

    The batched decode form of ``causal_conv1d``: no per-sequence loop and no host read of a device
    value, so a CUDA graph can capture it. Accumulates in fp32 (as a conv kernel does). Rows that share
    a slot (padding rows of a captured batch) leave that slot with one of their windows.
    """
    N, C = x.shape
    W = weight.shape[1]
    if weight.shape[0] != C or conv_state.shape[1:] != (C, W - 1) or state_indices.shape != (N,):
        raise ValueError(f"shapes x{tuple(x.shape)} weight{tuple(weight.shape)} conv_state"
                         f"{tuple(conv_state.shape)} state_indices{tuple(state_indices.shape)} disagree")
    idx = state_indices.long()
    window = torch.cat([conv_state[idx].to(x.dtype), x[:, :, None]], dim=2)  # [N, C, W], oldest first
    y = (window.float() * weight.float()[None]).sum(-1)
    if bias is not None:
        y = y + bias.float()
    conv_state[idx] = window[:, :, 1:].to(conv_state.dtype)
    return _act(y, activation).to(x.dtype)


def _tree_windows(x, forest: PackedForest, conv_state, state_indices, W):
    """[N, C, W]: for each node the W inputs ending at it along its path (oldest first).

    Gathered in one pass from the ancestor chains: window column j of node i (depth d) holds the
    input of i's ancestor at depth p = d - (W-1) + j when p >= 1, else the committed conv state's
    column W-2+p (column W-2 is the last committed input).
    """
    N, C = x.shape
    if N == 0:
        return x.new_empty(0, C, W)
    rid = forest.request_ids.long()
    depth, anc = forest.depth.long(), forest.anc.long()
    p = depth[:, None] - (W - 1) + torch.arange(W, device=x.device)[None]            # [N, W]
    start = forest.cu_seqlens[:-1].long()[rid]
    node = anc.gather(1, (p - 1).clamp(min=0, max=anc.shape[1] - 1)) + start[:, None]
    from_x = x[node.clamp(min=0)].transpose(1, 2)                                       # [N, C, W]
    slots = torch.as_tensor(state_indices, device=conv_state.device).long()[rid.to(conv_state.device)]
    col = (W - 2 + p).clamp(min=0, max=W - 2).to(conv_state.device)
    from_state = conv_state[slots].gather(2, col[:, None, :].expand(N, C, W)).to(x.device, x.dtype)
    return torch.where((p >= 1)[:, None, :], from_x, from_state)


def causal_conv1d_tree_ref(x, weight, bias, conv_state, state_indices, forest: PackedForest,
                       activation="silu", out=None, x_copy=None):
    """Conv over a packed forest: each node sees its path, then the committed state. Read only.

    Sums in fp32 (float64 for float64 x), as the decode conv and the kernel do, and returns y [N, C] in
    x's dtype. ``out``: a [N, C] buffer, or a sequence of [N, C_s] buffers (C_s summing to C) receiving
    consecutive column ranges of y (the GDN layer's q | k | v, each contiguous); it is returned instead.
    ``x_copy``: a [N, C] buffer x is copied into (the commit's conv inputs, ``TreeFactors.conv_x``).
    """
    W = weight.shape[1]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    win = _tree_windows(x, forest, conv_state, state_indices, W)
    y = (win.to(dt) * weight.to(dt)[None]).sum(-1)
    if bias is not None:
        y = y + bias.to(dt)
    y = _act(y, activation).to(x.dtype)
    if x_copy is not None:
        x_copy.copy_(x)
    if out is None:
        return y
    parts = [out] if isinstance(out, torch.Tensor) else list(out)
    if any(p.dim() != 2 or p.shape[0] != y.shape[0] for p in parts) or sum(p.shape[1] for p in parts) != y.shape[1]:
        raise ValueError(f"out must be [{y.shape[0]}, C_s] buffers with C_s summing to {y.shape[1]}, got "
                         f"{[tuple(p.shape) for p in parts]}")
    for p, y_s in zip(parts, y.split([p.shape[1] for p in parts], dim=1), strict=True):
        p.copy_(y_s)
    return out


def gdn_tree_conv_ref(x, weight, conv_state, state_indices, forest: PackedForest, a, b, A_log, dt_bias,
                      bias=None, activation="silu", out=None, x_copy=None):
    """The GDN layer's verify prologue: ``causal_conv1d_tree_ref`` and the gating (``gdn_gating``).

    Twin of kernels/gdn_tree_conv.gdn_tree_conv (one launch). Returns (y or out, g [N, HV] fp32,
    beta [N, HV] in b's dtype).
    """
    y = causal_conv1d_tree_ref(x, weight, bias, conv_state, state_indices, forest, activation, out, x_copy)
    return (y, *gdn_gating(a, b, A_log, dt_bias))


def conv_state_commit(conv_state, x, forest: PackedForest, state_indices, accepted: torch.Tensor):
    """Keep the last W-1 inputs along each accepted path, in place.

    accepted: int [B, D] global node indices of each path (root first, -1 padded); an empty path
    leaves the state untouched. All requests at once: the new window is the tail of
    [old state | path inputs], gathered (one host sync: which requests have a path).
    """
    W1 = conv_state.shape[-1]
    acc = accepted.long().to(x.device)
    B, D = acc.shape
    if B == 0 or D == 0:
        return conv_state
    n = (acc >= 0).sum(1)                                              # path lengths
    k = n[:, None] + torch.arange(W1, device=acc.device)[None]         # [B, W1] index into the concat
    node = acc.gather(1, (k - W1).clamp(min=0, max=D - 1)).clamp(min=0)
    slots = torch.as_tensor(state_indices, device=conv_state.device).long()
    old = conv_state[slots]                                            # [B, C, W1]
    C = old.shape[1]
    from_old = old.gather(2, k.clamp(max=W1 - 1).to(old.device)[:, None, :].expand(B, C, W1))
    from_x = x[node].transpose(1, 2).to(old.device, conv_state.dtype)  # [B, C, W1]
    new = torch.where((k < W1).to(old.device)[:, None, :], from_old, from_x)
    keep = (n > 0).to(old.device)
    conv_state[slots[keep]] = new[keep]
    return conv_state


def conv_state_commit_layers(conv_state, x, state_indices, accepted: torch.Tensor, out_state=None,
                             out_indices=None):
    """``conv_state_commit`` for every layer at once, with no host sync (the engine's commit).

    conv_state [L, slots, C, W-1]; x [L, N, C] every layer's conv inputs of the forest's nodes;
    accepted int [B, D] global node indices of each path (root first, -1 padded). Requests with an
    empty path keep their window (rewritten with its own values: slots must be distinct, or repeat
    only with empty paths). ``out_state`` / ``out_indices``: write the windows there instead (the
    committed pool read only); an empty path then rewrites its out slot with that slot's own values.
    """
    if (out_state is None) != (out_indices is None):
        raise ValueError("pass out_state and out_indices together")
    W1 = conv_state.shape[-1]
    acc = accepted.long().to(x.device)
    B, D = acc.shape
    if B == 0 or D == 0:
        return conv_state if out_state is None else out_state
    n = (acc >= 0).sum(1)
    k = n[:, None] + torch.arange(W1, device=acc.device)[None]         # [B, W1] index into [old | path]
    node = acc.gather(1, (k - W1).clamp(min=0, max=D - 1)).clamp(min=0)
    slots = torch.as_tensor(state_indices, device=conv_state.device).long()
    old = conv_state[:, slots]                                         # [L, B, C, W1]
    L, _, C, _ = old.shape
    from_old = old.gather(3, k.clamp(max=W1 - 1)[None, :, None, :].expand(L, B, C, W1))
    from_x = x[:, node].permute(0, 1, 3, 2).to(conv_state.dtype)      # [L, B, C, W1]
    new = torch.where((k < W1)[None, :, None, :], from_old, from_x)
    if out_state is None:
        conv_state[:, slots] = torch.where((n > 0)[None, :, None, None], new, old)
        return conv_state
    out_slots = torch.as_tensor(out_indices, device=out_state.device).long()
    out_state[:, out_slots] = torch.where((n > 0)[None, :, None, None], new.to(out_state.dtype),
                                          out_state[:, out_slots])
    return out_state
