"""Greedy tree acceptance in two launches (twin: ``bole.ops.accept.greedy_accept_ref``).

Why: the greedy walk of ``accept_tree`` is max_depth + 1 dependent levels of ~14 small torch ops
(gather the row, argmax, match the children, advance): ~200 launches at depth 13, all in the verify
graph's tail, on the step's critical path. Here the argmax of every row is one torch reduction, and
one program per request walks its tree: at each level the current node's argmax token is looked up
among the node's children (a compare over the tree's T nodes in registers).

Same tie-breaking as the twin: ``torch.argmax`` (first maximal index), and the first child in node
order carrying the token (children of one node carry distinct tokens anyway).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_tensor

_INDEX = (torch.int32, torch.int64)


@triton.jit
def greedy_accept_kernel(amax, tokens, parents, path_out, tok_out, node_out, num_out,
                         T, s_ab, s_tb, s_pb,
                         D: tl.constexpr, BT: tl.constexpr, PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BT)
    m = o < T
    tok = tl.load(tokens + b * s_tb + o, mask=m, other=-1).to(tl.int64)
    par = tl.load(parents + b * s_pb + o, mask=m, other=-2).to(tl.int64)
    real = m & (tok >= 0)
    cur = tl.full([], 0, tl.int64)   # node 0: the root
    alive = tl.full([], 1, tl.int32)
    n_acc = tl.full([], 0, tl.int64)
    for step in tl.static_range(D + 1):
        x = tl.load(amax + b * s_ab + cur).to(tl.int64)
        tl.store(tok_out + b * (D + 1) + step, tl.where(alive != 0, x, PAD))
        if step < D:
            hit = real & (par == cur) & (tok == x)
            child = tl.min(tl.where(hit, o, BT), axis=0).to(tl.int64)
            matched = (child < BT) & (alive != 0)
            tl.store(path_out + b * D + step, tl.where(matched, child, -1))
            cur = tl.where(matched, child, cur)
            alive = matched.to(tl.int32)
            n_acc += matched.to(tl.int64)
    tl.store(node_out + b, cur)
    tl.store(num_out + b, n_acc + 1)


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, max_depth: int,
                  pad_token: int = -1) -> tuple[torch.Tensor, ...]:
    """``greedy_accept_ref`` in two launches; graph-capturable (no host sync). Trees as ``accept_tree``
    takes them: tokens, parents [B, T] with node 0 the root (parent -1), logits [B, T, V] (row i: after
    node i). Returns the fields of
    ``bole.spec.sampling.TreeAcceptance`` in its order (accepted_path, num_accepted, accepted_node,
    tokens, num_emitted), which ``bole.backend`` wraps."""
    dev = tokens.device
    check_tensor("tokens", tokens, 2, _INDEX, dev)
    check_tensor("parents", parents, 2, _INDEX, dev)
    B, T = tokens.shape
    if parents.shape != tokens.shape:
        raise ValueError(f"parents {tuple(parents.shape)} must match tokens {tuple(tokens.shape)}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != (B, T):
        raise ValueError(f"logits must be [B, T, V] = [{B}, {T}, V], got {tuple(getattr(logits, 'shape', ()))}")
    if logits.device != dev:
        raise ValueError(f"logits are on {logits.device}, expected {dev}")
    D = int(max_depth)
    if not 0 <= D <= 64:
        raise ValueError(f"max_depth must be in 0..64, got {max_depth}")
    if T < 1:
        raise ValueError("trees of 0 nodes: node 0 (the root) is needed")
    tokens = tokens if tokens.stride(1) == 1 else tokens.contiguous()
    parents = parents if parents.stride(1) == 1 else parents.contiguous()
    amax = logits.argmax(-1)                                       # [B, T] int64
    path = torch.empty(B, D, dtype=torch.int64, device=dev)
    toks = torch.empty(B, D + 1, dtype=torch.int64, device=dev)
    node = torch.empty(B, dtype=torch.int64, device=dev)
    num = torch.empty(B, dtype=torch.int64, device=dev)
    if B:
        greedy_accept_kernel[(B,)](amax, tokens, parents, path, toks, node, num, T,
                                   amax.stride(0), tokens.stride(0), parents.stride(0),
                                   D=D, BT=triton.next_power_of_2(T), PAD=int(pad_token), num_warps=1)
    return path, num - 1, node, toks, num
