"""The fused tree conv (kernels/gdn_tree_conv.py) against its twins (bole/ops/conv.py).

Forests mix tree sizes (a lone root, chains, bushy trees, the 128-node limit) and depths below and
above the conv window; x is a column slice of a wider tensor whose other columns are NaN, the state a
layer of an all-layer pool whose other layers are NaN, and every output buffer is NaN before the run,
so a read outside a view or an unwritten element fails. The pool must stay bitwise untouched. Under
TRITON_INTERPRET (CPU) bf16 is left to the GPU test: the interpreter truncates fp32 -> bf16 casts.
"""

import pytest
import torch
from numerics import rel_err

from bole.ops.conv import causal_conv1d_tree_ref, gdn_tree_conv_ref
from bole.spec.tree import DraftTree, PackedForest, random_tree
from kernels.gdn_tree_conv import causal_conv1d_tree, gdn_tree_conv

NAN = float("nan")



def make_forest(sizes, device, seed, max_depth=6):
    gen = torch.Generator().manual_seed(seed)
    trees = [DraftTree.chain(-n) if n < 0 else random_tree(n, max_depth, gen) for n in sizes]
    return PackedForest.from_trees(trees, device=device)


def conv_inputs(device, forest, C, W, dtype, state_dtype, seed, bias=False):
    gen = torch.Generator().manual_seed(seed)
    N, B = forest.num_nodes, forest.num_requests
    wide = torch.full((N, C + 9), NAN)
    wide[:, 5:5 + C] = torch.randn(N, C, generator=gen)
    x = wide.to(device, dtype)[:, 5:5 + C]
    weight = torch.randn(C, 1, W, generator=gen).to(device, dtype)[:, 0, :]  # as conv1d.weight[:, 0, :]
    slots = B + 3
    pool = torch.full((3, slots, C, W - 1), NAN)
    pool[1] = torch.randn(slots, C, W - 1, generator=gen)
    state = pool.to(device, state_dtype)[1]
    idx = torch.randperm(slots, generator=gen)[:B].to(device)
    b = torch.randn(C, generator=gen).to(device, dtype) if bias else None
    return x, weight, b, state, idx


def poisoned(*shape, dtype, device):
    return torch.full(shape, NAN, dtype=dtype, device=device)


@pytest.mark.parametrize("sizes,C,W,dtype,state_dtype", [
    ((1, 9, 14), 100, 4, torch.float32, torch.float32),         # Qwen's W=4, odd channel count
    ((-5, 1, 33), 63, 4, torch.float16, torch.float32),          # a chain deeper than the window
    ((128, 3), 40, 2, torch.float32, torch.float16),             # the 128-node tree tile, W=2
    ((7, -2, 20, 1), 96, 5, torch.float16, torch.float16),
])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_conv_matches_twin(device, sizes, C, W, dtype, state_dtype, bias, seed):
    forest = make_forest(sizes, device, seed)
    x, weight, b, state, idx = conv_inputs(device, forest, C, W, dtype, state_dtype, seed, bias)
    before = state.clone()
    out = poisoned(forest.num_nodes, C, dtype=dtype, device=device)
    y_k = causal_conv1d_tree(x, weight, b, state, idx, forest, out=out, block_c=32)
    y_t = causal_conv1d_tree_ref(x, weight, b, state, idx, forest)
    assert y_k is out and y_k.dtype == dtype
    # fp32 sums in another order (~1e-7); fp16: one rounding of the same fp32 value
    assert rel_err(y_k, y_t) <= (1e-6 if dtype == torch.float32 else 1e-3)
    assert torch.equal(state, before), "verification never writes the conv pool"


@pytest.mark.parametrize("activation", [None, "silu"])
def test_tree_conv_identity_activation_and_int32_slots(device, activation):
    forest = make_forest((4, 11), device, seed=2)
    x, weight, _, state, idx = conv_inputs(device, forest, 50, 4, torch.float32, torch.float32, seed=2)
    y_k = causal_conv1d_tree(x, weight, None, state, idx.int(), forest, activation)
    y_t = causal_conv1d_tree_ref(x, weight, None, state, idx, forest, activation)
    assert rel_err(y_k, y_t) <= 1e-6


