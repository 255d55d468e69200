"""Logit processing, sampling and lossless tree acceptance (bole/spec/sampling.py)."""

import itertools

import pytest
import torch

from bole.spec.sampling import accept_tree, counter_uniforms, position_uniforms, process_logits, sample_from_probs
from bole.spec.tree import random_tree


def chi2_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; cells expecting < min_expected are pooled into one."""
    n = counts.sum().double()
    exp = expected_probs.double().flatten() * n
    obs = counts.double().flatten()
    if (obs[exp == 0] > 0).any():
        return 0.0  # an impossible outcome happened
    exp, obs = exp[exp > 0], obs[exp > 0]
    small = exp < min_expected
    if small.any():
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
        obs = torch.cat([obs[~small], obs[small].sum()[None]])
    stat = ((obs - exp) ** 2 / exp).sum()
    df = exp.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


# ---------------------------------------------------------------- logit processing

def reference_process(row: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    V = row.numel()
    if t <= 0:
        out = torch.zeros(V)
        out[int(row.argmax())] = 1.0
        return out
    x = [float(torch.tensor(v, dtype=torch.float32)) for v in (row.float() / t).tolist()]
    keep = [True] * V
    if k > 0:
        kth = sorted(x, reverse=True)[min(k, V) - 1]
        keep = [v >= kth for v in x]
    masked = lambda keep: torch.tensor([v if kp else float("-inf") for v, kp in zip(x, keep, strict=True)])  # noqa: E731
    probs = torch.softmax(masked(keep), 0)
    if p < 1:
        cum, last = 0.0, None
        for q in sorted(probs.tolist(), reverse=True):
            if last is not None and cum >= p:
                break
            last, cum = q, cum + q
        keep = [kp and q >= last for kp, q in zip(keep, probs.tolist(), strict=True)]
        probs = torch.softmax(masked(keep), 0)
    return probs


def test_process_logits_matches_reference():
    g = torch.Generator().manual_seed(0)
    R, V = 96, 37
    # half-integer logits make ties at the top-k / top-p boundaries common
    logits = (torch.randn(R, V, generator=g) * 4).round() / 2
    logits[5, 3] = float("-inf")
    temps = [0.0, 0.5, 1.0, 1.7]
    ks = [-1, 0, 1, 5, 37, 100]
    ps = [1.0, 0.9, 0.5, 0.05]
    combos = list(itertools.product(temps, ks, ps))
    t = torch.tensor([combos[i % len(combos)][0] for i in range(R)])
    k = torch.tensor([combos[i % len(combos)][1] for i in range(R)])
    p = torch.tensor([combos[i % len(combos)][2] for i in range(R)])
    out = process_logits(logits, t, k, p)
    assert out.shape == (R, V) and out.dtype == torch.float32
    torch.testing.assert_close(out.sum(-1), torch.ones(R))
    for i in range(R):
        ref = reference_process(logits[i], float(t[i]), int(k[i]), float(p[i]))
        torch.testing.assert_close(out[i], ref, atol=1e-6, rtol=1e-5,
                                   msg=f"row {i}: t,k,p={combos[i % len(combos)]}")


def test_process_logits_scalars_and_greedy_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    torch.testing.assert_close(process_logits(logits, 0.0, -1, 1.0), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    # top-k 1 keeps both tied maxima
    torch.testing.assert_close(process_logits(logits, 1.0, 1, 1.0), torch.tensor([[0.0, 0.5, 0.5, 0.0]]))


# ---------------------------------------------------------------- sampling primitives

def test_sample_from_probs_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    for u in (0.0, 0.25, 0.5 - 1e-7, 0.5, 1.0 - 2**-24):
        x = sample_from_probs(probs, torch.full((3,), u))
        assert x[0] in (1, 3) and x[1] == 2 and x[2] == 0
    assert sample_from_probs(probs, torch.full((3,), 0.0))[0] == 1
    assert sample_from_probs(probs, torch.full((3,), 0.75))[0] == 3


def test_counter_uniforms_reproducible_batch_independent_uniform():
    seeds, offsets = torch.tensor([0, 1, 12345, -7]), torch.tensor([0, 0, 99, 2**40])
    u = counter_uniforms(seeds, offsets, 1000)
    assert u.shape == (4, 1000) and u.dtype == torch.float32
    assert (u >= 0).all() and (u < 1).all()
    torch.testing.assert_close(u, counter_uniforms(seeds, offsets, 1000), rtol=0, atol=0)
    for b in range(4):  # a request's uniforms do not depend on its batch mates
        torch.testing.assert_close(counter_uniforms(seeds[b:b + 1], offsets[b:b + 1], 1000)[0], u[b],
                                   rtol=0, atol=0)
    # shifting the counter shifts the stream; different seeds give different streams
    shifted = counter_uniforms(seeds[:1], offsets[:1] + 10, 990)[0]
    torch.testing.assert_close(shifted, u[0, 10:], rtol=0, atol=0)
    assert not torch.equal(u[0], u[1])
    big = counter_uniforms(torch.tensor([3]), torch.tensor([0]), 200_000)[0]
    assert chi2_pvalue(torch.bincount((big * 20).long(), minlength=20), torch.full((20,), 0.05)) > 1e-3


# ---------------------------------------------------------------- tree acceptance: greedy

def random_drafts(B, T, V, g, max_depth=5):
    """Padded [B, 1 + T] random trees (node 0 the root, token V - 1; up to T drafts below it) whose
    siblings carry distinct tokens (some requests smaller)."""
    tokens = torch.full((B, 1 + T), -1, dtype=torch.long)
    parents = torch.full((B, 1 + T), -1, dtype=torch.long)
    tokens[:, 0] = V - 1
    for b in range(B):
        n = int(torch.randint(1, T + 1, (1,), generator=g))
        tree = random_tree(n, max_depth, generator=g)
        node_parents = [p + 1 for p in tree.parents]  # the draft tree's root children hang below node 0
        parents[b, 1:n + 1] = torch.tensor(node_parents)
        used: dict[int, set] = {}
        for i, p in enumerate(node_parents):
            free = [v for v in torch.randperm(V, generator=g).tolist() if v not in used.setdefault(p, set())]
            used[p].add(free[0])
            tokens[b, i + 1] = free[0]
    return tokens, parents


def reference_walk(tokens, parents, probs, u):
    """Python walk of one request (node 0 the root): returns (accepted path, emitted tokens)."""
    cur, path, out = 0, [], []
    while True:
        x = int(sample_from_probs(probs[cur][None], u[cur][None])[0])
        out.append(x)
        child = [j for j in range(len(tokens)) if parents[j] == cur and tokens[j] == x and tokens[j] >= 0]
        if not child:
            return path, out
        cur = child[0]
        path.append(cur)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_walk_matches_python_reference(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, V, D = 12, 20, 9, 5
    tokens, parents = random_drafts(B, T, V, g, max_depth=D)
    logits = torch.randn(B, T + 1, V, generator=g)
    # make the target agree with a random child of each node most of the time, so paths go deep
    for b in range(B):
        for r in range(T + 1):
            kids = [j for j in range(T + 1) if parents[b, j] == r and tokens[b, j] >= 0]
            if kids and torch.rand(1, generator=g) < 0.8:
                logits[b, r, tokens[b, kids[int(torch.randint(len(kids), (1,), generator=g))]]] += 10
    u = torch.rand(B, T + 1, generator=g)
    zeros = torch.zeros(B)
    res = accept_tree(tokens, parents, u, logits=logits, temperature=zeros, top_k=-1, top_p=1.0, max_depth=D)
    probs = process_logits(logits.flatten(0, 1), 0.0, -1, 1.0).view(B, T + 1, V)
    res_p = accept_tree(tokens, parents, u, probs, max_depth=D)
    assert all(torch.equal(getattr(res, f), getattr(res_p, f)) for f in ("tokens", "accepted_path"))
    # the all-greedy fast path (a Python temperature: argmax, no sort) walks the same way
    res_g = accept_tree(tokens, parents, u, logits=logits, temperature=0.0, top_k=-1, top_p=1.0, max_depth=D)
    assert all(torch.equal(getattr(res, f), getattr(res_g, f)) for f in ("tokens", "accepted_path", "accepted_node"))
    deep = 0
    for b in range(B):
        path, out = reference_walk(tokens[b].tolist(), parents[b].tolist(),
                                   process_logits(logits[b], 0.0, -1, 1.0), u[b])
        n = len(path)
        deep += n >= 2
        assert res.num_accepted[b] == n and res.num_emitted[b] == n + 1
        assert res.accepted_path[b, :n].tolist() == path and (res.accepted_path[b, n:] == -1).all()
        assert res.accepted_node[b] == (path[-1] if path else 0)
        assert res.tokens[b, : n + 1].tolist() == out and (res.tokens[b, n + 1:] == -1).all()
        assert out[0] == int(logits[b, 0].argmax())
    assert deep >= 2  # the test exercised multi-node paths


@pytest.mark.parametrize("temp, top_k, top_p", [(0.0, -1, 1.0), (0.9, 5, 0.95), (1.0, 0, 1.0)])
def test_tree_walk_equals_autoregressive_sampling(temp, top_k, top_p):
    """With a context-dependent toy LM and one uniform per token position (the module's seeding
    convention), the tree walk emits exactly the tokens autoregressive sampling would: greedy is
    token-identical to AR greedy, and seeded sampling is identical with or without speculation."""
    g = torch.Generator().manual_seed(7)
    V, B, T, D = 11, 16, 24, 6
    table = torch.randn(997, V, generator=g) * 2
    lm = lambda ctx: table[hash(tuple(ctx)) % 997]  # noqa: E731 - int tuples hash deterministically
    tokens, parents = random_drafts(B, T, V, g, max_depth=D)
    # a good drafter: most nodes carry the LM's greedy token after their path (siblings stay distinct)
    logits = torch.zeros(B, T + 1, V)
    depth = torch.zeros(B, T + 1, dtype=torch.long)
    for b in range(B):
        ctx = {0: [b]}
        logits[b, 0] = lm(ctx[0])
        for i in range(1, T + 1):
            p = int(parents[b, i])
            if tokens[b, i] < 0:
                continue
            best = int(lm(ctx[p]).argmax())
            sibling_tokens = [int(tokens[b, j]) for j in range(1, T + 1) if j != i and parents[b, j] == p]
            if best not in sibling_tokens and torch.rand(1, generator=g) < 0.7:
                tokens[b, i] = best
            ctx[i] = ctx[p] + [int(tokens[b, i])]
            logits[b, i] = lm(ctx[i])
            depth[b, i] = len(ctx[i]) - 1
    seeds = torch.arange(B) * 1000 + 17
    n = torch.full((B,), 1)  # the root context [b] has length 1
    u_pos = counter_uniforms(seeds, n, D + 1)                      # [B, D+1], one per position
    res = accept_tree(tokens, parents, u_pos.gather(1, depth), logits=logits,
                      temperature=torch.full((B,), temp), top_k=torch.full((B,), top_k),
                      top_p=torch.full((B,), top_p), max_depth=D)
    assert (res.num_accepted >= 2).sum() >= 3
    for b in range(B):
        ctx, ar = [b], []
        for j in range(int(res.num_emitted[b])):
            probs = process_logits(lm(ctx)[None], temp, top_k, top_p)
            ar.append(int(sample_from_probs(probs, counter_uniforms(seeds[b:b + 1], n[b:b + 1] + j, 1)[0])))
            ctx.append(ar[-1])
        assert res.tokens[b, : len(ar)].tolist() == ar


def test_position_uniforms_are_the_positions_counter_uniforms():
    """Node r at depth d draws the uniform of token position first + d (depths past the bound clamp):
    what an ar step at that position draws."""
    seeds, first = torch.tensor([3, 17, 3]), torch.tensor([5, 0, 9])
    depth = torch.tensor([[0, 1, 1, 2, 7], [0, 2, 1, 0, 0], [0, 0, 3, 1, 2]])
    got = position_uniforms(seeds, first, depth, 3)
    for b in range(3):
        for r in range(5):
            d = min(int(depth[b, r]), 3)
            assert got[b, r] == counter_uniforms(seeds[b:b + 1], first[b:b + 1] + d, 1)[0, 0]
    assert not torch.equal(got[0], got[2])  # the same seed at other positions draws other values


def test_padding_and_empty_trees():
    # node 0 the root (its token 2 is never matched: it is not a child of anything)
    tokens = torch.tensor([[2, 2, -1, -1], [2, -1, -1, -1]])
    parents = torch.tensor([[-1, 0, 1, 1], [-1, 0, 0, 0]])
    probs = torch.zeros(2, 4, 3)
    probs[:, :, 2] = 1.0  # the target always says 2: the padding child of node 1 must not match
    res = accept_tree(tokens, parents, torch.zeros(2, 4), probs, max_depth=2, pad_token=-9)
    assert res.tokens.tolist() == [[2, 2, -9], [2, -9, -9]]
    assert res.num_accepted.tolist() == [1, 0] and res.accepted_path.tolist() == [[1, -1], [-1, -1]]
    assert res.accepted_node.tolist() == [1, 0]
    with pytest.raises(ValueError, match="root"):
        accept_tree(tokens[:, :0], parents[:, :0], torch.zeros(2, 0), probs[:, :0])


def test_no_host_sync_runs_on_meta_device():
    """Meta tensors have no data: any .item() / data-dependent shape would raise here."""
    B, T, V = 3, 5, 7
    m = dict(device="meta")
    res = accept_tree(torch.zeros(B, T, dtype=torch.long, **m), torch.zeros(B, T, dtype=torch.long, **m),
                      torch.zeros(B, T, **m), logits=torch.zeros(B, T, V, **m),
                      temperature=torch.zeros(B, **m), top_k=torch.zeros(B, dtype=torch.long, **m),
                      top_p=torch.ones(B, **m), max_depth=3)
    assert res.tokens.shape == (B, 4) and res.tokens.is_meta
    zeros = torch.zeros(B, dtype=torch.long, **m)
    assert counter_uniforms(zeros, zeros, 4).is_meta


# ---------------------------------------------------------------- tree acceptance: exactness

# A fixed tree over V=6 (siblings distinct): node 0 the root (token 5), drafts up to depth 4.
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7, 3]
TREE_TOKENS = [5, 0, 3, 5, 1, 2, 0, 4, 5, 2, 3]
V6 = 6


def toy_lm_logits(seed=11):
    """Context-dependent target logits over V6 tokens, favouring the tree's draft tokens (a good
    drafter) so that multi-node paths are accepted often."""
    g = torch.Generator().manual_seed(seed)
    ctxs = _tree_contexts()
    children = {}
    for p, t in zip(TREE_PARENTS[1:], TREE_TOKENS[1:], strict=True):
        children.setdefault(tuple(ctxs[p]), []).append(t)
    cache = {}

    def lm(ctx):
        key = tuple(ctx)
        if key not in cache:
            cache[key] = torch.randn(V6, generator=g)
            cache[key][children.get(key, [])] += 1.5
        return cache[key]

    return lm


def tree_target(lm, process):
    """[T, V] processed target rows for the fixed tree, plus a function ctx -> processed target."""
    rows = [process(lm(ctx)) for ctx in _tree_contexts()]
    return torch.stack(rows), lambda ctx: process(lm(ctx))


@pytest.mark.parametrize("params", [(1.0, -1, 1.0), (0.8, 4, 0.9)], ids=["plain", "temp-topk-topp"])
def test_tree_sampling_is_exact(params):
    """First one, two and three emitted tokens follow the target's exact marginals (chi-square).

    The step's own tokens are completed autoregressively (as the next steps would do), so the joint
    law of the first three tokens must be p(x1) p(x2|x1) p(x3|x1,x2) whatever the tree accepted.
    """
    temp, top_k, top_p = params
    lm = toy_lm_logits()
    process = lambda logits: process_logits(logits[None], temp, top_k, top_p)[0]  # noqa: E731
    rows, target = tree_target(lm, process)
    N, T = 60_000, len(TREE_PARENTS)
    g = torch.Generator().manual_seed(123)
    tokens = torch.tensor(TREE_TOKENS).expand(N, T)
    parents = torch.tensor(TREE_PARENTS).expand(N, T)
    logit_rows = torch.stack([lm(c) for c in _tree_contexts()])
    res = accept_tree(tokens, parents, torch.rand(N, T, generator=g),
                      logits=logit_rows.expand(N, T, V6), temperature=torch.full((N,), temp),
                      top_k=torch.full((N,), top_k), top_p=torch.full((N,), top_p), max_depth=4)
    assert (res.num_accepted >= 2).float().mean() > 0.2  # deep paths happen
    seq = complete_autoregressively(res, target, 3, g)

    # exact marginals of the first 1, 2 and 3 tokens
    p1 = rows[0]
    p12 = torch.stack([p1[a] * target([a]) for a in range(V6)])                          # [V, V]
    p123 = torch.stack([torch.stack([p12[a, b] * target([a, b]) for b in range(V6)]) for a in range(V6)])
    for n, exact in ((1, p1), (2, p12), (3, p123)):
        idx = torch.zeros(N, dtype=torch.long)
        for j in range(n):
            idx = idx * V6 + seq[:, j]
        counts = torch.bincount(idx, minlength=V6 ** n)
        assert chi2_pvalue(counts, exact.flatten()) > 1e-3, f"first {n} tokens"


def test_exactness_test_detects_a_wrong_rule():
    """Power check: using the root distribution at accepted nodes (a wrong rule) fails the test."""
    lm = toy_lm_logits()
    ident = lambda logits: torch.softmax(logits, -1)  # noqa: E731
    rows, target = tree_target(lm, ident)
    N, T = 60_000, len(TREE_PARENTS)
    g = torch.Generator().manual_seed(5)
    wrong = rows.clone()
    wrong[1:] = rows[0]
    res = accept_tree(torch.tensor(TREE_TOKENS).expand(N, T), torch.tensor(TREE_PARENTS).expand(N, T),
                      torch.rand(N, T, generator=g), wrong.expand(N, T, V6), max_depth=4)
    seq = complete_autoregressively(res, target, 2, g)
    p12 = torch.stack([rows[0][a] * target([a]) for a in range(V6)])
    assert chi2_pvalue(torch.bincount(seq[:, 0] * V6 + seq[:, 1], minlength=V6 * V6), p12.flatten()) < 1e-6


def _tree_contexts():
    """Each node's context after the committed prefix (the root's: empty)."""
    ctxs = {0: []}
    for i in range(1, len(TREE_PARENTS)):
        ctxs[i] = ctxs[TREE_PARENTS[i]] + [TREE_TOKENS[i]]
    return [ctxs[i] for i in range(len(TREE_PARENTS))]


def complete_autoregressively(res, target, n, g):
    """[N, n] first n tokens: the step's emitted ones, then AR draws from the target (vectorised)."""
    N = res.tokens.shape[0]
    seq = torch.full((N, n), -1, dtype=torch.long)
    m = min(n, res.tokens.shape[1])
    seq[:, :m] = res.tokens[:, :m]
    for j in range(1, n):
        need = seq[:, j] < 0
        # group by the (short) prefix so each distinct context is processed once
        prefixes = seq[:, :j]
        keys = torch.zeros(N, dtype=torch.long)
        for c in range(j):
            keys = keys * V6 + prefixes[:, c].clamp(min=0)
        probs = torch.stack([target(list(ctx)) for ctx in itertools.product(range(V6), repeat=j)])
        draw = sample_from_probs(probs[keys], torch.rand(N, generator=g))
        seq[:, j] = torch.where(need, draw, seq[:, j])
    return seq
