"""The speculative step's acceptance and commit, written once: ``accept_and_commit``.

After the verify forward, every request's tree (``DraftBatch``: node 0 the root, docs/DESIGN.md §7) is
walked with the lossless rule (docs/DESIGN.md §6: greedy by ``backend.greedy_accept``, sampled by
``accept_tree`` with each request's parameters and counter-based uniforms), the accepted paths are
committed (docs/DESIGN.md §4: ``commit_paths`` for GDN states, conv windows and K/V; a prefix-cache
checkpoint of the boundary a path jumps over first, out of place), and the step's outputs are written:
per request one row of ints (the step's one device-to-host read) and the accepted path's target
hiddens (the drafter's next catch-up inputs).

Device ops only, fixed shapes, no host read: the verify graph's tail (``bole.engine.graphs.verify``)
captures exactly this function over its static buffers, and the eager step (``ModelRunner.accept_commit``)
calls it on the eager verify's outputs, after its own logits preprocessing (min_tokens masking).
"""

from __future__ import annotations

import torch

from bole.cache.prefix_cache import boundary_cut
from bole.spec.sampling import Penalties, accept_tree, position_uniforms
from bole.spec.tree import path_prefixes


def accept_and_commit(model, ctx, logits: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor,
                      parents: torch.Tensor, depth: torch.Tensor | None, real: torch.Tensor,
                      num_computed: torch.Tensor | None, max_depth: int, sampling=None,
                      penalties: Penalties | None = None, checkpoint=None, out: torch.Tensor | None = None,
                      out_hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept, commit and write a speculative step's outputs (see the module docstring).

    Args:
        model: the target (``commit_paths``, ``backend.greedy_accept``).
        ctx: the verify forward's ``ForwardContext``; its forest may hold more trees than the B' rows
            here (a graph's padding rows, when the eager step follows a graph's forward).
        logits: [B', T, V] the verify forward's logits, row i tree node i (after any preprocessing).
        hidden: [N, H] the verify forward's hiddens, flat over ``ctx``'s forest.
        tokens, parents, depth: int [B', T] the trees (``DraftBatch``'s layout: node 0 the root,
            -1 tokens on padding nodes; depth 0 for the root; depth is read by the sampled walk only).
        real: bool [B'] rows that commit (a graph's padding rows do not).
        num_computed: int [B'] committed lengths (the uniforms' counters, the checkpoints' starts;
            unused, and may be None, when greedy without a checkpoint).
        max_depth: the drafts' depth bound (the walk's length).
        sampling: None (greedy) or the rows' ``SamplingTensors`` on the device.
        penalties: the requests' ``Penalties`` (accept_tree penalises each visited row with its path).
        checkpoint: None or (StatePool, interval, slots [forest's requests]): the path cut at the last
            multiple of ``interval`` strictly inside the commit goes to the row's slot first (nothing
            where none).
        out, out_hidden: buffers to write (allocated when None).
    Returns:
        (out int64 [B', 3 + D]: accepted node (0: the root only), emitted count, D = max_depth + 1
        emitted tokens (-1 padded), verified nodes; out_hidden [B', forest depth, H] the target
        hiddens along the accepted path, root first).
    """
    if sampling is None and penalties is None:
        acc = model.backend.greedy_accept(tokens, parents, logits, max_depth)
    elif sampling is None:  # greedy with penalties: the penalised argmax walk
        acc = accept_tree(tokens, parents, torch.zeros(tokens.shape, device=logits.device), logits=logits,
                          temperature=0.0, top_k=0, top_p=0.0, max_depth=max_depth, penalties=penalties)
    else:
        # node r draws the token at position num_computed + 1 + depth(r): an ar step's uniform there
        # (docs/DESIGN.md §6); the native logits: process_logits upcasts only the rows the walk visits
        u = position_uniforms(sampling.seed, num_computed + 1, depth, max_depth)
        acc = accept_tree(tokens, parents, u, logits=logits, temperature=sampling.temperature,
                          top_k=sampling.top_k, top_p=sampling.top_p, max_depth=max_depth, penalties=penalties)
    B, pad = tokens.shape[0], ctx.forest.num_requests - tokens.shape[0]
    local = torch.where(real, acc.accepted_node, -1)
    if pad:  # an eager step over a graph's forward: the graph's padding rows commit nothing
        local = torch.cat([local, local.new_full((pad,), -1)])
    paths = ctx.forest.accepted_path_nodes(local)                      # [B + pad, D] global ids
    if checkpoint is not None:
        # the path prefix up to the last checkpoint boundary strictly inside the commit of
        # [start, start + n) (PrefixCache.path_cut), committed into the row's checkpoint slot
        pool, interval, slots = checkpoint
        cut = torch.where(real, boundary_cut(num_computed, acc.num_emitted, interval), 0)
        if pad:
            cut = torch.cat([cut, cut.new_zeros(pad)])
        model.commit_paths(ctx, path_prefixes(paths, cut), out=(pool, slots))
    model.commit_paths(ctx, paths)
    D = max_depth + 1
    if out is None:
        out = torch.empty(B, 3 + D, dtype=torch.long, device=tokens.device)
    if out_hidden is None:
        out_hidden = hidden.new_empty(B, paths.shape[1], hidden.shape[-1])  # an eager forest may be shallower
    out_hidden.copy_(hidden[paths[:B].clamp(min=0).long()])
    out[:, 0] = acc.accepted_node
    out[:, 1] = acc.num_emitted
    out[:, 2:2 + D] = acc.tokens
    out[:, 2 + D] = (tokens >= 0).sum(1)  # verified nodes, root included (the step's statistics)
    return out, out_hidden
