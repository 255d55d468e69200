"""The drafter's fused log-softmax top-k (kernels/logits_topk.py) against its twin (bole/ops/topk.py).

Random logits (no ties), the shapes the drafter passes ([B, V] at the root, [B, M, V] per level, the
embedded model's 8192-token vocabulary), masked entries (-inf), half inputs; outputs compared value
by value (fp32 log-sum-exp, within 1e-5) and index by index.
"""

import pytest
import torch

from bole.backend import topk_within
from bole.ops.topk import log_softmax_topk_ref
from kernels.logits_topk import MAX_K, MAX_V, log_softmax_topk


def check(x, k, exact_ids=True):
    vals, idx = log_softmax_topk(x, k)
    ref_vals, ref_idx = log_softmax_topk_ref(x, k)
    assert vals.shape == ref_vals.shape == (*x.shape[:-1], k) and vals.dtype == torch.float32
    assert idx.dtype == torch.int64
    torch.testing.assert_close(vals, ref_vals, rtol=1e-5, atol=1e-5)
    if exact_ids:
        assert torch.equal(idx, ref_idx)
    else:  # ties (half inputs): the same logits and distinct ids
        assert torch.equal(x.gather(-1, idx), x.gather(-1, ref_idx))
        assert (idx.sort(-1).values.diff(dim=-1) != 0).all()


@pytest.mark.parametrize("shape,k", [((3, 100), 1), ((2, 4, 8192), 2), ((1, 8192), 4), ((5, 2, 37), 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_twin(device, shape, k, dtype):
    for seed in range(2):
        gen = torch.Generator().manual_seed(seed)
        x = (torch.randn(*shape, generator=gen) * 4).to(device, dtype)
        check(x, k, exact_ids=dtype == torch.float32)  # fp16 rounding makes ties likely


def test_masked_entries_and_strided_rows(device):
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(6, 300, generator=gen).to(device)
    base[:, ::3] = float("-inf")  # e.g. a vocabulary mask
    check(base[::2, 10:210], 5)   # rows with a stride, a column window


def test_rows_with_fewer_finite_entries_than_k(device):
    # the drafter then proposes -inf children (invalid, dropped); their ids must still be distinct
    x = torch.randn(2, 100, generator=torch.Generator().manual_seed(4)).to(device)
    x[0, 3:] = float("-inf")
    vals, idx = log_softmax_topk(x, 5)
    assert (idx.sort(-1).values.diff(dim=-1) != 0).all()
    assert torch.equal(idx[0, :3].sort().values, torch.arange(3, device=idx.device))
    assert torch.isinf(vals[0, 3:]).all() and torch.equal(idx[1], log_softmax_topk_ref(x[1], 5)[1])


def test_nan_rows_give_ids_in_range(device):
    # a broken model's NaN logits must not send an out-of-range token id into the drafter's embedding
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(2)).to(device)
    x[1] = float("nan")
    vals, idx = log_softmax_topk(x, 3)
    assert ((idx >= 0) & (idx < 50)).all()
    ref_vals, ref_idx = log_softmax_topk_ref(x[::2], 3)
    assert torch.equal(idx[::2], ref_idx) and torch.allclose(vals[::2], ref_vals, atol=1e-5)


def test_wide_rows_use_the_twin(device):
    x = torch.randn(2, MAX_V + 1, generator=torch.Generator().manual_seed(1)).to(device)
    with pytest.raises(ValueError, match="exceed the kernel's tile"):
        log_softmax_topk(x, 2)
    vals, idx = topk_within(log_softmax_topk, MAX_V, MAX_K)(x, 2)  # the backend's entry
    ref_vals, ref_idx = log_softmax_topk_ref(x, 2)
    assert torch.equal(idx, ref_idx) and torch.equal(vals, ref_vals)


@pytest.mark.parametrize("k", [0, 101, 2.0, True])
def test_bad_k_raises(k):
    with pytest.raises(ValueError, match="k must be"):
        log_softmax_topk(torch.zeros(2, 100), k)


def test_bad_logits_raise():
    with pytest.raises(ValueError, match="logits must be one of"):
        log_softmax_topk(torch.zeros(2, 100, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="logits must be a tensor"):
        log_softmax_topk([1.0, 2.0], 1)
