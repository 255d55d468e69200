"""The MTP drafter against a direct implementation of its formula:

    h = fc([RMSNorm_e(embed(x)) ; RMSNorm_h(target_hidden)]);  h = decoder_layer(h)
    logits = lm_head(RMSNorm(h))

with zero-centred RMSNorms written out here and the decoder layer run by transformers (the same
layer whose weights were written under ``mtp.layers.0.``)."""

import pytest
import torch
from conftest import Runner, rel_err

from bole.cache.kv_cache import PagedKVCache
from bole.models.context import ForwardContext
from bole.models.loader import load_model

TOL = 1e-4


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


@torch.no_grad()
def reference(ck, ids, hidden):
    t = ck.mtp_tensors
    e = ck.hf.model.embed_tokens(ids)
    x = torch.cat([rms(e, t["mtp.pre_fc_norm_embedding.weight"]),
                   rms(hidden, t["mtp.pre_fc_norm_hidden.weight"])], dim=-1) @ t["mtp.fc.weight"].T
    T = ids.numel()
    pos = torch.arange(T)[None]
    rotary = ck.hf.model.rotary_emb
    if type(rotary).__name__.startswith("Qwen3_5"):
        pos = pos[None].expand(3, 1, T)  # text-only M-RoPE: t = h = w
    cos, sin = rotary(x[None], pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    y = ck.mtp_layer(x[None], position_embeddings=(cos, sin), attention_mask=mask)
    y = y[0] if isinstance(y, tuple) else y
    return ck.hf.lm_head(rms(y[0], t["mtp.norm.weight"]))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_mtp_matches_formula(checkpoints, kind):
    ck = checkpoints(kind)
    model = load_model(ck.path, dtype="float32", backend="torch")
    assert model.mtp is not None and len(model.mtp.layers) == 1
    gen = torch.Generator().manual_seed(5)
    T = 14
    ids = torch.randint(0, 128, (T,), generator=gen)
    # target hidden states from the target model itself, as the drafter sees them
    r = Runner(model)
    r.add(0)
    _, hidden = r.step("prefill", {0: torch.randint(0, 128, (T,), generator=gen).tolist()})
    ref = reference(ck, ids, hidden)

    kv = PagedKVCache(1, 16, 4, model.config.num_key_value_heads, model.config.head_dim, dtype=torch.float32)
    blocks = kv.allocator.allocate(4)
    # prefill the first 10 pairs, then 4 single-token drafting steps over the drafter's own cache
    ctx = ForwardContext.build("prefill", [10], [0], [0], [blocks], kv, None)
    with torch.no_grad():
        out = [model.mtp.compute_logits(model.mtp(ids[:10], hidden[:10], ctx))]
        for t in range(10, T):
            ctx = ForwardContext.build("decode", [1], [t], [0], [blocks], kv, None)
            out.append(model.mtp.compute_logits(model.mtp(ids[t:t + 1], hidden[t:t + 1], ctx)))
    assert rel_err(torch.cat(out), ref) <= TOL


def test_mtp_shares_embedding_and_head(checkpoints):
    model = load_model(checkpoints("dense").path, dtype="float32", backend="torch")
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.startswith(("mtp.embed_tokens", "mtp.lm_head")) for n in names)
    assert model.mtp._shared == (model.model.embed_tokens, model.lm_head)
    no_mtp = load_model(checkpoints("dense").path, dtype="float32", backend="torch", load_mtp=False)
    assert no_mtp.mtp is None
