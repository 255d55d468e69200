"""Calibration tables from a sweep's raw records: eq. 12 per bucket, the measured header, YAML, plot.

B_ver(c) follows by eq. 12 on the running maximum over N of the medians (a longer forest never
costs less; the raw medians stay in ``provenance.raw``).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import logging
import platform
import sys
from statistics import median

import torch

from bole.calibrate_sweep import SweepPlan, graph_widths
from bole.hardware import detect_hardware, device_name, model_signature
from bole.spec.budget import CalibrationTable, select_b_ver

logger = logging.getLogger(__name__)


def _r(x: float) -> float:
    return float(round(x, 4))


def build_table(plan: SweepPlan, records: list[dict], header: dict,
                keep_samples: bool = True) -> CalibrationTable:
    """Eq. 12 per bucket from raw records ({"at", "dec": [ms], "ver": {N: [ms]}}); validated."""
    buckets, raw = [], []
    for rec in records:
        B, kv, d = rec["at"]
        t_dec = median(rec["dec"])
        raw_ver = {n: median(s) for n, s in sorted(rec["ver"].items())}
        env, run, worst = {}, 0.0, 0.0
        for n, t in raw_ver.items():
            run = max(run, t)
            env[n] = _r(run)
            worst = max(worst, (run - t) / run)
        t_dec = _r(t_dec)
        buckets.append({**plan.ranges(B, kv, d), "b_ver": select_b_ver(env, t_dec, plan.epsilon),
                        "t_dec_ms": t_dec, "t_ver_ms": env})
        entry = {"at": [B, kv, d], "t_dec_ms": t_dec, "t_ver_ms": {n: _r(t) for n, t in raw_ver.items()},
                 "monotone_fix_max_rel": _r(worst)}
        if keep_samples and len(rec["dec"]) > 1:
            entry["t_dec_samples_ms"] = [_r(t) for t in rec["dec"]]
            entry["t_ver_samples_ms"] = {n: [_r(t) for t in s] for n, s in sorted(rec["ver"].items())}
        raw.append(entry)
    data = dict(header)
    data.update(epsilon=plan.epsilon, capture_set=list(plan.capture_set), buckets=buckets)
    data["provenance"] = {**header.get("provenance", {}), "raw": raw}
    return CalibrationTable.from_dict(data)


def write_table(table: CalibrationTable, path: str) -> None:
    """YAML with a short header comment; leaves in flow style so a bucket reads as one block."""
    import yaml

    CalibrationTable.from_dict(table.to_dict())  # what is written must load
    head = (f"# {table.table_id}: {table.source} verification budgets (eq. 12, epsilon {table.epsilon}).\n"
            "# Written by `python -m bole.calibrate`; how it was obtained is under `provenance`.\n")
    with open(path, "w") as f:
        f.write(head)
        yaml.safe_dump(table.to_dict(), f, sort_keys=False, default_flow_style=None, width=110)


def versions() -> dict:
    try:
        ours = importlib.metadata.version("bole")
    except importlib.metadata.PackageNotFoundError:   # run from a checkout that was not installed
        ours = "unknown"
    out = {"bole": ours, "torch": torch.__version__,
           "python": platform.python_version()}
    for mod in ("triton", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # an optional package that is absent or broken is simply not listed
            pass
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    return out


EAGER = ("eager: runner.decode / runner.verify called directly, without CUDA graphs; with "
         "enable_cuda_graphs the engine on a GPU replays captured graphs for decode (ar), draft and verify, "
         "which `python -m bole.calibrate --cuda-graphs` measures")


def execution(device: torch.device, cuda_graphs: bool, plan: SweepPlan) -> str:
    """``provenance.execution``: how the sweep ran the forwards it timed."""
    if not cuda_graphs:
        return EAGER
    how = ("replayed from CUDA graphs captured during warm-up" if device.type == "cuda"
           else "the graphs' static forwards run uncaptured (CUDA graphs are GPU-only)")
    return (f"cuda graphs: runner.decode / runner.verify through the runner's DecodeGraphs / VerifyGraphs, as "
            f"the engine with enable_cuda_graphs: batch sizes {list(plan.batch_points)}, trees padded to widths "
            f"{graph_widths(plan)}, KV-length buckets; {how}")


def measured_header(model, device, dtype: torch.dtype, model_name: str, plan: SweepPlan, weights: str,
                    hardware: str | None = None, cuda_graphs: bool = False) -> dict:
    dev = torch.device(device)
    return {
        "hardware": hardware or detect_hardware(dev), "model": model_name,
        "dtype": str(dtype).replace("torch.", ""), "tp_size": getattr(model, "tp_size", 1), "versions": versions(),
        "date": datetime.date.today().isoformat(), "source": "measured",
        "notes": f"measured by bole.calibrate on {device_name(dev)}",
        "provenance": {
            "device_name": device_name(dev), "model_signature": model_signature(model.config),
            "weights": weights, "gdn_backend": model.backend.name,
            "execution": execution(dev, cuda_graphs, plan),
            "timing": {"method": "cuda events after synchronize" if dev.type == "cuda" else "perf_counter",
                       "warmup": plan.warmup, "iters": plan.iters, "statistic": "median",
                       "order": "interleaved rounds over decode and every N",
                       "cpu_threads": torch.get_num_threads()},
            "cache_fill": "blocks and state slots filled directly with random values; no prefill",
            "trees": "N drafts split evenly over B requests, random_tree shapes of depth <= d-1 under "
                     "each request's root: forest of N + B nodes",
            "bucket_point": "each bucket measured at its upper edges (batch, kv, depth)",
            "monotone": "t_ver_ms = running max over N of the raw medians (raw.t_ver_ms)",
            "command": " ".join(["python -m bole.calibrate"] + sys.argv[1:]) if sys.argv else "",
        },
    }


def plot_table(table: CalibrationTable, path: str) -> bool:
    """T_ver(N)/T_dec curves per bucket with the (1+ε) bound and B_ver marked; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot")
        return False
    kvs = sorted({b.kv for b in table.buckets})
    fig, axes = plt.subplots(1, len(kvs), figsize=(5 * len(kvs), 4), squeeze=False, sharey=True)
    for ax, kv in zip(axes[0], kvs, strict=True):
        for b in (b for b in table.buckets if b.kv == kv):
            ns = sorted(b.t_ver_ms)
            line, = ax.plot(ns, [b.t_ver_ms[n] / b.t_dec_ms for n in ns], marker=".",
                            label=f"batch {b.batch[0]}-{b.batch[1]}, depth {b.depth[1]}")
            ax.plot([b.b_ver], [b.t_ver_ms[b.b_ver] / b.t_dec_ms], marker="*", markersize=14,
                    color=line.get_color())
        ax.axhline(1 + table.epsilon, color="k", linestyle="--", linewidth=1,
                   label=f"1 + ε = {1 + table.epsilon}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("capacity N (draft nodes in the batch)")
        ax.set_title(f"kv {kv[0]}-{kv[1]}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("T_ver(N) / T_dec   (★ = B_ver)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"{table.table_id} ({table.source})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
