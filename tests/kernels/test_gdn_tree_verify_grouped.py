"""method="grouped" of the Triton tree verifier (kernels/gdn_tree_verify_grouped.py) against the naive twin.

A program loops over several value heads of one GQA group (sharing Q Kᵀ / K Kᵀ) and several value
tiles (sharing W and C W). As in test_gdn_tree_verify.py: float64 twin on the kernel's exact input
values, NaN-poisoned outputs, the state pool bitwise unchanged. The cases below make every loop do
real work: groups of 2 and 4 heads, heads_per_program that must be clamped to a divisor of the group,
tile chunks that run past V (masked), several K chunks. Small shapes: the CPU runs the interpreter.
"""

import pytest
import torch
from test_gdn_tree_verify import check, make_forest, make_inputs, reference, rel_err

from bole.spec.tree import DraftTree, PackedForest
from kernels.gdn_tree_verify import (
    GROUPED_CONFIGS,
    VerifyConfig,
    configs_for,
    default_config,
    gdn_tree_verify,
    group_heads,
)


def grouped(bk=16, bv=16, ng=2, nvt=1, warps=4):
    return VerifyConfig(bk, bv, warps, 1, ng, nvt)


@pytest.mark.parametrize("HK,HV,ng,nvt", [
    (2, 4, 2, 1),   # both heads of a group per program
    (1, 4, 4, 2),   # a group of 4, two tiles per program
    (1, 4, 2, 4),   # half a group; four tiles of 16 per program over V = 32: two run past V
    (2, 2, 2, 2),   # HV == HK: heads_per_program clamps to 1
    (1, 3, 2, 1),   # a group of 3: heads_per_program 2 clamps to 1 (Qwen3.5-27B's HV = 3·HK)
])
@pytest.mark.parametrize("l2", [False, True])
def test_matches_twin_fp32(device, HK, HV, ng, nvt, l2):
    forest = make_forest([1, 7, 13], seed=40, device=device)
    check(forest, HK, HV, 32, 32, torch.float32, torch.float32, l2, seed=41, device=device, method="grouped",
          config=grouped(ng=ng, nvt=nvt))


def test_value_dim_not_a_tile_multiple(device):
    # V = 24 with BV = 16: the second tile is partly masked, in both tile-loop positions
    forest = make_forest([9, 4], seed=42, device=device)
    for nvt in (1, 2):
        check(forest, 1, 2, 32, 24, torch.float32, torch.float32, True, seed=43, device=device,
              method="grouped", config=grouped(ng=2, nvt=nvt))


@pytest.mark.parametrize("name,trees", [
    ("depth1", lambda: [DraftTree([-1] * 5), DraftTree([-1]), DraftTree([-1] * 3)]),  # no squaring, G = 0
    ("chains", lambda: [DraftTree.chain(9), DraftTree.chain(3)]),                      # 3 squarings (d = 9)
    ("star_chain", lambda: [DraftTree([-1] + [0] * 16), DraftTree.chain(16)]),         # BT = 32
])
def test_tree_shapes(device, name, trees):
    forest = PackedForest.from_trees(trees(), device=device)
    check(forest, 1, 2, 16, 16, torch.float32, torch.float32, True, seed=44, device=device, method="grouped",
          config=grouped(ng=2, nvt=1))


@pytest.mark.parametrize("seed", [45, 46])
def test_random_forests_odd_sizes(device, seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(x) for x in torch.randint(1, 20, (4,), generator=gen)]
    forest = make_forest(sizes, seed=seed, device=device, depth=7)
    check(forest, 2, 4, 16, 16, torch.float32, torch.float32, True, seed=seed, device=device, method="grouped",
          config=grouped(ng=2, nvt=2))


def test_low_precision_inputs(device):
    forest = make_forest([5, 1, 11], seed=47, device=device)
    for dtype, pool_dtype in ((torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)):
        check(forest, 1, 2, 32, 16, dtype, pool_dtype, True, seed=48, device=device, method="grouped",
              config=grouped(ng=2, nvt=1))


