"""Gated attention's prologue in Triton: q / k RMS norms, partial RoPE and the KV-cache store in one launch.

Replaces the ~25 small kernels GatedAttention ran between its qkv GEMM and attention in bf16 (copies of
the strided q / k, two norm kernels, cos / sin and their casts, rotate-half for q and k, two cache
index_puts):

    q_out[n, h]           = rope(rmsnorm(q[n, h]; w_q), positions[n])     h < H
    k_cache[slot_n, h]    = rope(rmsnorm(k[n, h]; w_k), positions[n])     h < Hkv, slot_n = slot_mapping[n]
    v_cache[slot_n, h]    = v[n, h]

rmsnorm is zero-centred (x̂ · (1 + w), fp32, rounded to the input dtype); rope rotates the first
R = 2 · inv_freq.numel() dims rotate-half style with θ_j = float(position) · inv_freq[j mod R/2]
computed here (no cos/sin table), cos / sin rounded to the dtype, x·cos and rotate_half(x)·sin each
rounded, then their sum, as the twin's torch ops do. Dims R.. pass through normalised.

Grid (N, H + Hkv): one program per (token, head) holds the head's row. The rotate-half partner
(dim j ± R/2) is loaded a second time rather than permuted in registers. q, k, v are read in place
from the qkv GEMM output (any token / head strides: q interleaved with the gate per head). Rows that
share a slot (a CUDA graph's padding rows) race: the slot ends with one of them.
Twin: `bole.ops.rope.qk_norm_rope_store_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels._checks import check_index, check_tensor, interpreting

# cos / sin of large angles (positions of 10^5 and more times a frequency near 1) need the accurate
# libdevice functions that torch's cos / sin compile to; the interpreter (CPU tests) has no libdevice
# and computes tl.cos / tl.sin with numpy's accurate ones.
_LIBDEVICE_TRIG = not interpreting()

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
MAX_D = 4096


@triton.jit
def qk_norm_rope_store_kernel(
    q, k, v, wq, wk, positions, inv_freq, q_out, k_cache, v_cache, slots,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
    stride_kcs, stride_kch, stride_vcs, stride_vch, H, eps,
    D: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, LIBDEVICE_TRIG: tl.constexpr,
):
    i_n, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_r = o_d < R
    m_lo = o_d < R // 2
    o_p = tl.where(m_lo, o_d + R // 2, o_d - R // 2)  # rotate-half partner of rotary dim j
    if i_h < H:
        p_x = q + i_n * stride_qn + i_h * stride_qh
        b_w = tl.load(wq + o_d, mask=m_d, other=0).to(tl.float32)
        b_wp = tl.load(wq + o_p, mask=m_r, other=0).to(tl.float32)
    else:
        p_x = k + i_n * stride_kn + (i_h - H) * stride_kh
        b_w = tl.load(wk + o_d, mask=m_d, other=0).to(tl.float32)
        b_wp = tl.load(wk + o_p, mask=m_r, other=0).to(tl.float32)
    b_x = tl.load(p_x + o_d, mask=m_d, other=0).to(tl.float32)
    b_xp = tl.load(p_x + o_p, mask=m_r, other=0).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=0) / D + eps)
    # the norm's output rounding (the twin's type_as), for the row and its partners
    b_y = (b_x * b_rstd * (1.0 + b_w)).to(q.dtype.element_ty).to(tl.float32)
    b_yp = (b_xp * b_rstd * (1.0 + b_wp)).to(q.dtype.element_ty).to(tl.float32)
    b_yp = tl.where(m_lo, -b_yp, b_yp)  # rotate_half: [-x2, x1]

    b_pos = tl.load(positions + i_n).to(tl.float32)
    b_f = b_pos * tl.load(inv_freq + o_d % (R // 2), mask=m_r, other=0)
    if LIBDEVICE_TRIG:
        b_cos, b_sin = libdevice.cos(b_f), libdevice.sin(b_f)
    else:
        b_cos, b_sin = tl.cos(b_f), tl.sin(b_f)
    b_cos = b_cos.to(q.dtype.element_ty).to(tl.float32)
    b_sin = b_sin.to(q.dtype.element_ty).to(tl.float32)
    b_rot = (b_y * b_cos).to(q.dtype.element_ty).to(tl.float32) + (b_yp * b_sin).to(q.dtype.element_ty).to(tl.float32)
    b_o = tl.where(m_r, b_rot, b_y).to(q.dtype.element_ty)

    if i_h < H:
        tl.store(q_out + i_n * stride_on + i_h * stride_oh + o_d, b_o, mask=m_d)
    else:
        i_kh = i_h - H
        i_slot = tl.load(slots + i_n).to(tl.int64)
        tl.store(k_cache + i_slot * stride_kcs + i_kh * stride_kch + o_d, b_o.to(k_cache.dtype.element_ty), mask=m_d)
        b_v = tl.load(v + i_n * stride_vn + i_kh * stride_vh + o_d, mask=m_d, other=0)
        tl.store(v_cache + i_slot * stride_vcs + i_kh * stride_vch + o_d, b_v.to(v_cache.dtype.element_ty), mask=m_d)


def launch_qk_norm_rope_store(q, k, v, q_weight, k_weight, positions, inv_freq, eps, k_cache, v_cache,
                              slot_mapping, q_out):
    """Launcher: grid (N, H + Hkv), one (token, head) row per program."""
    N, H, D = q.shape
    BD = triton.next_power_of_2(D)
    qk_norm_rope_store_kernel[(N, H + k.shape[1])](
        q, k, v, q_weight, k_weight, positions, inv_freq, q_out, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), H, eps,
        D=D, R=2 * inv_freq.shape[0], BD=BD, LIBDEVICE_TRIG=_LIBDEVICE_TRIG, num_warps=max(1, min(4, BD // 256)),
        # no FMA contraction: compiled with it (H100, 2026-12-07) 5.8% of the bf16 outputs left the twin's op
        # sequence, up to 15224 ulps where x·cos and rotate_half(x)·sin cancel; without it every output is
        # within one ulp. Presumably a product and the sum after it became one FMA, skipping the product's
        # rounding to bf16 (an fp32 round trip the compiler may narrow to bf16 arithmetic; PTX not read)
        enable_fp_fusion=False,
    )
    return q_out


def _check_rows(name, t, shape, dtypes, device):
    """A [rows, heads, D] tensor of ``shape`` with a unit last stride."""
    check_tensor(name, t, len(shape), dtypes, device)
    if tuple(t.shape) != tuple(shape) or t.stride(-1) != 1:
        raise ValueError(f"{name} must be {tuple(shape)} with a unit last stride, got {tuple(t.shape)} "
                         f"strides {t.stride()}")


def qk_norm_rope_store(q, k, v, q_weight, k_weight, positions, inv_freq, eps, k_cache, v_cache, slot_mapping,
                       q_out=None, *, checked: bool = False):
    """Per-head zero-centred RMS norm of q and k, partial rotate-half RoPE on both, k and v stored in the
    paged KV cache: GatedAttention's prologue in one launch.

    Twin: `bole.ops.rope.qk_norm_rope_store_ref`. Batch-invariant (one program per token and head).

    Args:
        q: [N, H, D] float32/float16/bfloat16, D <= 4096, unit last stride, any token / head strides.
        k, v: [N, Hkv, D] in q's dtype, unit last stride, any token / head strides.
        q_weight, k_weight: [D] norm weights (offsets from one), any float dtype; one ``eps`` for both.
        positions: int32/int64 [N] rotary position of each token.
        inv_freq: float32 [R / 2], 2 <= R <= D: the rotary frequencies (``RotaryEmbedding.inv_freq``).
        k_cache, v_cache: [num_slots, Hkv, D] float, unit last stride (``PagedKVCache.k(layer)``
            flattened over blocks); k and v are rounded to q's dtype, then stored in the cache's.
        slot_mapping: int32/int64 [N] cache slot of each token, in [0, num_slots) (not checked: a
            check would read the device).
        q_out: optional [N, H, D] in q's dtype, unit last stride. Default: contiguous.
        checked: the caller checked ``positions`` and ``slot_mapping`` once for the whole forward
            (`kernels._checks.check_forward_inputs`, run by ``bole.models.context.ForwardContext``);
            only their sizes are compared here.
    Returns:
        q_out: the normed, rotated queries.
    """
    check_tensor("q", q, 3, _FLOATS, q.device if isinstance(q, torch.Tensor) else None)
    N, H, D = q.shape
    dev = q.device
    if not 1 <= D <= MAX_D:
        raise ValueError(f"head dim D must be in [1, {MAX_D}], got {D}")
    if q.stride(-1) != 1:
        raise ValueError(f"q must have a unit last stride, got strides {q.stride()}")
    check_tensor("k", k, 3, (q.dtype,), dev)
    Hkv = k.shape[1]
    _check_rows("k", k, (N, Hkv, D), (q.dtype,), dev)
    _check_rows("v", v, (N, Hkv, D), (q.dtype,), dev)
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_tensor(name, w, 1, _FLOATS, dev)
        if w.shape[0] != D:
            raise ValueError(f"{name} must be [{D}], got {tuple(w.shape)}")
    check_index("positions", positions, N, dev, checked)
    check_index("slot_mapping", slot_mapping, N, dev, checked)
    check_tensor("inv_freq", inv_freq, 1, (torch.float32,), dev)
    if not 2 <= 2 * inv_freq.shape[0] <= D:
        raise ValueError(f"inv_freq must hold R / 2 frequencies with 2 <= R <= D={D}, got {inv_freq.shape[0]}")
    check_tensor("k_cache", k_cache, 3, _FLOATS, dev)
    _check_rows("k_cache", k_cache, (k_cache.shape[0], Hkv, D), _FLOATS, dev)
    _check_rows("v_cache", v_cache, k_cache.shape, _FLOATS, dev)
    if q_out is None:
        q_out = torch.empty(N, H, D, dtype=q.dtype, device=dev)
    _check_rows("q_out", q_out, (N, H, D), (q.dtype,), dev)
    if N == 0:
        return q_out
    return launch_qk_norm_rope_store(q, k, v, q_weight.contiguous(), k_weight.contiguous(), positions.contiguous(),
                                     inv_freq.contiguous(), float(eps), k_cache, v_cache, slot_mapping.contiguous(),
                                     q_out)
