"""SGLang's serial tree verifier, loaded from .peers/ (benchmarks/peers.py), agrees with our serial twin.

Skipped when .peers/ is absent (CI never has it): run scripts/fetch_peers.sh where PyPI is reachable.
On CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py), so the shapes are tiny.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers import (  # noqa: E402
    SGLANG_FILE,
    SGLangTreeVerifier,
    sglang_available,
    single_root_tree,
)
from bole.ops.gdn import gdn_tree_serial_ref  # noqa: E402
from bole.spec.tree import PackedForest  # noqa: E402

needs_peer = pytest.mark.skipif(
    not sglang_available(),
    reason=f"SGLang peer file {SGLANG_FILE} absent: run scripts/fetch_peers.sh (needs PyPI)",
)


def _inputs(trees, HK, HV, K, V, slots, device, seed):
    gen = torch.Generator().manual_seed(seed)
    forest = PackedForest.from_trees(trees, device=device)
    N = forest.num_nodes
    r = lambda *s: torch.randn(*s, generator=gen)
    q = r(1, N, HK, K).to(device)
    k = r(1, N, HK, K).to(device)
    v = r(1, N, HV, V).to(device)
    g = -torch.nn.functional.softplus(r(1, N, HV)).to(device) * 0.5
    beta = torch.rand(1, N, HV, generator=gen).to(device)
    pool = (0.3 * r(slots, HV, V, K)).to(device)
    return q, k, v, g, beta, forest, pool


@needs_peer
@pytest.mark.parametrize("HK,HV,K,V", [(2, 4, 16, 16), (1, 3, 12, 10)])
@pytest.mark.parametrize("seed", [0, 1])
def test_sglang_tree_matches_serial(device, HK, HV, K, V, seed):
    gen = torch.Generator().manual_seed(100 + seed)
    trees = [single_root_tree(n, 4, generator=gen) for n in (7, 1, 5)]
    q, k, v, g, beta, forest, pool = _inputs(trees, HK, HV, K, V, slots=5, device=device, seed=seed)
    slots = torch.tensor([3, 0, 4], device=device)
    pool_before = pool.clone()

    run = SGLangTreeVerifier(q, k, v, g, beta, forest, pool, slots, use_qk_l2norm=True)
    o = run()
    o_ref, snaps_ref = gdn_tree_serial_ref(q, k, v, g, beta, forest, pool, slots, use_qk_l2norm=True)

    assert o.shape == o_ref.shape
    err = (o.float() - o_ref.float()).abs().max() / o_ref.float().abs().max()
    assert err < 1e-5, f"O rel err {err}"
    # the per-node snapshots are node i's state S_i, packed per request
    cu = forest.cu_seqlens.tolist()
    for b in range(forest.num_requests):
        s, e = cu[b], cu[b + 1]
        torch.testing.assert_close(run.snapshots[b, : e - s], snaps_ref[s:e], rtol=1e-5, atol=1e-5)
    assert torch.equal(pool, pool_before), "disable_state_update=True must leave the pool alone"


@needs_peer
def test_multi_root_forest_is_rejected(device):
    q, k, v, g, beta, forest, pool = _inputs([[-1, 0, -1]], 1, 2, 8, 8, slots=1, device=device, seed=0)
    with pytest.raises(ValueError, match="only child of the committed root"):
        SGLangTreeVerifier(q, k, v, g, beta, forest, pool)


def test_single_root_tree_shape():
    gen = torch.Generator().manual_seed(0)
    for n in (1, 8, 64):
        t = single_root_tree(n, 8, generator=gen)
        assert t.num_nodes == n and t.depth <= 8
        assert [i for i, p in enumerate(t.parents) if p == -1] == [0]
