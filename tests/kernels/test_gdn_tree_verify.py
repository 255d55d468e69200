"""The Triton tree verifier (kernels/gdn_tree_verify.py) against its naive twin (bole/ops/gdn.py).

The reference runs in float64 on the same (possibly fp16/bf16) input values, so the kernel's fp32
result must agree to fp32 rounding; outputs are poisoned with NaN so an unwritten element fails;
the state pool must be bitwise unchanged. Shapes are small: the CPU runs these under the Triton
interpreter.
"""

import pytest
import torch
from numerics import rel_err

from benchmarks.verify_space import CONFIGS, configs_for
from bole.ops import gdn as ref
from bole.spec.tree import DraftTree, PackedForest, random_tree
from kernels.gdn_tree_verify import gdn_tree_verify
from kernels.gdn_tree_verify_launch import VerifyConfig, chunk_tile, default_config, solve_plan


def make_forest(sizes, seed, device, depth=5):
    gen = torch.Generator().manual_seed(seed)
    trees = [DraftTree([-1]) if n == 1 else random_tree(n, depth, gen) for n in sizes]
    return PackedForest.from_trees(trees, device=device)


def make_inputs(forest, HK, HV, K, V, dtype, pool_dtype, seed, device, slots=6, gate_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    N = forest.num_nodes
    r = lambda *s: torch.randn(*s, generator=gen)
    gate_dtype = dtype if gate_dtype is None else gate_dtype
    q = r(1, N, HK, K).to(device, dtype)
    k = (r(1, N, HK, K) * 0.4).to(device, dtype)
    v = r(1, N, HV, V).to(device, dtype)
    g = (-torch.rand(1, N, HV, generator=gen) * 0.7).to(device, gate_dtype)
    beta = torch.rand(1, N, HV, generator=gen).to(device, gate_dtype)
    pool = (r(slots, HV, V, K) * 0.2).to(device, pool_dtype)
    perm = torch.randperm(slots, generator=gen)[: forest.num_requests].to(device)
    return q, k, v, g, beta, pool, perm


def reference(q, k, v, g, beta, forest, pool, indices, **kw):
    """The twin in float64 on exactly the kernel's input values."""
    d = lambda t: None if t is None else t.double()
    return ref.gdn_tree_verify_ref(d(q), d(k), d(v), d(g), d(beta), forest, d(pool), indices, **kw)


def poisoned(q, v, HV):
    N, V = q.shape[1], v.shape[3]
    return dict(o_out=torch.full((1, N, HV, V), float("nan"), dtype=v.dtype, device=v.device),
                u_out=torch.full((N, HV, V), float("nan"), device=v.device),
                logp_out=torch.full((N, HV), float("nan"), device=v.device))


O_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}  # o is stored in v's dtype


def check(forest, HK, HV, K, V, dtype, pool_dtype, l2, seed, device, method="blocked", **kw):
    q, k, v, g, beta, pool, idx = make_inputs(forest, HK, HV, K, V, dtype, pool_dtype, seed, device)
    pool_before = pool.clone()
    outs = poisoned(q, v, HV)
    o, u, logp = gdn_tree_verify(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=l2, method=method,
                                 **outs, **kw)
    assert o.data_ptr() == outs["o_out"].data_ptr() and u.data_ptr() == outs["u_out"].data_ptr()
    assert logp.data_ptr() == outs["logp_out"].data_ptr()
    assert torch.equal(pool, pool_before), "verification wrote the state pool"
    assert o.dtype == v.dtype and u.dtype == torch.float32 and logp.dtype == torch.float32
    o_r, u_r, lp_r = reference(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=l2)
    assert rel_err(o, o_r) < O_TOL[dtype]
    assert rel_err(u, u_r) < 1e-5
    assert rel_err(logp, lp_r) < 1e-5
    return o, u, logp


