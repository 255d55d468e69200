"""The GDN prefill's depthwise causal conv1d over variable-length sequences, in one Triton launch.

Twin: `bole.ops.conv.causal_conv1d` (a host loop over the sequences: about eight launches each, per layer).
Here a program per (sequence, channel tile, block of BT tokens) computes token t's output act(Σ_j w[:, j] ·
in(t - (W-1) + j)), summed in fp32, where in(p) is the sequence's input p for p >= 0 and the committed
window ``conv_state[slot, :, W-1+p]`` before the sequence start. The first block's program, the only one
that reads the committed window (BT >= W - 1), then writes the slot's new window: the last W-1 inputs of the
sequence, older committed ones shifted in when the sequence is shorter than W-1; no other program touches
the state. With a checkpoint (``ckpt_*``, the prefix cache's boundary inside a prompt) that program first
stores the window at the boundary, the W-1 inputs before the sequence's ``ckpt_ends[b]``-th token, into
checkpoint slot ``ckpt_slots[b]`` of ``ckpt_conv``. The grid covers the longest sequence the launch can hold
(all N tokens); blocks past a sequence's end store nothing. Nothing is read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOATS, INDEX, check_checkpoint, check_conv_inputs, check_index, check_tensor

_ACTIVATIONS = {"silu": True, "swish": True, None: False, "identity": False}


@triton.jit
def _inputs(x, conv_state, p, bos, T, o_c, m_c, p_state, stride_xn, stride_sc, stride_sw, W: tl.constexpr):
    """in(p) [BT, BC] fp32 for positions p [BT] of one sequence (masked where p >= T)."""
    m_x = (p >= 0) & (p < T)
    b_x = tl.load(x + (bos + p)[:, None] * stride_xn + o_c[None, :], mask=m_x[:, None] & m_c[None, :], other=0)
    m_s = (p < 0) & (p >= -(W - 1))
    b_s = tl.load(p_state + o_c[None, :] * stride_sc + (W - 1 + p)[:, None] * stride_sw,
                  mask=m_s[:, None] & m_c[None, :], other=0)
    # the committed window in x's dtype first, as the twin's window (its values came from x anyway)
    return b_x.to(tl.float32) + b_s.to(x.dtype.element_ty).to(tl.float32)   # disjoint masks: one is 0


@triton.jit
def _conv_block(x, weight, conv_state, y, t0, bos, T, o_c, m_c, p_state, b_bias, stride_xn, stride_wc, stride_ww,
                stride_sc, stride_sw, stride_yn, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                SILU: tl.constexpr):
    """Outputs of tokens t0 .. t0 + BT of one sequence and channel tile."""
    t = t0 + tl.arange(0, BT)
    b_acc = tl.zeros([BT, BC], dtype=tl.float32) + b_bias[None, :]
    for j in tl.static_range(W):
        b_w = tl.load(weight + o_c * stride_wc + j * stride_ww, mask=m_c, other=0).to(tl.float32)
        b_in = _inputs(x, conv_state, t - (W - 1) + j, bos, T, o_c, m_c, p_state, stride_xn, stride_sc, stride_sw, W)
        b_acc += b_in * b_w[None, :]
    if SILU:
        b_acc = b_acc * tl.sigmoid(b_acc)
    tl.store(y + (bos + t)[:, None] * stride_yn + o_c[None, :], b_acc.to(y.dtype.element_ty),
             mask=(t < T)[:, None] & m_c[None, :])


@triton.jit
def causal_conv1d_varlen_kernel(
    x, weight, bias, conv_state, state_indices, cu_seqlens, y, ck_conv, ck_ends, ck_slots,
    C, stride_xn, stride_wc, stride_ww, stride_ss, stride_sc, stride_sw, stride_yn, stride_ks, stride_kc, stride_kw,
    W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr, HAS_CKPT: tl.constexpr,
):
    i_b, i_c, i_t = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + i_b).to(tl.int64)
    T = (tl.load(cu_seqlens + i_b + 1).to(tl.int64) - bos).to(tl.int32)
    i_slot = tl.load(state_indices + i_b).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    p_state = conv_state + i_slot * stride_ss
    b_bias = tl.zeros([BC], dtype=tl.float32)
    if HAS_BIAS:
        b_bias = tl.load(bias + o_c, mask=m_c, other=0).to(tl.float32)
    # a block past the sequence's end stores nothing (the grid covers the longest possible sequence)
    _conv_block(x, weight, conv_state, y, i_t * BT, bos, T, o_c, m_c, p_state, b_bias, stride_xn,
                stride_wc, stride_ww, stride_sc, stride_sw, stride_yn, W, BT, BC, SILU)
    if i_t == 0:
        # the new window: inputs T - (W-1) .. T-1 (committed ones where the sequence is shorter). Only
        # this program reads the old window (BT >= W - 1: later blocks start past it), and its reads
        # above precede this store in program order.
        o_w = tl.arange(0, WP)                                       # WP: W - 1 rounded up to a power of 2
        if HAS_CKPT:
            # the window at the boundary: inputs E - (W-1) .. E-1, read (like the new window's) before
            # the store below overwrites the committed window
            ck_end = tl.load(ck_ends + i_b).to(tl.int32)
            if ck_end > 0:
                b_ck = _inputs(x, conv_state, ck_end - (W - 1) + o_w, bos, T, o_c, m_c, p_state, stride_xn,
                               stride_sc, stride_sw, W)
                p_ck = ck_conv + tl.load(ck_slots + i_b).to(tl.int64) * stride_ks
                tl.store(p_ck + o_c[None, :] * stride_kc + o_w[:, None] * stride_kw,
                         b_ck.to(ck_conv.dtype.element_ty), mask=(o_w < W - 1)[:, None] & m_c[None, :])
        b_new = _inputs(x, conv_state, T - (W - 1) + o_w, bos, T, o_c, m_c, p_state, stride_xn, stride_sc,
                        stride_sw, W)
        tl.store(p_state + o_c[None, :] * stride_sc + o_w[:, None] * stride_sw,
                 b_new.to(conv_state.dtype.element_ty), mask=(o_w < W - 1)[:, None] & m_c[None, :])


def causal_conv1d_varlen(x, weight, conv_state, state_indices, cu_seqlens, bias=None, activation="silu", out=None,
                         *, ckpt_conv=None, ckpt_ends=None, ckpt_slots=None, block_t: int = 32,
                         block_c: int = 128, num_warps: int = 4, checked: bool = False, **_host):
    """Depthwise causal conv of B packed sequences, each continuing its slot's conv window (in place).

    Twin: `bole.ops.conv.causal_conv1d` (the same arguments; the host copies ``cu_host`` / ``slots_host``
    the twin may take are accepted and ignored here). No host read of a device value.

    Args:
        x: [N, C] fp32/fp16/bf16, last dim contiguous (any row stride: a column slice is fine).
        weight: [C, W] depthwise taps, oldest first (weight[:, W-1] multiplies the current input).
        conv_state: [slots, C, W-1] the last W-1 committed inputs per slot, oldest first, any strides;
            slot state_indices[b] becomes the last W-1 inputs of sequence b (older ones shifted in).
        state_indices: int32/int64 [B] slot of each sequence (distinct slots).
        cu_seqlens: int32/int64 [B+1] offsets of the sequences in x.
        bias: optional [C]. activation: "silu" / "swish" or None / "identity".
        out: optional [N, C] in x's dtype, last dim contiguous.
        ckpt_conv: optional checkpoint pool [slots, C, W-1] (any strides), with ckpt_ends int [B] (the
            window after this many of sequence b's tokens, 1 .. its length; 0: none) and ckpt_slots
            int [B] (its slot; read where the end is > 0).
        checked: the caller checked state_indices and cu_seqlens once for the whole forward
            (`kernels._checks.check_forward_inputs`): only their sizes are compared.
    Returns:
        y [N, C] in x's dtype.
    """
    N, C, W = check_conv_inputs(x, weight, conv_state)
    dev = x.device
    if not checked:
        check_tensor("state_indices", state_indices, 1, INDEX, dev)
    B = state_indices.shape[0]
    check_index("cu_seqlens", cu_seqlens, B + 1, dev, checked)
    if bias is not None:
        check_tensor("bias", bias, 1, FLOATS, dev)
        if bias.shape[0] != C:
            raise ValueError(f"bias must be [{C}], got {tuple(bias.shape)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unsupported conv activation {activation!r}")
    for name, v in (("block_t", block_t), ("block_c", block_c)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if block_t < W - 1:
        raise ValueError(f"block_t={block_t} must cover the window's W - 1 = {W - 1} committed inputs")
    if out is None:
        out = torch.empty(N, C, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, 2, (x.dtype,), dev)
        if tuple(out.shape) != (N, C) or out.stride(1) != 1:
            raise ValueError(f"out must be [{N}, {C}] with a contiguous last dim, got {tuple(out.shape)}")
    has_ckpt = ckpt_conv is not None
    if has_ckpt:
        check_checkpoint(ckpt_conv, ckpt_ends, ckpt_slots, (C, W - 1), B, dev, contiguous=False)
    if B == 0 or C == 0:
        return out
    # token blocks for the longest sequence the launch can hold (all N tokens): no host read of the offsets
    causal_conv1d_varlen_kernel[(B, triton.cdiv(C, block_c), triton.cdiv(N, block_t))](
        x, weight, bias if bias is not None else weight, conv_state, state_indices, cu_seqlens, out,
        ckpt_conv if has_ckpt else conv_state, ckpt_ends if has_ckpt else cu_seqlens,
        ckpt_slots if has_ckpt else cu_seqlens,
        C, x.stride(0), weight.stride(0), weight.stride(1), conv_state.stride(0), conv_state.stride(1),
        conv_state.stride(2), out.stride(0), *(ckpt_conv if has_ckpt else conv_state).stride(),
        W=W, WP=max(2, triton.next_power_of_2(W - 1)), BT=block_t, BC=block_c, HAS_BIAS=bias is not None,
        SILU=_ACTIVATIONS[activation], HAS_CKPT=has_ckpt, num_warps=num_warps,
    )
    return out
