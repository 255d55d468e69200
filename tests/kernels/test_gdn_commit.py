"""The Triton commit (kernels/gdn_commit.py) against its twin and against the serial recurrence.

Factors come from the Triton verifier, one call per layer writing into slices of an all-layer factor
buffer (as the engine does); the commit then updates every layer and request in one launch. The
committed state of accepted node a must equal the twin's commit and node a's serial snapshot.
"""

import pytest
import torch
from numerics import rel_err

from bole.ops import gdn as ref
from bole.spec.tree import DraftTree, PackedForest, random_tree
from kernels.gdn_commit import gdn_commit
from kernels.gdn_tree_verify import gdn_tree_verify


def setup(device, L=2, HK=1, HV=2, K=16, V=16, dtype=torch.float32, pool_dtype=torch.float32, l2=True,
          seed=0, slots=5):
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(7, 4, gen), DraftTree([-1, 0, 0]), random_tree(5, 3, gen)]
    forest = PackedForest.from_trees(trees, device=device)
    N, B = forest.num_nodes, forest.num_requests
    r = lambda *s: torch.randn(*s, generator=gen)
    q = r(L, N, HK, K).to(device, dtype)
    k = (r(L, N, HK, K) * 0.4).to(device, dtype)
    v = r(L, N, HV, V).to(device, dtype)
    g = (-torch.rand(L, N, HV, generator=gen) * 0.7).to(device)
    beta = torch.rand(L, N, HV, generator=gen).to(device)
    pool = (r(L, slots, HV, V, K) * 0.2).to(device, pool_dtype)
    idx = torch.randperm(slots, generator=gen)[:B].to(device)
    # the engine's all-layer factor buffer, filled by one verifier call per layer
    u = torch.full((L, N, HV, V), float("nan"), device=device)
    logp = torch.full((L, N, HV), float("nan"), device=device)
    for layer in range(L):
        gdn_tree_verify(q[layer][None], k[layer][None], v[layer][None], g[layer][None], beta[layer][None],
                        forest, pool[layer], idx, use_qk_l2norm=l2, u_out=u[layer], logp_out=logp[layer])
    snaps = []  # serial per-node states in float64: [L, N, HV, V, K]
    for layer in range(L):
        args = [t[layer][None].double() for t in (q, k, v, g, beta)]
        snaps.append(ref.gdn_tree_serial_ref(*args, forest, pool[layer].double(), idx, use_qk_l2norm=l2)[1])
    return dict(forest=forest, k=k, u=u, logp=logp, pool=pool, idx=idx, snaps=torch.stack(snaps), l2=l2)


def commit_both(s, accepted_local):
    accepted = s["forest"].accepted_path_nodes(accepted_local)
    pool_k = s["pool"].clone()
    pool_t = s["pool"].clone()
    gdn_commit(pool_k, s["k"], s["u"], s["logp"], accepted, s["idx"], use_qk_l2norm=s["l2"])
    ref.gdn_commit_ref(pool_t, s["k"], s["u"], s["logp"], accepted, s["idx"], use_qk_l2norm=s["l2"])
    return pool_k, pool_t


def check_commit(s, accepted_local, tol_twin, tol_serial):
    pool_k, pool_t = commit_both(s, accepted_local)
    assert rel_err(pool_k, pool_t) <= tol_twin
    cu = s["forest"].cu_seqlens.tolist()
    touched = set()
    for b, a in enumerate(accepted_local):
        slot = int(s["idx"][b])
        if a < 0:  # empty path: bitwise untouched
            assert torch.equal(pool_k[:, slot], s["pool"][:, slot])
            continue
        touched.add(slot)
        assert rel_err(pool_k[:, slot], s["snaps"][:, cu[b] + a]) <= tol_serial, (b, a)
    for slot in set(range(s["pool"].shape[1])) - touched:  # slots no request owns: untouched
        assert torch.equal(pool_k[:, slot], s["pool"][:, slot])


def test_every_node_and_empty_paths(device):
    s = setup(device, L=2, HK=1, HV=2)
    for a in range(7):  # every node of request 0's tree; the others cycle through theirs and -1
        check_commit(s, [a, (a % 4) - 1, (a % 6) - 1], 1e-5, 1e-5)
    check_commit(s, [-1, -1, -1], 0, 0)


@pytest.mark.parametrize("HK,HV,l2", [(2, 4, True), (2, 2, False), (1, 1, True)])
def test_gqa_and_l2norm(device, HK, HV, l2):
    s = setup(device, L=3, HK=HK, HV=HV, K=32, V=16, l2=l2, seed=1)
    check_commit(s, [6, 2, 4], 1e-5, 1e-5)
    check_commit(s, [3, -1, 0], 1e-5, 1e-5)


def test_value_tiles_and_wide_heads(device):
    # V spread over several tiles, K = 256 in one row
    s = setup(device, L=1, HK=1, HV=1, K=256, V=32, seed=2)
    accepted = s["forest"].accepted_path_nodes([5, 1, 2])
    pool_a, pool_b = s["pool"].clone(), s["pool"].clone()
    gdn_commit(pool_a, s["k"], s["u"], s["logp"], accepted, s["idx"], use_qk_l2norm=True, block_v=16)
    gdn_commit(pool_b, s["k"], s["u"], s["logp"], accepted, s["idx"], use_qk_l2norm=True, block_v=32)
    assert rel_err(pool_a, pool_b) < 1e-6
    check_commit(s, [5, 1, 2], 1e-5, 1e-5)


