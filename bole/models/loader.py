"""Load Hugging Face Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints into ``HybridForCausalLM``.

    model = load_model(path, dtype="auto", device="cpu", tp_rank=0, tp_size=1, backend="auto")

* ``config.json`` goes through transformers' config classes (``AutoConfig``) into ``ModelConfig``. The fields
  that fix the tensor shapes must be in it (transformers would fill in its class defaults) and agree with the
  weights' shapes (``check_config_shapes``, read from the headers before anything is allocated); a ValueError
  names config.json and the field.
* Weights come only from ``*.safetensors`` (one file, or shards with ``model.safetensors.index.json``)
  read with ``safetensors.safe_open``; pickled ``*.bin`` / ``*.pt`` files are never opened.
* Names are normalised: ``model.language_model.`` -> ``model.`` (multimodal checkpoints; the vision
  tower ``model.visual.*`` is skipped), ``mtp.*`` goes to the drafter (its layer count is read from
  the tensor names). Conversions: Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` (interleaved
  per key-head group [q_g, k_g, v_g, z_g] / [b_g, a_g]) are split into the Qwen3.5 layout; per-expert
  ``experts.{e}.{gate,up,down}_proj.weight`` are stacked into ``experts.gate_up_proj`` /
  ``experts.down_proj`` (already fused checkpoints load as they are).
* ``tensors=`` (name -> tensor, checkpoint naming) stands in for the safetensors files: a checkpoint held
  in memory (``bole.models.widen.widened_tensors``, a widening larger than the disk); ``path`` then
  gives config.json only.
* Missing or unexpected tensors (all names listed), shape mismatches and unsupported model types
  raise ``ValueError``.

Tensor parallelism (``tp_rank`` of ``tp_size``): each rank loads only its slice (``tp_slice``);
``tp_reduce`` (``bole.parallel.make_tp_reduce``) is the all-reduce after row-parallel projections.
Head slices follow ``bole.parallel.head_range``: KV heads and GDN key heads fewer than the ranks are
replicated (each rank takes the one its query / value heads read).
    column parallel (output rows split by heads / intermediate units):
        self_attn.{q,k,v}_proj, mlp.{gate,up}_proj, shared_expert.{gate,up}_proj,
        experts.gate_up_proj (gate and up halves split separately), linear_attn.in_proj_qkv and
        conv1d.weight (q, k and v segments split separately), in_proj_z, in_proj_b, in_proj_a,
        A_log, dt_bias
    row parallel (input columns split): self_attn.o_proj, mlp.down_proj, shared_expert.down_proj,
        experts.down_proj, linear_attn.out_proj
    replicated: embeddings, lm_head, all norms, router gate, shared_expert_gate, mtp.fc
    o_proj.bias (attention_bias checkpoints): rank 0 holds it, the others zeros (it is summed)
"""

from __future__ import annotations

import json
import logging
import os
import re
from contextlib import ExitStack
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from bole.config import SUPPORTED_MODEL_TYPES, ModelConfig
from bole.models.qwen3_5 import HybridForCausalLM
from bole.parallel import head_range

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_SKIP_PREFIXES = ("model.visual.", "visual.")
_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_QKVZ_RE = re.compile(r"^(.*\.linear_attn)\.in_proj_qkvz\.weight$")
_BA_RE = re.compile(r"^(.*\.linear_attn)\.in_proj_ba\.weight$")
_MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


# ---------------------------------------------------------------------------------------- config
# The text model's fields that fix its tensor shapes. transformers fills an absent one with its class default
# (a 9B-class shape), which either disagrees with the weights deep inside the load or, worse, happens to match
# them, so config.json must state them (every released Qwen3.5 / Qwen3-Next config does).
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim")
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
_MULTIMODAL_TYPES = ("qwen3_5", "qwen3_5_moe")  # their text model's fields live in text_config


