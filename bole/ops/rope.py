"""Naive torch twins of the attention prologue kernel (kernels/qk_norm_rope.py): partial RoPE and the
per-head q / k norms with RoPE and the KV-cache store.

    rope_cos_sin(positions, inv_freq):  θ = positions.float() ⊗ inv_freq (fp32), cos / sin of [θ, θ]
    apply_rope(x, cos, sin):            rotate-half over the first R = cos.shape[-1] dims of each head,
                                        in x.dtype: cos, sin rounded to x.dtype, x·cos and
                                        rotate_half(x)·sin each rounded, then their sum; dims R.. pass
    qk_norm_rope_store_ref:             q, k = RMSNorm (zero-centred, bole.ops.norm.rms_norm_ref) per head,
                                        apply_rope on both, then k, v stored at the cache slots (in the
                                        cache dtype): GatedAttention's prologue, op for op

Shapes: q [N, H, D]; k, v [N, Hkv, D]; positions [N]; inv_freq [R / 2] fp32; k_cache, v_cache
[num_slots, Hkv, D]; slot_mapping [N].
"""

from __future__ import annotations

import torch

from bole.ops.norm import rms_norm_ref


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] -> cos, sin [N, 2 · inv_freq.numel()] (fp32)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim]; rotates the first R = cos.shape[-1] dims (rotate-half), passes the rest."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


def qk_norm_rope_store_ref(q, k, v, q_weight, k_weight, positions, inv_freq, eps, k_cache, v_cache,
                           slot_mapping, q_out=None):
    """Zero-centred RMS norm of every q and k head (weights [D], offsets from one, one eps), partial
    RoPE on both, then k_cache[slot_mapping] = k and v_cache[slot_mapping] = v in the cache dtype.

    Returns q [N, H, D] in q's dtype (written into ``q_out`` when given).
    """
    N, H, D = q.shape
    q = rms_norm_ref(q.reshape(-1, D), q_weight, eps).view(N, H, D)
    k = rms_norm_ref(k.reshape(-1, D), k_weight, eps).view(N, k.shape[1], D)
    cos, sin = rope_cos_sin(positions, inv_freq)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache[slot_mapping] = k.to(k_cache.dtype)
    v_cache[slot_mapping] = v.to(v_cache.dtype)
    if q_out is None:
        return q
    return q_out.copy_(q)