def test_split_outputs_and_input_copy_equal_the_default(device):
    """out as (q, k, v) column ranges with their own row strides, k a layer of a factor buffer, and x
    copied into the commit's conv inputs: the same values as one [N, C] output."""
    forest = make_forest((6, 1, 17), device, seed=3)
    N, HK, K, HV, V, W = forest.num_nodes, 2, 8, 3, 12, 4
    C = 2 * HK * K + HV * V
    x, weight, _, state, idx = conv_inputs(device, forest, C, W, torch.float32, torch.float32, seed=3)
    y = causal_conv1d_tree(x, weight, None, state, idx, forest)
    for fn in (causal_conv1d_tree, causal_conv1d_tree_ref):
        q = poisoned(N, HK * K, dtype=torch.float32, device=device)
        k_buf = poisoned(2, N, HK * K, dtype=torch.float32, device=device)
        v = poisoned(N, HV * V + 3, dtype=torch.float32, device=device)[:, :HV * V]  # row stride > width
        x_buf = poisoned(2, N, C, dtype=torch.float32, device=device)
        parts = (q, k_buf[1], v)
        got = fn(x, weight, None, state, idx, forest, out=parts, x_copy=x_buf[1])
        assert got is parts
        assert torch.equal(torch.cat(parts, dim=1), y) if fn is causal_conv1d_tree else \
            rel_err(torch.cat(parts, dim=1), y) <= 1e-6
        assert torch.equal(x_buf[1], x) and torch.isnan(x_buf[0]).all() and torch.isnan(k_buf[0]).all()