def read_config(path: str):
    """(transformers config, ModelConfig) of a checkpoint folder; a missing, malformed or unsupported
    ``config.json``, or one without a field the model's shapes need (``SHAPE_FIELDS``, the layer types, the
    MLP's sizes), raises ``ValueError`` naming the file and the field."""
    if not os.path.isdir(path):
        raise ValueError(f"{path}: no such model folder")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"{path}: no config.json")
    try:
        with open(cfg_file) as fh:
            raw = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{path}: unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    text, where = raw, ""
    if model_type in _MULTIMODAL_TYPES:
        text, where = raw.get("text_config"), "text_config."
        if not isinstance(text, dict):
            raise ValueError(f"{cfg_file}: model_type {model_type!r} keeps the text model's fields in a "
                             "'text_config' object, and there is none (transformers would build a default one)")
    _require(cfg_file, text, where, SHAPE_FIELDS)
    if "layer_types" not in text and "full_attention_interval" not in text:
        raise ValueError(f"{cfg_file}: {where}layer_types is missing (and no full_attention_interval): which "
                         "layers are linear_attention and which full_attention fixes the checkpoint's tensors")
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(path)
        cfg = ModelConfig.from_hf(hf)
    except Exception as e:  # noqa: BLE001 - transformers' strict config classes raise their own types
        # a field of the wrong type or a missing one surfaces deep inside transformers or from_hf
        detail = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"{cfg_file}: {detail}") from None
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        _require(cfg_file, text, where, ("intermediate_size",))
    if cfg.num_experts:  # a MoE model type (an absent num_experts is its class default, not 0)
        _require(cfg_file, text, where, MOE_FIELDS)
    return hf, cfg


def _require(cfg_file: str, fields: dict, where: str, names: tuple[str, ...]) -> None:
    missing = [f"{where}{n}" for n in names if fields.get(n) is None]
    if missing:
        one = len(missing) == 1
        raise ValueError(f"{cfg_file}: {', '.join(missing)} {'is' if one else 'are'} missing; the checkpoint's tensor "
                         f"shapes depend on {'it' if one else 'them'} (transformers would fill in its class default)")


def _exact(rows: int, per: int) -> int | None:
    return rows // per if rows > 0 and rows % per == 0 else None


