"""The fused decode kernels (kernels/gdn_decode.py) against their twins (bole/ops/gdn_decode.py).

Inputs are the views the layer would pass: q, k, v column slices of one wide conv output, a and b of
one wide projection output, the rest of each wide tensor NaN so that a read outside a view fails.
Pools are slices of an all-layer pool, rows use random distinct slots, and every other slot must stay
bitwise untouched. Outputs are NaN-poisoned before the run. Under TRITON_INTERPRET (CPU) bf16
activations are left to the GPU test: the interpreter truncates fp32 -> bf16 casts.
"""

import pytest
import torch
from numerics import rel_err

from bole.ops.gdn_decode import causal_conv1d_update_ref, gdn_decode_step_ref
from kernels.gdn_decode import causal_conv1d_update, gdn_decode_step


def gdn_inputs(device, N, HK, HV, K, V, dtype, pool_dtype, seed, slots=None):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    slots = slots or N + 3
    qkv = torch.full((N, 2 * HK * K + HV * V + 5), float("nan"))
    qkv[:, 2:2 + 2 * HK * K + HV * V] = r(N, 2 * HK * K + HV * V)
    qkv = qkv.to(device, dtype)
    q = qkv[:, 2:2 + HK * K].view(N, HK, K)
    k = qkv[:, 2 + HK * K:2 + 2 * HK * K].view(N, HK, K)
    v = qkv[:, 2 + 2 * HK * K:2 + 2 * HK * K + HV * V].view(N, HV, V)
    ab = torch.full((N, 2 * HV + 3), float("nan"))
    ab[:, :HV] = r(N, HV) * 3
    ab[0, 0], ab[-1, -4] = 25.0, -30.0  # softplus above its threshold, and far below zero
    ab[:, HV + 1:2 * HV + 1] = r(N, HV) * 2
    ab = ab.to(device, dtype)
    a, b = ab[:, :HV], ab[:, HV + 1:2 * HV + 1]
    A_log = (torch.rand(HV, generator=gen) * 2 - 1).to(device)
    dt_bias = r(HV).to(device)
    pool = (r(2, slots, HV, V, K) * 0.2).to(device, pool_dtype)[1]  # a layer of an all-layer pool
    idx = torch.randperm(slots, generator=gen)[:N].to(device)
    return q, k, v, a, b, A_log, dt_bias, pool, idx


def run_both(args, block_v=None, **kw):
    *inputs, pool, idx = args
    pool_k, pool_t = pool.clone(), pool.clone()
    N, HV, V = inputs[2].shape
    out = torch.full((N, HV, V), float("nan"), dtype=inputs[2].dtype, device=pool.device)
    o_k = gdn_decode_step(*inputs, pool_k, idx, out=out, block_v=block_v, **kw)
    assert o_k is out
    o_t = gdn_decode_step_ref(*inputs, pool_t, idx, **kw)
    return o_k, o_t, pool_k, pool_t


