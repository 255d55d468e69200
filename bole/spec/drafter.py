"""EAGLE-2 style draft-tree expansion, independent of the draft model.

One step of drafting for B requests:

1. ``expand_tree(root_log_probs, step, depth, topk, beam)`` grows every request's candidate tree.
   Depth 1: the root's ``topk`` most likely tokens. Depth d >= 2: the ``beam`` depth-(d-1) nodes
   with the highest cumulative log-probability ρ form the frontier; ``step`` evaluates the draft
   model (the MTP layer) at them and each proposes its ``topk`` most likely tokens as children.
   Every proposed node is kept as a candidate (not only the frontier), so the budget can later pick
   the globally best ones. Candidates are stored in fixed-shape [B, T_max] tensors, depth block by
   depth block, so parents precede children, with
   T_max = k + Σ_{d=2..D} min(beam, size of block d-1) * k, k = min(topk, V): all Python ints.
2. ``bole.spec.budget.select_nodes(c.rho, c.parents, c.valid, c.depth, b_ver, floor=...)`` picks the nodes to
   verify (prefix-closed).
3. ``compact(c, keep, roots)`` re-indexes the kept nodes compactly below each request's root (node
   0, the pending token), preserving the topological order, into padded [B, 1 + T_max] tensors: the
   step's one node list, which verification, ``accept_tree`` and the commit all index
   (docs/DESIGN.md §7).
4. ``to_forest(tree)`` builds the ``PackedForest`` the verification kernels take. It is the one
   place that needs the host (variable-size trees become Python lists), once per step.

The draft model is a callable ``step(frontier: Frontier) -> log_probs [B, M, V]`` (log-softmax of
the drafter's logits at each frontier node). ``Frontier.node_ids`` are indices into the candidate
list, so the model can store each node's hidden state under its id; ``Frontier.parent_ids`` tell it
which stored state (or, for -1, the target's hidden state at the committed root) feeds the node; a
node's ancestors are exactly the frontier nodes of earlier calls on its parent chain.

Steps 1 and 3 are fixed-shape topk / gather / scatter ops: no host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from bole.spec.tree import DraftTree, PackedForest


@dataclass(frozen=True)
class Frontier:
    """The nodes the draft model evaluates in one call (all int64 [B, M] tensors).

    depth: depth of the frontier nodes (1 = children of the root); their children get depth + 1.
    node_ids: index of each frontier node in the candidate list.
    parent_ids: index of its parent (-1 = the committed root).
    tokens: its draft token (the MTP input embedding).
    parent_slots: the position of its parent in the previous call's frontier (None at depth 1, where
        every parent is the root): a model that keeps each call's outputs in frontier order finds the
        parent's there, without a candidate-id map.
    """

    depth: int
    node_ids: torch.Tensor
    parent_ids: torch.Tensor
    tokens: torch.Tensor
    parent_slots: torch.Tensor | None = None


@dataclass(frozen=True)
class DraftCandidates:
    """Every candidate node of one drafting step, [B, T_max] each, in topological order.

    tokens: int64 draft token (-1 where invalid). parents: int64 local parent (-1 = root).
    rho: float32 cumulative log-probability along the path (-inf where invalid).
    depth: int64 (1 = child of the root). valid: bool, rho > -inf.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    rho: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor

    @property
    def max_nodes(self) -> int:
        return self.tokens.shape[1]


