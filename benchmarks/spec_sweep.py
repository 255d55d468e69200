"""Tokens/s of the speculative modes across drafting settings (depth, topk, beam), against ``ar`` in
the same run: which tree shape the embedded model's drafter pays for on this hardware.

Each point is ``benchmarks.engine_modes.run_mode`` (a fresh engine, graphs captured before timing,
greedy, the median of ``--repeats`` runs) on the held-out prompts: batch B runs prompts[:B]; with
``--prompts-per-point P`` (> B) the point runs P prompts B at a time and reports their total rate.

    python benchmarks/spec_sweep.py --configs 4,4,4 8,2,2 --batches 1 --out benchmarks/results/spec_sweep_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def parse_config(text: str) -> tuple[int, int, int]:
    try:
        d, k, b = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a config is depth,topk,beam (three ints), got {text!r}") from None
    return d, k, b


def run_point(path, mode, batch, prompts, per_point, max_tokens, cfg, repeats, opts):
    """run_mode over ``per_point`` prompts, ``batch`` at a time: total tokens / total time, mean MAT."""
    from benchmarks.engine_modes import run_mode

    rows, toks = [], []
    for i in range(0, per_point, batch):
        group = prompts[i:i + batch]
        row, out = run_mode(path, mode, len(group), group, max_tokens, *cfg, repeats=repeats, **opts)
        rows.append(row)
        toks += out
    n = sum(len(t) for t in toks)
    secs = sum(sum(len(t) for t in toks[j * batch:(j + 1) * batch]) / r["tokens_per_s"] for j, r in enumerate(rows))
    return dict(mode=mode, batch=batch, depth=cfg[0], topk=cfg[1], beam=cfg[2], prompts=per_point,
                tokens_per_s=round(n / secs, 1), mat=round(sum(r["mat"] for r in rows) / len(rows), 3),
                mat_per_group=[r["mat"] for r in rows], mean_tree_nodes=round(sum(r["mean_tree_nodes"] for r in rows)
                                                                              / len(rows), 1)), toks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO_ROOT / "models" / "bole-tiny-coder"))
    ap.add_argument("--prompts", default=str(REPO_ROOT / "benchmarks" / "data" / "heldout_prompts.jsonl"))
    ap.add_argument("--configs", type=parse_config, nargs="+", default=[(4, 4, 4), (8, 2, 2)])
    ap.add_argument("--modes", nargs="+", default=["bole", "serial_tree"], choices=["bole", "serial_tree"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--prompts-per-point", type=int, default=None, help="P prompts per point (default: B)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--calibration-table", default="calibration_tables/default.yaml")
    ap.add_argument("--budget-s", type=float, default=400.0, help="no new point starts after this")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    opts = dict(device="cuda" if cuda else "cpu", dtype=args.dtype, num_blocks=2048, enable_cuda_graphs=cuda,
                calibration_table=args.calibration_table)
    if not cuda:
        torch.set_num_threads(1)
    prompts = [json.loads(line)["prompt"] for line in open(args.prompts)]
    doc = dict(gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=" ".join(["python"] + sys.argv), calibration_table=args.calibration_table,
               dtype=args.dtype, max_tokens=args.max_tokens, rows=[])
    t_end = time.time() + args.budget_s
    for B in args.batches:
        P = max(B, args.prompts_per_point or B)
        ar, ref = run_point(args.model, "ar", B, prompts, P, args.max_tokens, (4, 4, 4), args.repeats, opts)
        ar.update(depth=None, topk=None, beam=None)
        doc["rows"].append(ar)
        print(json.dumps(ar), flush=True)
        for cfg in args.configs:
            for mode in args.modes:
                if time.time() > t_end:
                    print(f"budget spent: skipping {mode} {cfg} batch {B}", flush=True)
                    continue
                row, toks = run_point(args.model, mode, B, prompts, P, args.max_tokens, cfg, args.repeats, opts)
                row.update(exact_vs_ar=toks == ref, speedup_vs_ar=round(row["tokens_per_s"] / ar["tokens_per_s"], 3))
                doc["rows"].append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(doc, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
