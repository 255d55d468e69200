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

from bole.spec.tree import PackedForest


def _act(y, activation):
    if activation in (None, "identity"):
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r}")


def causal_conv1d(x, weight, bias, conv_state, state_indices, cu_seqlens=None, activation="silu"):
    """Causal conv over variable-length sequences that continue from conv_state; updates it in place.

    Returns y [N, C] in x's dtype. conv_state[state_indices[b]] becomes the last W-1 inputs of
    sequence b (the old state shifted in when the sequence is shorter than W-1).
    """
    N, C = x.shape
    W = weight.shape[1]
    if weight.shape[0] != C or conv_state.shape[1:] != (C, W - 1):
        raise ValueError(f"shapes x{tuple(x.shape)} weight{tuple(weight.shape)} "
                         f"conv_state{tuple(conv_state.shape)} disagree")
    cu = [0, N] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    y = torch.empty_like(x)
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        slot = int(state_indices[b])
        window = torch.cat([conv_state[slot].to(x.dtype), x[s:e].T], dim=1)  # [C, W-1+T]
        out = F.conv1d(window[None], weight[:, None, :].to(x.dtype), bias, groups=C)[0]  # [C, T]
        y[s:e] = _act(out, activation).T
        conv_state[slot] = window[:, -(W - 1):].to(conv_state.dtype)
    return y


def _tree_windows(x, forest: PackedForest, conv_state, state_indices, W):
    """[N, C, W]: for each node the W inputs ending at it along its path (oldest first)."""
    N, C = x.shape
    gpar = forest.global_parents().tolist()
    rid = forest.request_ids.tolist()
    win = torch.empty(N, C, W, dtype=x.dtype, device=x.device)
    for i in range(N):
        if gpar[i] < 0:
            prev = conv_state[int(state_indices[rid[i]])].to(x.dtype)  # [C, W-1]
        else:
            prev = win[gpar[i], :, 1:]
        win[i, :, : W - 1] = prev
        win[i, :, W - 1] = x[i]
    return win


def causal_conv1d_tree(x, weight, bias, conv_state, state_indices, forest: PackedForest,
                       activation="silu"):
    """Conv over a packed forest: each node sees its path, then the committed state. Read only."""
    W = weight.shape[1]
    win = _tree_windows(x, forest, conv_state, state_indices, W)
    y = (win * weight.to(x.dtype)[None]).sum(-1)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return _act(y, activation)


def conv_state_commit(conv_state, x, forest: PackedForest, state_indices, accepted: torch.Tensor):
    """Keep the last W-1 inputs along each accepted path, in place.

    accepted: int [B, D] global node indices of each path (root first, -1 padded); an empty path
    leaves the state untouched.
    """
    W = conv_state.shape[-1] + 1
    for b in range(accepted.shape[0]):
        path = [int(n) for n in accepted[b] if int(n) >= 0]
        if not path:
            continue
        slot = int(state_indices[b])
        seq = torch.cat([conv_state[slot], x[path].T.to(conv_state.dtype)], dim=1)
        conv_state[slot] = seq[:, -(W - 1):]
    return conv_state
