"""Penalties and log-probabilities as pure tensor functions (bole/spec/sampling.py, bole/spec/logprobs.py)."""

import pytest
import torch
from engine_helpers import reference_penalty

from bole.spec.logprobs import emitted_logprobs, path_rows, to_entries
from bole.spec.sampling import (
    Penalties,
    accept_tree,
    apply_penalties,
    process_logits,
    processed_logprobs,
    sample_from_probs,
)
from bole.spec.tree import PackedForest, random_tree


def make_penalties(outputs, prompts, rep, freq, pres, V) -> Penalties:
    B = len(outputs)
    counts, mask = torch.zeros(B, V), torch.zeros(B, V, dtype=torch.bool)
    for b in range(B):
        for t in outputs[b]:
            counts[b, t] += 1
        for t in prompts[b]:
            mask[b, t] = True
    f = lambda xs: torch.tensor(xs, dtype=torch.float32)
    return Penalties(counts, mask, f(rep), f(freq), f(pres))


def test_apply_penalties_matches_python_rule():
    gen = torch.Generator().manual_seed(0)
    V = 11
    logits = torch.randn(4, V, generator=gen) * 3
    outputs = [[1, 1, 4], [2], [], [3, 3, 3, 7]]
    prompts = [[0, 4, 9], [5], [6, 6], []]
    rep, freq, pres = [1.7, 1.0, 0.5, 1.0], [0.6, -1.2, 0.0, 0.0], [1.1, 0.0, 2.0, 0.0]
    pen = make_penalties(outputs, prompts, rep, freq, pres, V)
    path = torch.tensor([[4, -1], [2, 8], [-1, -1], [7, 3]])
    for tokens in (None, path):
        got = apply_penalties(logits, pen, tokens)
        for b in range(4):
            ctx = outputs[b] + ([] if tokens is None else [t for t in tokens[b].tolist() if t >= 0])
            ref = reference_penalty(logits[b].tolist(), ctx, prompts[b], rep[b], freq[b], pres[b])
            assert torch.allclose(got[b], ref, atol=1e-6), (b, tokens)
        assert torch.equal(got[3], logits[3])  # neutral parameters: bit-identical, whatever the counts


def walk_reference(tokens, parents, logits, uniforms, pen_rows, temp, D):
    """The lossless walk of one request done position by position: each visited row is penalised with
    the committed output plus the tokens emitted before it in this step (its path). Node 0 the root."""
    out_prev, prompt, rep, freq, pres = pen_rows
    cur, emitted = 0, []
    for _ in range(D + 1):
        row = reference_penalty(logits[cur].tolist(), out_prev + emitted, prompt, rep, freq, pres)
        if temp <= 0:
            x = int(row.argmax())
        else:
            p = process_logits(row[None], temp, -1, 1.0)
            x = int(sample_from_probs(p, uniforms[cur][None])[0])
        emitted.append(x)
        child = [i for i in range(len(tokens)) if parents[i] == cur and tokens[i] == x]
        if not child or len(emitted) > D:
            break
        cur = child[0]
    return emitted


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_penalised_tree_walk_equals_position_by_position(temp):
    """Random trees over a 4-token vocabulary (tokens recur along paths): accept_tree with penalties emits
    what the position-by-position reference emits, greedy and with uniforms."""
    gen = torch.Generator().manual_seed(1)
    V, B, T, D = 4, 6, 9, 4
    outputs = [[int(t) for t in torch.randint(0, V, (n,), generator=gen)] for n in (0, 1, 3, 2, 5, 1)]
    prompts = [[int(t) for t in torch.randint(0, V, (2,), generator=gen)] for _ in range(B)]
    rep, freq, pres = [2.0, 1.5, 0.7, 1.0, 3.0, 1.2], [1.0, 0.0, 0.5, -0.5, 1.5, 2.0], [1.5, 2.0, 0.0, 1.0, 0.5, 0.0]
    pen = make_penalties(outputs, prompts, rep, freq, pres, V)
    for trial in range(20):
        # node 0 the root, T drafts below it (a draft tree's root children are node 0's)
        parents = torch.stack([torch.tensor([-1] + [p + 1 for p in random_tree(T, D, generator=gen).parents])
                               for _ in range(B)])
        tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), torch.randint(0, V, (B, T), generator=gen)], 1)
        for b in range(B):  # children of one node carry distinct tokens
            for i in range(1, T + 1):
                sib = [j for j in range(1, i) if parents[b, j] == parents[b, i]]
                free = [v for v in range(V) if v not in tokens[b, sib].tolist()]
                tokens[b, i] = free[0] if free else -1
        logits = torch.randn(B, T + 1, V, generator=gen)
        u = torch.rand(B, T + 1, generator=gen)
        acc = accept_tree(tokens, parents, u, logits=logits, temperature=temp if temp <= 0 else torch.full((B,), temp),
                          top_k=-1 if temp <= 0 else torch.full((B,), -1), top_p=1.0 if temp <= 0 else
                          torch.ones(B), max_depth=D, penalties=pen)
        for b in range(B):
            ref = walk_reference(tokens[b].tolist(), parents[b].tolist(), logits[b], u[b],
                                 (outputs[b], prompts[b], rep[b], freq[b], pres[b]), temp, D)
            assert acc.tokens[b, :acc.num_emitted[b]].tolist() == ref, (trial, b)