@dataclass(frozen=True)
class DraftBatch:
    """Every request's tree to verify: node 0 the root (the pending token), then the kept drafts,
    compacted (padded [B, T]; node order stays topological). One node list from drafting to commit:
    node i's target logits are row i, an accepted node i is this i (docs/DESIGN.md §7).

    tokens: int64, the root's pending token at column 0, -1 padding. parents: int64 local parent in
    this order (-1 for the root, and -1 on padding; a first-level draft's parent is 0). depth: int64
    (0 for the root and on padding). rho: float32 (0 for the root, -inf on padding).
    source_index: int64 index of each draft in the ``DraftCandidates`` it came from (-1 for the root
    and on padding), to fetch per-candidate state such as draft hidden states.
    num_nodes: int64 [B] nodes per tree, the root included.
    budget: under the goodput rule, the capacity the device chose for the step (0-d int64, on the device);
    else None.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    rho: torch.Tensor
    source_index: torch.Tensor
    num_nodes: torch.Tensor
    budget: torch.Tensor | None = None

    def trimmed(self, width: int | None = None) -> "DraftBatch":
        """The same batch padded only to its widest tree (one host sync): kernels tile by the width.
        With ``width`` (a bound on every tree's size, root included, known on the host), cut there
        without a sync."""
        T = (int(self.num_nodes.max()) if self.num_nodes.numel() else 0) if width is None else int(width)
        return DraftBatch(*(t[:, :T] for t in (self.tokens, self.parents, self.depth, self.rho,
                                               self.source_index)), num_nodes=self.num_nodes, budget=self.budget)


def tree_size(vocab_size: int, depth: int, topk: int, beam: int) -> int:
    """T_max of ``expand_tree`` for these settings (a Python int: buffers can be sized up front)."""
    k = min(topk, vocab_size)
    return k + k * sum(frontier_sizes(vocab_size, depth, topk, beam))   # block d holds M_d * k candidates


def frontier_sizes(vocab_size: int, depth: int, topk: int, beam: int) -> list[int]:
    """The frontier size ``expand_tree`` evaluates at each expansion level (depth 2..D): Python ints."""
    k = min(topk, vocab_size)
    block, out = k, []
    for _ in range(2, depth + 1):
        M = min(beam, block)
        out.append(M)
        block = M * k
    return out


def _topk(log_probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return log_probs.float().topk(k, dim=-1)


def expand_tree(root_log_probs: torch.Tensor, step: Callable[[Frontier], torch.Tensor], depth: int,
                topk: int, beam: int, topk_fn: Callable = _topk) -> DraftCandidates:
    """Grow B candidate trees of depth ``depth`` (see the module docstring).

    Args:
        root_log_probs: [B, V] draft log-probabilities of the first draft token.
        step: the draft model, ``step(frontier) -> log_probs [B, M, V]``.
        depth: D >= 1 (``step`` is called D - 1 times). topk: children per node (>= 1).
        beam: frontier width per depth (>= 1).
        topk_fn: ``topk_fn(scores [..., V], k) -> (log-probs, token ids) [..., k]``, descending; by
            default the top-k of the scores themselves (log-probabilities). The engine passes raw
            logits and the backend's fused log-softmax top-k (``kernels.logits_topk``).
    """
    if root_log_probs.dim() != 2:
        raise ValueError(f"root_log_probs must be [B, V], got {tuple(root_log_probs.shape)}")
    if depth < 1 or topk < 1 or beam < 1:
        raise ValueError(f"depth={depth}, topk={topk} and beam={beam} must all be >= 1")
    B, V = root_log_probs.shape
    k = min(topk, V)
    rho, tok = topk_fn(root_log_probs, k)                              # [B, k], distinct tokens
    par = torch.full_like(tok, -1)
    blocks = [(tok, par, rho)]
    offset = 0                                                         # start of the last block
    for d in range(2, depth + 1):
        tok, par, rho = blocks[-1]
        M = min(beam, rho.shape[1])
        f_rho, f_local = rho.topk(M, dim=-1)                           # [B, M] frontier
        f_ids = f_local + offset
        # block d - 1 holds the previous frontier's children as [M_prev, k]: candidate j * k + i is child i
        # of frontier slot j (block 1: children of the root)
        frontier = Frontier(depth=d - 1, node_ids=f_ids, parent_ids=par.gather(1, f_local),
                            tokens=tok.gather(1, f_local), parent_slots=f_local // k if d > 2 else None)
        log_probs = step(frontier)
        if log_probs.shape != (B, M, V):
            raise ValueError(f"step returned {tuple(log_probs.shape)}, expected {(B, M, V)}")
        c_lp, c_tok = topk_fn(log_probs, k)                            # [B, M, k]
        offset += rho.shape[1]
        blocks.append((c_tok.reshape(B, M * k), f_ids[:, :, None].expand(B, M, k).reshape(B, M * k),
                       (f_rho[:, :, None] + c_lp).reshape(B, M * k)))

    tokens = torch.cat([b[0] for b in blocks], 1)
    rho = torch.cat([b[2] for b in blocks], 1)
    depths = torch.cat([torch.full_like(b[0], d + 1) for d, b in enumerate(blocks)], 1)
    valid = rho > float("-inf")
    parents = torch.cat([b[1] for b in blocks], 1)
    return DraftCandidates(tokens=torch.where(valid, tokens, -1), parents=parents, rho=rho, depth=depths,
                           valid=valid)


def compact(cand: DraftCandidates, keep: torch.Tensor, roots: torch.Tensor) -> DraftBatch:
    """Each request's tree: its root (node 0, token ``roots[b]``), then the kept candidates in their
    original (topological) order: a [B, 1 + T_max] ``DraftBatch``.

    ``keep`` [B, T] must be prefix-closed (``select_nodes`` guarantees it) and imply ``valid``;
    ``roots`` int64 [B] the pending root tokens.
    """
    B, T = cand.tokens.shape
    keep = keep.bool() & cand.valid
    node = keep.long().cumsum(1)                                       # [B, T] node index if kept
    # a candidate's parent -1 is the committed root, which is node 0 of the tree
    new_parent = torch.where(cand.parents >= 0, node.gather(1, cand.parents.clamp(min=0)), 0)
    dest = torch.where(keep, node, T + 1)                              # dropped nodes -> slot T + 1

    def move(values: torch.Tensor, root, fill) -> torch.Tensor:
        out = torch.full((B, T + 2), fill, dtype=values.dtype, device=values.device)
        out[:, 0] = root
        return out.scatter_(1, dest, values)[:, :T + 1]

    return DraftBatch(tokens=move(cand.tokens, roots, -1), parents=move(new_parent, -1, -1),
                      depth=move(cand.depth, 0, 0), rho=move(cand.rho, 0.0, float("-inf")),
                      source_index=move(torch.arange(T, device=keep.device).expand(B, T), -1, -1),
                      num_nodes=keep.sum(1) + 1)


def to_forest(batch: DraftBatch, max_depth: int | None = None) -> tuple[PackedForest, torch.Tensor]:
    """The ``PackedForest`` of a compacted batch (roots included) and its flat int64 [N] node tokens
    (host sync)."""
    counts = batch.num_nodes.tolist()
    parents = batch.parents.tolist()
    cap = batch.tokens.shape[1] if max_depth is None else max_depth   # a depth never exceeds T
    trees = [DraftTree(parents[b][:n], max_depth=cap) for b, n in enumerate(counts)]
    forest = PackedForest.from_trees(trees, device=batch.tokens.device, max_depth=max_depth)
    width = torch.arange(batch.tokens.shape[1], device=batch.tokens.device)
    return forest, batch.tokens[width[None] < batch.num_nodes[:, None]]
