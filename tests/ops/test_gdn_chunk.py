"""The chunked torch GDN (WY / UT form) equals the serial recurrence and transformers' chunk rule."""

import pytest
import torch

from bole.ops.gdn import gdn_recurrent_ref
from bole.ops.gdn_chunk import gdn_chunk


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _inputs(N, HK, HV, K, V, slots, seed, dtype, gate="mid"):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)
    g = {"mid": -u(1, N, HV), "near0": -20 - 10 * u(1, N, HV), "near1": -1e-4 * u(1, N, HV)}[gate]
    out = (r(1, N, HK, K), r(1, N, HK, K), r(1, N, HV, V), g, u(1, N, HV), r(slots, HV, V, K))
    return [t.to(dtype) for t in out]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("chunk_size", [64, 16])
def test_chunk_equals_recurrence_varlen(dtype, tol, seed, chunk_size):
    cu = torch.tensor([0, 1, 64, 65, 165, 228])  # lengths 1, 63, 1, 100, 63
    q, k, v, g, beta, pool = _inputs(int(cu[-1]), 2, 6, 16, 12, 7, seed, dtype)
    idx = torch.tensor([3, 0, 6, 2, 5])
    kw = dict(initial_state=pool, state_indices=idx, cu_seqlens=cu, use_qk_l2norm=True)
    o_ref, s_ref = gdn_recurrent_ref(q, k, v, g, beta, **kw)
    o, s = gdn_chunk(q, k, v, g, beta, chunk_size=chunk_size, **kw)
    assert rel_err(o, o_ref) <= tol and rel_err(s, s_ref) <= tol
    assert torch.equal(pool, _inputs(int(cu[-1]), 2, 6, 16, 12, 7, seed, dtype)[-1])  # read only


@pytest.mark.parametrize("gate", ["near0", "near1"])
def test_chunk_extreme_decays(gate):
    q, k, v, g, beta, _ = _inputs(130, 1, 2, 8, 8, 1, 3, torch.float64, gate)
    o_ref, s_ref = gdn_recurrent_ref(q, k, v, g, beta, use_qk_l2norm=True)
    o, s = gdn_chunk(q, k, v, g, beta, use_qk_l2norm=True)
    assert rel_err(o, o_ref) <= 1e-10 and rel_err(s, s_ref) <= 1e-10


def test_single_token_batch_path():
    """All sequences of length one (decode) take the batched step; same results."""
    q, k, v, g, beta, pool = _inputs(5, 2, 4, 16, 8, 9, 4, torch.float32)
    cu, idx = torch.arange(6), torch.tensor([8, 1, 4, 0, 2])
    kw = dict(initial_state=pool, state_indices=idx, cu_seqlens=cu, use_qk_l2norm=True)
    o_ref, s_ref = gdn_recurrent_ref(q, k, v, g, beta, **kw)
    o, s = gdn_chunk(q, k, v, g, beta, **kw)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5


def test_matches_transformers_chunk_rule():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta, pool = _inputs(100, 4, 4, 16, 8, 1, 5, torch.float32)
    o, s = gdn_chunk(q, k, v, g, beta, initial_state=pool, use_qk_l2norm=True)
    o_hf, s_hf = torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool.transpose(-1, -2),
                                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel_err(o, o_hf) <= 1e-5 and rel_err(s, s_hf.transpose(-1, -2)) <= 1e-5


def test_bad_cu_seqlens():
    q, k, v, g, beta, _ = _inputs(10, 1, 1, 4, 4, 1, 0, torch.float32)
    with pytest.raises(ValueError, match="partition"):
        gdn_chunk(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 9]))