def test_zero_state_no_indices_and_default_config(device):
    forest = make_forest([4, 7], seed=49, device=device)
    q, k, v, g, beta, pool, _ = make_inputs(forest, 2, 4, 16, 16, torch.float32, torch.float32, 50, device)
    o, u, _ = gdn_tree_verify(q, k, v, g, beta, forest, None, method="grouped", config=grouped(ng=2, nvt=1))
    o_r, u_r, _ = reference(q, k, v, g, beta, forest, None, None)
    assert rel_err(o, o_r) < 1e-5 and rel_err(u, u_r) < 1e-5
    o, u, _ = gdn_tree_verify(q, k, v, g, beta, forest, pool, scale=0.3, method="grouped")  # default config
    o_r, u_r, _ = reference(q, k, v, g, beta, forest, pool, None, scale=0.3)
    assert rel_err(o, o_r) < 1e-5 and rel_err(u, u_r) < 1e-5


def test_group_heads_and_configs():
    assert [group_heads(n, 32, 16) for n in (1, 2, 4)] == [1, 2, 2]
    assert [group_heads(n, 48, 16) for n in (1, 2, 3, 4)] == [1, 1, 3, 3]
    assert [group_heads(n, 64, 16) for n in (1, 2, 3, 4)] == [1, 2, 2, 4]
    cfgs = configs_for(128, 128, 64, method="grouped")
    assert cfgs and all(c in GROUPED_CONFIGS for c in cfgs)
    assert {c.heads_per_program for c in cfgs} == {1, 2, 4} and {c.tiles_per_program for c in cfgs} == {1, 2, 4}
    assert all(c.heads_per_program == c.tiles_per_program == 1 for c in configs_for(128, 128, 64))
    small = configs_for(16, 32, 16, method="grouped")
    assert small and all(c.block_v * c.tiles_per_program <= 32 and c.block_k == 16 for c in small)
    d = default_config(128, 128, 64, method="grouped")
    assert d in cfgs or d.tiles_per_program * d.block_v <= 128


@pytest.mark.parametrize("kw", [dict(heads_per_program=0), dict(tiles_per_program=0)])
def test_bad_grouped_config_raises(device, kw):
    forest = make_forest([3, 4], seed=51, device=device)
    q, k, v, g, beta, pool, idx = make_inputs(forest, 2, 4, 16, 16, torch.float32, torch.float32, 52, device)
    cfg = VerifyConfig(16, 16, 4, 1, **{"heads_per_program": 1, "tiles_per_program": 1, **kw})
    with pytest.raises(ValueError, match="heads_per_program and tiles_per_program"):
        gdn_tree_verify(q, k, v, g, beta, forest, pool, idx, method="grouped", config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("precision,tol", [("ieee", 1e-5), ("tf32", 2e-2)])
def test_gpu_qwen_shapes(device, dtype, pool_dtype, precision, tol):
    # Qwen3.5-9B head shapes (GQA 2, K = V = 128), a 64-node depth-8 tree beside odd ones; the (heads,
    # tiles) layouts the probe sweeps, compiled
    forest = make_forest([64, 33, 1], seed=53, device=device, depth=8)
    q, k, v, g, beta, pool, idx = make_inputs(forest, 2, 4, 128, 128, dtype, pool_dtype, 54, device)
    o_r, u_r, lp_r = reference(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True)
    for ng, nvt, bv, warps in ((1, 1, 64, 4), (2, 2, 64, 8), (2, 4, 32, 4), (2, 1, 128, 8)):
        o, u, logp = gdn_tree_verify(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True, method="grouped",
                                     config=VerifyConfig(32, bv, warps, 2, ng, nvt), input_precision=precision)
        assert rel_err(u, u_r) < tol, (ng, nvt, bv, precision)
        assert rel_err(o, o_r) < max(tol, 1.5e-2) and rel_err(logp, lp_r) < 1e-5
