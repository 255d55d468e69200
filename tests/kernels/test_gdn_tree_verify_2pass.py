"""method="two_pass" of the Triton tree verifier (kernels/gdn_tree_verify_2pass.py) against the naive twin.

Pass 1 forms W' = (I+G)⁻¹ D_β and M' = C W' per (request, value head) in a workspace; pass 2 applies them
per value tile. As in test_gdn_tree_verify.py the reference is the float64 twin on the kernel's exact
input values, outputs are NaN-poisoned and the state pool must stay untouched; here the workspace is
NaN-poisoned too (pass 2 may read only what pass 1 wrote). Small shapes: the CPU runs the interpreter.
"""

import pytest
import torch
from test_gdn_tree_verify import O_TOL, check, make_forest, make_inputs, poisoned, reference, rel_err

from bole.spec.tree import DraftTree, PackedForest, random_tree
from kernels.gdn_tree_verify import (
    CONFIGS,
    VerifyConfig,
    configs_for,
    default_config,
    gdn_tree_verify,
    two_pass_workspace_numel,
)
from kernels.gdn_tree_verify_2pass import factor_launch_params


def star(n):
    return DraftTree([-1] + [0] * (n - 1))


def forest_of(trees, device):
    return PackedForest.from_trees(trees, device=device)


def check2(forest, HK, HV, K, V, dtype=torch.float32, pool_dtype=torch.float32, l2=True, seed=0, device="cpu",
           **kw):
    return check(forest, HK, HV, K, V, dtype, pool_dtype, l2, seed, device, method="two_pass", **kw)


@pytest.mark.parametrize("HK,HV", [(2, 4), (2, 2), (1, 4)])
@pytest.mark.parametrize("l2", [False, True])
def test_matches_twin_gqa(device, HK, HV, l2):
    forest = make_forest([1, 7, 13], seed=0, device=device)
    check2(forest, HK, HV, 32, 16, l2=l2, seed=1, device=device)


@pytest.mark.parametrize("seed", [30, 31, 32])
def test_random_forests_odd_sizes(device, seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(x) for x in torch.randint(1, 20, (4,), generator=gen)]
    forest = make_forest(sizes, seed=seed, device=device, depth=7)
    check2(forest, 2, 4, 16, 16, seed=seed, device=device)


@pytest.mark.parametrize("name,trees", [
    ("depth1", lambda: [DraftTree([-1] * 5), DraftTree([-1]), DraftTree([-1] * 3)]),  # no squaring, G = 0
    ("depth2", lambda: [star(9), DraftTree([-1, -1, 0, 1])]),                         # no squaring, G² = 0
    ("chains", lambda: [DraftTree.chain(9), DraftTree.chain(3)]),                      # 3 squarings (d = 9)
    ("star_chain", lambda: [star(17), DraftTree.chain(16)]),                           # BT = 32, 3 squarings
])
def test_tree_shapes(device, name, trees):
    check2(forest_of(trees(), device), 1, 2, 16, 16, seed=33, device=device)


def test_target_tile_bt64(device):
    # a 64-node depth-8 tree (the Qwen3.5 verify tile, BT = 64) beside an odd one, small heads
    gen = torch.Generator().manual_seed(34)
    forest = forest_of([random_tree(64, 8, gen), random_tree(23, 8, gen)], device)
    check2(forest, 1, 2, 16, 16, seed=35, device=device)


@pytest.mark.parametrize("dtype,pool_dtype,l2", [
    (torch.float16, torch.float32, True), (torch.float16, torch.bfloat16, False),
    (torch.bfloat16, torch.float32, True), (torch.bfloat16, torch.bfloat16, True),
    (torch.float32, torch.bfloat16, False),
])
def test_low_precision_inputs_and_pool(device, dtype, pool_dtype, l2):
    forest = make_forest([5, 1, 11], seed=2, device=device)
    check2(forest, 1, 2, 32, 16, dtype, pool_dtype, l2, seed=3, device=device)


def test_no_state_no_indices_scale(device):
    forest = make_forest([4, 7], seed=14, device=device)
    q, k, v, g, beta, pool, _ = make_inputs(forest, 2, 4, 16, 16, torch.float32, torch.float32, 15, device)
    for init, kw in ((pool, dict(scale=0.3)), (None, {}), (None, dict(use_qk_l2norm=True))):
        outs = poisoned(q, v, 4)
        o, u, lp = gdn_tree_verify(q, k, v, g, beta, forest, init, method="two_pass", **kw, **outs)
        o_r, u_r, lp_r = reference(q, k, v, g, beta, forest, init, None, **kw)
        assert rel_err(o, o_r) < 1e-5 and rel_err(u, u_r) < 1e-5 and rel_err(lp, lp_r) < 1e-5


