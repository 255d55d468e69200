"""Hardware classes and the choice of a calibration table for (hardware, model).

A *hardware class* is a short name (``h200``, ``a100``, ``gb10``, ``cpu``, ...) that calibration
tables are keyed by. ``detect_hardware(device)`` maps ``torch.cuda.get_device_name`` to a class by
substring (most specific pattern first: "GH200" before "H200"); an unknown GPU becomes a slug of
its name (``gpu-rtx-pro-6000``) and CPU devices are ``cpu``.

Similarity order (``nearest_class``): verification budgets depend on how much arithmetic fits in
the time a decode step spends streaming weights, i.e. on memory bandwidth and on the ratio of peak
FLOP/s to bandwidth (the roofline ridge). The distance between two classes is
``|ln(bw_a / bw_b)| + |ln(ridge_a / ridge_b)|`` over the datasheet figures in ``HARDWARE``; an
unknown GPU (no datasheet) ranks known GPUs by ``UNKNOWN_GPU_ORDER``. CPU and GPU classes are never
each other's neighbours: a GPU table would over-budget a CPU by orders of magnitude.

Table choice (``resolve_calibration(spec, model_cfg, device, dtype)``): an explicit path loads that
file. ``"auto"`` scans ``calibration_tables/*.yaml`` for tables measured or modeled on the same
model *shapes* (``model_signature``: timings depend on shapes and dtype, not on weight values, so a
random-weight Qwen3.5-9B-shaped table serves the real checkpoint) and the detected class; failing
that, the nearest class's table with a logged warning; failing that, ``default.yaml`` (warning).
"""

from __future__ import annotations

import glob
import logging
import math
import os
import re
from dataclasses import dataclass

from bole.spec.budget import CalibrationTable

logger = logging.getLogger(__name__)

TABLE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "calibration_tables")
DEFAULT_TABLE = "default.yaml"


@dataclass(frozen=True)
class HardwareSpec:
    """Datasheet figures of one class (dense bf16 tensor-core peak, HBM/DRAM bandwidth)."""

    name: str
    patterns: tuple[str, ...]     # substrings of torch.cuda.get_device_name (upper-cased)
    bf16_tflops: float
    bandwidth_tbs: float
    gpu: bool = True

    @property
    def ridge(self) -> float:
        """FLOPs per byte at which the roofline turns compute bound."""
        return self.bf16_tflops / self.bandwidth_tbs


# Order matters for detection: the first spec with a matching pattern wins.
HARDWARE: tuple[HardwareSpec, ...] = (
    HardwareSpec("gh200", ("GH200",), 989.0, 4.0),
    HardwareSpec("gb200", ("GB200",), 2250.0, 8.0),
    HardwareSpec("gb10", ("GB10",), 256.0, 0.273),
    HardwareSpec("h200", ("H200",), 989.0, 4.8),
    HardwareSpec("h100", ("H100", "H800"), 989.0, 3.35),
    HardwareSpec("b200", ("B200",), 2250.0, 8.0),
    HardwareSpec("a100", ("A100", "A800"), 312.0, 2.04),
    HardwareSpec("l40s", ("L40S",), 362.0, 0.864),
    HardwareSpec("a10g", ("A10G",), 70.0, 0.6),
    HardwareSpec("l4", (" L4",), 121.0, 0.3),
    HardwareSpec("cpu", (), 1.0, 0.05, gpu=False),
)
SPECS = {h.name: h for h in HARDWARE}
UNKNOWN_GPU_ORDER = ("h100", "a100", "h200", "l40s", "gh200", "b200", "gb200", "a10g", "l4", "gb10")


