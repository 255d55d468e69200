"""The triton backend's GDN prefill (flash-linear-attention's chunk_gated_delta_rule behind
``bole.backend.fla_prefill``) against our chunked twin ``bole.ops.gdn_chunk``: variable-length
sequences, GQA, initial states read from pool slots, on the GPU (fla's kernels are Triton); on the CPU,
with fla stood in for, that a forward's layers hand fla one offsets tensor (its plans are memoised by it)."""

import sys
import types

import pytest
import torch
from numerics import rel_err

from bole.ops.gdn_chunk import gdn_chunk


def test_fla_prefill_plans_once_per_forward(monkeypatch):
    """fla memoises its chunk plans (one device read each) by the identity of ``cu_seqlens``: the wrapper
    passes the same int64 tensor for every call with the same int32 offsets (every layer of a forward),
    and a new one for a new forward's."""
    seen = []

    def chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                               use_qk_l2norm_in_kernel):
        seen.append(cu_seqlens)
        HV, V, K = v.shape[2], v.shape[3], q.shape[3]
        return torch.zeros_like(v), torch.zeros(cu_seqlens.numel() - 1, HV, K, V)

    fake = types.ModuleType("fla.ops.gated_delta_rule")
    fake.chunk_gated_delta_rule = chunk_gated_delta_rule
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake)
    from bole.backend import fla_prefill

    prefill = fla_prefill()
    q, v, g = torch.zeros(1, 7, 2, 4), torch.zeros(1, 7, 2, 4), torch.zeros(1, 7, 2)
    pool, slots = torch.zeros(3, 2, 4, 4), torch.tensor([2, 0])
    forwards = [torch.tensor([0, 3, 7], dtype=torch.int32) for _ in range(2)]
    for cu in forwards:
        for _layer in range(3):
            prefill(q, q, v, g, g, initial_state=pool, state_indices=slots, cu_seqlens=cu)
    assert all(c.dtype == torch.int64 and c.tolist() == [0, 3, 7] for c in seen)
    assert seen[0] is seen[1] is seen[2] and seen[3] is seen[4] is seen[5] and seen[0] is not seen[3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lens,dtype", [([13], torch.float32), ([5, 64, 130], torch.float32),
                                        ([1, 77, 200], torch.bfloat16)])
def test_fla_prefill_matches_chunk_twin(lens, dtype):
    pytest.importorskip("fla", reason="flash-linear-attention (the gpu extra) is not installed")
    from bole.backend import fla_prefill

    prefill = fla_prefill()
    gen = torch.Generator().manual_seed(0)
    HK, HV, K, V, N = 2, 4, 64, 64, sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k = r(1, N, HK, K).cuda().to(dtype), r(1, N, HK, K).cuda().to(dtype)
    v = r(1, N, HV, V).cuda().to(dtype)
    g = (-torch.rand(1, N, HV, generator=gen) * 2).cuda()
    beta = torch.rand(1, N, HV, generator=gen).cuda().to(dtype)
    pool = (r(6, HV, V, K) * 0.1).cuda()
    slots = torch.tensor([4, 1, 3][:len(lens)]).cuda()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32).cuda()
    o_ref, f_ref = gdn_chunk(q.float(), k.float(), v.float(), g, beta.float(), initial_state=pool,
                             state_indices=slots, cu_seqlens=cu, use_qk_l2norm=True)
    before = pool.clone()
    o, f = prefill(q, k, v, g, beta, initial_state=pool, state_indices=slots, cu_seqlens=cu, use_qk_l2norm=True)
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    assert o.shape == o_ref.shape and f.shape == f_ref.shape
    assert rel_err(o.float(), o_ref) < tol and rel_err(f.float(), f_ref) < tol
    assert torch.equal(pool, before)  # the pool is read, never written


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_prefill_plans_once_per_forward_gpu(monkeypatch):
    """With fla itself: three layers' calls with one forward's offsets plan (``prepare_lens`` under fla's
    memoised ``prepare_chunk_indices`` / ``_offsets``) only in the first; new offsets plan again."""
    pytest.importorskip("fla", reason="flash-linear-attention (the gpu extra) is not installed")
    import fla.ops.utils.index as index

    from bole.backend import fla_prefill

    calls = []
    real = index.prepare_lens
    monkeypatch.setattr(index, "prepare_lens", lambda cu: calls.append(1) or real(cu))
    prefill = fla_prefill()
    HK, HV, K, V, N = 2, 4, 64, 64, 200
    q, k = torch.randn(1, N, HK, K).cuda(), torch.randn(1, N, HK, K).cuda()
    v, g = torch.randn(1, N, HV, V).cuda(), -torch.rand(1, N, HV).cuda()
    beta, pool = torch.rand(1, N, HV).cuda(), torch.zeros(3, HV, V, K).cuda()
    slots = torch.tensor([2, 0]).cuda()

    def forward():
        cu = torch.tensor([0, 77, N], dtype=torch.int32).cuda()
        counts = []
        for _layer in range(3):
            prefill(q, k, v, g, beta, initial_state=pool, state_indices=slots, cu_seqlens=cu, use_qk_l2norm=True)
            counts.append(len(calls))
        return counts

    first, second = forward(), forward()
    assert first[0] > 0 and first[0] == first[1] == first[2]
    assert second[0] > first[2] and second[0] == second[1] == second[2]
