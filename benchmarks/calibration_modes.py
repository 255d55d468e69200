"""Eager- against graph-measured calibration tables, both served by the graphed engine.

Answers whether a table swept on eager forwards is right for an engine that replays CUDA graphs: the
two tables' T_dec, T_ver and B_ver per bucket side by side, then the embedded model in ``bole`` mode with
``enable_cuda_graphs`` on each table (batch 1 / 4 / 16, greedy, 128 tokens, median of 3 runs after 2
warm-ups; tokens compared). The tables come from, in the same device call:

    python -m bole.calibrate --model models/bole-tiny-coder --quick --dtype float32 --device cuda --out E.yaml
    python -m bole.calibrate --model models/bole-tiny-coder --quick --dtype float32 --device cuda \
        --cuda-graphs --out G.yaml
    python benchmarks/calibration_modes.py E.yaml G.yaml --out benchmarks/results/calibration_modes_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bole import LLM, SamplingParams  # noqa: E402
from bole.spec.budget import CalibrationTable  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("eager", help="table measured with eager forwards")
    ap.add_argument("graphed", help="table measured with --cuda-graphs")
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "bole-tiny-coder"))
    ap.add_argument("--prompts", default=os.path.join(ROOT, "benchmarks", "data", "heldout_prompts.jsonl"))
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    prompts = [json.loads(line)["prompt"] for line in open(args.prompts)][:max(args.batches)]
    tables = {"eager": args.eager, "graphed": args.graphed}
    doc = dict(benchmark="calibration_modes", date=datetime.date.today().isoformat(),
               gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               command="python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv or sys.argv[1:])),
               tables={}, runs=[])
    for name, path in tables.items():
        t = CalibrationTable.load(path)
        doc["tables"][name] = [dict(batch=list(b.batch), kv=list(b.kv), b_ver=b.b_ver, t_dec_ms=b.t_dec_ms,
                                    t_ver_ms=b.t_ver_ms) for b in t.buckets]
    tokens = {}
    for name, path in tables.items():
        llm = LLM(args.model, mode="bole", enable_cuda_graphs=True, device="cuda", calibration_table=path)
        sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        for batch in args.batches:
            for _ in range(2):
                llm.generate(prompts[:batch], sp)
            walls = []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                res = llm.generate(prompts[:batch], sp)
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
            n = sum(len(r.token_ids) for r in res)
            tokens[name, batch] = [r.token_ids for r in res]
            doc["runs"].append(dict(table=name, batch=batch, tokens_per_s=n / statistics.median(walls), walls=walls,
                                    same_tokens_as_eager_table=tokens[name, batch] == tokens["eager", batch]))
            print(json.dumps(doc["runs"][-1]), flush=True)
        del llm
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