def classify_device_name(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``; an unknown name -> ``"gpu-<slug>"``."""
    upper = " " + name.upper()
    for spec in HARDWARE:
        if any(p in upper for p in spec.patterns):
            return spec.name
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")
    return f"gpu-{slug or 'unknown'}"


def device_name(device="cuda") -> str:
    """Human-readable name of the device (``torch.cuda.get_device_name`` or the CPU model)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    import platform

    return platform.processor() or platform.machine() or "cpu"


def detect_hardware(device="cuda") -> str:
    """Hardware class of ``device`` ("cpu" for CPU devices or when CUDA is unavailable)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return "cpu"
    return classify_device_name(torch.cuda.get_device_name(dev))


def hardware_distance(a: str, b: str) -> float:
    """Distance of two known classes (see the module docstring); inf across CPU / GPU."""
    sa, sb = SPECS[a], SPECS[b]
    if sa.gpu != sb.gpu:
        return math.inf
    return abs(math.log(sa.bandwidth_tbs / sb.bandwidth_tbs)) + abs(math.log(sa.ridge / sb.ridge))


def nearest_class(name: str, known) -> str | None:
    """The class in ``known`` most similar to ``name`` (itself if present); None if none is comparable."""
    known = list(dict.fromkeys(known))
    if name in known:
        return name
    if name in SPECS:
        scored = [(hardware_distance(name, k), k) for k in known if k in SPECS]
        scored = [(d, k) for d, k in scored if d < math.inf]
        return min(scored)[1] if scored else None
    if name.startswith("gpu-"):
        for k in UNKNOWN_GPU_ORDER:
            if k in known:
                return k
    return None


def model_signature(cfg) -> str:
    """Shape id of a ``ModelConfig``: what verification timings depend on besides hardware/dtype."""
    mlp = (f"moe{cfg.num_experts}x{cfg.num_experts_per_tok}-{cfg.moe_intermediate_size}"
           f"+{cfg.shared_expert_intermediate_size}" if cfg.num_experts else f"ffn{cfg.intermediate_size}")
    return (f"h{cfg.hidden_size}-l{cfg.num_gdn_layers}g{cfg.num_attn_layers}a-"
            f"gdn{cfg.linear_num_key_heads}/{cfg.linear_num_value_heads}x"
            f"{cfg.linear_key_head_dim}/{cfg.linear_value_head_dim}-"
            f"attn{cfg.num_attention_heads}/{cfg.num_key_value_heads}x{cfg.head_dim}-{mlp}-v{cfg.vocab_size}")


def _is_auto(spec: str) -> bool:
    # build_engine joins relative paths onto the repository root, so "auto" may arrive as ROOT/auto
    return spec == "auto" or (os.path.basename(spec) == "auto" and not os.path.exists(spec))


def find_table(hardware: str, signature: str, dtype: str | None = None,
               directory: str | None = None) -> tuple[str | None, str]:
    """(path, how) of the best table in ``directory`` for (hardware, model signature), or (None, why).

    Among tables with the signature: the detected class, else its nearest class; within a class
    prefer the same dtype, then measured over modeled, then the latest date. Unreadable tables are
    skipped with a warning naming the problem.
    """
    directory = directory or TABLE_DIR
    candidates = []
    for path in sorted(glob.glob(os.path.join(directory, "*.yaml"))):
        if os.path.basename(path) == DEFAULT_TABLE:
            continue
        try:
            table = CalibrationTable.load(path)
        except (ValueError, OSError) as e:
            logger.warning("skipping calibration table %s: %s", path, e)
            continue
        if table.provenance.get("model_signature") == signature:
            candidates.append((path, table))
    if not candidates:
        return None, f"no table in {directory} for model shapes {signature}"
    chosen = nearest_class(hardware, [t.hardware for _, t in candidates])
    if chosen is None:
        return None, (f"no table for hardware {hardware!r} or a comparable class (have: "
                      f"{sorted({t.hardware for _, t in candidates})})")
    pool = [(p, t) for p, t in candidates if t.hardware == chosen]
    pool.sort(key=lambda pt: (pt[1].dtype == dtype, pt[1].source == "measured", pt[1].date), reverse=True)
    how = "exact" if chosen == hardware else f"nearest class {chosen!r} to {hardware!r}"
    return pool[0][0], how


def resolve_calibration(spec: str, model_cfg, device, dtype: str | None = None,
                        directory: str | None = None, hardware: str | None = None) -> CalibrationTable:
    """Load the table ``spec`` names: a path, or ``"auto"`` (see the module docstring). Logs the choice."""
    if not _is_auto(spec):
        table = CalibrationTable.load(spec)
        logger.info("calibration table %s from %s (%s)", table.table_id, spec, table.source)
        return table
    directory = directory or TABLE_DIR
    hardware = hardware or detect_hardware(device)
    signature = model_signature(model_cfg)
    path, how = find_table(hardware, signature, dtype, directory)
    if path is None:
        path = os.path.join(directory, DEFAULT_TABLE)
        logger.warning("calibration auto: %s; using the unmeasured defaults %s", how, path)
    elif how != "exact":
        logger.warning("calibration auto: no table measured on %r for this model; falling back to the "
                       "%s: %s", hardware, how, path)
    table = CalibrationTable.load(path)
    logger.info("calibration table %s from %s (%s, hardware %s)", table.table_id, path, table.source,
                hardware)
    return table


def table_execution(table: CalibrationTable) -> str | None:
    """"graphs" or "eager": how a measured table's sweep ran its forwards (``provenance.execution``);
    None where it is not recorded (modeled and default tables, older files)."""
    how = str(table.provenance.get("execution", ""))
    return "graphs" if how.startswith("cuda graphs") else "eager" if how.startswith("eager") else None


def table_mismatch(table: CalibrationTable, model_cfg, dtype: str, tp_size: int,
                   hardware: str | None, cuda_graphs: bool | None = None) -> dict[str, tuple]:
    """{field: (table's value, engine's value)} where ``table`` was not measured (or modeled) for how
    this engine runs: model shapes (``provenance.model_signature``), dtype, tp_size, hardware class,
    and (``cuda_graphs`` given) execution: a sweep of eager forwards against an engine replaying CUDA
    graphs, or the reverse. On the H200 the embedded model's graphed decode step is 21x faster than its
    eager one and T_ver / T_dec differs 2.5x (benchmarks/README.md, "Calibration in the serving mode"),
    so eq. 12 on one mode's timings does not describe the other.

    Budgets are timings: a table for other shapes, another dtype, another TP degree or another class
    of device over- or under-budgets every step. The unmeasured default table (``source: default``)
    stands for anything and is never a mismatch; fields a table leaves as ``any`` or unrecorded are
    not compared, nor is ``hardware`` when the engine's class is unknown.
    """
    if table.source == "default":
        return {}
    out: dict[str, tuple] = {}
    signature = table.provenance.get("model_signature")
    if signature and signature != model_signature(model_cfg):
        out["model"] = (f"{table.model} ({signature})", model_signature(model_cfg))
    if table.dtype != "any" and table.dtype != str(dtype):
        out["dtype"] = (table.dtype, str(dtype))
    if table.tp_size != tp_size:
        out["tp_size"] = (table.tp_size, tp_size)
    if hardware and hardware != "unknown" and table.hardware != "any" and table.hardware != hardware:
        out["hardware"] = (table.hardware, hardware)
    execution = table_execution(table)
    if cuda_graphs is not None and execution is not None and execution != ("graphs" if cuda_graphs else "eager"):
        out["execution"] = (execution, "graphs" if cuda_graphs else "eager")
    return out
