"""Naive torch twin of the greedy tree acceptance kernel (kernels/greedy_accept.py): the greedy case
of ``bole.spec.sampling.accept_tree`` (every row's draw is the argmax of its raw logits), which walks
max_depth + 1 levels with ~14 small ops each."""

from __future__ import annotations

import torch

from bole.spec.sampling import TreeAcceptance, accept_tree


def greedy_accept_ref(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, max_depth: int,
                      pad_token: int = -1) -> TreeAcceptance:
    """tokens, parents int [B, T] (parents local, -1 = the root; padding nodes carry a negative token);
    logits [B, T+1, V] (row 0: after the committed prefix, row i+1: after node i)."""
    B, T = tokens.shape
    uniforms = torch.zeros(B, T + 1, device=tokens.device)  # unused by the greedy walk
    return accept_tree(tokens, parents, uniforms, logits=logits, temperature=0.0, top_k=0, top_p=0.0,
                       max_depth=max_depth, pad_token=pad_token)
