"""EAGLE-2 style tree expansion, compaction and forest building (bole/spec/drafter.py)."""

import pytest
import torch

from bole.spec.budget import select_nodes
from bole.spec.drafter import Frontier, compact, expand_tree, to_forest, tree_size
from bole.spec.sampling import accept_tree

V = 7


def markov_drafter(seed=0, B=3):
    """A synthetic draft model: a fixed random Markov chain over V tokens (the row of the frontier
    node's token), plus per-request root distributions. Records every call."""
    g = torch.Generator().manual_seed(seed)
    trans = torch.randn(V, V, generator=g).mul(2).log_softmax(-1)
    root = torch.randn(B, V, generator=g).mul(2).log_softmax(-1)
    calls: list[Frontier] = []

    def step(f: Frontier) -> torch.Tensor:
        calls.append(f)
        return trans[f.tokens]  # [B, M, V]

    return root, step, trans, calls


@pytest.mark.parametrize("depth, topk, beam", [(1, 3, 2), (4, 3, 2), (5, 2, 4), (3, 10, 3)])
def test_expand_tree_structure(depth, topk, beam):
    root, step, trans, calls = markov_drafter()
    c = expand_tree(root, step, depth, topk, beam)
    B, T = c.tokens.shape
    assert T == tree_size(V, depth, topk, beam) == c.max_nodes
    assert len(calls) == depth - 1
    assert c.valid.all()
    for b in range(B):
        par, tok, dep, rho = (x[b].tolist() for x in (c.parents, c.tokens, c.depth, c.rho))
        for i in range(T):
            p = par[i]
            assert p < i, "topological order: parents precede children"
            assert dep[i] == (1 if p < 0 else dep[p] + 1) and 1 <= dep[i] <= depth
            # ρ is the log of the product of the draft probabilities along the path
            lp = float(root[b, tok[i]]) if p < 0 else rho[p] + float(trans[tok[p], tok[i]])
            assert rho[i] == pytest.approx(lp, abs=1e-5)
        siblings: dict[int, list[int]] = {}
        for p, t in zip(par, tok, strict=True):
            siblings.setdefault(p, []).append(t)
        assert all(len(ts) == len(set(ts)) for ts in siblings.values()), "children must be distinct"
        assert all(len(ts) == min(topk, V) for ts in siblings.values())
    # the frontier at each depth is the top-`beam` of the previous depth by ρ
    for f in calls:
        prev = (c.depth == f.depth)
        prev_rho = torch.where(prev, c.rho, float("-inf"))
        top = prev_rho.topk(f.node_ids.shape[1], -1).values
        torch.testing.assert_close(c.rho.gather(1, f.node_ids), top)
        assert torch.equal(c.tokens.gather(1, f.node_ids), f.tokens)
        assert torch.equal(c.parents.gather(1, f.node_ids), f.parent_ids)


def test_expand_tree_batch_independent():
    root, step, _, _ = markov_drafter(seed=4, B=5)
    full = expand_tree(root, step, 4, 3, 3)
    for b in range(5):
        alone = expand_tree(root[b:b + 1], step, 4, 3, 3)
        for f in ("tokens", "parents", "depth", "valid"):
            assert torch.equal(getattr(alone, f)[0], getattr(full, f)[b]), f
        torch.testing.assert_close(alone.rho[0], full.rho[b])


def test_impossible_tokens_are_invalid():
    root, step, _, _ = markov_drafter()
    root = root.clone()
    root[:, 2:] = float("-inf")  # only two tokens possible at the root
    c = expand_tree(root, step, 2, 3, 2)
    assert c.valid[:, :2].all() and not c.valid[:, 2].any()
    assert (c.tokens[~c.valid] == -1).all()


@pytest.mark.parametrize("b_ver", [6, 15, 40])
def test_compact_and_to_forest(b_ver):
    root, step, _, _ = markov_drafter(seed=2)
    c = expand_tree(root, step, 4, 3, 2)
    keep = select_nodes(c.rho, c.parents, c.valid, c.depth, b_ver, floor="children")
    B, T = c.tokens.shape
    roots = (torch.arange(B) + 1) % V
    d = compact(c, keep, roots)
    forest, flat_tokens = to_forest(d)
    assert d.tokens.shape == (B, 1 + T)
    assert torch.equal(d.num_nodes, keep.sum(1) + 1)
    for b in range(B):
        n = int(d.num_nodes[b])  # the root, then n - 1 kept drafts
        kept = keep[b].nonzero().flatten().tolist()
        assert (d.tokens[b, 0], d.parents[b, 0], d.depth[b, 0], d.rho[b, 0], d.source_index[b, 0]) == \
            (roots[b], -1, 0, 0.0, -1)
        assert d.source_index[b, 1:n].tolist() == kept and (d.source_index[b, n:] == -1).all()
        assert d.tokens[b, 1:n].tolist() == c.tokens[b, kept].tolist() and (d.tokens[b, n:] == -1).all()
        for j in range(1, n):
            p = int(d.parents[b, j])
            src_p = int(c.parents[b, kept[j - 1]])
            assert p == (0 if src_p < 0 else 1 + kept.index(src_p)) and 0 <= p < j
            assert int(d.depth[b, j]) == int(c.depth[b, kept[j - 1]])
        s, e = int(forest.cu_seqlens[b]), int(forest.cu_seqlens[b + 1])
        assert forest.parents[s:e].tolist() == d.parents[b, :n].tolist()
        assert forest.depth[s:e].tolist() == (d.depth[b, :n] + 1).tolist()  # the forest counts levels
        assert flat_tokens[s:e].tolist() == d.tokens[b, :n].tolist()
    # the compact form feeds accept_tree directly: a greedy target that always prefers a node's
    # first kept child accepts the whole first-child chain
    probs = torch.zeros(B, T + 1, V)
    for r in range(T + 1):
        first_child = ((d.parents == r) & (d.tokens >= 0)).long().argmax(-1)
        probs[torch.arange(B), r, d.tokens.gather(1, first_child[:, None])[:, 0].clamp(min=0)] = 1.0
    res = accept_tree(d.tokens, d.parents, torch.rand(B, T + 1), probs, max_depth=4)
    for b in range(B):
        chain, cur = [], 0
        while (kids := [j for j in range(T + 1) if d.parents[b, j] == cur and d.tokens[b, j] >= 0]):
            cur = kids[0]
            chain.append(cur)
        assert res.accepted_path[b, : len(chain)].tolist() == chain and res.num_accepted[b] == len(chain)


def test_drafting_has_no_host_sync():
    m = dict(device="meta")
    B, T = 2, tree_size(V, 3, 2, 2)
    c = expand_tree(torch.zeros(B, V, **m), lambda f: torch.zeros(B, f.tokens.shape[1], V, **m), 3, 2, 2)
    assert c.tokens.is_meta and c.tokens.shape == (B, T)
    keep = select_nodes(c.rho, c.parents, c.valid, c.depth, 4, floor="children")
    d = compact(c, keep, torch.zeros(B, dtype=torch.long, **m))
    assert d.tokens.is_meta and d.tokens.shape == (B, 1 + T)


def test_bad_arguments():
    root, step, _, _ = markov_drafter()
    with pytest.raises(ValueError):
        expand_tree(root, step, 0, 3, 2)
    with pytest.raises(ValueError, match="step returned"):
        expand_tree(root, lambda f: torch.zeros(3, 1, V), 2, 3, 2)
