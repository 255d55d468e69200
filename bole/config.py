"""Configuration dataclasses.

``ModelConfig`` is the engine's view of a hybrid Qwen3.5 / Qwen3-Next checkpoint, derived once from
the transformers config class (``config.json`` through ``AutoConfig``) and validated on construction.
Everything the layers, caches and loader need is here; nothing reads the transformers config after
``ModelConfig.from_hf``. Multimodal ``qwen3_5`` / ``qwen3_5_moe`` configs contribute their
``text_config`` (the vision tower is not served).
"""

from __future__ import annotations

from dataclasses import dataclass

from bole.option_checks import check_epsilon, check_types, int_tuple
from bole.spec.budget import BUDGET_FLOORS, BUDGET_RULES
from bole.spec.tree import MAX_TREE_NODES

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a hybrid GDN / gated-attention decoder.

    ``gdn_layout`` says how the checkpoint stores the GDN input projections: ``"split"`` (Qwen3.5:
    in_proj_qkv / in_proj_z / in_proj_b / in_proj_a) or ``"fused"`` (Qwen3-Next: in_proj_qkvz /
    in_proj_ba interleaved per key-head group). The model always runs the split layout; the loader
    converts fused tensors.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    attention_bias: bool
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    gdn_layout: str
    # MLP / MoE (num_experts == 0: dense everywhere)
    intermediate_size: int | None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # misc
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    num_mtp_layers: int = 0
    dtype: str = "bfloat16"
    max_position_embeddings: int = 32768

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; "
                             f"supported: {SUPPORTED_MODEL_TYPES}")
        if not isinstance(self.num_hidden_layers, int) or self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be an int >= 1, got {self.num_hidden_layers!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"unknown layer types {bad}; expected {LAYER_TYPES}")
        if not self.gdn_layer_ids or not self.attn_layer_ids:
            # the engine's caches are built for the mix: a paged KV cache for the attention layers and
            # a GDN state pool (plus the verifier's tree factors) for the linear ones; with no layer of
            # a kind those have no dimension to allocate, and a drafter's MTP layer is attention anyway
            missing = "linear_attention (Gated DeltaNet)" if not self.gdn_layer_ids else "full_attention"
            raise ValueError(f"layer_types has no {missing} layer (all {self.num_hidden_layers} layers are "
                             f"{self.layer_types[0]!r}): Bole serves hybrid models only, which interleave "
                             "linear_attention and full_attention layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads={self.linear_num_key_heads}")
        if self.gdn_layout not in ("split", "fused"):
            raise ValueError(f"gdn_layout must be 'split' or 'fused', got {self.gdn_layout!r}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary dim {self.rotary_dim} (head_dim {self.head_dim} x "
                             f"{self.partial_rotary_factor}) must be even and in (0, head_dim]")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only silu)")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                                 f"[1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size <= 0:
                raise ValueError("MoE models need moe_intermediate_size > 0")
        dense_layers = [i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i)]
        if dense_layers and not self.intermediate_size:
            raise ValueError("dense MLP layers need intermediate_size > 0")

    # ---- derived values
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def attn_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def num_gdn_layers(self) -> int:
        return len(self.gdn_layer_ids)

    @property
    def num_attn_layers(self) -> int:
        return len(self.attn_layer_ids)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: [q | k | v] of the mixed projection."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether decoder layer ``layer_id`` (or the MTP layer, ``layer_id >= num_hidden_layers``)
        uses the sparse MoE block (transformers' Qwen3NextDecoderLayer rule)."""
        if self.num_experts == 0:
            return False
        if layer_id >= self.num_hidden_layers:  # MTP layers follow the model's MLP kind
            return True
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0

    # ---- construction
    @staticmethod
    def from_hf(hf_config) -> "ModelConfig":
        """Derive from a transformers config object (multimodal configs contribute text_config)."""
        top_type = getattr(hf_config, "model_type", None)
        if top_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {top_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        if top_type in ("qwen3_5", "qwen3_5_moe") and hasattr(hf_config, "text_config"):
            text = hf_config.text_config
        rope = dict(getattr(text, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default'; text-only "
                             "M-RoPE with equal t/h/w positions reduces to it)")
        partial = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        num_experts = int(_attr(text, "num_experts", 0) or 0)
        is_next = top_type == "qwen3_next"
        # Qwen3.5-MoE's router always renormalises its top-k (the config has no norm_topk_prob).
        norm_topk = bool(_attr(text, "norm_topk_prob", True)) if is_next else True
        dtype = getattr(text, "dtype", None) or getattr(hf_config, "dtype", None) or "bfloat16"
        dtype = str(dtype).replace("torch.", "")
        mtp = getattr(text, "mtp_num_hidden_layers", None)
        if mtp is None:
            mtp = getattr(text, "num_nextn_predict_layers", 0)
        return ModelConfig(
            model_type=text.model_type if top_type in ("qwen3_5", "qwen3_5_moe") else top_type,
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            num_hidden_layers=text.num_hidden_layers,
            layer_types=tuple(text.layer_types),
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=text.num_key_value_heads,
            head_dim=head_dim,
            rope_theta=float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))),
            partial_rotary_factor=float(partial),
            attention_bias=bool(getattr(text, "attention_bias", False)),
            linear_num_key_heads=text.linear_num_key_heads,
            linear_num_value_heads=text.linear_num_value_heads,
            linear_key_head_dim=text.linear_key_head_dim,
            linear_value_head_dim=text.linear_value_head_dim,
            linear_conv_kernel_dim=text.linear_conv_kernel_dim,
            gdn_layout="fused" if is_next else "split",
            intermediate_size=_attr(text, "intermediate_size", None),
            num_experts=num_experts,
            num_experts_per_tok=int(getattr(text, "num_experts_per_tok", 0) or 0) if num_experts else 0,
            moe_intermediate_size=int(getattr(text, "moe_intermediate_size", 0) or 0) if num_experts else 0,
            shared_expert_intermediate_size=int(getattr(text, "shared_expert_intermediate_size", 0) or 0)
            if num_experts else 0,
            norm_topk_prob=norm_topk,
            decoder_sparse_step=int(_attr(text, "decoder_sparse_step", 1) or 1) if is_next else 1,
            mlp_only_layers=tuple(_attr(text, "mlp_only_layers", None) or ()) if is_next else (),
            rms_norm_eps=float(text.rms_norm_eps),
            hidden_act=text.hidden_act,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)
                                     or getattr(text, "tie_word_embeddings", False)),
            num_mtp_layers=int(mtp or 0),
            dtype=dtype,
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 32768)),
        )