@pytest.mark.parametrize("HK,HV", [(2, 4), (2, 2)])
@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("method", ["blocked", "horner"])
def test_matches_twin_fp32(device, HK, HV, l2, method):
    forest = make_forest([1, 7, 13], seed=0, device=device)
    check(forest, HK, HV, 32, 16, torch.float32, torch.float32, l2, seed=1, device=device, method=method)


@pytest.mark.parametrize("dtype,pool_dtype,l2", [
    (torch.float16, torch.float32, True), (torch.float16, torch.bfloat16, False),
    (torch.bfloat16, torch.float32, True), (torch.bfloat16, torch.bfloat16, True),
    (torch.float32, torch.bfloat16, False),
])
def test_matches_twin_low_precision(device, dtype, pool_dtype, l2):
    forest = make_forest([5, 1, 11], seed=2, device=device)
    check(forest, 1, 2, 32, 16, dtype, pool_dtype, l2, seed=3, device=device)


@pytest.mark.parametrize("seed", [4, 5])
def test_random_forests_odd_sizes(device, seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(x) for x in torch.randint(1, 16, (3,), generator=gen)]
    forest = make_forest(sizes, seed=seed, device=device, depth=6)
    check(forest, 2, 4, 16, 16, torch.float32, torch.float32, True, seed=seed, device=device)


def test_deep_chain_and_wider_tile(device):
    # depth 9 chain beside a 17-node tree (BT = 32): level steps past 8, the blocked method with
    # diagonal blocks and a merge
    gen = torch.Generator().manual_seed(6)
    forest = PackedForest.from_trees([DraftTree.chain(9), random_tree(17, 4, gen)], device=device)
    for method in ("blocked", "horner"):
        check(forest, 1, 1, 16, 16, torch.float32, torch.float32, False, seed=7, device=device, method=method)


def test_value_tiles_and_k_chunks(device):
    # BV < V (G/C recomputed per tile) and BK < K (several K chunks, l2norm across chunks)
    forest = make_forest([7, 3], seed=8, device=device)
    a = check(forest, 1, 2, 64, 32, torch.float32, torch.float32, True, seed=9, device=device,
              config=VerifyConfig(block_k=32, block_v=16))
    b = check(forest, 1, 2, 64, 32, torch.float32, torch.float32, True, seed=9, device=device, block_v=32)
    for x, y in zip(a, b, strict=True):
        assert rel_err(x, y) < 1e-6


def test_head_dim_256(device):
    forest = make_forest([3, 2], seed=10, device=device)
    check(forest, 1, 1, 256, 16, torch.float32, torch.float32, True, seed=11, device=device)


def test_matches_serial_recurrence_and_per_tree(device):
    # O also equals the serial per-node recurrence; a forest equals its trees verified one by one
    forest = make_forest([6, 9], seed=12, device=device)
    q, k, v, g, beta, pool, idx = make_inputs(forest, 1, 2, 16, 16, torch.float32, torch.float32, 13, device)
    o, u, logp = gdn_tree_verify(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True)
    d = lambda t: t.double()
    o_s, _ = ref.gdn_tree_serial_ref(d(q), d(k), d(v), d(g), d(beta), forest, d(pool), idx, use_qk_l2norm=True)
    assert rel_err(o, o_s) < 1e-5
    cu = forest.cu_seqlens.tolist()
    for b in range(forest.num_requests):
        s, e = cu[b], cu[b + 1]
        fb = PackedForest.from_trees([forest.tree(b)], device=device)
        ob, ub, lb = gdn_tree_verify(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], fb, pool,
                                     idx[b:b + 1], use_qk_l2norm=True)
        assert rel_err(ob, o[:, s:e]) < 1e-6 and rel_err(ub, u[s:e]) < 1e-6
        assert rel_err(lb, logp[s:e]) < 1e-6


