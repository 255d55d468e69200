"""The prefill conv kernel (kernels/causal_conv1d.py) against its twin (bole.ops.conv.causal_conv1d):
sequences of one token, fewer than W-1 tokens (the committed window shifts), block-sized and longer
ones, in one launch; x a column slice of a wider projection; fp32 / fp16 inputs, fp32 / bf16 windows,
with and without bias and activation. The windows of the launch's slots must match the twin's and
every other slot stay untouched; bad inputs raise ValueError."""

import pytest
import torch

from bole.ops.conv import causal_conv1d
from kernels._checks import interpreting
from kernels.causal_conv1d import causal_conv1d_varlen


def make(lengths, C, W, dtype, state_dtype, seed, device):
    gen = torch.Generator().manual_seed(seed)
    N, B = sum(lengths), len(lengths)
    wide = torch.randn(N, C + 7, generator=gen)
    x = wide.to(device, dtype)[:, 3:3 + C]                          # row stride C + 7
    weight = torch.randn(C, W, generator=gen).to(device)
    bias = torch.randn(C, generator=gen).to(device)
    state = torch.randn(B + 3, C, W - 1, generator=gen).to(device, state_dtype)
    slots = torch.randperm(B + 3, generator=gen)[:B].to(device)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return x, weight, bias, state, slots, cu


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("lengths", [[1], [2], [5, 1, 2, 40], [16, 17]])
@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("with_bias,activation", [(False, "silu"), (True, None)])
def test_matches_twin(device, lengths, dtype, state_dtype, with_bias, activation):
    x, w, bias, state, slots, cu = make(lengths, 40, 4, dtype, state_dtype, seed=len(lengths), device=device)
    bias = bias.to(dtype) if with_bias else None
    ref_state = state.clone()
    y_ref = causal_conv1d(x, w, bias, ref_state, slots, cu, activation=activation)
    y = causal_conv1d_varlen(x, w, state, slots, cu, bias=bias, activation=activation, block_t=8, block_c=16)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert rel(y, y_ref) < (1e-5 if dtype == torch.float32 else 2e-3)
    # every slot: the launch's updated as the twin's, the rest untouched (bf16 windows: the interpreter's
    # fp32 -> bf16 casts truncate where torch rounds, one unit in the last place)
    if state_dtype == torch.float32 or not interpreting():
        assert torch.equal(state, ref_state)
    else:
        assert torch.allclose(state.float(), ref_state.float(), rtol=2 ** -7, atol=0)


def test_default_tiles_and_width_two(device):
    x, w, _, state, slots, cu = make([3, 70], 300, 2, torch.float32, torch.float32, seed=3, device=device)
    ref_state = state.clone()
    y_ref = causal_conv1d(x, w, None, ref_state, slots, cu)
    out = torch.full_like(y_ref, float("nan"))
    y = causal_conv1d_varlen(x, w, state, slots, cu.long(), out=out, cu_host=[0, 3, 73], slots_host=[1, 2])
    assert y is out and rel(y, y_ref) < 1e-5 and torch.equal(state, ref_state)


BAD_CASES = ["x_rank", "x_stride", "w_shape", "w_narrow", "state_shape", "idx_dtype",
             "cu_rows", "bias_shape", "activation", "block", "block_small", "out_shape"]
# the forward context's checks (checked=True skips them; sizes are still compared)
SHARED_CASES = ("idx_dtype",)


@pytest.mark.parametrize("case,checked", [(c, False) for c in BAD_CASES]
                         + [(c, True) for c in BAD_CASES if c not in SHARED_CASES])
def test_bad_inputs_raise(device, case, checked):
    x, w, bias, state, slots, cu = make([3, 2], 16, 4, torch.float32, torch.float32, seed=0, device=device)
    kw = dict(x=x, weight=w, conv_state=state, state_indices=slots, cu_seqlens=cu)
    bad = {"x_rank": dict(x=x[None]), "x_stride": dict(x=x.t().contiguous().t()), "w_shape": dict(weight=w[:8]),
           "w_narrow": dict(weight=w[:, :1]), "state_shape": dict(conv_state=state[:, :, :2]),
           "idx_dtype": dict(state_indices=slots.float()), "cu_rows": dict(cu_seqlens=cu[:2]),
           "bias_shape": dict(bias=bias[:3]), "activation": dict(activation="gelu"), "block": dict(block_t=12),
           "block_small": dict(block_t=2),
           "out_shape": dict(out=torch.zeros(5, 8, device=device))}
    kw.update(bad[case])
    with pytest.raises(ValueError):
        causal_conv1d_varlen(**kw, checked=checked)
