"""The tree verifier (kernel and twin) against a float64 serial recurrence on hard inputs.

Correlated keys (mean cosine up to 0.99), β → 1, decay → 1, q = k, on chains, stars, brooms and
random trees up to the deepest and widest the kernel takes (256 nodes): the inputs on which the old
product-form inverse returned finite, wrong outputs (1e12 relative error on a 64-chain). The reference
is ``bole.ops.gdn.gdn_tree_serial_ref`` in float64 (a snapshot per node, no closed form at all). On the CPU
the kernel runs under the Triton interpreter (fp32 exact, fp16 operands where the kernel asks for
them); on a GPU at Qwen3.5-9B head shapes with bf16 inputs, as the engine calls it.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bole.ops import gdn as ref
from bole.ops.gdn_inputs import hard_trees, mean_cosine, verify_inputs
from bole.spec.tree import DraftTree, PackedForest, random_tree
from kernels.gdn_tree_verify import gdn_tree_verify
from kernels.limits import MAX_TREE_NODES


def max_rel(a, b) -> float:
    """max|a − b| / max|b| (the issue's metric), a finite."""
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite output"
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def serial64(q, k, v, g, beta, forest, pool, idx):
    d = lambda t: t.double()
    o, snaps = ref.gdn_tree_serial_ref(d(q), d(k), d(v), d(g), d(beta), forest, d(pool), idx, use_qk_l2norm=True)
    return o


def errors(forest, inputs, **kw):
    q, k, v, g, beta, pool, idx = inputs
    o, u, _ = gdn_tree_verify(q, k, v, g, beta, forest, pool, idx, use_qk_l2norm=True, **kw)
    o_ref = serial64(*inputs[:5], forest, pool, idx)
    return max_rel(o, o_ref), o


REGIMES = {  # (key_cos, beta, decay, q_equals_k)
    "hard": (0.99, "one", "one", False),
    "qk": (0.9, "high", "slow", True),
}
TREES = {**hard_trees(MAX_TREE_NODES, MAX_TREE_NODES), **hard_trees(64, 16, seed=1), "chain32": DraftTree.chain(32),
         "chain64": DraftTree.chain(64)}


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("regime", list(REGIMES))
def test_hard_inputs_fp32(device, tree, regime):
    # fp32 inputs: the kernel (both methods) and the fp32 twin agree with float64 to fp32 rounding
    cos, beta, decay, qk = REGIMES[regime]
    forest = PackedForest.from_trees([TREES[tree]], device=device)
    inputs = verify_inputs(forest, 1, 2, 16, 16, key_cos=cos, beta=beta, decay=decay, q_equals_k=qk,
                           seed=3, device=device)
    if regime == "hard":  # the premise: the keys really are that correlated
        assert mean_cosine(inputs[1][0, :, 0]) > 0.95
    methods = ("blocked", "horner") if TREES[tree].num_nodes <= 64 else ("blocked",)
    for method in methods:
        err, _ = errors(forest, inputs, method=method, input_precision="ieee")
        assert err < 1e-5, (method, err)
    q, k, v, g, b, pool, idx = inputs
    o_twin, _, _ = ref.gdn_tree_verify_ref(q, k, v, g, b, forest, pool, idx, use_qk_l2norm=True)
    assert max_rel(o_twin, serial64(q, k, v, g, b, forest, pool, idx)) < 1e-5


@pytest.mark.parametrize("tree", ["chain64", "random64d16", "broom256", "chain256"])
def test_hard_inputs_half_operands(device, tree):
    # fp16 q/k/v with tf32 asked for: the T×T products take fp16 operands (the bounded ones, see the
    # kernel's error analysis); within half-precision output rounding of the float64 result
    forest = PackedForest.from_trees([TREES[tree]], device=device)
    inputs = verify_inputs(forest, 1, 2, 16, 16, key_cos=0.99, beta="one", decay="one", dtype=torch.float16,
                           seed=4, device=device)
    for method in ("blocked", "horner"):
        err, _ = errors(forest, inputs, method=method, input_precision="tf32")
        assert err < 3e-3, (method, err)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(sizes=st.lists(st.integers(1, 90), min_size=1, max_size=3), depth=st.integers(1, 90),
       key_cos=st.floats(0.0, 0.99), beta=st.sampled_from(["random", "high", "one"]),
       decay=st.sampled_from(["random", "slow", "one"]), qk=st.booleans(),
       method=st.sampled_from(["blocked", "horner"]), seed=st.integers(0, 2**16))
def test_property_kernel_and_twin_match_float64(sizes, depth, key_cos, beta, decay, qk, method, seed):
    # any forest, correlation and gate regime: kernel (interpreted on the CPU) and fp32 twin within fp32
    # rounding of the float64 serial recurrence
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    forest = PackedForest.from_trees([random_tree(n, min(depth, n), gen) for n in sizes], device=device)
    inputs = verify_inputs(forest, 1, 2, 16, 16, key_cos=key_cos, beta=beta, decay=decay, q_equals_k=qk,
                           seed=seed, device=device)
    precision = "tf32x3" if device == "cuda" else "ieee"
    err, _ = errors(forest, inputs, method=method, input_precision=precision)
    assert err < 1e-4
    q, k, v, g, b, pool, idx = inputs
    o_twin, _, _ = ref.gdn_tree_verify_ref(q, k, v, g, b, forest, pool, idx, use_qk_l2norm=True)
    assert max_rel(o_twin, serial64(q, k, v, g, b, forest, pool, idx)) < 1e-4


# ---- GPU: Qwen3.5-9B heads (K = V = 128), bf16 activations, fp32 pool, the engine's tuned launch

GPU_TREES = {"chain16": DraftTree.chain(16), "random64d16": random_tree(64, 16, torch.Generator().manual_seed(5)),
             "chain32": DraftTree.chain(32), "chain64": DraftTree.chain(64), "chain128": DraftTree.chain(128),
             "random256d16": random_tree(256, 16, torch.Generator().manual_seed(6)), "chain256": DraftTree.chain(256)}


@pytest.mark.gpu
@pytest.mark.parametrize("tree", list(GPU_TREES))
@pytest.mark.parametrize("key_cos", [0.0, 0.5, 0.9, 0.99])
def test_gpu_bf16_tuned(device, tree, key_cos):
    forest = PackedForest.from_trees([GPU_TREES[tree]] * 3, device=device)
    for beta, decay in (("high", "slow"), ("one", "one")):
        inputs = verify_inputs(forest, 2, 4, 128, 128, key_cos=key_cos, beta=beta, decay=decay,
                               dtype=torch.bfloat16, seed=7, device=device)
        err, _ = errors(forest, inputs, tuned=True)
        assert err < 1e-2, (beta, decay, err)
        if tree in ("random64d16", "chain64"):  # both methods outside the tuned table (each is a compile)
            for method in ("blocked", "horner"):
                err, _ = errors(forest, inputs, method=method, input_precision="tf32")
                assert err < 1e-2, (method, beta, decay, err)


@pytest.mark.gpu
@pytest.mark.parametrize("tree", ["random64d16", "chain64", "chain256"])
@pytest.mark.parametrize("key_cos", [0.0, 0.99])
def test_gpu_fp32_tuned(device, tree, key_cos):
    forest = PackedForest.from_trees([GPU_TREES[tree]] * 2, device=device)
    inputs = verify_inputs(forest, 2, 4, 128, 128, key_cos=key_cos, beta="one", decay="one", seed=8,
                           device=device)
    err, _ = errors(forest, inputs, tuned=True)
    assert err < 1e-4, err


@pytest.mark.gpu
@settings(max_examples=40, deadline=None, derandomize=True)
@given(sizes=st.lists(st.sampled_from([1, 16, 37, 64, 100, 256]), min_size=1, max_size=4),
       depth=st.sampled_from([8, 16, 64]), key_cos=st.floats(0.0, 0.99),
       beta=st.sampled_from(["random", "high", "one"]), decay=st.sampled_from(["random", "slow", "one"]),
       qk=st.booleans(), seed=st.integers(0, 2**16))
def test_gpu_property_bf16(sizes, depth, key_cos, beta, decay, qk, seed):
    # tree shapes vary freely below a few (size, depth cap) classes: the forest's depth is pinned to the
    # cap, so the kernel compiles once per class, not once per example
    gen = torch.Generator().manual_seed(seed)
    forest = PackedForest.from_trees([random_tree(n, min(depth, n), gen) for n in sizes], device="cuda",
                                     max_depth=depth)
    inputs = verify_inputs(forest, 2, 4, 128, 128, key_cos=key_cos, beta=beta, decay=decay, q_equals_k=qk,
                           dtype=torch.bfloat16, seed=seed, device="cuda")
    err, _ = errors(forest, inputs, tuned=True)
    assert err < 1e-2
