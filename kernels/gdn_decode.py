"""Fused GDN decode in Triton: one token per request, batched, CUDA-graph capturable.

Two kernels replace the ~25 small torch ops of a GDN layer's decode step (bole/layers/gdn.py):

    causal_conv1d_update   window = [conv_state[slot] | x_n]; y = silu(Σ_j window_j w_j) (fp32 sum);
                           conv_state[slot] ← window[1:], in place.         grid (N, C / BC)
    gdn_decode_step        g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) (rounded to b's
                           dtype, as the layer's torch.sigmoid on bf16 is), l2norm(q)·scale, l2norm(k);
                           Sᵀ ← exp(g) Sᵀ;  u = beta (v − Sᵀ k);  Sᵀ ← Sᵀ + u kᵀ;  o = Sᵀ q,
                           Sᵀ written back in place in the pool's dtype.    grid (N, HV, V / BV)

The state is stored transposed ([V, K], K contiguous); a program owns a [BV, K] tile of one
(row, head): value rows are independent, so it reads and writes only its tile. Inputs may be strided
views of wider projection outputs (any row / head stride, last dim contiguous). Rows that share a
slot (a CUDA graph's padding rows) race: the slot ends with elements from any of their updates.
Twins: bole.ops.gdn_decode.{causal_conv1d_update_ref, gdn_decode_step_ref}.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_conv_inputs, check_index, check_tensor

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_ACTIVATIONS = {None: False, "identity": False, "silu": True, "swish": True}


@triton.jit
def softplus(x):
    """torch's softplus in fp32: x above the threshold 20, else log1p(exp(x)) (Goldberg's accurate form)."""
    b_e = tl.exp(tl.minimum(x, 20.0))
    b_1e = 1.0 + b_e
    b_sp = tl.where(b_1e == 1.0, b_e, tl.log(b_1e) * (b_e / (b_1e - 1.0)))
    return tl.where(x > 20.0, x, b_sp)


@triton.jit
def causal_conv1d_update_kernel(
    x, weight, conv_state, state_indices, y,
    C, stride_xn, stride_yn, stride_wc, stride_ww, stride_ss, stride_sc, stride_sw,
    W: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr,
):
    i_n, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    i_slot = tl.load(state_indices + i_n).to(tl.int64)
    p_s = conv_state + i_slot * stride_ss + o_c.to(tl.int64) * stride_sc  # [BC] column 0 of the window
    p_w = weight + o_c * stride_wc
    b_x = tl.load(x + i_n * stride_xn + o_c, mask=m_c, other=0)
    b_y = tl.zeros([BC], dtype=tl.float32)
    # oldest tap first, as the twin sums; the state is read in x's dtype (the twin's torch.cat).
    # Column j is loaded before column j-1 is overwritten, by the same thread (same [BC] layout).
    for j in tl.static_range(W - 1):
        b_s = tl.load(p_s + j * stride_sw, mask=m_c, other=0).to(b_x.dtype)
        b_y += b_s.to(tl.float32) * tl.load(p_w + j * stride_ww, mask=m_c, other=0).to(tl.float32)
        if j > 0:
            tl.store(p_s + (j - 1) * stride_sw, b_s.to(conv_state.dtype.element_ty), mask=m_c)
    b_y += b_x.to(tl.float32) * tl.load(p_w + (W - 1) * stride_ww, mask=m_c, other=0).to(tl.float32)
    tl.store(p_s + (W - 2) * stride_sw, b_x.to(conv_state.dtype.element_ty), mask=m_c)
    if SILU:
        b_y = b_y * tl.sigmoid(b_y)
    tl.store(y + i_n * stride_yn + o_c, b_y.to(y.dtype.element_ty), mask=m_c)


def launch_causal_conv1d_update(x, weight, conv_state, state_indices, silu: bool, out,
                                block_c: int, num_warps: int):
    """Launcher: grid (N, C / BC)."""
    N, C = x.shape
    grid = (N, triton.cdiv(C, block_c))
    causal_conv1d_update_kernel[grid](
        x, weight, conv_state, state_indices.contiguous(), out,
        C, x.stride(0), out.stride(0), weight.stride(0), weight.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        W=weight.shape[1], BC=block_c, SILU=silu, num_warps=num_warps,
    )
    return out


def _check_out(out, shape, dtype, device):
    check_tensor("out", out, len(shape), (dtype,), device)
    if tuple(out.shape) != shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {shape} with a contiguous last dim, got {tuple(out.shape)} "
                         f"strides {out.stride()}")


def causal_conv1d_update(x, weight, conv_state, state_indices, activation="silu", out=None, *,
                         block_c: int = 128, num_warps: int = 4, checked: bool = False):
    """Depthwise causal conv of one new token per row, continuing each row's conv window in place.

    Twin: `bole.ops.gdn_decode.causal_conv1d_update_ref` (= `causal_conv1d_decode` without bias).

    Args:
        x: [N, C] fp32/fp16/bf16, last dim contiguous (any row stride: a column slice is fine).
        weight: [C, W] depthwise taps, oldest first (weight[:, W-1] multiplies x), any strides.
        conv_state: [slots, C, W-1] the last W-1 inputs per slot, oldest first, any strides;
            updated in place (slot state_indices[n] becomes [conv_state[slot, :, 1:], x[n]]).
        state_indices: int32/int64 [N] slot of each row.
        activation: "silu" / "swish" or None / "identity".
        out: optional [N, C] in x's dtype, last dim contiguous.
        block_c: channel tile (power of two).
        checked: the caller checked ``state_indices`` once for the whole forward
            (`kernels._checks.check_forward_inputs`); only its size is compared here.
    Returns:
        y [N, C] in x's dtype: act(Σ_j window[:, j] · weight[:, j]) summed in fp32.
    """
    N, C, W = check_conv_inputs(x, weight, conv_state)
    check_index("state_indices", state_indices, N, x.device, checked)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unsupported conv activation {activation!r}")
    if block_c < 1 or block_c & (block_c - 1):
        raise ValueError(f"block_c must be a power of two, got {block_c}")
    if out is None:
        out = torch.empty(N, C, dtype=x.dtype, device=x.device)
    else:
        _check_out(out, (N, C), x.dtype, x.device)
    if N == 0 or C == 0:
        return out
    return launch_causal_conv1d_update(x, weight, conv_state, state_indices, _ACTIVATIONS[activation],
                                       out, block_c, num_warps)


@triton.jit
def gdn_decode_step_kernel(
    q, k, v, a, b, A_log, dt_bias, state, state_indices, o,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_an, stride_ah, stride_bn, stride_bh, stride_on, stride_oh, stride_ss, scale,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
):
    i_n, i_h, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // HK)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V

    b_q = tl.load(q + i_n * stride_qn + i_hk * stride_qh + o_k, mask=m_k, other=0).to(tl.float32)
    b_k = tl.load(k + i_n * stride_kn + i_hk * stride_kh + o_k, mask=m_k, other=0).to(tl.float32)
    if USE_L2NORM:  # bole.ops.gdn.l2norm: x · rsqrt(Σx² + 1e-6)
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
    b_q = b_q * scale

    # g = -exp(A_log) · softplus(a + dt_bias)
    b_a = tl.load(a + i_n * stride_an + i_h * stride_ah).to(tl.float32) + tl.load(dt_bias + i_h).to(tl.float32)
    b_g = -tl.exp(tl.load(A_log + i_h).to(tl.float32)) * softplus(b_a)
    b_b = tl.load(b + i_n * stride_bn + i_h * stride_bh)
    b_beta = tl.sigmoid(b_b.to(tl.float32)).to(b_b.dtype).to(tl.float32)

    i_slot = tl.load(state_indices + i_n).to(tl.int64)
    p_s = state + i_slot * stride_ss + (i_h * V + o_v[:, None]).to(tl.int64) * K + o_k[None, :]
    m_s = m_v[:, None] & m_k[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0).to(tl.float32) * tl.exp(b_g)  # Sᵀ tile [BV, BK]
    b_v = tl.load(v + i_n * stride_vn + i_h * stride_vh + o_v, mask=m_v, other=0).to(tl.float32)
    b_u = b_beta * (b_v - tl.sum(b_s * b_k[None, :], axis=1))
    b_s = b_s + b_u[:, None] * b_k[None, :]
    b_o = tl.sum(b_s * b_q[None, :], axis=1)
    tl.store(p_s, b_s.to(state.dtype.element_ty), mask=m_s)
    tl.store(o + i_n * stride_on + i_h * stride_oh + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


def launch_gdn_decode_step(q, k, v, a, b, A_log, dt_bias, ssm_state, state_indices, scale: float,
                           use_qk_l2norm: bool, out, block_v: int, num_warps: int):
    """Launcher: grid (N, HV, V / BV), whole K rows per program."""
    N, HK, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    grid = (N, HV, triton.cdiv(V, block_v))
    gdn_decode_step_kernel[grid](
        q, k, v, a, b, A_log.contiguous(), dt_bias.contiguous(), ssm_state, state_indices.contiguous(),
        out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        ssm_state.stride(0), float(scale),
        HK=HK, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=block_v,
        USE_L2NORM=bool(use_qk_l2norm), num_warps=num_warps,
    )
    return out


def gdn_decode_step(q, k, v, a, b, A_log, dt_bias, ssm_state, state_indices, scale=None,
                    use_qk_l2norm=True, out=None, *, block_v: int | None = None, num_warps: int = 4,
                    checked: bool = False):
    """One gated delta rule step per row (decode), gating and q/k normalisation fused, pool updated in place.

    Twin: `bole.ops.gdn_decode.gdn_decode_step_ref`. Rows must use distinct slots (except padding).

    Args:
        q, k: [N, HK, K] conv outputs (fp32/fp16/bf16), last dim contiguous, any row/head strides.
        v: [N, HV, V] likewise; HV a multiple of HK (value head h reads key head h // (HV // HK)).
        a, b: [N, HV] raw in_proj_a / in_proj_b outputs (any strides).
        A_log, dt_bias: [HV].
        ssm_state: [slots, HV, V, K] fp32 or bf16 pool (Sᵀ), [HV, V, K] contiguous; updated in place.
        state_indices: int32/int64 [N] slot of each row.
        scale: q scale (default K ** -0.5); use_qk_l2norm: L2-normalise q and k (eps 1e-6) first.
        out: optional [N, HV, V] in v's dtype, last dim contiguous.
        block_v: value tile (power of two; default 16, or 32 when there are >= 1024 tiles of 16).
        checked: the caller checked ``state_indices`` once for the whole forward
            (`kernels._checks.check_forward_inputs`); only its size is compared here.
    Returns:
        o [N, HV, V] in v's dtype.
    """
    dev = q.device if isinstance(q, torch.Tensor) else None
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 3, _FLOATS, dev)
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    if k.shape != q.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != q shape {tuple(q.shape)}")
    N, HK, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    if v.shape[0] != N or HV % HK != 0:
        raise ValueError(f"v must be [{N}, HV, V] with HV a multiple of HK={HK}, got {tuple(v.shape)}")
    if K > 256 or V > 256:
        raise ValueError(f"head dims K={K}, V={V} exceed 256")
    for name, t in (("a", a), ("b", b)):
        check_tensor(name, t, 2, _FLOATS, dev)
        if tuple(t.shape) != (N, HV):
            raise ValueError(f"{name} must be [{N}, {HV}], got {tuple(t.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_tensor(name, t, 1, _FLOATS, dev)
        if t.shape[0] != HV:
            raise ValueError(f"{name} must be [{HV}], got {tuple(t.shape)}")
    check_tensor("ssm_state", ssm_state, 4, (torch.float32, torch.bfloat16), dev)
    if tuple(ssm_state.shape[1:]) != (HV, V, K) or ssm_state.stride()[1:] != (V * K, K, 1):
        raise ValueError(f"ssm_state must be [slots, {HV}, {V}, {K}] with contiguous slots, got "
                         f"{tuple(ssm_state.shape)} strides {ssm_state.stride()}")
    check_index("state_indices", state_indices, N, dev, checked)
    if block_v is None:
        block_v = 32 if N * HV * triton.cdiv(V, 16) >= 1024 else 16
        block_v = min(block_v, triton.next_power_of_2(V))
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    if out is None:
        out = torch.empty(N, HV, V, dtype=v.dtype, device=v.device)
    else:
        _check_out(out, (N, HV, V), v.dtype, v.device)
    if N == 0:
        return out
    scale = K ** -0.5 if scale is None else scale
    return launch_gdn_decode_step(q, k, v, a, b, A_log, dt_bias, ssm_state, state_indices, scale,
                                  use_qk_l2norm, out, block_v, num_warps)