@pytest.mark.parametrize("N,HK,HV,K,V,dtype,pool_dtype", [
    (1, 4, 8, 64, 64, torch.float32, torch.float32),    # the tiny test model, batch 1
    (3, 2, 6, 48, 48, torch.float32, torch.float32),    # GQA ratio 3, K and V not powers of two
    (5, 4, 8, 64, 64, torch.float16, torch.float32),
    (3, 3, 3, 16, 24, torch.float16, torch.float32),    # no GQA, K != V
    (3, 1, 2, 32, 48, torch.float32, torch.bfloat16),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_gdn_decode_step_matches_twin(device, N, HK, HV, K, V, dtype, pool_dtype, seed):
    args = gdn_inputs(device, N, HK, HV, K, V, dtype, pool_dtype, seed)
    o_k, o_t, pool_k, pool_t = run_both(args)
    pool, idx = args[-2], args[-1]
    # fp32 agrees to ~1e-7 (summation order); an unrounded fp16 beta would show as ~1e-4
    tol_o = 2e-6 if dtype == torch.float32 else 5e-5
    tol_s = 2e-6 if pool_dtype == torch.float32 else 1e-2  # bf16: the interpreter truncates, torch rounds
    assert o_k.dtype == dtype and rel_err(o_k, o_t) <= tol_o
    assert pool_k.dtype == pool_dtype and rel_err(pool_k[idx], pool_t[idx]) <= tol_s
    for slot in set(range(pool.shape[0])) - set(idx.tolist()):
        assert torch.equal(pool_k[slot], pool[slot])


@pytest.mark.parametrize("block_v", [4, 16, 64])
def test_gdn_no_l2norm_scale_and_value_tiles(device, block_v):
    args = gdn_inputs(device, 3, 2, 4, 32, 48, torch.float32, torch.float32, seed=2)
    o_k, o_t, pool_k, pool_t = run_both(args, scale=0.3, use_qk_l2norm=False, block_v=block_v)
    assert rel_err(o_k, o_t) <= 2e-6 and rel_err(pool_k, pool_t) <= 2e-6


def test_gdn_padding_rows_share_a_slot(device):
    # rows 3 and 4 are a CUDA graph's padding rows on one pad slot: the real rows are unaffected
    q, k, v, a, b, A_log, dt_bias, pool, idx = gdn_inputs(device, 5, 2, 4, 32, 32, torch.float32,
                                                          torch.float32, seed=3, slots=6)
    idx = torch.tensor([4, 0, 2, 5, 5], device=device, dtype=torch.int32)
    pool_k, pool_t = pool.clone(), pool.clone()
    o_k = gdn_decode_step(q, k, v, a, b, A_log, dt_bias, pool_k, idx)
    o_t = gdn_decode_step_ref(q[:3], k[:3], v[:3], a[:3], b[:3], A_log, dt_bias, pool_t, idx[:3])
    assert rel_err(o_k[:3], o_t) <= 2e-6 and rel_err(pool_k[:5], pool_t[:5]) <= 2e-6
    assert torch.isfinite(o_k).all() and torch.isfinite(pool_k[5]).all()


def conv_inputs(device, N, C, W, dtype, state_dtype, seed, slots=None):
    gen = torch.Generator().manual_seed(seed)
    slots = slots or N + 2
    wide = torch.full((N, C + 7), float("nan"))
    wide[:, 3:3 + C] = torch.randn(N, C, generator=gen)
    x = wide.to(device, dtype)[:, 3:3 + C]
    weight = torch.randn(C, 1, W, generator=gen).to(device, dtype)[:, 0, :]  # as conv1d.weight[:, 0, :]
    state = torch.randn(3, slots, C, W - 1, generator=gen).to(device, state_dtype)[2]
    idx = torch.randperm(slots, generator=gen)[:N].to(device)
    return x, weight, state, idx


@pytest.mark.parametrize("N,C,W,dtype,state_dtype", [
    (1, 100, 4, torch.float32, torch.float32),
    (3, 257, 4, torch.float16, torch.float32),
    (5, 63, 2, torch.float32, torch.float16),
    (3, 96, 3, torch.float16, torch.float16),
])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("seed", [0, 1])
def test_conv_update_matches_twin(device, N, C, W, dtype, state_dtype, activation, seed):
    x, weight, state, idx = conv_inputs(device, N, C, W, dtype, state_dtype, seed)
    state_k, state_t = state.clone(), state.clone()
    out = torch.full((N, C), float("nan"), dtype=dtype, device=device)
    y_k = causal_conv1d_update(x, weight, state_k, idx, activation, out=out, block_c=32)
    y_t = causal_conv1d_update_ref(x, weight, state_t, idx, activation)
    assert y_k is out and y_k.dtype == dtype
    assert rel_err(y_k, y_t) <= (1e-6 if dtype == torch.float32 else 1e-4)
    assert torch.equal(state_k, state_t)  # shifted window: plain copies (other slots untouched)


def test_conv_bf16_state(device):
    # bf16 state (the pool's default) with fp32 inputs that bf16 represents exactly
    x, weight, state, idx = conv_inputs(device, 3, 130, 4, torch.float32, torch.bfloat16, seed=4)
    x = x.bfloat16().float()
    state_k, state_t = state.clone(), state.clone()
    y_k = causal_conv1d_update(x, weight, state_k, idx.int())
    y_t = causal_conv1d_update_ref(x, weight, state_t, idx)
    assert rel_err(y_k, y_t) <= 1e-6 and torch.equal(state_k, state_t)


def test_conv_then_gdn_as_the_layer(device):
    # the layer's decode: conv over [q | k | v], views of its output into the GDN step (tiny model)
    N, HK, HV, K, V, W = 3, 4, 8, 64, 64, 4
    C = 2 * HK * K + HV * V
    x, weight, state, idx = conv_inputs(device, N, C, W, torch.float32, torch.float32, seed=5, slots=6)
    _, _, _, a, b, A_log, dt_bias, pool, _ = gdn_inputs(device, N, HK, HV, K, V, torch.float32,
                                                        torch.float32, seed=5, slots=6)
    results = []
    for conv, step in ((causal_conv1d_update, gdn_decode_step), (causal_conv1d_update_ref, gdn_decode_step_ref)):
        st, pl = state.clone(), pool.clone()
        y = conv(x, weight, st, idx)
        q, k, v = y[:, :HK * K].view(N, HK, K), y[:, HK * K:2 * HK * K].view(N, HK, K), y[:, 2 * HK * K:].view(N, HV, V)
        results.append((step(q, k, v, a, b, A_log, dt_bias, pl, idx), st, pl))
    (o_k, st_k, pl_k), (o_t, st_t, pl_t) = results
    assert rel_err(o_k, o_t) <= 2e-6 and rel_err(pl_k, pl_t) <= 2e-6 and torch.equal(st_k, st_t)


@pytest.mark.parametrize("case", ["x_rank", "x_dtype", "x_stride", "w_shape", "state_shape", "idx_dtype",
                                  "idx_len", "activation", "block_c", "out_dtype"])
def test_conv_bad_inputs_raise(device, case):
    x, weight, state, idx = conv_inputs(device, 3, 16, 4, torch.float32, torch.float32, seed=0)
    kw = dict(x=x, weight=weight, conv_state=state, state_indices=idx)
    bad = {"x_rank": dict(x=x[None]), "x_dtype": dict(x=x.double()), "x_stride": dict(x=x.T.contiguous().T),
           "w_shape": dict(weight=weight[:-1]), "state_shape": dict(conv_state=state[..., :1]),
           "idx_dtype": dict(state_indices=idx.float()), "idx_len": dict(state_indices=idx[:2]),
           "activation": dict(activation="gelu"), "block_c": dict(block_c=24),
           "out_dtype": dict(out=torch.empty(3, 16, dtype=torch.float16, device=device))}
    kw.update(bad[case])
    with pytest.raises(ValueError):
        causal_conv1d_update(**kw)


@pytest.mark.parametrize("case", ["q_rank", "k_shape", "v_rows", "gqa", "qkv_dtype", "v_stride", "head_dim",
                                  "a_shape", "A_log_shape", "pool_dtype", "pool_shape", "pool_stride",
                                  "idx_dtype", "idx_len", "block_v", "out_shape"])
def test_gdn_bad_inputs_raise(device, case):
    q, k, v, a, b, A_log, dt_bias, pool, idx = gdn_inputs(device, 3, 2, 4, 16, 16, torch.float32,
                                                          torch.float32, seed=0)
    kw = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_state=pool, state_indices=idx)
    z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=device)
    bad = {"q_rank": dict(q=q[None]), "k_shape": dict(k=k[:, :, :8]), "v_rows": dict(v=v[:2]),
           "gqa": dict(v=z(3, 3, 16), a=z(3, 3), b=z(3, 3)), "qkv_dtype": dict(v=v.double()),
           "v_stride": dict(v=v.transpose(1, 2)), "head_dim": dict(q=z(3, 2, 512), k=z(3, 2, 512)),
           "a_shape": dict(a=a[:, :2]), "A_log_shape": dict(A_log=A_log[:2]),
           "pool_dtype": dict(ssm_state=pool.half()), "pool_shape": dict(ssm_state=pool[:, :, :8]),
           "pool_stride": dict(ssm_state=pool.transpose(2, 3)), "idx_dtype": dict(state_indices=idx.float()),
           "idx_len": dict(state_indices=idx[:1]), "block_v": dict(block_v=12),
           "out_shape": dict(out=z(3, 4, 8))}
    kw.update(bad[case])
    with pytest.raises(ValueError):
        gdn_decode_step(**kw)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 7])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_gpu_bf16_qwen_shapes(device, N, pool_dtype):
    # Qwen3.5-9B's GDN (HK=16, HV=32, K=V=128) with bf16 activations and conv window
    HK, HV, K, V, W = 16, 32, 128, 128, 4
    C = 2 * HK * K + HV * V
    x, weight, state, idx = conv_inputs(device, N, C, W, torch.bfloat16, torch.bfloat16, seed=N, slots=N + 4)
    state_k, state_t = state.clone(), state.clone()
    y_k = causal_conv1d_update(x, weight, state_k, idx)
    y_t = causal_conv1d_update_ref(x, weight, state_t, idx)
    assert rel_err(y_k, y_t) <= 1e-2 and torch.equal(state_k, state_t)
    args = gdn_inputs(device, N, HK, HV, K, V, torch.bfloat16, pool_dtype, seed=N, slots=N + 4)
    o_k, o_t, pool_k, pool_t = run_both(args)
    assert rel_err(o_k, o_t) <= 1e-2
    assert rel_err(pool_k, pool_t) <= (1e-5 if pool_dtype == torch.float32 else 1e-2)
