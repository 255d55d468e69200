"""The short-prefill recurrence kernel (kernels/gdn_recurrent.py) against its twin (bole.ops.gdn.gdn_recurrent_ref)
and the torch chunk it replaces for short prefills (bole.ops.gdn_chunk).

Mixed sequence lengths (one token, a few, a chunk's worth), GQA, fp32 and fp16 activations, fp32 and
bf16 state pools read by slot index (never written), no initial state; bad inputs raise ValueError.
"""

import functools

import pytest
import torch

from bole.ops.gdn import gdn_recurrent_ref as twin
from bole.ops.gdn_chunk import gdn_chunk
from kernels.gdn_recurrent import gdn_recurrent


def make(lengths, HK, HV, K, V, dtype, pool_dtype, seed, device):
    gen = torch.Generator().manual_seed(seed)
    N, B = sum(lengths), len(lengths)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k, v = r(1, N, HK, K), r(1, N, HK, K), r(1, N, HV, V)
    g = -torch.exp(r(HV) * 0.5 - 2.0) * torch.nn.functional.softplus(r(1, N, HV))
    beta = torch.sigmoid(r(1, N, HV))
    pool = (0.1 * r(B + 3, HV, V, K)).to(pool_dtype)
    idx = torch.randperm(B + 3, generator=gen)[:B].to(torch.int32)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    to = lambda t, dt=None: t.to(device=device, dtype=dt or t.dtype)
    return (to(q, dtype), to(k, dtype), to(v, dtype), to(g), to(beta, dtype)), to(pool), to(idx), to(cu)


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("lengths", [[1], [13], [5, 1, 9], [64]])
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                              (torch.float32, torch.bfloat16)])
def test_matches_twin(device, lengths, dtype, pool_dtype):
    x, pool, idx, cu = make(lengths, 2, 4, 32, 16, dtype, pool_dtype, seed=len(lengths), device=device)
    before = pool.clone()
    o, final = gdn_recurrent(*x, initial_state=pool, state_indices=idx, cu_seqlens=cu, use_qk_l2norm=True)
    o_r, f_r = twin(*(t.float() for t in x), initial_state=pool.float(), state_indices=idx, cu_seqlens=cu,
                    use_qk_l2norm=True)
    assert o.dtype == x[2].dtype and final.dtype == torch.float32 and final.shape == (len(lengths), 4, 16, 32)
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # fp16 o is rounded once
    assert rel(o, o_r) < tol and rel(final, f_r) < 1e-5
    assert torch.equal(pool, before)  # read only


def test_matches_the_torch_chunk_and_needs_no_state(device):
    # what the backend replaces for short prefills; also without an initial state or slot indices
    x, pool, _, cu = make([7, 20, 3], 1, 3, 16, 32, torch.float32, torch.float32, seed=5, device=device)
    for kw in (dict(initial_state=pool[:3]), dict()):
        o, final = gdn_recurrent(*x, cu_seqlens=cu, use_qk_l2norm=True, **kw)
        o_c, f_c = gdn_chunk(*x, cu_seqlens=cu, use_qk_l2norm=True, **kw)
        assert rel(o, o_c) < 1e-5 and rel(final, f_c) < 1e-5


def test_raw_qk_and_explicit_scale(device):
    x, pool, idx, cu = make([4, 6], 2, 2, 16, 16, torch.float32, torch.float32, seed=9, device=device)
    o, final = gdn_recurrent(*x, scale=0.3, initial_state=pool, state_indices=idx, cu_seqlens=cu)
    o_r, f_r = twin(*x, scale=0.3, initial_state=pool, state_indices=idx, cu_seqlens=cu)
    assert rel(o, o_r) < 1e-5 and rel(final, f_r) < 1e-5


@pytest.mark.parametrize("checked", [False, True])
def test_bad_inputs_raise(checked):
    # checked=True (the forward context checked the offsets and slots): their sizes are still compared
    x, pool, idx, cu = make([3, 2], 2, 4, 16, 16, torch.float32, torch.float32, seed=1, device="cpu")
    with pytest.raises(ValueError, match="initial_state must be"):
        gdn_recurrent(*x, initial_state=pool[:, :2], state_indices=idx, cu_seqlens=cu, checked=checked)
    with pytest.raises(ValueError, match="state_indices must be"):
        gdn_recurrent(*x, initial_state=pool, state_indices=idx[:1], cu_seqlens=cu, checked=checked)
    with pytest.raises(ValueError, match="block_v must be"):
        gdn_recurrent(*x, initial_state=pool, state_indices=idx, cu_seqlens=cu, block_v=24, checked=checked)
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        gdn_recurrent(*x, cu_seqlens=cu[:1], checked=checked)
    if not checked:
        with pytest.raises(ValueError, match="cu_seqlens must be"):
            gdn_recurrent(*x, cu_seqlens=cu[None])


def test_backend_sends_short_and_fp32_prefills_here(device):
    # short prefills, and fp32 ones of any length (fla's chunk would take TF32 products), come here;
    # long half-precision ones go to the long path
    from bole.backend import FLA_MIN_TOKENS, short_to_recurrent

    calls = []
    prefill = short_to_recurrent(lambda *a, **kw: calls.append(a[0].shape[1]) or "long")
    for lengths, dtype in (([FLA_MIN_TOKENS - 1], torch.float16), ([FLA_MIN_TOKENS - 30, 31], torch.float32)):
        x, pool, idx, cu = make(lengths, 1, 2, 16, 16, dtype, torch.float32, seed=2, device=device)
        o, final = prefill(*x, initial_state=pool, state_indices=idx, cu_seqlens=cu, use_qk_l2norm=True)
        o_r, f_r = twin(*x, initial_state=pool, state_indices=idx, cu_seqlens=cu, use_qk_l2norm=True)
        assert rel(o, o_r) < (1e-5 if dtype == torch.float32 else 2e-3) and rel(final, f_r) < 1e-5 and not calls
    x, pool, idx, cu = make([FLA_MIN_TOKENS], 1, 2, 16, 16, torch.float16, torch.float32, seed=2, device=device)
    assert prefill(*x, initial_state=pool, cu_seqlens=cu) == "long" and calls == [FLA_MIN_TOKENS]
    # a long path that is exact in fp32 (the torch chunk) keeps fp32 prefills
    exact = short_to_recurrent(lambda *a, **kw: "long", fp32_to_recurrent=False)
    x, pool, idx, cu = make([FLA_MIN_TOKENS], 1, 2, 16, 16, torch.float32, torch.float32, seed=2, device=device)
    assert exact(*x, initial_state=pool, cu_seqlens=cu) == "long"


def test_backend_shares_one_checked_recurrence():
    # the triton backend builds one checked recurrence: the short / fp32 prefills' and the captured ones'
    from bole.backend import FLA_MIN_TOKENS, resolve_backend, short_to_recurrent

    short = []
    prefill = short_to_recurrent(lambda *a, **kw: "long", recurrent=lambda *a, **kw: short.append(a[0].shape[1]))
    x, pool, idx, cu = make([FLA_MIN_TOKENS - 1], 1, 2, 16, 16, torch.float16, torch.float32, seed=2, device="cpu")
    assert prefill(*x, initial_state=pool, cu_seqlens=cu) is None and short == [FLA_MIN_TOKENS - 1]
    backend = resolve_backend("triton")
    cell = [c.cell_contents for c in backend.prefill.__closure__ if isinstance(c.cell_contents, functools.partial)]
    assert cell == [backend.prefill_sync_free]
