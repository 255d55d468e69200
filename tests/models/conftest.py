"""Tiny random checkpoints written by transformers' own classes, plus a small cache-owning runner.

Each checkpoint: hidden 64, 4 layers (3 GDN + 1 gated attention), vocab 128, saved with
``save_pretrained`` and extended with random ``mtp.*`` tensors (one MTP decoder layer taken from a
transformers decoder layer, so tests can run that layer as the reference).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from bole.cache.kv_cache import PagedKVCache, blocks_needed
from bole.cache.state_pool import StatePool
from bole.models.context import ForwardContext, TreeFactors
from bole.spec.tree import PackedForest

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
              initializer_range=0.1, rms_norm_eps=1e-6)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2)


def _classes(kind):
    if kind == "dense":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
        return Qwen3_5TextConfig, Qwen3_5ForCausalLM, Qwen3_5DecoderLayer, dict(intermediate_size=96)
    if kind == "moe":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer
        return Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeDecoderLayer, dict(MOE)
    if kind == "next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer
        # layer 1 dense (mlp_only_layers) to cover both MLP kinds
        return Qwen3NextConfig, Qwen3NextForCausalLM, Qwen3NextDecoderLayer, dict(
            MOE, intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=True)
    raise ValueError(kind)


def _perturb_vectors(module, gen):
    """Random norm weights, A_log and dt_bias so every per-channel vector is exercised."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))


class Checkpoint:
    def __init__(self, kind, path, hf_model, mtp_layer, mtp_tensors, hf_config):
        self.kind, self.path, self.hf, self.mtp_layer = kind, path, hf_model, mtp_layer
        self.mtp_tensors, self.hf_config = mtp_tensors, hf_config


def make_checkpoint(kind: str, path, seed: int = 0) -> Checkpoint:
    Config, Model, Layer, extra = _classes(kind)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = Config(**COMMON, **extra)
    cfg._attn_implementation = "eager"
    hf = Model(cfg).eval()
    _perturb_vectors(hf, gen)
    hf.save_pretrained(path)
    # one MTP decoder layer (full attention), weights from a transformers layer
    attn_idx = cfg.layer_types.index("full_attention")
    layer = Layer(cfg, attn_idx).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1, generator=gen)
            elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                p.normal_(0, 0.1, generator=gen)
    _perturb_vectors(layer, gen)
    H = cfg.hidden_size
    mtp = {f"mtp.layers.0.{k}": v.detach().clone().contiguous() for k, v in layer.state_dict().items()}
    mtp["mtp.fc.weight"] = 0.1 * torch.randn(H, 2 * H, generator=gen)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{n}.weight"] = 0.2 * torch.randn(H, generator=gen)
    file = f"{path}/model.safetensors"
    tensors = load_file(file)
    tensors.update(mtp)
    save_file(tensors, file, metadata={"format": "pt"})
    return Checkpoint(kind, str(path), hf, layer, mtp, cfg)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = make_checkpoint(kind, tmp_path_factory.mktemp(f"ckpt_{kind}"))
        return cache[kind]
    return get


class Runner:
    """Owns the caches for a few requests and builds a ForwardContext per step (test harness)."""

    def __init__(self, model, num_slots=4, num_blocks=96, block_size=4, dtype=torch.float32, device="cpu"):
        cfg = model.config
        self.model, self.device = model, device
        self.kv = PagedKVCache(max(cfg.num_attn_layers, 1), num_blocks, block_size, cfg.num_key_value_heads,
                               cfg.head_dim, dtype=dtype, device=device)
        self.pool = StatePool.for_model(cfg, num_slots, conv_dtype=dtype, device=device)
        self.reqs = {}

    def add(self, rid):
        self.reqs[rid] = dict(slot=self.pool.allocate(), blocks=[], cached=0)

    def _reserve(self, rid, total):
        r = self.reqs[rid]
        need = blocks_needed(total, self.kv.block_size) - len(r["blocks"])
        if need > 0:
            r["blocks"] += self.kv.allocator.allocate(need)

    def context(self, mode, rids, counts, forest=None):
        for rid, n in zip(rids, counts, strict=True):
            self._reserve(rid, self.reqs[rid]["cached"] + n)
        factors = None
        if mode == "verify":
            factors = TreeFactors.allocate(self.model.config, sum(counts), dtype=torch.float32,
                                           device=self.device)
        return ForwardContext.build(mode, None if mode == "verify" else counts,
                                    [self.reqs[r]["cached"] for r in rids],
                                    [self.reqs[r]["slot"] for r in rids],
                                    [self.reqs[r]["blocks"] for r in rids], self.kv, self.pool,
                                    forest=forest, factors=factors)

    @torch.no_grad()
    def step(self, mode, batch: dict):
        """batch: rid -> list of new tokens. Returns logits [N, vocab] and advances the caches."""
        rids = list(batch)
        counts = [len(batch[r]) for r in rids]
        ctx = self.context(mode, rids, counts)
        ids = torch.tensor([t for r in rids for t in batch[r]], device=self.device)
        hidden = self.model(ids, ctx)
        for r, n in zip(rids, counts, strict=True):
            self.reqs[r]["cached"] += n
        return self.model.compute_logits(hidden), hidden

    @torch.no_grad()
    def verify(self, batch: dict):
        """batch: rid -> (parents, tokens). Returns logits [N, vocab], hidden, ctx (not committed)."""
        rids = list(batch)
        forest = PackedForest.from_trees([batch[r][0] for r in rids], device=self.device)
        ctx = self.context("verify", rids, [len(batch[r][0]) for r in rids], forest)
        ids = torch.tensor([t for r in rids for t in batch[r][1]], device=self.device)
        hidden = self.model(ids, ctx)
        return self.model.compute_logits(hidden), hidden, ctx

    def commit(self, ctx, rids, accepted):
        lengths = self.model.commit(ctx, accepted)
        for r, n in zip(rids, lengths, strict=True):
            self.reqs[r]["cached"] += n
        return lengths


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@torch.no_grad()
def hf_logits(hf, ids):
    return hf(torch.tensor([ids], device=hf.device)).logits[0]
