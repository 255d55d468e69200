"""Gated full attention of Qwen3.5 / Qwen3-Next over the paged KV cache.

    [q | gate] = q_proj(x) per head (each head's 2·D rows: D query rows then D gate rows)
    q = RMSNorm_q(q), k = RMSNorm_k(k_proj x) per head (zero-centred), partial RoPE on q, k
    o = softmax(q kᵀ / √D + mask) v   (GQA: query head h reads kv head h // (Hq / Hkv))
    y = o_proj(o · sigmoid(gate))

Between the qkv GEMM and attention, one call (``qk_norm_rope_store``: bole.ops.rope, or
kernels.qk_norm_rope on the "triton" backend) norms and rotates q and k and writes the new tokens' K/V
to ``ctx.slot_mapping``; the output gate is one more (``act_mul``: bole.ops.activation, or
kernels.act_mul), so on "triton" the layer is two launches around attention besides its GEMMs. Each
request then attends over ``ctx.kv_slots[b]`` (its committed prefix followed by its new tokens) with a
causal mask for prefill/decode, or prefix + ancestor mask (M⁺) for verify. ``_per_request`` is the torch reference,
one SDPA call per request (prefill runs it); verify and decode run ``_padded``, one SDPA call for the
whole batch over keys padded to the longest request (``ForwardContext.padded_attention``, built once
per forward), compared with the reference in tests/models/test_padded_attention.py.
A static decode context (``ctx.static``, CUDA graphs) instead gathers every row's keys at a fixed
padded length (``static.kv_index``) and masks the padding (``static.kv_valid``): one batched SDPA call,
the query heads of a KV head grouped as that call's query rows (GQA without repeating K/V).

Tensor parallel: q_proj / k_proj / v_proj column parallel by heads (q_proj's per-head [q, gate]
blocks are contiguous rows, so a head slice keeps them together), o_proj row parallel. With fewer KV
heads than ranks each rank holds one replicated KV head (``bole.parallel.head_range``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from bole.layers.draft_math import bf16_attention
from bole.layers.linear import FusedLinear
from bole.layers.norm import RMSNorm
from bole.layers.rotary import RotaryEmbedding
from bole.ops.activation import act_mul_ref
from bole.ops.rope import qk_norm_rope_store_ref
from bole.parallel import local_heads, split_heads

# verify and decode steps attend in one batched SDPA call per layer (``_padded``); prefill keeps the
# per-request reference path (its chunks can be long, and padding them to the widest would cost).
BATCHED_VERIFY_DECODE = True

# SDPA backends, in torch's order of preference, without cuDNN: cuDNN's attention builds an execution
# plan per input shape, ~10 ms of host time each time the key length changes, i.e. on every engine
# step (measured on the H200: benchmarks/results/profile_h200_before.json, aten::_cudnn_attention_forward
# 10.4 ms of CPU per call in the tiny model's decode step). Flash / memory-efficient take the same inputs.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q, k, v, mask, scale):
    """``F.scaled_dot_product_attention`` with a boolean mask, cuDNN excluded (see ``_SDPA_BACKENDS``)."""
    if q.dtype == torch.float32 and q.is_cuda and bf16_attention():  # the drafter (bole.layers.draft_math)
        with sdpa_kernel(_SDPA_BACKENDS):
            o = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=mask,
                                               scale=scale)
        return o.to(q.dtype)
    with sdpa_kernel(_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class GatedAttention(nn.Module):
    def __init__(self, cfg, cache_index: int, tp_size: int = 1):
        super().__init__()
        self.cache_index = cache_index
        self.num_heads = split_heads(cfg.num_attention_heads, tp_size, "attention")
        self.num_kv_heads = local_heads(cfg.num_key_value_heads, tp_size)
        self.head_dim = D = cfg.head_dim
        H, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(H, self.num_heads * D * 2, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
        self.qkv_proj: FusedLinear | None = None
        # the backend's kernels (set by the model; the torch twins by default)
        self.decode_attention = None  # paged decode attention
        self.qk_norm_rope_store: Callable = qk_norm_rope_store_ref  # q / k norms, RoPE, K/V into the cache
        self.act_mul: Callable = act_mul_ref                        # the output gate o · sigmoid(gate)
        # verify-mode attention in one launch, keys read in place and split over the prefix
        # (kernels.tree_attention on "triton"; the target's verify forward and the drafter's); None keeps
        # the batched SDPA path over gathered, padded keys (``_padded``, the "torch" backend)
        self.tree_attention: Callable | None = None
        # short prefill chunks' causal attention in one launch (kernels.tree_attention without a mask), on
        # every attention layer of the "triton" backend, and captured prefills' (``ctx.sync_free``); None
        # (or a long eager chunk) keeps the per-request SDPA
        self.prefill_attention: Callable | None = None

    def fuse_projections(self) -> None:
        """One GEMM for q_proj (queries and gate) | k_proj | v_proj (``bole.layers.linear``)."""
        self.qkv_proj = FusedLinear([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        N, D = x.shape[0], self.head_dim
        ctx.check_kernel_inputs()  # the shared positions / KV slots, once per forward (the kernels skip them)
        if self.qkv_proj is not None:
            qg, k, v = self.qkv_proj(x)
        else:
            qg, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, gate = qg.view(N, self.num_heads, 2 * D).chunk(2, dim=-1)  # [N, H, D] each, strided views
        # q, k normed and rotated, k and v written to the new tokens' cache slots (one launch on "triton")
        cache = ctx.kv_cache
        q = self.qk_norm_rope_store(
            q, k.view(N, self.num_kv_heads, D), v.view(N, self.num_kv_heads, D), self.q_norm.weight,
            self.k_norm.weight, ctx.positions, self.rotary.inv_freq(x.device), self.q_norm.eps,
            cache.k(self.cache_index).flatten(0, 1), cache.v(self.cache_index).flatten(0, 1), ctx.slot_mapping)
        if ctx.static is not None:
            out = self._static_decode(q, cache, ctx.static, x.dtype)
        elif ctx.mode == "verify" and self.tree_attention is not None and BATCHED_VERIFY_DECODE:
            pa = ctx.padded_attention()
            out = self._in_one_launch(self.tree_attention, q, cache, pa.kv_index, pa.mask, ctx, x.dtype)
        elif ctx.mode == "prefill" and self.prefill_attention is not None and ctx.sync_free:
            # short and captured prefills (ForwardContext.sync_free): the per-request SDPA loops over host
            # offsets; longer eager ones keep it (flash / memory-efficient kernels)
            out = self._in_one_launch(self.prefill_attention, q, cache, ctx.key_index(), None, ctx, x.dtype)
        elif ctx.mode in ("verify", "decode") and BATCHED_VERIFY_DECODE:
            out = self._padded(q, cache, ctx.padded_attention(), x.dtype)
        else:
            out = self._per_request(q, cache, ctx, x.dtype)
        return self.o_proj(self.act_mul(out, gate, "sigmoid").reshape(N, -1))

    def _in_one_launch(self, attend: Callable, q: torch.Tensor, cache, kv_index, mask, ctx, dtype) -> torch.Tensor:
        """``kernels.tree_attention``'s call: keys read in place through kv_index, rows masked by ``mask``
        (None: causal), TF32 products inside the drafter's fast math."""
        return attend(q.to(dtype), cache.k(self.cache_index).flatten(0, 1), cache.v(self.cache_index).flatten(0, 1),
                      kv_index, mask, ctx.cu_seqlens, ctx.num_cached, self.head_dim ** -0.5,
                      precision="tf32" if bf16_attention() else None)

    def _padded(self, q: torch.Tensor, cache, pa, dtype) -> torch.Tensor:
        """Every request in one SDPA call over its padded keys (``ForwardContext.padded_attention``):
        the query heads of a KV head are stacked as that call's query rows (GQA without repeating K/V)."""
        N, H, D = q.shape
        B, L = pa.kv_index.shape
        Hkv, rep, tq = self.num_kv_heads, self.num_heads // self.num_kv_heads, pa.tq
        kb, vb = cache.gather(self.cache_index, pa.kv_index)                      # [B, L, Hkv, D]
        kb, vb = kb.to(dtype).transpose(1, 2), vb.to(dtype).transpose(1, 2)       # [B, Hkv, L, D]
        qp = q.new_zeros(B * tq, H, D)
        qp[pa.rows] = q
        qg = qp.view(B, tq, Hkv, rep, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, rep * tq, D)
        mask = pa.mask.expand(B, rep, tq, L).reshape(B, 1, rep * tq, L)
        o = sdpa(qg, kb, vb, mask, D ** -0.5)
        o = o.view(B, Hkv, rep, tq, D).permute(0, 3, 1, 2, 4).reshape(B * tq, H, D)
        return o[pa.rows]

    def _per_request(self, q: torch.Tensor, cache, ctx, dtype) -> torch.Tensor:
        """The reference: one SDPA call per request over its own keys (every mode; prefill uses it)."""
        N, D = q.shape[0], self.head_dim
        out = torch.empty(N, self.num_heads, D, dtype=dtype, device=q.device)
        rep = self.num_heads // self.num_kv_heads
        for b in range(ctx.num_requests):
            s, e = ctx.cu_host[b], ctx.cu_host[b + 1]
            T, P = e - s, ctx.num_cached_host[b]
            kb, vb = cache.gather(self.cache_index, ctx.kv_slots[b])  # [P + T, Hkv, D]
            kb = kb.to(dtype).repeat_interleave(rep, dim=1).transpose(0, 1)
            vb = vb.to(dtype).repeat_interleave(rep, dim=1).transpose(0, 1)
            mask = torch.ones(T, P + T, dtype=torch.bool, device=q.device)
            if ctx.mode == "verify":
                mask[:, P:] = ctx.tree_mask(b)
            else:
                mask[:, P:] = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
            o = sdpa(q[s:e].transpose(0, 1), kb, vb, mask, D ** -0.5)
            out[s:e] = o.transpose(0, 1)
        return out

    def _static_decode(self, q: torch.Tensor, cache, static, dtype) -> torch.Tensor:
        """One query token per row over its padded key list: q [B, Hq, D] -> [B, Hq, D]. With the
        backend's ``decode_attention`` (kernels.paged_decode_attention on the GPU) the keys are read
        in place from the paged cache, split over the key length; else gathered for one SDPA call."""
        if self.decode_attention is not None and static.kv_len is not None:
            return self.decode_attention(q.to(dtype), cache.k(self.cache_index).flatten(0, 1),
                                         cache.v(self.cache_index).flatten(0, 1), static.kv_index, static.kv_len,
                                         self.head_dim ** -0.5)
        B, D, Hkv = q.shape[0], self.head_dim, self.num_kv_heads
        kb, vb = cache.gather(self.cache_index, static.kv_index)  # [B, L, Hkv, D]
        kb, vb = kb.to(dtype).transpose(1, 2), vb.to(dtype).transpose(1, 2)  # [B, Hkv, L, D]
        qg = q.reshape(B, Hkv, self.num_heads // Hkv, D)  # query head h reads kv head h // rep
        o = sdpa(qg, kb, vb, static.kv_valid[:, None, None, :], D ** -0.5)
        return o.reshape(B, self.num_heads, D)
