"""Naive torch twin of the greedy tree acceptance kernel (kernels/greedy_accept.py): the greedy case
of ``bole.spec.sampling.accept_tree`` (every row's draw is the argmax of its raw logits), which walks
max_depth + 1 levels with ~14 small ops each."""

from __future__ import annotations

import torch

from bole.spec.sampling import TreeAcceptance, accept_tree


def greedy_accept_ref(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, max_depth: int,
                      pad_token: int = -1) -> TreeAcceptance:
    """tokens, parents int [B, T]: node 0 the root (parent -1), parents local, padding nodes carry a
    negative token; logits [B, T, V] (row i: after node i). ``accept_tree``'s convention."""
    B, T = tokens.shape
    uniforms = torch.zeros(B, T, device=tokens.device)  # unused by the greedy walk
    return accept_tree(tokens, parents, uniforms, logits=logits, temperature=0.0, top_k=0, top_p=0.0,
                       max_depth=max_depth, pad_token=pad_token)
