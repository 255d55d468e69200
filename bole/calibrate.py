"""Offline calibration sweep (Algorithm 3, eq. 12) and live recalibration of a running engine.

    python -m bole.calibrate --model models/bole-tiny-coder --out calibration_tables/cpu-bole-tiny-coder.yaml
    python -m bole.calibrate --shapes qwen3.5-9b --quick            # random weights, GPU only
    python -m bole.calibrate --modeled a100 --shapes qwen3.5-9b --fit h200.yaml --compare h200.yaml

A table is measured (``sweep``: the forwards timed by ``bole.calibrate_sweep``, the table built by
``bole.calibrate_table``) or modeled (``modeled_table``: the roofline of ``bole.calibrate_model``).
Recalibration of a running engine (re-sweep, validation, swap) is ``bole.recalibration``.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from dataclasses import replace

import torch

from bole.calibrate_model import RooflineAssumptions, fit_overheads, model_error, model_point
from bole.calibrate_sweep import QUICK_PLAN, SHAPES, SweepPlan, measure, random_model, shapes_config
from bole.calibrate_table import build_table, measured_header, plot_table, versions, write_table
from bole.config import ModelConfig
from bole.hardware import SPECS, TABLE_DIR, model_signature
from bole.spec.budget import CalibrationTable

logger = logging.getLogger(__name__)


def sweep(model, plan: SweepPlan, device, dtype: torch.dtype, model_name: str, weights: str = "checkpoint",
          hardware: str | None = None, progress: bool = True, cuda_graphs: bool = False) -> CalibrationTable:
    """A measured table: the sweep's timings (eager, or graphed as the engine serves with graphs)."""
    records = measure(model, plan, device, dtype, progress, cuda_graphs)
    header = measured_header(model, device, dtype, model_name, plan, weights, hardware, cuda_graphs)
    return build_table(plan, records, header)


def modeled_table(cfg: ModelConfig, hardware: str, plan: SweepPlan, model_name: str,
                  assumptions: RooflineAssumptions | None = None, dtype: str = "bfloat16",
                  compare: CalibrationTable | None = None) -> CalibrationTable:
    """A ``source: modeled`` table from the roofline model with ``hardware``'s datasheet figures."""
    assumptions = assumptions or RooflineAssumptions()
    hw = SPECS[hardware]
    wb = 4 if dtype == "float32" else 2
    records = []
    for B, kv, d in plan.points():
        t_dec, t_ver = model_point(cfg, hw, assumptions, B, kv, d, plan.capture_set, wb)
        records.append({"at": [B, kv, d], "dec": [t_dec], "ver": {n: [t] for n, t in t_ver.items()}})
    header = {
        "hardware": hardware, "model": model_name, "dtype": dtype, "tp_size": 1, "versions": versions(),
        "date": datetime.date.today().isoformat(), "source": "modeled",
        "notes": f"roofline model (bole.calibrate_model) with {hardware} datasheet figures; not measured",
        "provenance": {"model_signature": model_signature(cfg),
                       "method": "roofline (bole/calibrate_model.py)",
                       "formula": "sum over {linear, attention, gdn} of max(flops / (peak * "
                                  "compute_efficiency), bytes / (bandwidth * memory_efficiency)) + fixed + "
                                  "per_layer * layers + per_request_attn * batch * attn_layers + "
                                  "per_node * verified nodes",
                       "hardware_figures": {"bf16_tflops": hw.bf16_tflops, "bandwidth_tbs": hw.bandwidth_tbs},
                       "assumptions": assumptions.to_dict(),
                       "bucket_point": "each bucket modeled at its upper edges (batch, kv, depth)",
                       "command": " ".join(["python -m bole.calibrate"] + sys.argv[1:]) if sys.argv else ""},
    }
    table = build_table(plan, records, header, keep_samples=False)
    if compare is not None:
        err = model_error(cfg, compare, assumptions, wb)
        if assumptions.fitted_on:
            prior = RooflineAssumptions(state_bytes=assumptions.state_bytes)
            err["a_priori"] = model_error(cfg, compare, prior, wb)
        table = replace(table, model_error=err)
    else:
        note = ("unknown: no measured table was given (--compare); scripts/run_gpu_calibrate.sh "
                "reports it against an H200 measurement")
        table = replace(table, provenance={**table.provenance, "model_error": note})
    return table


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.replace(",", " ").split())


