"""The hybrid Qwen3.5 / Qwen3.5-MoE / Qwen3-Next decoder and its MTP drafter.

Interface (the engine builds on this):

    model = HybridForCausalLM(cfg, backend="auto")             # or bole.models.loader.load_model(path)
    hidden = model(input_ids [N], ctx)                          # [N, H], after the final norm
    logits = model.compute_logits(hidden)                       # [N, vocab]
    accepted_len = model.commit(ctx, accepted)                  # after a verify step, see below
    h_draft = model.mtp(next_ids [N], target_hidden [N, H], ctx_mtp)   # MTP drafter
    draft_logits = model.mtp.compute_logits(h_draft)

``ctx`` is a ``bole.models.context.ForwardContext`` (mode, packed batch, positions, caches, tree).
Parameter names equal the checkpoint's (``model.layers.3.self_attn.q_proj.weight``, ``mtp.fc.weight``,
...), so the loader maps tensors by name.

Decoder layer: x += mixer(RMSNorm(x)); x += mlp(RMSNorm(x)), mixer = Gated DeltaNet or gated
attention per ``cfg.layer_types``, mlp = dense SwiGLU or sparse MoE. All RMSNorms of the decoder
are zero-centred (1 + w).

Verify / commit (DESIGN.md §2): the verify forward reads the committed GDN state, stores per-node
factors and writes the tree nodes' K/V at positions num_cached + node_index. ``commit(ctx,
accepted)`` takes each request's deepest accepted local node (-1: none) and
  1. materialises every GDN layer's state on the accepted path in ONE backend.commit call,
  2. keeps the last W-1 conv inputs along the path (per layer),
  3. moves the accepted nodes' K/V (all attention layers at once) to num_cached + 0..len(path)-1.
The caller then advances each request's committed length by the returned path lengths; rejected
nodes' K/V slots are simply overwritten later.

Tensor parallelism: built with ``tp_size`` > 1 the layers hold their rank's slices (see the
loader) and ``tp_reduce`` sums each row-parallel output (mixer and MLP) over the TP group
(``bole.parallel.make_tp_reduce``: an all-reduce; identity by default). Embedding, lm_head, norms
and mtp.fc are replicated, so hidden states between layers and the logits are full on every rank.
``local_config`` is the config with this rank's head counts (what caches are sized with).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bole.backend import GDNBackend, resolve_backend
from bole.config import ModelConfig
from bole.layers.attention import GatedAttention
from bole.layers.draft_math import draft_math
from bole.layers.gdn import GatedDeltaNet
from bole.layers.mlp import MLP
from bole.layers.moe import Experts, SparseMoE
from bole.layers.norm import GatedRMSNorm, RMSNorm
from bole.ops.conv import conv_state_commit_layers
from bole.parallel import local_model_config


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, layer_type: str, cache_index: int,
                 backend: GDNBackend, tp_size: int = 1, tp_reduce: Callable | None = None):
        super().__init__()
        self.layer_type = layer_type
        self.tp_reduce = tp_reduce or (lambda t: t)
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, cache_index, backend, tp_size)
        else:
            self.self_attn = GatedAttention(cfg, cache_index, tp_size)
        if cfg.is_moe_layer(layer_id):
            if cfg.moe_intermediate_size % tp_size or cfg.shared_expert_intermediate_size % tp_size:
                raise ValueError(f"MoE intermediate sizes do not divide over tp_size={tp_size}")
            self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                 cfg.moe_intermediate_size // tp_size,
                                 cfg.shared_expert_intermediate_size // tp_size, cfg.norm_topk_prob)
        else:
            if cfg.intermediate_size % tp_size:
                raise ValueError(f"intermediate_size {cfg.intermediate_size} does not divide over "
                                 f"tp_size={tp_size}")
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size // tp_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx, residual: torch.Tensor | None = None):
        """Returns (mlp output, residual stream): the layer's output is their sum, which the next
        layer's input norm (or the final norm) forms fused with its own normalisation.
        ``residual`` None: x is the residual stream itself (the first layer)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        mixer = self.linear_attn if self.layer_type == "linear_attention" else self.self_attn
        h, residual = self.post_attention_layernorm(self.tp_reduce(mixer(h, ctx)), residual)
        return self.tp_reduce(self.mlp(h)), residual