def test_tiles_chunks_and_agreement_with_one_pass(device):
    # BV < V and BK < K (several tiles and K chunks, L2 norm across chunks); all equal the one-pass kernel
    forest = make_forest([7, 3, 12], seed=8, device=device)
    runs = [check2(forest, 1, 2, 64, 32, seed=9, device=device, config=VerifyConfig(block_k=16, block_v=16)),
            check2(forest, 1, 2, 64, 32, seed=9, device=device, config=VerifyConfig(block_k=64, block_v=32)),
            check(forest, 1, 2, 64, 32, torch.float32, torch.float32, True, 9, device, method="neumann")]
    for other in runs[1:]:
        for x, y in zip(runs[0], other, strict=True):
            assert rel_err(x, y) < 1e-6


def test_head_dims_256_and_odd_chunks(device):
    forest = make_forest([3, 2], seed=10, device=device)
    check2(forest, 1, 1, 256, 16, seed=11, device=device)
    check2(forest, 1, 1, 48, 16, seed=12, device=device, config=VerifyConfig(block_k=32, block_v=16))


def test_workspace_preallocated_and_poisoned(device):
    forest = make_forest([6, 9, 2], seed=36, device=device)
    HV = 4
    q, k, v, g, beta, pool, idx = make_inputs(forest, 2, HV, 16, 16, torch.float32, torch.float32, 37, device)
    n = two_pass_workspace_numel(forest.num_requests, HV, forest.max_nodes)
    assert n == forest.num_requests * HV * (2 * 16 * 16 + 2 * 16)
    ws = torch.full((n + 7,), float("nan"), device=device)  # larger is fine; NaNs must all be overwritten
    o_r, u_r, _ = reference(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True)
    for _ in range(2):  # reused across calls
        outs = poisoned(q, v, HV)
        o, u, _ = gdn_tree_verify(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True, method="two_pass",
                                  workspace=ws, **outs)
        assert rel_err(o, o_r) < O_TOL[torch.float32] and rel_err(u, u_r) < 1e-5


@pytest.mark.parametrize("case", ["small", "dtype", "method", "num_rounds"])
def test_bad_workspace_and_options_raise(device, case):
    forest = make_forest([3, 4], seed=16, device=device)
    q, k, v, g, beta, pool, idx = make_inputs(forest, 2, 4, 16, 16, torch.float32, torch.float32, 17, device)
    n = two_pass_workspace_numel(2, 4, forest.max_nodes)
    kw = dict(method="two_pass")
    if case == "small":
        kw.update(workspace=torch.empty(n - 1, device=device))
    elif case == "dtype":
        kw.update(workspace=torch.empty(n, dtype=torch.float16, device=device))
    elif case == "method":
        kw.update(method="neumann", workspace=torch.empty(n, device=device))
    elif case == "num_rounds":
        kw.update(num_rounds=2)
    with pytest.raises(ValueError):
        gdn_tree_verify(q, k, v, g, beta, forest, pool, idx, **kw)


def test_two_pass_defaults():
    for BT in (16, 32, 64, 128):
        c = default_config(128, 128, BT, method="two_pass")
        assert c in configs_for(128, 128, BT) and VerifyConfig(c.block_k, c.block_v, c.num_warps, 1) in CONFIGS
        bk, warps, stages = factor_launch_params(128, BT)
        assert bk == 64 and warps == (8 if BT >= 32 else 4) and stages == 2
    assert default_config(128, 128, 64, method="two_pass").num_warps == 8


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_gpu_low_precision_dot_paths(device, dtype, pool_dtype):
    forest = make_forest([64, 33, 1], seed=18, device=device, depth=8)
    check2(forest, 2, 4, 128, 128, dtype, pool_dtype, True, seed=19, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,tol", [("tf32", 2e-2), ("tf32x3", 1e-5)])
def test_gpu_tf32(device, precision, tol):
    forest = make_forest([64, 20], seed=20, device=device, depth=8)
    q, k, v, g, beta, pool, idx = make_inputs(forest, 2, 4, 128, 128, torch.float32, torch.float32, 21, device)
    o, u, _ = gdn_tree_verify(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True, method="two_pass",
                              input_precision=precision)
    o_r, u_r, _ = reference(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True)
    assert rel_err(o, o_r) < tol and rel_err(u, u_r) < tol


@pytest.mark.gpu
def test_gpu_all_configs_qwen_shapes(device):
    forest = make_forest([64, 64], seed=22, device=device, depth=8)
    q, k, v, g, beta, pool, idx = make_inputs(forest, 2, 4, 128, 128, torch.bfloat16, torch.float32, 23, device)
    o_r, u_r, _ = reference(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True)
    base = default_config(128, 128, 64, method="two_pass")
    for cfg in configs_for(128, 128, 64):
        if (cfg.block_k, cfg.num_stages) != (base.block_k, base.num_stages):
            continue
        o, u, _ = gdn_tree_verify(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True, config=cfg,
                                  method="two_pass")
        assert rel_err(u, u_r) < 1e-5 and rel_err(o, o_r) < O_TOL[torch.bfloat16], cfg
