"""Naive torch twin of the paged decode attention kernel (kernels/paged_decode_attention.py).

What GatedAttention's static decode path computes (gather every row's keys by ``kv_index``, cast to
q's dtype, masked SDPA with the query heads of a kv head grouped), written out in fp32: key position
p of row b is valid when p < kv_len[b] (the engine's ``kv_valid``), scores and softmax in fp32, the
output rounded to q's dtype once. Invalid positions are neither gathered nor multiplied, so their
slots may hold anything. A row with no valid key gets zeros (SDPA would give NaN; the engine never
makes one).

Shapes: q [B, Hq, D]; k_cache, v_cache [num_slots, Hkv, D]; kv_index [B, L]; kv_len [B].
"""

from __future__ import annotations

import torch


def paged_decode_attention_ref(q, k_cache, v_cache, kv_index, kv_len, scale=None, out=None):
    """o[b, h] = softmax_p(q[b, h] · k[kv_index[b, p], h // rep] · scale, p < kv_len[b]) v[...].

    Returns o [B, Hq, D] in q's dtype (written into ``out`` when given).
    """
    B, HQ, D = q.shape
    HKV, L = k_cache.shape[1], kv_index.shape[1]
    scale = D ** -0.5 if scale is None else scale
    valid = torch.arange(L, device=q.device)[None, :] < kv_len.to(q.device)[:, None]   # [B, L]
    slots = torch.where(valid, kv_index, 0).long()
    kb = k_cache[slots].to(q.dtype).float().masked_fill(~valid[..., None, None], 0)      # [B, L, Hkv, D]
    vb = v_cache[slots].to(q.dtype).float().masked_fill(~valid[..., None, None], 0)
    qg = q.float().reshape(B, HKV, HQ // HKV, D)                # query head h reads kv head h // rep
    s = torch.einsum("bgrd,blgd->bgrl", qg, kb) * scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)               # a row without keys: zeros, not NaN
    o = torch.einsum("bgrl,blgd->bgrd", p, vb).reshape(B, HQ, D).to(q.dtype)
    if out is None:
        return o
    return out.copy_(o)
