"""The greedy acceptance kernel (kernels/greedy_accept.py) against its twin (bole.ops.accept, the
greedy walk of accept_tree): random trees whose logits plant argmax paths of random lengths, padding
nodes, strided inputs, depth bounds that cut the walk."""

import random

import pytest
import torch

from bole.backend import tree_acceptance
from bole.ops.accept import greedy_accept_ref
from kernels.greedy_accept import greedy_accept as greedy_accept_kernel

greedy_accept = tree_acceptance(greedy_accept_kernel)  # as the triton backend wires it


def planted(B, T, V, D, seed, device="cpu", dtype=torch.float32):
    """Trees of T nodes (node 0 the root, drafts of depth <= D, siblings with distinct tokens, some
    padding nodes), and logits whose argmax follows a random path of each tree for a random number of
    levels."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.full((B, T), -1, dtype=torch.long)
    parents = torch.full((B, T), -1, dtype=torch.long)
    logits = torch.randn(B, T, V, generator=gen)
    for b in range(B):
        tokens[b, 0] = rng.randrange(V)  # the root: never matched
        depth, used = {0: 0}, {}
        for t in range(1, T):
            opts = [0] + [j for j in range(1, t) if depth[j] < D and tokens[b, j] >= 0]
            p = rng.choice(opts)
            taken = used.setdefault(p, set())
            free = [v for v in range(V) if v not in taken]
            parents[b, t] = p
            depth[t] = depth[p] + 1
            if rng.random() < 0.15 or not free:  # a padding node
                continue
            tok = rng.choice(free)
            taken.add(tok)
            tokens[b, t] = tok
        # plant: from the root, follow random children for a random number of levels
        cur, steps = 0, rng.randint(0, D + 1)
        for _ in range(steps):
            kids = [t for t in range(1, T) if parents[b, t] == cur and tokens[b, t] >= 0]
            if not kids:
                break
            c = rng.choice(kids)
            logits[b, cur, tokens[b, c]] = 50.0
            cur = c
    return tokens.to(device), parents.to(device), logits.to(device, dtype)


def assert_same(a, b):
    for f in ("accepted_path", "num_accepted", "accepted_node", "tokens", "num_emitted"):
        assert torch.equal(getattr(a, f).cpu(), getattr(b, f).cpu()), f


@pytest.mark.parametrize("B,T,V,D", [(1, 5, 16, 4), (3, 47, 40, 12), (2, 128, 64, 8), (4, 2, 8, 1), (4, 1, 8, 1),
                                     (2, 20, 30, 0)])
def test_kernel_matches_twin(B, T, V, D):
    for seed in range(3):
        tok, par, logits = planted(B, T, V, max(D, 1), seed)
        assert_same(greedy_accept(tok, par, logits, D), greedy_accept_ref(tok, par, logits, D))


def test_deep_acceptance_and_strided_inputs():
    tok, par, logits = planted(3, 30, 50, 10, 7)
    wide = torch.full((3, 40), 99, dtype=torch.long)
    wide[:, 5:35] = tok
    got = greedy_accept(wide[:, 5:35], par - 0, logits, 10, pad_token=-3)
    ref = greedy_accept_ref(tok, par, logits, 10, pad_token=-3)
    assert_same(got, ref)
    chain = torch.arange(-1, 10)[None]               # the root and a chain of 10 drafts, all accepted
    toks = torch.cat([torch.tensor([11]), torch.arange(10)])[None]
    lg = torch.zeros(1, 11, 12)
    lg[0, torch.arange(11), torch.arange(11)] = 1.0  # node i's argmax is node i + 1's token
    acc = greedy_accept(toks, chain, lg, 10)
    assert acc.num_emitted.item() == 11 and acc.accepted_node.item() == 10
    assert_same(acc, greedy_accept_ref(toks, chain, lg, 10))


def test_bad_inputs():
    tok, par, logits = planted(2, 6, 10, 3, 0)
    with pytest.raises(ValueError, match="tokens"):
        greedy_accept(tok.float(), par, logits, 3)
    with pytest.raises(ValueError, match="logits"):
        greedy_accept(tok, par, logits[:, :3], 3)
    with pytest.raises(ValueError, match="parents"):
        greedy_accept(tok, par[:, :4], logits, 3)
    with pytest.raises(ValueError, match="max_depth"):
        greedy_accept(tok, par, logits, -1)
    with pytest.raises(ValueError, match="root"):
        greedy_accept(tok[:, :0], par[:, :0], logits[:, :0], 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,T,V,D,dtype", [(1, 64, 5000, 13, torch.bfloat16), (16, 128, 1000, 9, torch.float32)])
def test_kernel_matches_twin_cuda(B, T, V, D, dtype):
    tok, par, logits = planted(B, T, V, D, 1, "cuda", dtype)
    assert_same(greedy_accept(tok, par, logits, D), greedy_accept_ref(tok, par, logits, D))
