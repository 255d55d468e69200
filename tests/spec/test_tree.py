import pytest
import torch

from bole.spec.tree import DraftTree, PackedForest, random_tree, validate_parents


def test_depths_and_paths():
    t = DraftTree([-1, 0, 0, 1, -1, 4])
    assert t.depths == [1, 2, 2, 3, 1, 2]
    assert t.depth == 3
    assert t.path_to(3) == [0, 1, 3]
    assert t.path_to(5) == [4, 5]


@pytest.mark.parametrize("parents, msg", [
    ([0], "node 0: parent 0"),                 # self-loop
    ([-1, 2, 1], "node 1: parent 2"),          # parent after child (also a cycle 1<->2)
    ([-1, -2], "node 1: parent -2"),
    ([], "at least one node"),
])
def test_bad_parents_raise(parents, msg):
    with pytest.raises(ValueError, match=msg):
        DraftTree(parents)


def test_depth_limit_names_node():
    with pytest.raises(ValueError, match="node 3: depth 4 exceeds"):
        DraftTree([-1, 0, 1, 2], max_depth=3)
    with pytest.raises(ValueError, match="exceeds max_depth"):
        PackedForest.from_trees([[-1, 0, 1]], max_depth=2)


def test_bad_parent_tensor_shape():
    with pytest.raises(ValueError, match="1-D"):
        validate_parents(torch.zeros(2, 2, dtype=torch.long))


def test_forest_packing_matches_trees():
    g = torch.Generator().manual_seed(1)
    trees = [random_tree(n, 5, g) for n in (1, 7, 13, 70)]
    f = PackedForest.from_trees(trees)
    assert f.cu_seqlens.tolist() == [0, 1, 8, 21, 91]
    assert f.anc_bits.shape == (91, 2)
    for b, t in enumerate(trees):
        m = t.ancestor_mask()
        assert torch.equal(f.ancestor_mask(b), m)
        assert torch.equal(f.ancestor_mask(b, include_self=False), t.ancestor_mask(include_self=False))
        s = int(f.cu_seqlens[b])
        for i in range(t.num_nodes):
            word = f.anc_bits[s + i]
            bits = [(int(word[j // 64]) >> (j % 64)) & 1 for j in range(t.num_nodes)]
            assert bits == m[i].int().tolist()
            assert f.depth[s + i] == t.depths[i]
        assert f.tree(b).parents == t.parents
    gp = f.global_parents()
    assert gp[8 + 0] == -1 and all(gp[i] < i for i in range(91))


def test_accepted_path_nodes():
    f = PackedForest.from_trees([[-1, 0, 0, 2], [-1, -1]])
    p = f.accepted_path_nodes([3, -1])
    assert p.tolist() == [[0, 2, 3], [-1, -1, -1]]
    assert f.accepted_path_nodes([1, 1]).tolist() == [[0, 1, -1], [5, -1, -1]]
    with pytest.raises(ValueError, match="accepted node 4"):
        f.accepted_path_nodes([4, 0])
    with pytest.raises(ValueError, match="2 requests"):
        f.accepted_path_nodes([0])


def test_random_tree_respects_limits():
    g = torch.Generator().manual_seed(0)
    for n in (1, 8, 64, 128):
        t = random_tree(n, 8, g)
        assert t.num_nodes == n and t.depth <= 8
    assert random_tree(64, 8, torch.Generator().manual_seed(3)).depth >= 4


def test_from_padded_equals_from_trees():
    g = torch.Generator().manual_seed(7)
    for sizes, D in (((1, 7, 13, 70), 6), ((5,), 3), ((64, 2, 128), 8)):
        trees = [random_tree(n, D, g) for n in sizes]
        T = max(sizes)
        par = torch.full((len(trees), T), -5, dtype=torch.long)  # garbage past each tree
        for b, t in enumerate(trees):
            par[b, : t.num_nodes] = torch.tensor(t.parents)
        a = PackedForest.from_padded(par, torch.tensor(sizes), D)
        ref = PackedForest.from_trees(trees, max_depth=D)
        for f in ("cu_seqlens", "parents", "depth", "anc", "anc_bits", "request_ids"):
            assert torch.equal(getattr(a, f), getattr(ref, f)), f
        assert a.max_depth == D and a.max_nodes == T


def test_from_padded_rejects_bad_trees():
    with pytest.raises(ValueError, match="precede"):
        PackedForest.from_padded(torch.tensor([[-1, 1]]), torch.tensor([2]), 4)
    with pytest.raises(ValueError, match="deeper than max_depth=2"):
        PackedForest.from_padded(torch.tensor([[-1, 0, 1]]), torch.tensor([3]), 2)
