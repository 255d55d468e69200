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


def tree_attention_ref(q, k_cache, v_cache, kv_index, mask, cu_seqlens, num_cached, scale=None, out=None,
                       precision=None):
    """Twin of kernels.tree_attention: tree row t of request b (flat row cu_seqlens[b] + t) attends to
    the keys p < num_cached[b] + T_b with mask[b, 0, t, p], o = softmax(q k[kv_index[b, p]]ᵀ · scale) v
    in fp32 (K/V cast to q's dtype first), rounded to q's dtype once; no visible key gives zeros.

    Shapes: q [N, Hq, D]; k_cache, v_cache [num_slots, Hkv, D]; kv_index [B, L]; mask bool
    [B, 1, tq, L], or None for causal rows (row t sees the keys p <= num_cached[b] + t); cu_seqlens
    [B + 1]; num_cached [B]. ``precision`` is the kernel's (ignored: fp32).
    """
    N, HQ, D = q.shape
    HKV, L = k_cache.shape[1], kv_index.shape[1]
    rep = HQ // HKV
    scale = D ** -0.5 if scale is None else scale
    o = torch.zeros(N, HQ, D, dtype=torch.float32, device=q.device)
    cu, nc = cu_seqlens.tolist(), num_cached.tolist()
    for b in range(kv_index.shape[0]):
        s, e = cu[b], cu[b + 1]
        T, hi = e - s, min(nc[b] + e - s, L)
        if T == 0 or hi <= 0:
            continue
        slots = kv_index[b, :hi].long()
        kb = k_cache[slots].to(q.dtype).float().repeat_interleave(rep, dim=1)            # [hi, Hq, D]
        vb = v_cache[slots].to(q.dtype).float().repeat_interleave(rep, dim=1)
        if mask is None:
            vis = torch.arange(hi, device=q.device)[None, :] <= nc[b] + torch.arange(T, device=q.device)[:, None]
        else:
            vis = mask[b, 0, :T, :hi]                                                   # [T, hi]
        sc = torch.einsum("thd,phd->htp", q[s:e].float(), kb) * scale
        sc = sc.masked_fill(~vis[None], float("-inf"))
        p = torch.softmax(sc, dim=-1).nan_to_num(0.0)
        o[s:e] = torch.einsum("htp,phd->thd", p, vb.masked_fill(~vis.any(0)[:, None, None], 0))
    o = o.to(q.dtype)
    if out is None:
        return o
    return out.copy_(o)