def test_defaults_no_indices_and_zero_state(device):
    forest = make_forest([4, 7], seed=14, device=device)
    q, k, v, g, beta, pool, _ = make_inputs(forest, 2, 4, 16, 16, torch.float32, torch.float32, 15, device)
    # state_indices None: request b reads slot b
    o, u, _ = gdn_tree_verify(q, k, v, g, beta, forest, pool, scale=0.3)
    o_r, u_r, _ = reference(q, k, v, g, beta, forest, pool, None, scale=0.3)
    assert rel_err(o, o_r) < 1e-5 and rel_err(u, u_r) < 1e-5
    # initial_state None: zero states
    o, u, _ = gdn_tree_verify(q, k, v, g, beta, forest, None)
    o_r, u_r, _ = reference(q, k, v, g, beta, forest, None, None)
    assert rel_err(o, o_r) < 1e-5 and rel_err(u, u_r) < 1e-5


def test_config_table_and_solve_plan():
    cfgs = configs_for(128, 128, 64)
    assert cfgs and all(VerifyConfig(64, c.block_v, c.num_warps, c.num_stages) in CONFIGS for c in cfgs
                        if c.block_k == 64)
    assert default_config(128, 128, 64) in cfgs
    assert {c.block_v for c in cfgs} >= {32, 64, 128} and {c.num_warps for c in cfgs} == {4, 8}
    small = configs_for(16, 32, 16)
    assert small and all(c.block_v <= 32 and c.block_k == 16 for c in small)
    assert chunk_tile(64) == (64, 1) and chunk_tile(65) == (64, 2) and chunk_tile(256) == (64, 4)
    assert chunk_tile(5) == (16, 1) and chunk_tile(17) == (32, 1)
    # (BS, level steps, merges): level steps alone for shallow trees, diagonal blocks + doubling merges
    # for deep ones; the level steps never exceed a chunk's depth
    assert solve_plan("blocked", 8, 64) == (64, 7, 0)
    assert solve_plan("blocked", 64, 64) == (4, 3, 4)
    assert solve_plan("blocked", 200, 64) == (4, 3, 4)
    assert solve_plan("horner", 200, 64) == (64, 63, 0)
    for d in range(1, 65):
        bs, steps, merges = solve_plan("blocked", d, 64)
        assert steps == min(d, bs) - 1 and bs << merges == 64 and steps + 2 * merges <= d - 1


def _bad_inputs(device):
    forest = make_forest([3, 4], seed=16, device=device)
    return forest, make_inputs(forest, 2, 4, 16, 16, torch.float32, torch.float32, 17, device)


BAD_CASES = ["q_rank", "k_shape", "v_tokens", "gqa", "g_shape", "beta_shape", "dtype_int", "dtype_f64",
             "forest_size", "too_many_nodes", "pool_shape", "pool_dtype", "indices_len", "out_shape",
             "out_dtype", "block_v", "precision", "method"]
# the forward's shared slots: with checked=True the context checked them (tests/models/test_kernel_checks.py)
SHARED_CASES = ("indices_len",)


@pytest.mark.parametrize("case,checked", [(c, False) for c in BAD_CASES]
                         + [(c, True) for c in BAD_CASES if c not in SHARED_CASES])
