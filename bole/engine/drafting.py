"""The MTP drafter's tree growth, shared by the eager draft (``ModelRunner.draft``) and the draft graph
(``bole.engine.graphs.draft``): one function over a caller-supplied forest context."""

from __future__ import annotations

from typing import Callable

import torch

from bole.models.context import ForwardContext, TreeFactors
from bole.spec.drafter import Frontier, expand_tree, frontier_sizes


def empty_factors(num_nodes: int, device) -> TreeFactors:
    """A factor buffer for a model without GDN layers (the MTP drafter)."""
    z = torch.empty(0, num_nodes, 1, 1, device=device)
    return TreeFactors(k=z, u=z, logp=z[..., 0], conv_x=z[..., 0])


def grow_draft_tree(mtp, h_root: torch.Tensor, depth: int, topk: int, beam: int,
                    tree_ctx: Callable[[torch.Tensor, int], ForwardContext], incremental: bool | None = None):
    """``expand_tree`` driven by the MTP head from its catch-up outputs ``h_root`` [B, H]: the eager
    draft and the draft graph (``bole.engine.graphs.draft``) both run this, with their own ``tree_ctx``.

    ``tree_ctx(parents, d)`` returns the verify-mode context of the frontier forest so far (local
    parents [B, S], depth <= d) over the drafter's KV cache. A node's input hidden is its parent's MTP
    output (``h_root`` for first-level nodes); fixed-shape device ops only.

    Each level runs the MTP on its new frontier only (``ForwardContext.suffix``): the earlier nodes' K/V
    are in the drafter's cache from their own level, unchanged since (a node's K/V depend on its token
    and its parent's output), so they are keys, not rows again. A drafter of several MTP layers (layer
    ``depth % L`` at each level) re-runs the whole forest instead: its earlier nodes have no K/V in this
    level's layer. ``incremental``: force either (None: the frontier only when the drafter has one layer).
    """
    root_logits = mtp.compute_logits(h_root)
    B, H = h_root.shape
    # The forest evaluated at level d is every frontier so far, in call order: frontier nodes at forest
    # positions S0..S0+M (static buffers, appended per call). A node's parent is a node of the previous
    # frontier (``Frontier.parent_slots``), whose MTP output that call returned; first-level nodes take
    # ``h_root``. Fixed-shape device ops only, a handful per level (the launch count is the cost here).
    s_max = sum(frontier_sizes(root_logits.shape[-1], depth, topk, beam))
    tok_buf = torch.empty(B, s_max, dtype=torch.long, device=h_root.device)
    par_buf = torch.empty(B, s_max, dtype=torch.long, device=h_root.device)
    hid_buf = h_root.new_empty(B, s_max, H)             # each forest node's input hidden
    prev = {}                                            # the previous call: its S0 and frontier outputs [B, M, H]
    incremental = len(mtp.layers) == 1 if incremental is None else incremental

    def step(fr: Frontier) -> torch.Tensor:
        M = fr.node_ids.shape[1]
        S0 = prev["s0"] + prev["m"] if prev else 0
        S = S0 + M
        tok_buf[:, S0:S].copy_(fr.tokens)
        if fr.parent_slots is None:                      # children of the root
            par_buf[:, S0:S].fill_(-1)
            hid_buf[:, S0:S].copy_(h_root[:, None, :].expand(B, M, H))
        else:
            par_buf[:, S0:S].copy_(fr.parent_slots + prev["s0"])
            hid_buf[:, S0:S].copy_(prev["h"].gather(1, fr.parent_slots[..., None].expand(B, M, H)))
        ctx = tree_ctx(par_buf[:, :S], fr.depth)
        first = S0 if incremental else 0                 # the forest rows this level runs
        h = mtp(tok_buf[:, first:S].reshape(-1), hid_buf[:, first:S].reshape(-1, H),
                ctx.suffix(first) if first else ctx, step=fr.depth).view(B, S - first, H)[:, S0 - first:]
        prev.update(s0=S0, m=M, h=h)
        return mtp.compute_logits(h)

    # the steps return raw logits: the backend's fused log-softmax top-k forms the children's log-probs
    # (over the drafter's scored columns: its reduced vocabulary's ids when it has one)
    return expand_tree(root_logits, step, depth, topk, beam, topk_fn=mtp.log_softmax_topk)
