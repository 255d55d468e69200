"""Fused GDN tree conv in Triton: the causal conv1d over a packed draft forest, and the verify gating.

One launch replaces the ~30 small torch ops that open a GDN layer's verify forward (bole/layers/gdn.py):

    window(i)  node i's W inputs along its path, oldest first: tap j reads the input of i's ancestor
               at depth p = depth(i) − (W−1) + j (row cu_seqlens[b] + anc[i, p−1]) when p ≥ 1, else
               the committed conv state column W−2+p of its request's slot (read in x's dtype, as the
               twin's gather); the last tap is i itself (anc[i, depth(i)−1] == i)
    y(i)       act(Σ_j window_j(i) · weight[:, j] + bias), summed in fp32, stored in the outputs' dtype
    outputs    y into one [N, C] buffer or split into up to three ([N, C_s], consecutive column
               ranges: the layer's q | k | v, each contiguous as the verifier wants, k straight into
               the commit's factor buffer); x optionally copied into x_copy (the commit's conv inputs)
    gating     (``gdn_tree_conv``) g = −exp(A_log) softplus(a + dt_bias) in fp32 and beta = sigmoid(b)
               rounded to b's dtype, by each node's first channel tile program

grid (N, C / BC). The pools are only read; everything is a device tensor and nothing is read on the
host, so a CUDA graph can capture it. Twins: bole.ops.conv.{causal_conv1d_tree_ref, gdn_tree_conv_ref}.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_conv_inputs, check_forest_inputs, check_index, check_tensor
from kernels.gdn_decode import softplus

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_ACTIVATIONS = {None: False, "identity": False, "silu": True, "swish": True}


@triton.jit
def gdn_tree_conv_kernel(
    x, weight, bias, conv_state, state_indices,       # [N, C], [C, W], [C], [slots, C, W-1], [B]
    cu_seqlens, depth, anc, request_ids,                # the forest: [B+1], [N], [N, D_ANC], [N]
    y0, y1, y2, x_copy,                                 # columns [0, C1), [C1, C2), [C2, C); [N, C]
    a, b, A_log, dt_bias, g, beta,                      # [N, HV] (strided), [HV], [HV]; out [N, HV]
    C, C1, C2, D_ANC, HV,
    stride_xn, stride_y0, stride_y1, stride_y2, stride_cn, stride_wc, stride_ww,
    stride_ss, stride_sc, stride_sw, stride_an, stride_ah, stride_bn, stride_bh,
    W: tl.constexpr, BC: tl.constexpr, BH: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_COPY: tl.constexpr, HAS_GATING: tl.constexpr,
):
    i_n, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    i_r = tl.load(request_ids + i_n)
    bos = tl.load(cu_seqlens + i_r).to(tl.int64)
    i_slot = tl.load(state_indices + i_r).to(tl.int64)
    b_d = tl.load(depth + i_n).to(tl.int32)
    p_s = conv_state + i_slot * stride_ss + o_c.to(tl.int64) * stride_sc  # [BC] state column 0
    p_w = weight + o_c * stride_wc

    b_y = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(W - 1):  # oldest tap first, as the twin sums
        i_p = b_d - (W - 1) + j       # depth of the tap's token; <= 0: a committed one
        m_x = i_p >= 1
        i_a = tl.load(anc + i_n * D_ANC + tl.minimum(tl.maximum(i_p - 1, 0), D_ANC - 1), mask=m_x, other=0)
        p_x = x + tl.maximum(bos + i_a, 0) * stride_xn + o_c
        b_x = tl.load(p_x, mask=m_c & m_x, other=0).to(tl.float32)
        p_sj = p_s + tl.maximum(W - 2 + i_p, 0) * stride_sw
        b_s = tl.load(p_sj, mask=m_c & (i_p < 1), other=0).to(x.dtype.element_ty).to(tl.float32)
        b_y += tl.where(m_x, b_x, b_s) * tl.load(p_w + j * stride_ww, mask=m_c, other=0).to(tl.float32)
    b_own = tl.load(x + i_n * stride_xn + o_c, mask=m_c, other=0)
    b_y += b_own.to(tl.float32) * tl.load(p_w + (W - 1) * stride_ww, mask=m_c, other=0).to(tl.float32)
    if HAS_BIAS:
        b_y += tl.load(bias + o_c, mask=m_c, other=0).to(tl.float32)
    if SILU:
        b_y = b_y * tl.sigmoid(b_y)
    tl.store(y0 + i_n * stride_y0 + o_c, b_y.to(y0.dtype.element_ty), mask=m_c & (o_c < C1))
    tl.store(y1 + i_n * stride_y1 + (o_c - C1), b_y.to(y1.dtype.element_ty), mask=m_c & (o_c >= C1) & (o_c < C2))
    tl.store(y2 + i_n * stride_y2 + (o_c - C2), b_y.to(y2.dtype.element_ty), mask=m_c & (o_c >= C2))
    if HAS_COPY:
        tl.store(x_copy + i_n * stride_cn + o_c, b_own.to(x_copy.dtype.element_ty), mask=m_c)

    if HAS_GATING:  # the first channel tile's program of the node (a mask, not a branch)
        o_h = tl.arange(0, BH)
        m_h = (o_h < HV) & (i_c == 0)
        b_a = tl.load(a + i_n * stride_an + o_h * stride_ah, mask=m_h, other=0).to(tl.float32)
        b_a += tl.load(dt_bias + o_h, mask=m_h, other=0).to(tl.float32)
        b_g = -tl.exp(tl.load(A_log + o_h, mask=m_h, other=0).to(tl.float32)) * softplus(b_a)
        b_b = tl.load(b + i_n * stride_bn + o_h * stride_bh, mask=m_h, other=0)
        b_beta = tl.sigmoid(b_b.to(tl.float32))
        tl.store(g + i_n * HV + o_h, b_g, mask=m_h)
        tl.store(beta + i_n * HV + o_h, b_beta.to(beta.dtype.element_ty), mask=m_h)


def launch_gdn_tree_conv(x, weight, bias, conv_state, state_indices, forest, silu: bool,
                         parts, x_copy, gating, block_c: int, num_warps: int):
    """Launcher: grid (N, C / BC). ``parts``: 1-3 output buffers of consecutive column ranges;
    ``gating``: None or (a, b, A_log, dt_bias, g, beta)."""
    N, C = x.shape
    W = weight.shape[1]
    state_indices = state_indices.contiguous()  # the kernel indexes it densely (a view of a row buffer: a copy)
    widths = [p.shape[1] for p in parts]
    C1, C2 = min(widths[0], C), min(sum(widths[:2]), C)
    y0, y1, y2 = (parts + [parts[0]] * (3 - len(parts)))[:3]  # missing parts: empty column ranges
    a, b, A_log, dt_bias, g, beta = gating if gating is not None else (x,) * 6
    HV = g.shape[1] if gating is not None else 1
    grid = (N, max(1, triton.cdiv(C, block_c)))  # one tile at least: the gating's program
    gdn_tree_conv_kernel[grid](
        x, weight, bias if bias is not None else x, conv_state, state_indices,
        forest.cu_seqlens, forest.depth, forest.anc, forest.request_ids,
        y0, y1, y2, x_copy if x_copy is not None else x,
        a, b, A_log, dt_bias, g, beta,
        C, C1, C2, forest.anc.shape[1], HV,
        x.stride(0), y0.stride(0), y1.stride(0), y2.stride(0),
        x_copy.stride(0) if x_copy is not None else 0, weight.stride(0), weight.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        a.stride(0), a.stride(-1), b.stride(0), b.stride(-1),
        W=W, BC=block_c, BH=triton.next_power_of_2(HV), SILU=silu, HAS_BIAS=bias is not None,
        HAS_COPY=x_copy is not None, HAS_GATING=gating is not None, num_warps=num_warps,
    )


def _check_conv_args(x, weight, bias, conv_state, state_indices, forest, activation, block_c, checked):
    """ValueError naming the bad argument (STYLE 7); returns (N, C). ``checked``: the forward's forest and
    slots passed `kernels._checks.check_forward_inputs` (once per forward): only their sizes are compared."""
    N, C, W = check_conv_inputs(x, weight, conv_state)
    dev = x.device
    if bias is not None:
        check_tensor("bias", bias, 1, _FLOATS, dev)
        if bias.shape[0] != C or bias.stride(0) != 1:
            raise ValueError(f"bias must be a contiguous [{C}], got {tuple(bias.shape)} strides {bias.stride()}")
    if not checked:
        check_forest_inputs(forest, None, dev)
    if forest.num_nodes != N:
        raise ValueError(f"forest has {forest.num_nodes} nodes but x has {N} rows")
    check_index("state_indices", state_indices, forest.num_requests, dev, checked)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unsupported conv activation {activation!r}")
    if block_c < 1 or block_c & (block_c - 1):
        raise ValueError(f"block_c must be a power of two, got {block_c}")
    return N, C


def _check_buffer(name, t, rows, cols, dev):
    check_tensor(name, t, 2, _FLOATS, dev)
    if t.shape[0] != rows or (cols is not None and t.shape[1] != cols) or t.stride(1) != 1:
        raise ValueError(f"{name} must be [{rows}, {'C_s' if cols is None else cols}] with a contiguous last "
                         f"dim, got {tuple(t.shape)} strides {t.stride()}")


def _outputs(x, out, x_copy):
    """The output buffers as a list of 1-3 [N, C_s] column ranges (allocated when ``out`` is None)."""
    N, C = x.shape
    if out is None:
        parts = [torch.empty(N, C, dtype=x.dtype, device=x.device)]
    else:
        parts = [out] if isinstance(out, torch.Tensor) else list(out)
        if not 1 <= len(parts) <= 3:
            raise ValueError(f"out must be a tensor or 1 to 3 tensors, got {len(parts)}")
        for s, p in enumerate(parts):
            _check_buffer(f"out[{s}]", p, N, None, x.device)
        if sum(p.shape[1] for p in parts) != C:
            raise ValueError(f"out widths {[p.shape[1] for p in parts]} must sum to C={C}")
    if x_copy is not None:
        _check_buffer("x_copy", x_copy, N, C, x.device)
    return parts


def causal_conv1d_tree(x, weight, bias, conv_state, state_indices, forest, activation="silu",
                       out=None, x_copy=None, *, block_c: int = 128, num_warps: int = 4, checked: bool = False):
    """Depthwise causal conv over a packed forest (each node: its path, then the committed state). Read only.

    Twin: `bole.ops.conv.causal_conv1d_tree_ref`.

    Args:
        x: [N, C] fp32/fp16/bf16 inputs of the forest's nodes, last dim contiguous (any row stride).
        weight: [C, W] depthwise taps, oldest first (weight[:, W-1] multiplies the node's own input).
        bias: optional [C], contiguous.
        conv_state: [slots, C, W-1] committed inputs per slot, oldest first, any strides; never written.
        state_indices: int32/int64 [B] slot of each request.
        forest: the packed trees (N nodes) on x's device; its anc, depth, cu_seqlens, request_ids.
        activation: "silu" / "swish" or None / "identity".
        out: optional [N, C] buffer, or 1-3 buffers [N, C_s] (C_s summing to C) receiving consecutive
            column ranges; any float dtype (y is cast), contiguous last dim, any row stride.
        x_copy: optional [N, C] buffer x is copied into (cast to its dtype).
        block_c: channel tile (power of two).
        checked: the caller checked ``forest`` and ``state_indices`` once for the whole forward
            (`kernels._checks.check_forward_inputs`); only their sizes are compared with x here.
    Returns:
        y [N, C] in x's dtype, or ``out`` as passed.
    """
    _check_conv_args(x, weight, bias, conv_state, state_indices, forest, activation, block_c, checked)
    parts = _outputs(x, out, x_copy)
    if x.shape[0] > 0:
        launch_gdn_tree_conv(x, weight, bias, conv_state, state_indices, forest, _ACTIVATIONS[activation],
                             parts, x_copy, None, block_c, num_warps)
    return parts[0] if out is None else out


def gdn_tree_conv(x, weight, conv_state, state_indices, forest, a, b, A_log, dt_bias, bias=None,
                  activation="silu", out=None, x_copy=None, *, block_c: int = 128, num_warps: int = 4,
                  checked: bool = False):
    """The GDN layer's verify prologue in one launch: ``causal_conv1d_tree`` plus the gating.

    Twin: `bole.ops.conv.gdn_tree_conv_ref`. Args as `causal_conv1d_tree`, and a, b: [N, HV] raw
    in_proj_a / in_proj_b outputs (any strides, fp32/fp16/bf16); A_log, dt_bias: [HV] contiguous.
    Returns:
        (y or out, g [N, HV] fp32 = -exp(A_log) softplus(a + dt_bias), beta [N, HV] = sigmoid(b) in b's dtype)
    """
    N, _ = _check_conv_args(x, weight, bias, conv_state, state_indices, forest, activation, block_c, checked)
    dev = x.device
    for name, t in (("a", a), ("b", b)):
        check_tensor(name, t, 2, _FLOATS, dev)
    HV = a.shape[1]
    if a.shape[0] != N or tuple(b.shape) != (N, HV):
        raise ValueError(f"a and b must be [{N}, HV], got {tuple(a.shape)} and {tuple(b.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_tensor(name, t, 1, _FLOATS, dev)
        if t.shape[0] != HV or t.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous [{HV}], got {tuple(t.shape)} strides {t.stride()}")
    parts = _outputs(x, out, x_copy)
    g = torch.empty(N, HV, dtype=torch.float32, device=dev)
    beta = torch.empty(N, HV, dtype=b.dtype, device=dev)
    if N > 0:
        launch_gdn_tree_conv(x, weight, bias, conv_state, state_indices, forest, _ACTIVATIONS[activation],
                             parts, x_copy, (a, b, A_log, dt_bias, g, beta), block_c, num_warps)
    return parts[0] if out is None else out, g, beta