def test_bad_inputs_raise(device, case, checked):
    forest, (q, k, v, g, beta, pool, idx) = _bad_inputs(device)
    N = q.shape[1]
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, forest=forest, initial_state=pool, state_indices=idx)
    if case == "q_rank":
        kw.update(q=q[0], k=k[0])
    elif case == "k_shape":
        kw.update(k=k[..., :8])
    elif case == "v_tokens":
        kw.update(v=v[:, :-1])
    elif case == "gqa":
        kw.update(q=torch.randn(1, N, 3, 16), k=torch.randn(1, N, 3, 16))
    elif case == "g_shape":
        kw.update(g=g[0])
    elif case == "beta_shape":
        kw.update(beta=beta[..., :2])
    elif case == "dtype_int":
        kw.update(q=q.to(torch.int32))
    elif case == "dtype_f64":
        kw.update(v=v.double())
    elif case == "forest_size":
        kw.update(forest=make_forest([3, 5], seed=16, device=device))
    elif case == "too_many_nodes":
        big = PackedForest.from_trees([DraftTree([-1] * 257)], device=device)
        kw = dict(q=torch.randn(1, 257, 2, 16), k=torch.randn(1, 257, 2, 16), v=torch.randn(1, 257, 4, 16),
                  g=-torch.rand(1, 257, 4), beta=torch.rand(1, 257, 4), forest=big, initial_state=None)
    elif case == "pool_shape":
        kw.update(initial_state=pool[:, :, :, :8])
    elif case == "pool_dtype":
        kw.update(initial_state=pool.half())
    elif case == "indices_len":
        kw.update(state_indices=idx[:1])
    elif case == "out_shape":
        kw.update(u_out=torch.empty(N, 4, 8))
    elif case == "out_dtype":
        kw.update(logp_out=torch.empty(N, 4, dtype=torch.float16))
    elif case == "block_v":
        kw.update(block_v=24)
    elif case == "precision":
        kw.update(input_precision="fp8")
    elif case == "method":
        kw.update(method="lu")
    with pytest.raises(ValueError):
        gdn_tree_verify(**kw, checked=checked)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_gpu_low_precision_dot_paths(device, dtype, pool_dtype):
    # compiled only: half-precision q/k (and a matching pool) enter tl.dot natively
    forest = make_forest([64, 33, 1], seed=18, device=device, depth=8)
    check(forest, 2, 4, 128, 128, dtype, pool_dtype, True, seed=19, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["blocked", "horner"])
@pytest.mark.parametrize("precision,tol", [("tf32", 2e-2), ("tf32x3", 1e-5)])
def test_gpu_tf32(device, method, precision, tol):
    forest = make_forest([64, 20], seed=20, device=device, depth=8)
    q, k, v, g, beta, pool, idx = make_inputs(forest, 2, 4, 128, 128, torch.float32, torch.float32, 21,
                                              device)
    o, u, _ = gdn_tree_verify(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True, method=method,
                              input_precision=precision)
    o_r, u_r, _ = reference(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True)
    assert rel_err(o, o_r) < tol and rel_err(u, u_r) < tol


@pytest.mark.gpu
def test_gpu_all_configs_qwen_shapes(device):
    # the configurations the benchmark sweeps first compile and are exact at Qwen3.5-9B head shapes
    forest = make_forest([64, 64], seed=22, device=device, depth=8)
    q, k, v, g, beta, pool, idx = make_inputs(forest, 2, 4, 128, 128, torch.bfloat16, torch.float32, 23,
                                              device)
    o_r, u_r, _ = reference(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True)
    base = default_config(128, 128, 64)
    for cfg in configs_for(128, 128, 64):
        if (cfg.block_k, cfg.num_stages) != (base.block_k, base.num_stages):
            continue  # block_v x num_warps only: every config is a separate compile
        for method in ("blocked", "horner"):
            o, u, _ = gdn_tree_verify(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True, config=cfg,
                                      method=method)
            assert rel_err(u, u_r) < 1e-5, (cfg, method)


def test_tuned_launch_table():
    # the engine's measured dispatch: every tile up to 256 nodes has a catch-all row, tiles clamp to small heads
    from kernels.gdn_tree_verify_launch import TUNED_FP32, TUNED_LOWP, tuned_launch

    for table, precisions in ((TUNED_LOWP, ("tf32",)), (TUNED_FP32, ("tf32x3",))):
        assert set(table) == {16, 32, 64, 128, 256}
        for BT, rows in table.items():
            assert rows[-1][0] is None
            for n in (1, 32, 512, 4096):
                cfg, method, precision = tuned_launch(BT, n, 128, 128, table)
                assert method in ("horner", "blocked") and precision in precisions
    cfg, _, _ = tuned_launch(64, 32, 16, 16)
    assert cfg.block_v == 16 and cfg.block_k == 16 and cfg.num_stages == 1


