"""Hard inputs for the GDN tree verifiers: the cases that break unstable solves.

Real GDN keys are L2-normalised projections of one residual stream, so they are correlated; trained
gates push β towards 1 and decays towards 1 on long contexts. Those are exactly the inputs on which
the powers of G grow (kernels/gdn_tree_verify.py's error analysis), so every verifier (ours, the
twins, the peers) is tested and benchmarked on them, beside ordinary random inputs.

    keys (and queries) = a·c + noise, one shared unit direction c per key head, noise ~ N(0, I/K):
        the mean pairwise cosine of the normalised keys is ≈ a² / (a² + 1) = ``key_cos``
    beta:  "random" U(0, 1) | "high" sigmoid(N(0, 1) + 2.5) (≈ 0.9) | "one" (1 − 1e-4·U, 1 in bf16)
    decay: "random" g = −softplus(N(0,1)) | "slow" g = −0.02·softplus(N(0, 1)) | "one" g = −1e-6·U
    q_equals_k: queries are the keys themselves
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bole.spec.tree import DraftTree, PackedForest, random_tree

BETAS = ("random", "high", "one")
DECAYS = ("random", "slow", "one")


def correlated(n: int, heads: int, dim: int, key_cos: float, gen: torch.Generator) -> torch.Tensor:
    """[n, heads, dim] vectors a·c_h + noise whose normalised mean pairwise cosine is ≈ key_cos."""
    if not 0.0 <= key_cos < 1.0:
        raise ValueError(f"key_cos must be in [0, 1), got {key_cos}")
    c = torch.randn(heads, dim, generator=gen)
    c = c / c.norm(dim=-1, keepdim=True)
    a = math.sqrt(key_cos / (1.0 - key_cos))
    return a * c[None] + torch.randn(n, heads, dim, generator=gen) / math.sqrt(dim)


def mean_cosine(x: torch.Tensor) -> float:
    """Mean pairwise cosine of the rows of x [n, dim] (the diagonal excluded)."""
    xn = x.double() / x.double().norm(dim=-1, keepdim=True)
    n = xn.shape[0]
    cos = xn @ xn.T
    return float((cos.sum() - cos.diagonal().sum()) / max(n * (n - 1), 1))


def verify_inputs(forest: PackedForest, HK: int, HV: int, K: int, V: int, *, key_cos: float = 0.0,
                  beta: str = "random", decay: str = "random", q_equals_k: bool = False,
                  dtype=torch.float32, pool_dtype=torch.float32, slots: int | None = None, seed: int = 0,
                  device="cpu"):
    """(q, k, v, g, beta, pool, state_indices) for ``forest`` in the verifiers' layouts (module docstring).
    The pool holds states of a realistic size (‖S‖ ~ 1 per head) in ``pool_dtype``; requests read a
    random permutation of the slots."""
    if beta not in BETAS or decay not in DECAYS:
        raise ValueError(f"beta must be one of {BETAS} and decay one of {DECAYS}, got {beta!r}, {decay!r}")
    gen = torch.Generator().manual_seed(seed)
    N, B = forest.num_nodes, forest.num_requests
    slots = B + 2 if slots is None else slots
    k = correlated(N, HK, K, key_cos, gen)
    q = k.clone() if q_equals_k else correlated(N, HK, K, key_cos, gen)
    v = torch.randn(N, HV, V, generator=gen)
    if beta == "random":
        b = torch.rand(N, HV, generator=gen)
    elif beta == "high":
        b = torch.sigmoid(torch.randn(N, HV, generator=gen) + 2.5)
    else:
        b = 1.0 - 1e-4 * torch.rand(N, HV, generator=gen)
    if decay == "random":
        g = -F.softplus(torch.randn(N, HV, generator=gen))
    elif decay == "slow":
        g = -0.02 * F.softplus(torch.randn(N, HV, generator=gen))
    else:
        g = -1e-6 * torch.rand(N, HV, generator=gen)
    pool = torch.randn(slots, HV, V, K, generator=gen) / math.sqrt(K)
    idx = torch.randperm(slots, generator=gen)[:B]
    to = lambda t, dt: t[None].to(device=device, dtype=dt)
    return (to(q, dtype), to(k, dtype), to(v, dtype), to(g, torch.float32), to(b, dtype),
            pool.to(device=device, dtype=pool_dtype), idx.to(device))


def star(n: int) -> DraftTree:
    """n children of the root (the widest tree of n nodes, depth 1)."""
    return DraftTree([-1] * n)


def hard_trees(max_nodes: int, max_depth: int, seed: int = 0) -> dict[str, DraftTree]:
    """Named tree shapes up to ``max_nodes`` nodes: the deepest (a chain), the widest (a star), an
    EAGLE-like random tree of full depth, and a broom (a chain with a wide top)."""
    gen = torch.Generator().manual_seed(seed)
    deep = min(max_nodes, max_depth)
    broom = [-1] * (max_nodes - deep + 1) + list(range(max_nodes - deep, max_nodes - 1))
    return {f"chain{deep}": DraftTree.chain(deep), f"star{max_nodes}": star(max_nodes),
            f"random{max_nodes}d{max_depth}": random_tree(max_nodes, max_depth, gen),
            f"broom{max_nodes}": DraftTree(broom, max_depth=max(deep, 1))}