def check_config_shapes(cfg_file: str, cfg: ModelConfig, names, shape_of: Callable[[str], tuple | None]) -> None:
    """ValueError naming ``cfg_file`` and the field when a field of ``cfg`` disagrees with the checkpoint's
    tensors: ``names`` (model naming) and ``shape_of`` (a name -> its shape, None when absent; the
    missing-tensor check names those). Run before the model is allocated, so a wrong config fails at once,
    not after materialising a model of the wrong size."""
    def check(field: str, value, tensor: str, derive: Callable[[tuple], int | None]) -> None:
        # derive: the field's value that shape implies, None when none does (a malformed tensor, which the
        # shape check after the load names, not the config)
        shape = shape_of(tensor)
        implied = None if shape is None else derive(shape)
        if implied is not None and implied != value:
            raise ValueError(f"{cfg_file}: {field}={value!r} disagrees with the weights: {tensor} has shape "
                             f"{list(shape)}, which means {field}={implied!r}")

    check("vocab_size", cfg.vocab_size, "model.embed_tokens.weight", lambda s: s[0])
    check("hidden_size", cfg.hidden_size, "model.embed_tokens.weight", lambda s: s[-1])
    layers = 1 + max((int(m[1]) for n in names if (m := _LAYER_RE.match(n))), default=-1)
    if layers and layers != cfg.num_hidden_layers:
        raise ValueError(f"{cfg_file}: num_hidden_layers={cfg.num_hidden_layers} disagrees with the weights: "
                         f"they hold model.layers.0 to model.layers.{layers - 1}")
    for i, kind in enumerate(cfg.layer_types):
        have = [k for k, part in (("linear_attention", "linear_attn"), ("full_attention", "self_attn"))
                if shape_of(f"model.layers.{i}.{part}.{'norm' if part == 'linear_attn' else 'q_norm'}.weight")]
        if have and have != [kind]:
            raise ValueError(f"{cfg_file}: layer_types[{i}]={kind!r} disagrees with the weights: model.layers.{i} "
                             f"holds a {have[0]} layer's tensors")
    if not cfg.tie_word_embeddings and "lm_head.weight" not in names and "model.embed_tokens.weight" in names:
        raise ValueError(f"{cfg_file}: tie_word_embeddings is false (or absent) but the weights have no "
                         "lm_head.weight; set it to true if the output head shares the input embedding")
    a = f"model.layers.{cfg.attn_layer_ids[0]}.self_attn"
    D = cfg.head_dim
    check("head_dim", D, f"{a}.q_norm.weight", lambda s: s[0])
    check("num_attention_heads", cfg.num_attention_heads, f"{a}.q_proj.weight", lambda s: _exact(s[0], 2 * D))
    check("num_key_value_heads", cfg.num_key_value_heads, f"{a}.k_proj.weight", lambda s: _exact(s[0], D))
    g = f"model.layers.{cfg.gdn_layer_ids[0]}.linear_attn"
    check("linear_num_value_heads", cfg.linear_num_value_heads, f"{g}.A_log", lambda s: s[0])
    check("linear_value_head_dim", cfg.linear_value_head_dim, f"{g}.norm.weight", lambda s: s[0])
    check("linear_conv_kernel_dim", cfg.linear_conv_kernel_dim, f"{g}.conv1d.weight", lambda s: s[-1])
    # conv channels [q | k | v]: 2 * key heads * key dim + the value dim
    check("linear_num_key_heads * linear_key_head_dim", cfg.linear_key_dim, f"{g}.conv1d.weight",
          lambda s: _exact(s[0] - cfg.linear_value_dim, 2))
    rows, half = (lambda s: s[0]), (lambda s: _exact(s[1], 2))  # [I, H]; experts.gate_up_proj [E, 2I, H]
    for i in range(cfg.num_hidden_layers):
        m = f"model.layers.{i}.mlp"
        if not cfg.is_moe_layer(i):
            check("intermediate_size", cfg.intermediate_size, f"{m}.gate_proj.weight", rows)
            continue
        check("num_experts", cfg.num_experts, f"{m}.gate.weight", rows)
        check("moe_intermediate_size", cfg.moe_intermediate_size, f"{m}.experts.0.gate_proj.weight", rows)
        check("moe_intermediate_size", cfg.moe_intermediate_size, f"{m}.experts.gate_up_proj", half)
        check("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size,
              f"{m}.shared_expert.gate_proj.weight", rows)


def resolve_dtype(dtype, cfg: ModelConfig) -> torch.dtype:
    if dtype in (None, "auto"):
        dtype = cfg.dtype
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).replace("torch.", "")
    table = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16, "float64": torch.float64}
    if name not in table:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(table)} or 'auto'")
    return table[name]