def test_a_node_row_is_penalised_with_its_own_path():
    """Root row: token 2 wins; the accepted child carries 2, and its row's raw argmax is 2 again, which
    the repetition penalty on the path's 2 turns into 3. A rule that ignored the path would emit 2, 2."""
    logits = torch.tensor([[[0.0, 0.0, 5.0, 1.0], [0.0, 0.0, 3.0, 2.0]]])
    pen = make_penalties([[]], [[]], [4.0], [0.0], [0.0], 4)
    tree = torch.tensor([[0, 2]]), torch.tensor([[-1, 0]])   # the root (node 0), its child 2
    acc = accept_tree(*tree, torch.zeros(1, 2), logits=logits, temperature=0.0, top_k=-1, top_p=1.0, penalties=pen)
    assert acc.tokens[0].tolist() == [2, 3]
    plain = accept_tree(*tree, torch.zeros(1, 2), logits=logits, temperature=0.0, top_k=-1, top_p=1.0)
    assert plain.tokens[0].tolist() == [2, 2]
    with pytest.raises(ValueError, match="penalties apply to logits"):
        accept_tree(*tree, torch.zeros(1, 2), probs=logits.softmax(-1), penalties=pen)


def test_processed_logprobs_are_the_sampled_distribution():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 30, generator=gen) * 2
    temp, top_k, top_p = torch.tensor([0.0, 0.7, 1.3, 1.0]), torch.tensor([-1, 5, -1, 3]), \
        torch.tensor([1.0, 1.0, 0.6, 0.9])
    pen = make_penalties([[1, 2, 2], [], [4], [0]], [[3], [], [], [5]], [1.3, 1.0, 2.0, 1.0],
                         [0.5, 0.0, 0.0, 1.0], [0.2, 0.0, 1.0, 0.0], 30)
    lp = processed_logprobs(logits, temp, top_k, top_p, pen)
    probs = process_logits(logits, temp, top_k, top_p, pen)
    # greedy row: the log-softmax of the penalised logits (its argmax is the emitted one-hot)
    assert torch.allclose(lp[0], torch.log_softmax(apply_penalties(logits, pen)[0], -1), atol=1e-6)
    assert int(lp[0].argmax()) == int(probs[0].argmax())
    for r in (1, 2, 3):
        assert torch.equal(torch.isinf(lp[r]), probs[r] == 0), r
        kept = probs[r] > 0
        assert torch.allclose(lp[r][kept].exp(), probs[r][kept], atol=1e-6)
    assert int(torch.isfinite(lp[1]).sum()) == 5


def test_path_rows_and_emitted_logprobs():
    """Two trees (root + drafts); each emitted position's logprob comes from the row of its path node, and
    with penalties a later position sees the earlier emitted tokens."""
    parents = torch.tensor([[-1, 0, 0, 1, -1], [-1, 0, 1, 2, 3]])    # local, node 0 = the root
    forest = PackedForest.from_padded(parents, torch.tensor([4, 5]), 5)
    rows = path_rows(forest, [3, 4], 2)       # deepest accepted nodes: node 3 and node 4 of the trees
    assert rows.tolist()[0][:3] == [0, 1, 3] and rows.tolist()[1][:5] == [0, 1, 2, 3, 4]
    assert path_rows(forest, [0, 1], 2).tolist()[0][:2] == [0, -1]
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 6, generator=gen)
    tokens = torch.tensor([[4, 4, 1], [2, -1, -1]])
    pen = make_penalties([[], []], [[], []], [2.0, 1.0], [0.0, 0.0], [0.0, 0.0], 6)
    chosen, ids, lps = emitted_logprobs(logits, tokens, 2, 0.0, -1, 1.0, pen)
    ref1 = torch.log_softmax(reference_penalty(logits[0, 1].tolist(), [4], [], 2.0, 0, 0), -1)
    assert abs(float(chosen[0, 1]) - float(ref1[4])) < 1e-6
    assert abs(float(chosen[1, 0]) - float(torch.log_softmax(logits[1, 0], -1)[2])) < 1e-6
    entries = to_entries(chosen, ids, lps, [[4, 4, 1], [2]], [2, 0])
    assert [e.token_id for e in entries[0]] == [4, 4, 1] and len(entries[1]) == 1
    assert len(entries[0][0].top) == 2 and entries[1][0].top == ()
    assert entries[0][0].top[0][1] >= entries[0][0].top[1][1]
