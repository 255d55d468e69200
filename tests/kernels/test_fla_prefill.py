"""The triton backend's GDN prefill (flash-linear-attention's chunk_gated_delta_rule behind
``bole.backend.fla_prefill``) against our chunked twin ``bole.ops.gdn_chunk``: variable-length
sequences, GQA, initial states read from pool slots. On the GPU only (fla's kernels are Triton)."""

import pytest
import torch
from numerics import rel_err

from bole.ops.gdn_chunk import gdn_chunk

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


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