def _attr(obj, name, default):
    """getattr that also treats transformers' deleted fields (AttributeError sentinels) as absent."""
    try:
        value = getattr(obj, name, default)
    except AttributeError:
        return default
    return default if isinstance(value, BaseException) else value


# ---------------------------------------------------------------------------------------------
# Engine configuration: EngineConfig -> SpecConfig / CacheConfig (frozen, validated, layered).
# ---------------------------------------------------------------------------------------------

ENGINE_MODES = ("ar", "serial_tree", "bole")
DEFAULT_CALIBRATION_TABLE = "calibration_tables/default.yaml"
# the largest prefill graph (``cuda_graph_prefill_tokens``) allowed: the recurrence a captured prefill runs
# walks a sequence's tokens one by one (bole.engine.graphs.prefill)
PREFILL_GRAPH_MAX_TOKENS = 1024


def token_buckets(largest: int = 256) -> tuple[int, ...]:
    """The prefill graphs' token buckets 16, 32, ... up to ``largest`` (a power of two in
    [16, PREFILL_GRAPH_MAX_TOKENS])."""
    if not isinstance(largest, int) or isinstance(largest, bool) or not 16 <= largest <= PREFILL_GRAPH_MAX_TOKENS \
            or largest & (largest - 1):
        raise ValueError(f"the largest prefill token bucket must be a power of two in [16, "
                         f"{PREFILL_GRAPH_MAX_TOKENS}], got {largest!r}")
    return tuple(16 << i for i in range((largest // 16).bit_length()))


def useful_token_buckets(largest: int, max_step_tokens: int, max_rows: int) -> tuple[int, ...]:
    """``token_buckets(largest)`` without the buckets no step can reach: a step packs at most
    ``max_step_tokens`` tokens of at most ``max_rows`` chunks, plus the padding rows' (one each past the
    chunks, and one more in the last), so buckets past the smallest one holding that are never replayed."""
    most = max_step_tokens + max_rows + 1
    buckets = token_buckets(largest)
    return tuple(n for i, n in enumerate(buckets) if i == 0 or buckets[i - 1] < most)


@dataclass(frozen=True)
class SpecConfig:
    """Draft-tree shape (EAGLE-2 style expansion with the MTP head).

    depth: draft levels D (the verified tree is D + 1 deep with its root). topk: children proposed
    per expanded node. beam: nodes expanded per level (by cumulative draft probability ρ).
    draft_fast_math: the drafter's fp32 products on tensor cores (TF32 GEMMs, bf16 attention;
    ``bole.layers.draft_math``). Outputs stay exact either way: only the proposals can change.
    draft_vocab: the drafter scores only the N most frequent training tokens (FR-Spec; the model folder's
    ``token_frequencies.json``, ``bole.spec.draft_vocab``), topk <= N <= the vocabulary size (``build_engine``
    refuses more: ``check_draft_vocab``); None: all.
    budget_epsilon: ε of eq. 12 (docs/DESIGN.md §5), the verify latency the budget may add over its
    floor: each bucket's B_ver is re-derived from the calibration table's own timings at this ε
    (``CalibrationTable.with_epsilon``); None: the table's B_ver as written (its calibration ε).
    cap_tree_width: cap every request's tree at the width the calibration timed B_ver at (the smallest
    captured tree width holding ceil(B_ver / batch) drafts and the root, ``bole.spec.budget.width_cap``),
    so the verify forward, which pads every tree to the widest, runs the rows its budget was measured
    for; off (the paper's): a request may take up to the whole budget (docs/DESIGN.md §5). Under
    ``budget_rule="goodput"`` each timed capacity is scored with its own such cap.
    budget_floor: the budget's fairness floor (``bole.spec.budget.select_nodes``): "best_child" (each
    request keeps its likeliest first-level draft; its other first-level drafts compete for the budget
    like deeper ones) or "children", the paper's (every request keeps all its first-level drafts).
    The defaults (cap on, "best_child") are the measured better pair: docs/DESIGN.md §5.
    budget_rule: how a step's B_ver is chosen. "epsilon": the table's bucket value (eq. 12). "goodput": per
    step on the device, the capacity of the bucket's timed curve that maximises the batch's expected
    tokens per verify time from the drafts' own ρ (``bole.spec.budget.select_nodes``'s ``costs``); it
    needs a table with timings (a measured or modeled one). "auto" (the default): "goodput" for a model
    with routed experts and a table that can feed it, else "epsilon", fixed at the engine's start
    (``bole.spec.budget.resolve_budget_rule``, which says why). Drafts only propose: outputs are exact
    either way.
    """

    depth: int = 4
    topk: int = 4
    beam: int = 4
    draft_fast_math: bool = True
    draft_vocab: int | None = None
    budget_epsilon: float | None = None
    cap_tree_width: bool = True
    budget_floor: str = "best_child"
    budget_rule: str = "auto"

    def __post_init__(self):
        check_types(self, ints=("depth", "topk", "beam") + (("draft_vocab",) if self.draft_vocab is not None else ()),
                    bools=("draft_fast_math", "cap_tree_width"))
        if self.budget_epsilon is not None:
            check_epsilon("SpecConfig.budget_epsilon", self.budget_epsilon)
        if self.budget_floor not in BUDGET_FLOORS:
            raise ValueError(f"SpecConfig.budget_floor must be one of {BUDGET_FLOORS}, got {self.budget_floor!r}")
        if self.budget_rule not in BUDGET_RULES:
            raise ValueError(f"SpecConfig.budget_rule must be one of {BUDGET_RULES}, got {self.budget_rule!r}")
        if self.draft_vocab is not None and self.draft_vocab < self.topk:
            raise ValueError(f"SpecConfig.draft_vocab must be an int >= topk={self.topk} (or None), "
                             f"got {self.draft_vocab!r}")
        for name in ("depth", "topk", "beam"):
            v = getattr(self, name)
            if v < 1:
                raise ValueError(f"SpecConfig.{name} must be an int >= 1, got {v!r}")
        if self.depth > 15:
            raise ValueError(f"SpecConfig.depth={self.depth} exceeds the supported 15")
        if self.topk > MAX_TREE_NODES - 1:  # a request always keeps its first-level drafts (root + topk nodes)
            raise ValueError(f"SpecConfig.topk={self.topk} exceeds {MAX_TREE_NODES - 1} (MAX_TREE_NODES - 1)")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache for full-attention layers (the GDN state pool has max_num_seqs + 1 slots).

    enable_prefix_cache: share full KV blocks of common prefixes between requests
        (``bole.cache.prefix_cache``); GDN layers restore from state checkpoints.
    checkpoint_interval_blocks: GDN checkpoints are taken every this many KV blocks (a restore
        point is a multiple of ``checkpoint_interval_blocks * block_size`` tokens).
    num_checkpoint_slots: the checkpoint pool (ssm + conv of every GDN layer per slot), a budget
        separate from the KV blocks.
    num_blocks / num_checkpoint_slots None: planned (``bole.cache.memory_plan``): on CUDA from the
        free memory at start, within gpu_memory_utilization of the device; on the CPU 512 / 32. A count
        given wins over the plan, but is refused at start if it does not fit.
    """

    block_size: int = 16
    num_blocks: int | None = None
    enable_prefix_cache: bool = True
    checkpoint_interval_blocks: int = 1
    num_checkpoint_slots: int | None = None
    gpu_memory_utilization: float = 0.9

    def __post_init__(self):
        check_types(self, ints=("block_size", "checkpoint_interval_blocks")
                    + tuple(k for k in ("num_blocks", "num_checkpoint_slots") if getattr(self, k) is not None),
                    bools=("enable_prefix_cache",))
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"CacheConfig.gpu_memory_utilization must be a float in (0, 1], got {u!r}")
        if self.block_size < 1 or (self.num_blocks is not None and self.num_blocks < 1):
            raise ValueError(f"block_size={self.block_size} and num_blocks={self.num_blocks} must be >= 1")
        if self.checkpoint_interval_blocks < 1 or (self.num_checkpoint_slots is not None and
                                                   self.num_checkpoint_slots < 1):
            raise ValueError(f"checkpoint_interval_blocks={self.checkpoint_interval_blocks} and "
                             f"num_checkpoint_slots={self.num_checkpoint_slots} must be >= 1")

    @property
    def checkpoint_interval(self) -> int:
        """Tokens between GDN checkpoints."""
        return self.checkpoint_interval_blocks * self.block_size


# options that existed once, and why they went (docs/performance-notes.md)
REMOVED_OPTIONS = {
    "cuda_graph_whole_step": "the whole greedy step as one CUDA graph measured no faster than the draft and "
                             "verify graphs (docs/performance-notes.md)",
}


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "bole"
    device: str = "auto"   # "auto": the GPU when torch sees one, else the CPU (resolved on construction)
    dtype: str = "float32"
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 1024
    calibration_table: str = DEFAULT_CALIBRATION_TABLE
    eos_token_ids: tuple[int, ...] = ()
    tp_size: int = 1  # tensor-parallel ranks; each runs an identical engine (bole.parallel)
    # ar-mode decode steps replay CUDA graphs captured per padded batch size (bole.engine.graphs.decode),
    # speculative modes their verify forward (bole.engine.graphs.verify: batch, tree width, KV length);
    # ignored on the CPU, under tensor parallelism and for MoE models on the torch backend, whose expert loop
    # reads the routed experts on the host (decode then runs eagerly; kernels.moe_experts is captured)
    enable_cuda_graphs: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    # with enable_cuda_graphs, prefill steps of <= cuda_graph_prefill_tokens tokens (with padding) replay
    # captured graphs in every mode (bole.engine.graphs.prefill; the "triton" backend only; token buckets
    # 16, 32, ... up to it, a power of two in [16, 1024], and no larger than a step can fill:
    # max_num_batched_tokens + max_num_seqs + 1 with the padding rows); off: prefills run eagerly
    cuda_graph_prefill: bool = True
    cuda_graph_prefill_tokens: int = 256
    # with prefill graphs, a step whose prefill fits no graph whole runs as several graphed forwards of up
    # to cuda_graph_prefill_tokens each (``ModelRunner.prefill_waves``) rather than one eager forward, which
    # is host-bound at model scale (a 9B-cost eager prefill: 81 ms wall for 10.6 ms of GPU work); measured
    # in benchmarks/README.md ("Prefill in graphed waves"); False: the one eager forward
    cuda_graph_prefill_split: bool = True
    # with enable_cuda_graphs, capture at start every graph a step of <= max_num_seqs requests of <= this
    # many tokens each can need (vLLM's max_seq_len_to_capture), so no step waits on a capture; longer
    # requests' keys are still captured when first needed. None: every graph is captured lazily
    cuda_graph_capture_len: int | None = None
    # served (``AsyncEngine``), requests that arrive while a step runs are admitted inside it: before its
    # decode forward and, in the speculative modes, between its draft and verify forward, within the
    # step's token budget (``LLMEngine.step``'s ``admit``); off: only between steps, as vLLM and SGLang
    admit_mid_step: bool = True
    # with admit_mid_step, one more admission point: while the GPU runs the step's forwards, the engine
    # thread polls for arrivals and prefills them at once on a stream of the highest priority beside the
    # forwards in flight (``LLMEngine._admit_while_busy``); the GPU idles for up to a polling interval
    # between the decode / verify forward and what follows it, every step
    admit_during_forward: bool = False
    # the most tree rows one verify forward holds across the batch, every tree padded to the step's widest
    # (``bole.spec.budget.verify_rows_limit``): it sizes the verify factor buffer, the verify graphs'
    # static logits and the memory plan's verify logits, and every step's drafts per request are capped
    # to stay within it (at least max_num_seqs trees of the fairness floor). None: in bole the step's token
    # budget, max_num_batched_tokens, as vLLM counts draft tokens against it (raised to the floor's rows if
    # below them); in serial_tree every request's whole tree (max_num_seqs × the lookahead: its per-node
    # snapshots, the baseline's cost). Whole trees in bole (~12 GiB of logits at batch 32, depth 8 and a 248k
    # vocabulary) take a value at least that large
    max_verify_rows: int | None = None
    spec: SpecConfig = SpecConfig()
    cache: CacheConfig = CacheConfig()

    def __post_init__(self):
        check_types(self, ints=("max_num_seqs", "max_num_batched_tokens"), strs=("mode", "device", "dtype",
                                                                              "calibration_table"))
        object.__setattr__(self, "eos_token_ids", int_tuple("eos_token_ids", self.eos_token_ids))
        if self.device == "auto":
            import torch

            object.__setattr__(self, "device", "cuda" if torch.cuda.is_available() else "cpu")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.mode not in ENGINE_MODES:
            raise ValueError(f"mode must be one of {ENGINE_MODES}, got {self.mode!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not isinstance(self.tp_size, int) or isinstance(self.tp_size, bool) or self.tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {self.tp_size!r}")
        for name in ("enable_cuda_graphs", "cuda_graph_prefill", "cuda_graph_prefill_split", "admit_mid_step",
                     "admit_during_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        try:
            token_buckets(self.cuda_graph_prefill_tokens)
        except ValueError as e:
            raise ValueError(f"cuda_graph_prefill_tokens: {e}") from None
        n = self.cuda_graph_capture_len
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"cuda_graph_capture_len must be None or an int >= 1, got {n!r}")
        n = self.max_verify_rows
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"max_verify_rows must be None or an int >= 1, got {n!r}")
        sizes = self.cuda_graph_batch_sizes
        if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
            raise ValueError(f"cuda_graph_batch_sizes must be ints >= 1, got {sizes!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} and max_num_batched_tokens="
                             f"{self.max_num_batched_tokens} must be >= 1")

    @property
    def prefills_beside_forward(self) -> bool:
        """Whether an arrival may be prefilled while the step's forwards run (``admit_during_forward``, which
        needs ``admit_mid_step``): the runner's priority stream, and the memory plan's second prefill."""
        return self.admit_mid_step and self.admit_during_forward

    @property
    def prefill_graphs(self) -> bool:
        """Whether prefills replay captured graphs: asked for, on a GPU (the model's backend may still
        turn them off: ``bole.engine.graphs.prefill.prefill_graphs_unsupported``)."""
        return self.enable_cuda_graphs and self.cuda_graph_prefill and self.device.startswith("cuda")

    @property
    def prefill_graph_tokens(self) -> tuple[int, ...]:
        """The prefill graphs' token buckets: to ``cuda_graph_prefill_tokens``, without those no step of
        ``max_num_batched_tokens`` tokens in ``max_num_seqs`` chunks (and the padding rows) can reach."""
        return useful_token_buckets(self.cuda_graph_prefill_tokens, self.max_num_batched_tokens, self.max_num_seqs)

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @staticmethod
    def from_options(**options) -> "EngineConfig":
        """Build from flat keyword options (``LLM(path, mode=..., depth=..., num_blocks=...)``).

        Unknown keys raise ``ValueError`` naming them; removed ones say why.
        """
        from dataclasses import fields

        removed = sorted(set(options) & set(REMOVED_OPTIONS))
        if removed:
            raise ValueError("; ".join(f"engine option {k!r} was removed: {REMOVED_OPTIONS[k]}" for k in removed))
        spec_keys = {f.name for f in fields(SpecConfig)}
        cache_keys = {f.name for f in fields(CacheConfig)}
        top_keys = {f.name for f in fields(EngineConfig)} - {"spec", "cache"}
        unknown = sorted(set(options) - spec_keys - cache_keys - top_keys)
        if unknown:
            raise ValueError(f"unknown engine options {unknown}; known: "
                             f"{sorted(spec_keys | cache_keys | top_keys)}")
        spec = SpecConfig(**{k: v for k, v in options.items() if k in spec_keys})
        cache = CacheConfig(**{k: v for k, v in options.items() if k in cache_keys})
        top = {k: v for k, v in options.items() if k in top_keys}
        if "cuda_graph_batch_sizes" in top:  # eos_token_ids is normalised (and checked) by __post_init__
            top["cuda_graph_batch_sizes"] = int_tuple("cuda_graph_batch_sizes", top["cuda_graph_batch_sizes"])
        return EngineConfig(spec=spec, cache=cache, **top)