class HybridModel(nn.Module):
    """Embedding, decoder layers and final norm (checkpoint prefix ``model.``)."""

    def __init__(self, cfg: ModelConfig, backend: GDNBackend, tp_size: int, tp_reduce):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        gdn_index = {layer: i for i, layer in enumerate(cfg.gdn_layer_ids)}
        attn_index = {layer: i for i, layer in enumerate(cfg.attn_layer_ids)}
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, t, gdn_index[i] if t == "linear_attention" else attn_index[i], backend,
                         tp_size, tp_reduce)
            for i, t in enumerate(cfg.layer_types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, ctx, residual)
        return self.norm(x, residual)[0]


class MTPDrafter(nn.Module):
    """Qwen3.5 / Qwen3-Next multi-token-prediction head (checkpoint prefix ``mtp.``).

        h = fc([RMSNorm_e(embed(next_ids)) ; RMSNorm_h(target_hidden)])     (2H -> H, embedding first)
        h = decoder_layer_d(h)      full attention with its own KV cache (ctx_mtp.kv_cache, index d)
        return RMSNorm(h)           logits through the target's lm_head (``compute_logits``)

``target_hidden`` is the target model's output hidden state (after its final norm) at the token
preceding ``next_ids``. A depth-D draft reuses layer ``step % num_mtp_layers`` D times. The embedding
and lm_head are the target's (shared, not registered here).
"""

    def __init__(self, cfg: ModelConfig, num_layers: int, backend: GDNBackend, embed: nn.Embedding,
                 lm_head: nn.Linear, tp_size: int = 1, tp_reduce=None):
        super().__init__()
        H = cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, cfg.num_hidden_layers + i, "full_attention", i, backend, tp_size, tp_reduce)
            for i in range(num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self._shared = (embed, lm_head)  # a tuple keeps them out of this module's parameters
        self.backend = backend
        # TF32 GEMMs and bf16 attention on fp32 CUDA activations (bole.layers.draft_math: drafts only
        # propose, so outputs stay exact); the engine sets it from SpecConfig.draft_fast_math
        self.fast_math = True
        self.vocab_ids: torch.Tensor | None = None      # the ids the drafter scores [N] (None: all)
        self._vocab_weight: torch.Tensor | None = None  # their lm_head rows [N, H], contiguous

    def restrict_vocab(self, ids: Sequence[int] | None) -> None:
        """Score only the token ids ``ids`` (``SpecConfig.draft_vocab``, ``bole.spec.draft_vocab``;
        None: the whole vocabulary again). Their lm_head rows are gathered once into a contiguous
        [N, H] weight; logits column j is token ``ids[j]``. Every TP rank holds the full (replicated)
        lm_head, so each gathers the same rows."""
        if ids is None:
            self.vocab_ids = self._vocab_weight = None
            return
        w = self._shared[1].weight
        self.vocab_ids = torch.tensor(list(ids), dtype=torch.long, device=w.device)
        self._vocab_weight = w.detach()[self.vocab_ids].contiguous()

    @property
    def vocab_width(self) -> int:
        """Columns of ``compute_logits``: N with a reduced vocabulary, else the vocabulary size."""
        return self._shared[1].weight.shape[0] if self.vocab_ids is None else self.vocab_ids.numel()

    def _math(self, x: torch.Tensor):
        return draft_math(self.fast_math and x.is_cuda and x.dtype == torch.float32)

    def forward(self, input_ids: torch.Tensor, target_hidden: torch.Tensor, ctx,
                step: int = 0) -> torch.Tensor:
        embed, _ = self._shared
        e = self.pre_fc_norm_embedding(embed(input_ids))
        with self._math(e):
            h = self.pre_fc_norm_hidden(target_hidden.to(e.dtype))
            x = self.fc(torch.cat([e, h], dim=-1))
            x, residual = self.layers[step % len(self.layers)](x, ctx)
            return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., vocab_width]: hidden @ W^T over the shared lm_head's rows (all, or the
        ``restrict_vocab`` ones)."""
        weight = self._shared[1].weight if self._vocab_weight is None else self._vocab_weight
        with self._math(hidden):
            # One GEMM over contiguous rows. F.linear on a strided [B, M, H] input (the drafter's frontier
            # sliced out of its forest) against a weight that needs no grad (the reduced vocabulary's rows)
            # runs as a bmm with the weight expanded per request, re-reading it B times: 6.2 of a 23.6 ms
            # batch-16 step at 9B cost (benchmarks/README.md). On contiguous 2D rows cuBLAS reads it once
            # (docs/performance-notes.md), and the copy is small.
            rows = hidden.reshape(-1, hidden.shape[-1])
            return F.linear(rows, weight).view(*hidden.shape[:-1], weight.shape[0])

    def log_softmax_topk(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, token ids) [..., k] of ``compute_logits`` rows: the backend's fused log-softmax
        top-k over the scored columns, their indices mapped to token ids by a device gather."""
        lp, idx = self.backend.log_softmax_topk(logits, k)
        return lp, (idx if self.vocab_ids is None else self.vocab_ids[idx])


class HybridForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str | GDNBackend = "auto",
                 num_mtp_layers: int | None = None, tp_size: int = 1, tp_reduce: Callable | None = None,
                 device=None):
        super().__init__()
        self.config = cfg
        # the checkpoint folder (``load_model`` sets it): files beside the weights, e.g. token_frequencies.json
        self.source_path: str | None = None
        self.tp_size = tp_size
        self.local_config = local_model_config(cfg, tp_size)  # per-rank heads, for cache sizing
        self.backend = backend if isinstance(backend, GDNBackend) else resolve_backend(backend, device)
        self.model = HybridModel(cfg, self.backend, tp_size, tp_reduce)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        n_mtp = cfg.num_mtp_layers if num_mtp_layers is None else num_mtp_layers
        self.mtp = MTPDrafter(cfg, n_mtp, self.backend, self.model.embed_tokens, self.lm_head, tp_size,
                              tp_reduce) if n_mtp > 0 else None
        for m in self.modules():  # the backend's kernels (the torch twins by default)
            if isinstance(m, RMSNorm) and self.backend.rms_norm is not None:
                m.kernel = self.backend.rms_norm
            elif isinstance(m, GatedRMSNorm) and self.backend.gated_rms_norm is not None:
                m.kernel = self.backend.gated_rms_norm
            elif isinstance(m, GatedAttention):
                m.decode_attention = self.backend.decode_attention
                m.qk_norm_rope_store = self.backend.qk_norm_rope_store
                m.prefill_attention = self.backend.tree_attention   # short prefill chunks (causal rows)
                m.tree_attention = self.backend.tree_attention      # verify forwards: the target's and the drafter's
            if isinstance(m, (GatedAttention, MLP, SparseMoE)):
                m.act_mul = self.backend.act_mul
            elif isinstance(m, Experts):
                m.dispatch = self.backend.moe_experts

    def fuse_projections(self) -> "HybridForCausalLM":
        """Concatenate the projections that share an input into one GEMM each (``bole.layers.linear``);
        called once the weights are loaded (``load_model``, ``bole.calibrate_sweep.random_model``)."""
        for m in self.modules():
            if m is not self and hasattr(m, "fuse_projections"):
                m.fuse_projections()
        return self

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        if input_ids.dim() != 1 or input_ids.numel() != ctx.num_tokens:
            raise ValueError(f"input_ids must be [N={ctx.num_tokens}], got {tuple(input_ids.shape)}")
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.no_grad()
    def commit(self, ctx, accepted: "Sequence[int] | torch.Tensor", lengths: Sequence[int] | None = None) -> list[int]:
        """Materialise each request's accepted path after a verify forward; returns path lengths.

        ``accepted[b]``: local index of request b's deepest accepted node, or -1 (nothing accepted); a
        host list (validated) or a device tensor. ``lengths``: the path lengths (root included) when
        the caller knows them on the host (the engine: emitted tokens per request); with a device
        ``accepted`` and ``lengths`` the commit reads nothing on the host. Without ``lengths`` they
        are read from the device (one sync).
        """
        if ctx.mode != "verify":
            raise ValueError(f"commit follows a verify step, not {ctx.mode}")
        paths = ctx.forest.accepted_path_nodes(accepted)  # [B, D] global node ids, -1 padded
        lengths = (paths >= 0).sum(1).tolist() if lengths is None else [int(n) for n in lengths]
        self.commit_paths(ctx, paths, move_kv=any(lengths))
        return lengths

    @torch.no_grad()
    def commit_paths(self, ctx, paths: torch.Tensor, move_kv: bool = True, out=None) -> None:
        """``commit`` from the accepted paths [B, D] (global node ids, root first, -1 padded): device
        ops only, nothing read on the host, so a CUDA graph can capture it (``VerifyGraphs``' tail).

        ``out`` = (StatePool, slots [B]): write the GDN states and conv windows there instead, the
        request's pool slot read only (a prefix-cache checkpoint of a path prefix; K/V untouched)."""
        f, pool = ctx.factors, ctx.state_pool
        slots = ctx.state_slots.long()
        dst, dst_slots = (pool, slots) if out is None else (out[0], out[1].long())
        if pool is not None and self.config.num_gdn_layers and f.snapshots is not None:
            # serial_tree baseline: copy the accepted node's snapshot of every layer
            last = paths.gather(1, (paths >= 0).sum(1, keepdim=True).clamp(min=1) - 1)[:, 0].long()
            snap = f.snapshots[:, last.clamp(min=0)].to(dst.ssm.dtype)
            dst.ssm[:, dst_slots] = torch.where((last >= 0)[None, :, None, None, None], snap, dst.ssm[:, dst_slots])
            conv_state_commit_layers(pool.conv, f.conv_x, slots, paths, *(() if out is None else (dst.conv, dst_slots)))
        elif pool is not None and self.config.num_gdn_layers:
            self.backend.commit(pool.ssm, f.k, f.u, f.logp, paths, ctx.state_slots, use_qk_l2norm=True,
                                **({} if out is None else dict(out_pool=dst.ssm, out_indices=dst_slots)))
            conv_state_commit_layers(pool.conv, f.conv_x, slots, paths, *(() if out is None else (dst.conv, dst_slots)))
        if out is None and ctx.kv_cache is not None and self.config.num_attn_layers and move_kv:
            # node j of a request's path moves to position num_cached + j, whose slot is the one its
            # local node j was written to (kv position = num_cached + local index): no host read.
            # An entry j past a path copies the request's node min(j, T_b - 1) onto itself: a slot
            # no move writes (positions >= the path length), or, when the whole tree is the path (a
            # chain, node j at local j), a move that writes that same value.
            B, D = paths.shape
            sm = ctx.slot_mapping
            cu = ctx.cu_seqlens.long().to(sm.device)
            start, size = cu[:-1, None], (cu[1:] - cu[:-1])[:, None]
            p = paths.long().to(sm.device)
            ok = p >= 0
            j = torch.arange(D, device=sm.device)[None]
            own = sm[start + torch.minimum(j, size - 1)]
            src = torch.where(ok, sm[p.clamp(min=0)], own)
            ctx.kv_cache.move(src.reshape(-1), own.reshape(-1))
