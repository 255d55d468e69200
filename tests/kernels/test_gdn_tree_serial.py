"""The compiled serial tree verifier (the serial_tree baseline) == its naive twin."""

import pytest
import torch

from bole.ops.gdn import gdn_tree_serial_ref as twin
from bole.spec.tree import PackedForest, random_tree
from kernels.gdn_tree_serial import gdn_tree_serial


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("HK,HV,l2,in_dtype,pool_dtype", [
    (2, 4, True, torch.float32, torch.float32),
    (1, 1, False, torch.float32, torch.float32),
    (2, 2, True, torch.float16, torch.bfloat16),
])
def test_kernel_matches_twin(HK, HV, l2, in_dtype, pool_dtype, device):
    gen = torch.Generator().manual_seed(HK + HV)
    f = PackedForest.from_trees([random_tree(n, 5, gen) for n in (1, 7, 13)], device=device)
    N, K, V = f.num_nodes, 16, 24
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k, v = r(1, N, HK, K), r(1, N, HK, K), r(1, N, HV, V)
    g, beta = -torch.rand(1, N, HV, generator=gen), torch.rand(1, N, HV, generator=gen)
    pool = (0.3 * r(4, HV, V, K)).to(pool_dtype)
    ins = [t.to(in_dtype).to(device) for t in (q, k, v)] + [g.to(device), beta.to(device)]
    pool, idx = pool.to(device), torch.tensor([3, 0, 2], device=device)
    before = pool.clone()
    snaps = torch.full((N, HV, V, K), float("nan"), device=device)
    o_out = torch.full((1, N, HV, V), float("nan"), dtype=in_dtype, device=device)
    o, s = gdn_tree_serial(*ins, f, pool, idx, use_qk_l2norm=l2, snapshots_out=snaps, o_out=o_out,
                           block_v=8)
    o_ref, s_ref = twin(*[t.float() for t in ins], f, pool.float(), idx, use_qk_l2norm=l2)
    tol = 1e-5 if in_dtype == torch.float32 else 5e-3
    assert o is o_out and s is snaps
    assert rel(o, o_ref) <= tol and rel(s, s_ref) <= 1e-5
    assert torch.equal(pool, before)


def test_bad_inputs_raise():
    f = PackedForest.from_trees([[-1, 0]])
    q = torch.randn(1, 2, 1, 8)
    v, g = torch.randn(1, 2, 2, 8), torch.zeros(1, 2, 2)
    pool = torch.zeros(1, 2, 8, 8)
    with pytest.raises(ValueError, match="pool"):
        gdn_tree_serial(q, q, v, g, g, f, None)
    with pytest.raises(ValueError, match="block_v"):
        gdn_tree_serial(q, q, v, g, g, f, pool, block_v=12)
    with pytest.raises(ValueError, match="forest has 2 nodes"):
        gdn_tree_serial(q[:, :1], q[:, :1], v[:, :1], g[:, :1], g[:, :1], f, pool)