def main(argv=None) -> CalibrationTable:
    ap = argparse.ArgumentParser(prog="python -m bole.calibrate", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint folder (HF format)")
    src.add_argument("--shapes", choices=sorted(SHAPES), help="random-weight model of these shapes (GPU only "
                     "when measuring)")
    ap.add_argument("--out", help="YAML path (default calibration_tables/<hardware>-<model>.yaml)")
    ap.add_argument("--png", help="plot path (default: --out with .png); 'none' to skip")
    ap.add_argument("--model-name", help="model id in the table (default: folder name or shapes name)")
    ap.add_argument("--quick", action="store_true", help=f"quick plan: batch {QUICK_PLAN.batch_points}, kv "
                    f"{QUICK_PLAN.kv_points}, G {QUICK_PLAN.capture_set}, {QUICK_PLAN.iters} iters")
    d = SweepPlan()
    ap.add_argument("--epsilon", type=float, default=d.epsilon)
    ap.add_argument("--batch-buckets", type=_ints, help=f"batch points (default {d.batch_points})")
    ap.add_argument("--kv-buckets", type=_ints, help=f"KV-length points (default {d.kv_points})")
    ap.add_argument("--depths", type=_ints, help=f"tree depths with the root (default {d.depth_points})")
    ap.add_argument("--capture-set", type=_ints, help=f"capacities G (default {d.capture_set})")
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--iters", type=int)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", help="float32 | bfloat16 | float16 (default bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--hardware", help="hardware class to record (default: detected)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    ap.add_argument("--modeled", choices=sorted(k for k, v in SPECS.items() if v.gpu),
                    help="write a roofline-modeled table for this class instead of measuring")
    ap.add_argument("--fit", help="measured table to fit the model's overhead terms on (--modeled)")
    ap.add_argument("--compare", help="measured table to report the model's error against (--modeled)")
    ap.add_argument("--cuda-graphs", action="store_true", help="time decode and verify replayed from CUDA graphs, "
                    "as the engine serves them with enable_cuda_graphs (default: eager; needs --device cuda)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)

    base = QUICK_PLAN if args.quick else d
    over = {k: v for k, v in (("batch_points", args.batch_buckets), ("kv_points", args.kv_buckets),
                              ("depth_points", args.depths), ("capture_set", args.capture_set),
                              ("warmup", args.warmup), ("iters", args.iters)) if v is not None}
    plan = replace(base, epsilon=args.epsilon, **over)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") or args.modeled else "float32")
    if args.model:
        from bole.llm import resolve_repo_path
        from bole.models.loader import read_config

        path = resolve_repo_path(args.model)
        name = args.model_name or os.path.basename(os.path.normpath(path))
        cfg = read_config(path)[1]
    else:
        name, cfg = args.model_name or args.shapes, shapes_config(args.shapes)

    if args.cuda_graphs and (args.modeled or not args.device.startswith("cuda")):
        raise SystemExit("--cuda-graphs measures captured graphs: it needs --device cuda and no --modeled")
    if args.modeled:
        a = RooflineAssumptions()
        if args.fit:
            a = fit_overheads(cfg, CalibrationTable.load(args.fit), a)
        compare = CalibrationTable.load(args.compare) if args.compare else None
        table = modeled_table(cfg, args.modeled, plan, name, a, dtype, compare)
    else:
        tdtype = getattr(torch, dtype)
        if args.model:
            from bole.models.loader import load_model

            model, weights = load_model(path, dtype=dtype, device=args.device), "checkpoint"
        else:
            if not args.device.startswith("cuda"):
                raise SystemExit(f"--shapes {args.shapes} measures a full-size model: it needs --device cuda")
            model, weights = random_model(cfg, tdtype, args.device, plan.seed), "random"
        table = sweep(model, plan, args.device, tdtype, name, weights, args.hardware, not args.no_progress,
                      args.cuda_graphs)

    out = args.out or os.path.join(TABLE_DIR, f"{table.hardware}-{name}.yaml")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_table(table, out)
    png = args.png or os.path.splitext(out)[0] + ".png"
    if png != "none" and plot_table(table, png):
        logger.info("plot: %s", png)
    rows = [f"  batch {b.batch} kv {b.kv} depth {b.depth}: T_dec {b.t_dec_ms:.3f} ms  B_ver {b.b_ver}"
            for b in table.buckets]
    print(f"{table.table_id} ({table.source}) -> {out}\n" + "\n".join(rows))
    if table.model_error:
        print("model_error:", dict(table.model_error))
    return table


if __name__ == "__main__":
    main()
