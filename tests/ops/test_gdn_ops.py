"""The naive twins agree with each other: closed form (eq. 2) and commit (eq. 10) == serial recurrence."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bole.ops.gdn import gdn_commit_ref, gdn_recurrent_ref, gdn_tree_serial_ref, gdn_tree_verify_ref
from bole.spec.tree import DraftTree, PackedForest, random_tree

F64 = torch.float64


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def make_inputs(N, HK, HV, K, V, slots, gen, gate="mid", beta_mode="mid", dtype=F64):
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)
    u = lambda *s: torch.rand(*s, generator=gen, dtype=F64)
    q, k, v = r(1, N, HK, K), r(1, N, HK, K), r(1, N, HV, V)
    g = {"near0": -20 - 10 * u(1, N, HV),          # gamma = exp(g) near 0
         "near1": -1e-4 * u(1, N, HV),              # gamma near 1
         "mid": -u(1, N, HV)}[gate]
    beta = {"near0": 1e-4 * u(1, N, HV), "near1": 1 - 1e-4 * u(1, N, HV), "mid": u(1, N, HV)}[beta_mode]
    pool = r(slots, HV, V, K)
    return [t.to(dtype) for t in (q, k, v, g, beta, pool)]


trees = st.one_of(
    st.integers(1, 12).map(lambda n: list(range(-1, n - 1))),          # chains, depth 1..12
    st.integers(1, 12).map(lambda n: [-1] * n),                          # stars
    st.just([-1]),                                                        # single node
    st.lists(st.integers(0, 10**6), min_size=1, max_size=24).map(        # arbitrary trees
        lambda xs: [-1] + [x % i - 1 if x % (i + 1) else x % i for i, x in enumerate(xs[1:], 1)]),
)


@settings(max_examples=40, deadline=None)
@given(forest=st.lists(trees, min_size=1, max_size=3), gate=st.sampled_from(["near0", "near1", "mid"]),
       beta_mode=st.sampled_from(["near0", "near1", "mid"]), l2=st.booleans(), seed=st.integers(0, 99))
def test_closed_form_equals_serial_float64(forest, gate, beta_mode, l2, seed):
    forest = [DraftTree(t, max_depth=24) for t in forest]
    f = PackedForest.from_trees(forest)
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta, pool = make_inputs(f.num_nodes, 2, 4, 5, 3, 4, gen, gate, beta_mode)
    idx = torch.randperm(4, generator=gen)[: f.num_requests]
    o_ser, snaps = gdn_tree_serial_ref(q, k, v, g, beta, f, pool, idx, use_qk_l2norm=l2)
    o_cf, u, logp = gdn_tree_verify_ref(q, k, v, g, beta, f, pool, idx, use_qk_l2norm=l2)
    assert rel_err(o_cf, o_ser) <= 1e-10
    # Commit of every node's path reproduces that node's serial state.
    for b in range(f.num_requests):
        T = int(f.cu_seqlens[b + 1] - f.cu_seqlens[b])
        for a in range(T):
            acc = [-1] * f.num_requests
            acc[b] = a
            p = pool[None].clone()
            gdn_commit_ref(p, k, u[None], logp[None], f.accepted_path_nodes(acc), idx, use_qk_l2norm=l2)
            assert rel_err(p[0, idx[b]], snaps[int(f.cu_seqlens[b]) + a]) <= 1e-10
            others = [s for s in range(4) if s != int(idx[b])]
            assert torch.equal(p[0, others], pool[others])


def test_chain_equals_sequence_recurrence():
    gen = torch.Generator().manual_seed(0)
    f = PackedForest.from_trees([DraftTree.chain(9), DraftTree.chain(3)])
    q, k, v, g, beta, pool = make_inputs(12, 1, 3, 8, 6, 2, gen)
    o_cf, _, _ = gdn_tree_verify_ref(q, k, v, g, beta, f, pool, [1, 0])
    o_seq, _ = gdn_recurrent_ref(q, k, v, g, beta, initial_state=pool, state_indices=[1, 0],
                             cu_seqlens=f.cu_seqlens)
    assert rel_err(o_cf, o_seq) <= 1e-10


def test_closed_form_fp32_matches_float64():
    gen = torch.Generator().manual_seed(2)
    f = PackedForest.from_trees([random_tree(31, 8, gen), random_tree(17, 6, gen)])
    ins = make_inputs(f.num_nodes, 2, 4, 16, 16, 2, gen)
    o64, u64, _ = gdn_tree_verify_ref(*ins[:5], f, ins[5], [0, 1], use_qk_l2norm=True)
    ins32 = [t.float() for t in ins]
    o32, u32, _ = gdn_tree_verify_ref(*ins32[:5], f, ins32[5], [0, 1], use_qk_l2norm=True)
    assert o32.dtype == torch.float32
    assert rel_err(o32.double(), o64) <= 1e-5 and rel_err(u32.double(), u64) <= 1e-5


def test_empty_path_leaves_state_untouched():
    gen = torch.Generator().manual_seed(3)
    f = PackedForest.from_trees([[-1, 0]])
    q, k, v, g, beta, pool = make_inputs(2, 1, 1, 4, 4, 1, gen)
    _, u, logp = gdn_tree_verify_ref(q, k, v, g, beta, f, pool, [0])
    p = pool[None].clone()
    gdn_commit_ref(p, k, u[None], logp[None], f.accepted_path_nodes([-1]), torch.tensor([0]))
    assert torch.equal(p[0], pool)


def test_bad_shapes_raise():
    gen = torch.Generator().manual_seed(4)
    f = PackedForest.from_trees([[-1, 0, 0]])
    q, k, v, g, beta, pool = make_inputs(3, 2, 4, 4, 4, 1, gen)
    with pytest.raises(ValueError, match="multiple of key heads"):
        gdn_tree_verify_ref(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3], f, pool, [0])
    with pytest.raises(ValueError, match="k shape"):
        gdn_tree_verify_ref(q, k[:, :2], v, g, beta, f, pool, [0])
    with pytest.raises(ValueError, match="forest has 3 nodes"):
        gdn_tree_verify_ref(q[:, :2], k[:, :2], v[:, :2], g[:, :2], beta[:, :2], f, pool, [0])
    with pytest.raises(ValueError, match="g must be"):
        gdn_tree_verify_ref(q, k, v, g[..., :1], beta, f, pool, [0])


def test_tree_verify_out_buffers_equal_the_default_returns():
    """u_out / logp_out / o_out (the layer passes slices of the all-layer factor buffer) receive exactly
    what the default call returns, and are what the call returns."""
    gen = torch.Generator().manual_seed(5)
    f = PackedForest.from_trees([random_tree(9, 4, gen), random_tree(5, 3, gen)])
    q, k, v, g, beta, pool = [t.float() for t in make_inputs(f.num_nodes, 2, 4, 8, 8, 3, gen)]
    want = gdn_tree_verify_ref(q, k, v, g, beta, f, pool, [2, 0], use_qk_l2norm=True)
    buf_u = torch.full((2, f.num_nodes, 4, 8), float("nan"))
    buf_logp = torch.full((2, f.num_nodes, 4), float("nan"))
    o_out = torch.full_like(want[0], float("nan"))
    got = gdn_tree_verify_ref(q, k, v, g, beta, f, pool, [2, 0], use_qk_l2norm=True, u_out=buf_u[1],
                          logp_out=buf_logp[1], o_out=o_out)
    assert got[0] is o_out and got[1].data_ptr() == buf_u[1].data_ptr() and got[2].data_ptr() == buf_logp[1].data_ptr()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.isnan(buf_u[0]).all() and torch.isnan(buf_logp[0]).all()
    with pytest.raises(ValueError, match="u_out"):
        gdn_tree_verify_ref(q, k, v, g, beta, f, pool, [2, 0], u_out=buf_u)