@pytest.mark.parametrize("sizes", [[5, 1, 9], [20, 33], [70]])
def test_tuned_matches_twin_fp32(device, sizes):
    # fp32 q/k take the 3xTF32 rows; fp32-grade results (the interpreter runs every precision exactly)
    forest = make_forest(sizes, seed=33, device=device, depth=6)
    q, k, v, g, beta, pool, idx = make_inputs(forest, 2, 4, 32, 16, torch.float32, torch.float32, 34, device)
    o, u, logp = gdn_tree_verify(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True, tuned=True,
                                 **poisoned(q, v, 4))
    o_r, u_r, lp_r = reference(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True)
    assert rel_err(o, o_r) < 1e-5 and rel_err(u, u_r) < 1e-5 and rel_err(logp, lp_r) < 1e-5


@pytest.mark.parametrize("sizes", [[5, 1, 9], [20, 33]])
def test_tuned_matches_twin_fp16(device, sizes):
    # fp16 q/k take the tuned launch: tf32 products, whose bounded T×T operands are fp16 (10-bit
    # mantissa, like tf32), which the interpreter runs too; other products are exact there
    forest = make_forest(sizes, seed=31, device=device, depth=6)
    q, k, v, g, beta, pool, idx = make_inputs(forest, 2, 4, 32, 16, torch.float16, torch.float32, 32, device)
    o, u, logp = gdn_tree_verify(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True, tuned=True,
                                 **poisoned(q, v, 4))
    o_r, u_r, lp_r = reference(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True)
    tol = 2e-3 if device == "cpu" else 1e-2
    assert rel_err(o, o_r) < max(tol, O_TOL[torch.float16]) and rel_err(u, u_r) < tol
    assert rel_err(logp, lp_r) < 1e-5


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("method", ["blocked", "horner"])
def test_early_loads_and_chunks(device, early, method):
    # loads issued before the K-loop (early_loads) or after it, with trees of more than 64 nodes
    # (two and four 64-row chunks) beside a single node and a small tree
    gen = torch.Generator().manual_seed(40)
    forest = PackedForest.from_trees([random_tree(100, 7, gen), DraftTree([-1]), random_tree(70, 5, gen)],
                                     device=device)
    check(forest, 1, 2, 16, 16, torch.float32, torch.float32, True, seed=41, device=device, method=method,
          config=VerifyConfig(16, 16, 8, 1, early_loads=early))
    forest = PackedForest.from_trees([random_tree(256, 12, gen), random_tree(190, 30, gen)], device=device)
    check(forest, 1, 2, 16, 16, torch.float32, torch.float32, True, seed=42, device=device, method=method,
          config=VerifyConfig(16, 16, 8, 1, early_loads=early))


@pytest.mark.parametrize("l2,exact", [(True, False), (False, True)])
def test_tf32_takes_fp16_tt_products_only_where_bounded(device, l2, exact):
    # input_precision="tf32" with normalised q/k: fp16 operands for the T×T products (bounded, 10-bit
    # mantissa) at any depth; raw q/k keep fp32 products, which the CPU interpreter runs exactly (it
    # ignores tf32), so there the result must be exact
    gen = torch.Generator().manual_seed(42)
    forest = PackedForest.from_trees([DraftTree.chain(40), random_tree(30, 8, gen)], device=device)
    q, k, v, g, beta, pool, idx = make_inputs(forest, 2, 4, 32, 16, torch.float32, torch.float32, 43, device)
    o, u, _ = gdn_tree_verify(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=l2, method="blocked",
                              input_precision="tf32", **poisoned(q, v, 4))
    o_r, u_r, _ = reference(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=l2)
    err = max(rel_err(o, o_r), rel_err(u, u_r))
    if device != "cpu":
        assert err < 2e-2  # GPU: tf32 or fp16 products either way
    elif exact:
        assert err < 1e-5
    else:
        assert 1e-6 < err < 2e-3  # the fp16 path ran, and within 10-bit rounding
