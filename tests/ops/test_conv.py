"""Tree conv1d and its commit agree with the sequence conv along every root-to-node path."""

import torch

from bole.ops.conv import causal_conv1d, causal_conv1d_tree_ref, conv_state_commit
from bole.spec.tree import PackedForest, random_tree


def test_tree_conv_equals_sequence_conv_along_paths():
    gen = torch.Generator().manual_seed(0)
    C, W, slots = 6, 4, 3
    trees = [random_tree(n, 6, gen) for n in (1, 9, 14)]
    f = PackedForest.from_trees(trees)
    x = torch.randn(f.num_nodes, C, generator=gen, dtype=torch.float64)
    w = torch.randn(C, W, generator=gen, dtype=torch.float64)
    bias = torch.randn(C, generator=gen, dtype=torch.float64)
    state = torch.randn(slots, C, W - 1, generator=gen, dtype=torch.float64)
    idx = torch.tensor([2, 0, 1])
    before = state.clone()
    y = causal_conv1d_tree_ref(x, w, bias, state, idx, f)
    assert torch.equal(state, before)  # verification never writes the state
    for b, t in enumerate(trees):
        s = int(f.cu_seqlens[b])
        for i in range(t.num_nodes):
            path = [s + j for j in t.path_to(i)]
            st = state.clone()
            y_seq = causal_conv1d(x[path], w, bias, st, idx[b : b + 1])
            assert torch.allclose(y[s + i], y_seq[-1], rtol=0, atol=1e-12)
            # commit of that path leaves exactly the sequence conv's final state
            acc = [-1] * len(trees)
            acc[b] = i
            st2 = state.clone()
            conv_state_commit(st2, x, f, idx, f.accepted_path_nodes(acc))
            assert torch.equal(st2[idx[b]], st[idx[b]])
            assert torch.equal(st2[[k for k in range(slots) if k != int(idx[b])]],
                               state[[k for k in range(slots) if k != int(idx[b])]])


def test_sequence_conv_matches_torch_conv1d_from_zero_state():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(10, 5, generator=gen)
    w = torch.randn(5, 4, generator=gen)
    st = torch.zeros(1, 5, 3)
    y = causal_conv1d(x, w, None, st, [0], activation=None)
    ref = torch.nn.functional.conv1d(x.T[None], w[:, None], padding=3, groups=5)[0, :, :10].T
    assert torch.allclose(y, ref, atol=1e-6)
    assert torch.equal(st[0], x[-3:].T)


def test_tree_windows_equal_the_recursive_definition():
    """The gathered windows equal the node-by-node recursion (parent's window shifted, own input last)."""
    from bole.ops.conv import _tree_windows

    gen = torch.Generator().manual_seed(1)
    for W in (2, 4, 5):
        f = PackedForest.from_trees([random_tree(n, 8, gen) for n in (1, 3, 17, 40)])
        x = torch.randn(f.num_nodes, 12, generator=gen).bfloat16()
        state, idx = torch.randn(7, 12, W - 1, generator=gen), torch.tensor([6, 0, 3, 2])
        gpar, rid = f.global_parents().tolist(), f.request_ids.tolist()
        ref = torch.empty(f.num_nodes, 12, W, dtype=x.dtype)
        for i in range(f.num_nodes):
            ref[i, :, : W - 1] = state[int(idx[rid[i]])].to(x.dtype) if gpar[i] < 0 else ref[gpar[i], :, 1:]
            ref[i, :, W - 1] = x[i]
        assert torch.equal(_tree_windows(x, f, state, idx, W), ref)


def test_conv_commit_layers_matches_per_layer_commit_and_writes_out_of_place():
    from bole.ops.conv import conv_state_commit_layers

    gen = torch.Generator().manual_seed(5)
    forest = PackedForest.from_trees([random_tree(9, 4, gen), random_tree(4, 3, gen), random_tree(6, 5, gen)])
    L, C, W1, slots = 2, 5, 3, 6
    x = torch.randn(L, forest.num_nodes, C, generator=gen)
    state = torch.randn(L, slots, C, W1, generator=gen)
    idx = torch.tensor([4, 0, 2])
    accepted = forest.accepted_path_nodes([6, -1, 3])
    want = state.clone()
    for layer in range(L):
        conv_state_commit(want[layer], x[layer], forest, idx, accepted)
    got = conv_state_commit_layers(state.clone(), x, idx, accepted)
    assert torch.equal(got, want)
    out = torch.full((L, 4, C, W1), float("nan"))
    before = state.clone()
    conv_state_commit_layers(state, x, idx, accepted, out, torch.tensor([1, 3, 0]))
    assert torch.equal(state, before)  # the committed pool is read only
    assert torch.equal(out[:, 1], want[:, 4]) and torch.equal(out[:, 0], want[:, 2])
    assert torch.isnan(out[:, 3]).all() and torch.isnan(out[:, 2]).all()  # empty path: its out slot as it was