def gating_inputs(device, N, HV, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    ab = torch.full((N, 2 * HV + 3), NAN)
    ab[:, :HV] = torch.randn(N, HV, generator=gen) * 3
    ab[0, 0], ab[-1, HV - 1] = 25.0, -30.0  # softplus above its threshold, and far below zero
    ab[:, HV + 1:2 * HV + 1] = torch.randn(N, HV, generator=gen) * 2
    ab = ab.to(device, dtype)
    A_log = (torch.rand(HV, generator=gen) * 2 - 1).to(device, dtype)
    dt_bias = torch.randn(HV, generator=gen).to(device, dtype)
    return ab[:, :HV], ab[:, HV + 1:2 * HV + 1], A_log, dt_bias


@pytest.mark.parametrize("HV,dtype", [(4, torch.float32), (6, torch.float32), (1, torch.float16),
                                      (5, torch.float16)])
@pytest.mark.parametrize("seed", [0, 1])
def test_fused_gating_matches_twin(device, HV, dtype, seed):
    forest = make_forest((9, 1, 5), device, seed)
    N, HK, K = forest.num_nodes, 1, 16
    C = 2 * HK * K + HV * 8
    x, weight, _, state, idx = conv_inputs(device, forest, C, 4, dtype, torch.float32, seed)
    a, b, A_log, dt_bias = gating_inputs(device, N, HV, dtype, seed)
    x_k, x_t = poisoned(N, C, dtype=dtype, device=device), poisoned(N, C, dtype=dtype, device=device)
    y_k, g_k, beta_k = gdn_tree_conv(x, weight, state, idx, forest, a, b, A_log, dt_bias, x_copy=x_k, block_c=16)
    y_t, g_t, beta_t = gdn_tree_conv_ref(x, weight, state, idx, forest, a, b, A_log, dt_bias, x_copy=x_t)
    assert g_k.dtype == torch.float32 and beta_k.dtype == dtype and g_k.shape == beta_k.shape == (N, HV)
    assert rel_err(y_k, y_t) <= (1e-6 if dtype == torch.float32 else 1e-3)
    assert rel_err(g_k, g_t) <= 1e-6
    # beta: the fp32 sigmoid (an ulp apart), then rounded to b's dtype (fp16: equal, or one step apart)
    assert (beta_k.double() - beta_t.double()).abs().max() <= (3e-7 if dtype == torch.float32 else 1e-3)
    assert torch.equal(x_k, x_t)


def test_graph_padded_forest(device):
    """The verify graph's forest (``PackedForest.full_padded``: trees padded with extra root children,
    padding requests on one shared slot) through the whole prologue."""
    parents = torch.tensor([[-1, 0, 1, 2, 0, -1, -1, -1], [-1, 0, 0, 1, 3, 4, -1, -1],
                            [-1, -1, -1, -1, -1, -1, -1, -1]], device=device)
    forest = PackedForest.full_padded(parents, max_depth=6)
    x, weight, _, state, _ = conv_inputs(device, forest, 37, 4, torch.float32, torch.float32, seed=4)
    idx = torch.tensor([2, 0, 3], device=device)  # slot 3: the graph's pad slot
    a, b, A_log, dt_bias = gating_inputs(device, forest.num_nodes, 4, torch.float32, seed=4)
    got = gdn_tree_conv(x, weight, state, idx, forest, a, b, A_log, dt_bias)
    want = gdn_tree_conv_ref(x, weight, state, idx, forest, a, b, A_log, dt_bias)
    for t_k, t_t in zip(got, want):
        assert rel_err(t_k, t_t) <= 1e-6


def bad_cases(device, x, weight, state, idx, a, A_log):
    """case -> (the bad arguments, the name the error must give)."""
    z = lambda *s: torch.zeros(*s, device=device)
    return {
        "x_rank": (dict(x=x[None]), "x"), "x_dtype": (dict(x=x.double()), "x"),
        "x_stride": (dict(x=x.T.contiguous().T), "x"), "w_shape": (dict(weight=weight[:-1]), "weight"),
        "bias_shape": (dict(bias=z(15)), "bias"), "state_shape": (dict(conv_state=state[..., :1]), "conv_state"),
        "forest_nodes": (dict(forest=make_forest((3,), device, 0)), "forest"),
        "idx_dtype": (dict(state_indices=idx.float()), "state_indices"),
        "idx_len": (dict(state_indices=idx[:1]), "state_indices"),
        "activation": (dict(activation="gelu"), "activation"),
        "block_c": (dict(block_c=24), "block_c"), "out_width": (dict(out=(z(5, 8), z(5, 4))), "out"),
        "out_rows": (dict(out=z(4, 16)), "out"), "out_count": (dict(out=[z(5, 4)] * 4), "out"),
        "out_stride": (dict(out=z(16, 5).T), "out"), "copy_shape": (dict(x_copy=z(5, 15)), "x_copy"),
        "a_shape": (dict(a=a[:, :3]), "a and b"), "A_log_shape": (dict(A_log=A_log[:2]), "A_log"),
    }


BAD_CASES = ["x_rank", "x_dtype", "x_stride", "w_shape", "bias_shape", "state_shape", "forest_nodes", "idx_dtype",
             "idx_len", "activation", "block_c", "out_width", "out_rows", "out_count", "out_stride", "copy_shape",
             "a_shape", "A_log_shape"]
# the forward's shared slots: with checked=True the context checked them (tests/models/test_kernel_checks.py)
SHARED_CASES = ("idx_dtype", "idx_len")


@pytest.mark.parametrize("case,checked", [(c, False) for c in BAD_CASES]
                         + [(c, True) for c in BAD_CASES if c not in SHARED_CASES])
def test_bad_inputs_raise(device, case, checked):
    forest = make_forest((3, 2), device, seed=0)
    x, weight, _, state, idx = conv_inputs(device, forest, 16, 4, torch.float32, torch.float32, seed=0)
    a, b, A_log, dt_bias = gating_inputs(device, 5, 4, torch.float32, seed=0)
    kw = dict(x=x, weight=weight, bias=None, conv_state=state, state_indices=idx, forest=forest, checked=checked)
    args, name = bad_cases(device, x, weight, state, idx, a, A_log)[case]
    kw.update(args)
    with pytest.raises(ValueError, match=name):
        if case in ("a_shape", "A_log_shape"):
            gdn_tree_conv(**{"a": a, "b": b, "A_log": A_log, "dt_bias": dt_bias, **kw})
        else:
            causal_conv1d_tree(**kw)


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [(8,), (64, 1, 33, 128)])
def test_gpu_bf16_qwen_shapes(device, sizes):
    # Qwen3.5-9B's GDN conv (C = 2·16·128 + 32·128, W=4) and gating (HV=32), bf16 activations and pool
    forest = make_forest(sizes, device, seed=len(sizes))
    C, HV = 2 * 16 * 128 + 32 * 128, 32
    x, weight, _, state, idx = conv_inputs(device, forest, C, 4, torch.bfloat16, torch.bfloat16, seed=1)
    a, b, A_log, dt_bias = gating_inputs(device, forest.num_nodes, HV, torch.bfloat16, seed=1)
    A_log, dt_bias = A_log.float(), dt_bias.float()
    y_k, g_k, beta_k = gdn_tree_conv(x, weight, state, idx, forest, a, b, A_log, dt_bias)
    y_t, g_t, beta_t = gdn_tree_conv_ref(x, weight, state, idx, forest, a, b, A_log, dt_bias)
    assert rel_err(y_k, y_t) <= 1e-2 and rel_err(g_k, g_t) <= 1e-5
    assert (beta_k.float() - beta_t.float()).abs().max() <= 1e-2


def test_strided_state_indices():
    # a column of a host-row buffer, as the graphs pass their inputs (review finding: read densely)
    from bole.ops.conv import causal_conv1d_tree_ref as twin
    from bole.spec.tree import DraftTree, PackedForest
    from kernels.gdn_tree_conv import causal_conv1d_tree

    gen = torch.Generator().manual_seed(0)
    f = PackedForest.from_trees([DraftTree([-1, 0, 1], max_depth=4), DraftTree([-1, 0], max_depth=4)])
    x, w = torch.randn(f.num_nodes, 8, generator=gen), torch.randn(8, 4, generator=gen)
    state = torch.randn(6, 8, 3, generator=gen)
    idx = torch.tensor([[3, 99], [5, 99]])[:, 0]
    assert idx.stride() == (2,)
    torch.testing.assert_close(causal_conv1d_tree(x, w, None, state, idx, f), twin(x, w, None, state, idx, f))