# ---------------------------------------------------------------------------------------- files
def checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index (sharded) or the files themselves."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
        missing = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(path, f))})
        if missing:
            raise ValueError(f"{path}: shards named in {INDEX_FILE} are missing: {missing}")
        return {name: os.path.join(path, f) for name, f in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        pickles = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth"))]
        hint = f" (found pickled {pickles}; refusing to unpickle)" if pickles else ""
        raise ValueError(f"{path}: no *.safetensors files{hint}")
    out = {}
    for f in files:
        full = os.path.join(path, f)
        with open_safetensors(full) as fh:
            for name in fh.keys():
                out[name] = full
    return out


def open_safetensors(file: str):
    """``safe_open`` that names the file when it is not a readable safetensors file (truncated,
    corrupt header, not safetensors at all)."""
    try:
        return safe_open(file, framework="pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None


def normalize_name(name: str) -> str | None:
    """Checkpoint name -> model name; None for tensors that are skipped (vision tower)."""
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    elif name.startswith("language_model.model."):
        name = "model." + name[len("language_model.model."):]
    elif name.startswith("language_model.lm_head."):
        name = name[len("language_model."):]
    if name.startswith(_SKIP_PREFIXES):
        return None
    return name


# ---------------------------------------------------------------------------------------- plan
class CheckpointReader:
    """A checkpoint's tensors by name (``files``: name -> safetensors file, ``checkpoint_files``), each
    file opened once, on first use; a context manager that closes them:

        with CheckpointReader(checkpoint_files(path)) as reader:
            t = reader.get("model.norm.weight")
    """

    def __init__(self, files: dict[str, str]):
        self.files, self._stack, self._handles = files, ExitStack(), {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._handles.clear()
        self._stack.close()

    def _handle(self, name: str):
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = self._stack.enter_context(open_safetensors(f))
        return self._handles[f]

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handle(name).get_tensor(name)
        except (SafetensorError, OSError) as e:  # a header that lies about the data (truncated file)
            raise ValueError(f"{self.files[name]}: tensor {name} cannot be read ({e})") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """``name``'s shape, from its file's header (no data read)."""
        return tuple(self._handle(name).get_slice(name).get_shape())


class MemoryReader(CheckpointReader):
    """``CheckpointReader`` over tensors held in memory (name -> tensor, checkpoint naming)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__(dict.fromkeys(tensors, "(in memory)"))
        self.tensors = tensors

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)


def _split_qkvz(t: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    HK, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    rep = cfg.linear_num_value_heads // HK
    per = 2 * dk + 2 * rep * dv
    if t.dim() != 2 or t.shape[0] != HK * per:
        raise ValueError(f"in_proj_qkvz has shape {tuple(t.shape)}, expected [{HK * per}, H]")
    q, k, v, z = t.view(HK, per, -1).split([dk, dk, rep * dv, rep * dv], dim=1)
    H = t.shape[1]
    return {"in_proj_qkv.weight": torch.cat([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)]),
            "in_proj_z.weight": z.reshape(-1, H)}


def _split_ba(t: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    HK = cfg.linear_num_key_heads
    rep = cfg.linear_num_value_heads // HK
    if t.dim() != 2 or t.shape[0] != 2 * HK * rep:
        raise ValueError(f"in_proj_ba has shape {tuple(t.shape)}, expected [{2 * HK * rep}, H]")
    b, a = t.view(HK, 2 * rep, -1).split([rep, rep], dim=1)
    return {"in_proj_b.weight": b.reshape(-1, t.shape[1]), "in_proj_a.weight": a.reshape(-1, t.shape[1])}


def build_plan(names: list[str], cfg: ModelConfig
               ) -> tuple[dict[str, Callable], dict[str, list[str]], list[str]]:
    """Map model parameter names to producers of their full (unsliced) tensors.

    Returns (producers: target -> fn(reader) -> tensor, sources: target -> checkpoint names,
    skipped checkpoint names).
    """
    producers: dict[str, Callable] = {}
    sources: dict[str, list[str]] = {}
    experts: dict[str, dict[str, dict[int, str]]] = {}
    skipped = []
    for raw in names:
        name = normalize_name(raw)
        if name is None:
            skipped.append(raw)
            continue
        if m := _QKVZ_RE.match(name):
            for part in ("in_proj_qkv.weight", "in_proj_z.weight"):
                target = f"{m[1]}.{part}"
                producers[target] = lambda r, raw=raw, part=part: _split_qkvz(r.get(raw), cfg)[part]
                sources[target] = [raw]
        elif m := _BA_RE.match(name):
            for part in ("in_proj_b.weight", "in_proj_a.weight"):
                target = f"{m[1]}.{part}"
                producers[target] = lambda r, raw=raw, part=part: _split_ba(r.get(raw), cfg)[part]
                sources[target] = [raw]
        elif m := _EXPERT_RE.match(name):
            experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = raw
        else:
            producers[name] = lambda r, raw=raw: r.get(raw)
            sources[name] = [raw]
    for prefix, kinds in experts.items():
        def stacked(kind_list, kinds=kinds):
            return lambda r: torch.stack([torch.cat([r.get(kinds[k][e]) for k in kind_list])
                                          for e in range(cfg.num_experts)])
        gate_up = f"{prefix}.gate_up_proj"
        producers[gate_up] = stacked(["gate_proj", "up_proj"])
        producers[f"{prefix}.down_proj"] = stacked(["down_proj"])
        for kind in ("gate_proj", "up_proj", "down_proj"):
            target = gate_up if kind != "down_proj" else f"{prefix}.down_proj"
            sources.setdefault(target, []).extend(kinds.get(kind, {}).values())
    return producers, sources, skipped


def _expert_gaps(sources: dict[str, list[str]], cfg: ModelConfig) -> list[str]:
    """Checkpoint names of per-expert tensors absent from an otherwise per-expert checkpoint."""
    gaps = []
    for target, srcs in sources.items():
        if not target.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        if len(srcs) == 1 and _EXPERT_RE.match(normalize_name(srcs[0]) or "") is None:
            continue  # a fused checkpoint tensor
        prefix = target.rsplit(".", 1)[0]
        kinds = ("gate_proj", "up_proj") if target.endswith("gate_up_proj") else ("down_proj",)
        have = {normalize_name(s) for s in srcs}
        gaps += [f"{prefix}.{e}.{k}.weight" for e in range(cfg.num_experts) for k in kinds
                 if f"{prefix}.{e}.{k}.weight" not in have]
    return gaps


# ---------------------------------------------------------------------------------------- TP
def _chunk(t: torch.Tensor, dim: int, rank: int, size: int, what: str) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ValueError(f"{what}: dim {dim} of size {t.shape[dim]} does not divide over tp_size={size}")
    return t.chunk(size, dim=dim)[rank]


def _heads(t: torch.Tensor, num_heads: int, rank: int, size: int, what: str) -> torch.Tensor:
    """Rows of rank's heads (``head_range``: split, or one replicated head) of [num_heads * d, ...]."""
    try:
        start, count = head_range(num_heads, size, rank)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    d = t.shape[0] // num_heads
    return t[start * d:(start + count) * d]


def tp_slice(name: str, t: torch.Tensor, cfg: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """The slice of full tensor ``name`` (model naming) that rank ``rank`` of ``size`` holds."""
    if size == 1:
        return t
    leaf = name.split(".")
    last2 = ".".join(leaf[-2:])
    if ".linear_attn." in name and (last2 in ("in_proj_qkv.weight", "conv1d.weight")):
        kd, vd = cfg.linear_key_dim, cfg.linear_value_dim
        q, k, v = t.split([kd, kd, vd], dim=0)
        HK = cfg.linear_num_key_heads
        return torch.cat([_heads(q, HK, rank, size, name), _heads(k, HK, rank, size, name),
                          _chunk(v, 0, rank, size, name)])
    if last2 in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"):
        return _heads(t, cfg.num_key_value_heads, rank, size, name)
    if ".linear_attn." in name and last2 in ("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"):
        return _chunk(t, 0, rank, size, name)
    if ".linear_attn." in name and leaf[-1] in ("A_log", "dt_bias"):
        return _chunk(t, 0, rank, size, name)
    if last2 in ("q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight"):
        return _chunk(t, 0, rank, size, name)
    if last2 in ("o_proj.weight", "out_proj.weight") or (last2 == "down_proj.weight"):
        return _chunk(t, 1, rank, size, name)
    if name.endswith("experts.gate_up_proj"):
        E, two_i, H = t.shape
        gate, up = t.view(E, 2, two_i // 2, H).unbind(1)
        return torch.cat([_chunk(gate, 1, rank, size, name), _chunk(up, 1, rank, size, name)], dim=1)
    if name.endswith("experts.down_proj"):
        return _chunk(t, 2, rank, size, name)
    if last2 == "o_proj.bias":  # added after the all-reduce sums the ranks: rank 0 carries it
        return t if rank == 0 else torch.zeros_like(t)
    return t  # replicated (norms, embeddings, lm_head, router, shared_expert_gate, mtp.fc)


# ---------------------------------------------------------------------------------------- load
def _listing(names, limit: int = 50) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_model(path: str, dtype="auto", device="cpu", tp_rank: int = 0, tp_size: int = 1,
               backend="auto", load_mtp: bool = True, tp_reduce: Callable | None = None,
               tensors: dict[str, torch.Tensor] | None = None) -> HybridForCausalLM:
    """Build the model for ``path`` and load its (rank's) weights (``tensors``: held in memory instead of
    ``path``'s safetensors files). See the module docstring."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} is not in [0, tp_size={tp_size})")
    _, cfg = read_config(path)
    dt = resolve_dtype(dtype, cfg)
    opened = CheckpointReader(checkpoint_files(path)) if tensors is None else MemoryReader(tensors)
    files = opened.files
    names = list(files)
    mtp_layers = sorted({int(m[1]) for n in names if (m := _MTP_LAYER_RE.match(normalize_name(n) or ""))})
    num_mtp = (max(mtp_layers) + 1) if (mtp_layers and load_mtp) else 0
    ignored = [n for n in names if not load_mtp and (normalize_name(n) or "").startswith("mtp.")]
    names = [n for n in names if n not in set(ignored)]
    by_model = {m: n for n in names if (m := normalize_name(n))}
    try:
        check_config_shapes(os.path.join(path, "config.json"), cfg, by_model,
                            lambda m: opened.shape(by_model[m]) if m in by_model else None)
    except ValueError:
        opened.close()
        raise
    producers, sources, skipped = build_plan(names, cfg)
    if cfg.tie_word_embeddings and "lm_head.weight" in producers:
        producers.pop("lm_head.weight")  # tied: the embedding is the head
        sources.pop("lm_head.weight")

    with torch.device("meta"):
        model = HybridForCausalLM(cfg, backend=backend, num_mtp_layers=num_mtp, tp_size=tp_size,
                                  tp_reduce=tp_reduce, device=device)
    params = dict(model.named_parameters())  # tied lm_head appears once, under the embedding
    expected = set(params)
    missing = sorted(expected - set(producers)) + _expert_gaps(sources, cfg)
    unexpected = sorted(s for t in set(producers) - expected for s in sources[t])
    if missing or unexpected:
        msg = [f"{path}: checkpoint does not match the {cfg.model_type} model"]
        if missing:
            msg.append(f"missing tensors ({len(missing)}): {_listing(missing)}")
        if unexpected:
            msg.append(f"unexpected tensors ({len(unexpected)}): {_listing(unexpected)}")
        raise ValueError("; ".join(msg))
    if skipped:
        logger.info("skipped %d vision-tower tensors", len(skipped))

    model = model.to(dtype=dt).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty materialises tied parameters separately: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters())
    mismatches, p, t = [], None, None
    with opened as reader, torch.no_grad():
        for name, produce in producers.items():
            t = tp_slice(name, produce(reader), cfg, tp_rank, tp_size)
            p = params[name]
            if tuple(t.shape) != tuple(p.shape):
                src = ", ".join(sources[name][:2]) + (", ..." if len(sources[name]) > 2 else "")
                mismatches.append(f"{name} (from {src}): checkpoint {tuple(t.shape)} "
                                  f"vs model {tuple(p.shape)}")
                continue
            p.copy_(t.to(dt))
            if p.is_floating_point() and not bool(torch.isfinite(p).all()):
                # a NaN / inf weight makes every logit NaN: argmax then emits token 0 forever
                srcs = sources[name]
                where = ", ".join(f"{s} in {files.get(s, path)}" for s in srcs[:2])
                cause = ("has NaN / inf values" if not bool(torch.isfinite(t).all()) else
                         f"overflows {dt} (finite in the checkpoint, inf after conversion)")
                raise ValueError(f"{path}: weight {name} ({where}) {cause}")
    if mismatches:
        raise ValueError(f"{path}: shape mismatches ({len(mismatches)}): " + "; ".join(mismatches))
    logger.info("loaded %s (%s, %d MTP layers, tp %d/%d) from %s", cfg.model_type, dt, num_mtp,
                tp_rank, tp_size, path)
    model.source_path = path  # the folder: files beside the weights (token_frequencies.json, bole.spec.draft_vocab)
    # fuse_projections concatenates each group and frees its originals: nothing here may still hold them, or
    # the fused copies double those weights for a moment (a 27B-shape checkpoint then overflows an 80 GB GPU)
    del params, p, t
    return model.eval().fuse_projections()