def test_bf16_pool_and_half_keys(device):
    # bf16 pool: the twin rounds to nearest, the interpreter truncates: allow a few bf16 ulps
    s = setup(device, L=2, HK=1, HV=2, dtype=torch.bfloat16, pool_dtype=torch.bfloat16, seed=3)
    pool_k, pool_t = commit_both(s, [4, 2, -1])
    assert pool_k.dtype == torch.bfloat16
    assert rel_err(pool_k, pool_t) < 1e-2
    assert (pool_k.float() - pool_t.float()).abs().max() <= 2 ** -6 * pool_t.float().abs().max()
    check_commit(s, [4, 2, -1], 1e-2, 1e-2)


def test_int64_indices_and_wider_paths(device):
    # int64 paths padded beyond the forest depth, int64 slots
    s = setup(device, seed=4)
    accepted = s["forest"].accepted_path_nodes([6, 1, 3]).long()
    accepted = torch.cat([accepted, torch.full((3, 5), -1, dtype=torch.long, device=device)], 1)
    pool_k, pool_t = s["pool"].clone(), s["pool"].clone()
    gdn_commit(pool_k, s["k"], s["u"], s["logp"], accepted, s["idx"].long(), use_qk_l2norm=True)
    ref.gdn_commit_ref(pool_t, s["k"], s["u"], s["logp"], accepted, s["idx"], use_qk_l2norm=True)
    assert rel_err(pool_k, pool_t) < 1e-5


@pytest.mark.parametrize("case", ["pool_rank", "pool_dtype", "layers", "gqa", "u_shape", "u_dtype",
                                  "logp_shape", "paths_dtype", "indices_len", "block_v", "precision"])
def test_bad_inputs_raise(device, case):
    L, N, HK, HV, V, K, B = 2, 6, 1, 2, 16, 16, 2
    pool = torch.zeros(L, 4, HV, V, K, device=device)
    kw = dict(state_pool=pool, k=torch.zeros(L, N, HK, K, device=device),
              u=torch.zeros(L, N, HV, V, device=device), logp=torch.zeros(L, N, HV, device=device),
              accepted_nodes=torch.full((B, 3), -1, dtype=torch.int32, device=device),
              state_indices=torch.arange(B, device=device))
    if case == "pool_rank":
        kw.update(state_pool=pool[0])
    elif case == "pool_dtype":
        kw.update(state_pool=pool.half())
    elif case == "layers":
        kw.update(k=kw["k"][:1])
    elif case == "gqa":
        kw.update(state_pool=torch.zeros(L, 4, 3, V, K, device=device),
                  k=torch.zeros(L, N, 2, K, device=device))
    elif case == "u_shape":
        kw.update(u=kw["u"][:, :-1])
    elif case == "u_dtype":
        kw.update(u=kw["u"].half())
    elif case == "logp_shape":
        kw.update(logp=kw["logp"][..., :1])
    elif case == "paths_dtype":
        kw.update(accepted_nodes=kw["accepted_nodes"].float())
    elif case == "indices_len":
        kw.update(state_indices=torch.arange(B + 1, device=device))
    elif case == "block_v":
        kw.update(block_v=20)
    elif case == "precision":
        kw.update(input_precision="bf16")
    with pytest.raises(ValueError):
        gdn_commit(**kw)


@pytest.mark.gpu
def test_gpu_qwen_shapes(device):
    s = setup(device, L=3, HK=2, HV=4, K=128, V=128, dtype=torch.bfloat16, seed=5)
    check_commit(s, [6, 2, 4], 1e-5, 1e-5)


@pytest.mark.parametrize("impl", ["kernel", "twin"])
def test_out_of_place_commit(device, impl):
    # a prefix-cache checkpoint: the committed state written into another pool's slots, the request's
    # own pool read only; an empty path writes nothing
    s = setup(device, L=2, HK=1, HV=2, seed=3)
    fn = gdn_commit if impl == "kernel" else ref.gdn_commit_ref
    accepted_local = [4, -1, 2]
    accepted = s["forest"].accepted_path_nodes(accepted_local)
    pool = s["pool"].clone()
    out = torch.full((2, 4, 2, 16, 16), float("nan"), device=device)
    out_idx = torch.tensor([3, 1, 0], device=device)
    fn(pool, s["k"], s["u"], s["logp"], accepted, s["idx"], use_qk_l2norm=True, out_pool=out, out_indices=out_idx)
    assert torch.equal(pool, s["pool"])
    in_place, _ = commit_both(s, accepted_local)
    for b, a in enumerate(accepted_local):
        if a < 0:
            assert torch.isnan(out[:, int(out_idx[b])]).all()
        else:
            assert rel_err(out[:, int(out_idx[b])], in_place[:, int(s["idx"][b])]) <= 1e-6
    assert torch.isnan(out[:, 2]).all()
    with pytest.raises(ValueError, match="together"):
        fn(pool, s["k"], s["u"], s["logp"], accepted, s["idx"], out_pool=out)
