"""Log-probabilities of emitted and prompt tokens, from logits a step already computed.

No extra forward is run for them. An autoregressive step has its one row of logits per request; a
speculative step has the verify forward's logits of every tree node, and the token emitted at path
position j (j = 0: the root's row, then each accepted node's row, the last one giving the
correction / bonus token) was drawn from exactly that row. ``path_rows`` finds those rows from the
accepted node, ``emitted_logprobs`` processes them as the sampler did (penalties with the path's
own earlier tokens, temperature, top-k / top-p: ``bole.spec.sampling.processed_logprobs``) and takes
each token's log-probability and the k most likely alternatives. Prompt tokens (``prompt_logprobs``)
are scored with the raw log-softmax of the prefill's per-position logits.

Everything is a fixed-shape tensor function; ``to_entries`` is the one host read that turns the
results into ``TokenLogprob`` lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bole.spec.sampling import Penalties, processed_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token, its log-probability, and the most likely alternatives, best first
    (``(token_id, logprob)``; as many as the request asked for; -inf for tokens the sampler cut)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def gather_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, k: int):
    """From log-probabilities [R, V] and tokens [R]: (token logprob [R], top ids int64 [R, k], top
    logprobs [R, k]); negative tokens (padding) read id 0."""
    chosen = logprobs.gather(-1, tokens.clamp(min=0).long()[:, None])[:, 0]
    top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return chosen, top.indices, top.values


def path_rows(forest, accepted_node: list[int], num_rows: int) -> torch.Tensor:
    """Local row (= tree node: 0 the root) of each path position of each request's accepted path:
    int64 [num_rows, D], -1 padded. ``forest``: the verify step's ``PackedForest`` (a graph's may hold
    padding requests after the real ones); ``accepted_node``: per real request its deepest accepted
    node (0: the root only)."""
    pad = forest.num_requests - len(accepted_node)
    paths = forest.accepted_path_nodes(list(accepted_node) + [-1] * pad).long()   # [B', D] global
    start = forest.cu_seqlens[:-1].long()[:, None]
    return torch.where(paths >= 0, paths - start, -1)[:num_rows]


def emitted_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int, temperature, top_k, top_p,
                     penalties: Penalties | None = None):
    """Log-probabilities of the tokens emitted at consecutive positions, as they were sampled.

    Args:
        logits: [B, J, V] the target row each position was drawn from (after min_tokens masking).
        tokens: int64 [B, J] the emitted tokens, -1 padded.
        k: alternatives per position.
        temperature, top_k, top_p, penalties: the requests' sampling parameters ([B] or scalars); with
            penalties, position j's context also holds the tokens emitted at positions < j.
    Returns:
        (token logprobs [B, J], top ids [B, J, k], top logprobs [B, J, k]).
    """
    out = []
    for j in range(tokens.shape[1]):
        path = tokens[:, :j] if penalties is not None else None
        lp = processed_logprobs(logits[:, j], temperature, top_k, top_p, penalties, path)
        out.append(gather_logprobs(lp, tokens[:, j], k))
    return tuple(torch.stack(parts, 1) for parts in zip(*out))


def prompt_logprobs(logits: torch.Tensor, next_tokens: torch.Tensor, k: int):
    """Raw log-probabilities of each prompt position's next token: logits [N, V] (position p predicts
    next_tokens[p]); returns ``gather_logprobs``' triple over the N positions."""
    return gather_logprobs(torch.log_softmax(logits.float(), -1), next_tokens, k)


def to_entries(chosen: torch.Tensor, top_ids: torch.Tensor, top_lp: torch.Tensor, tokens: list[list[int]],
               ks: list[int]) -> list[list[TokenLogprob]]:
    """The host side, in one read: per row b, a ``TokenLogprob`` for each of ``tokens[b]`` (position j
    of row b is ``chosen[b, j]``) with its first ``ks[b]`` alternatives. Tensors [B, J] / [B, J, k]."""
    chosen, top_ids, top_lp = chosen.tolist(), top_ids.tolist(), top_lp.tolist()
    return [[TokenLogprob(t, chosen[b][j], tuple(zip(top_ids[b][j][:ks[b]], top_lp[b][j][:ks[b]])))
             for j, t in enumerate(row)] for b, row in enumerate(tokens)]
