"""Draft acceptance and throughput of a checkpoint's MTP head on the held-out prompts (issue 6 / 9c).

Runs the same prompts through the engine in `ar` mode and in `bole` mode with chain drafts
(top-k 1, beam 1) and tree drafts, greedy, and reports per configuration: MAT (mean tokens emitted
per request-step: accepted drafts + 1), tokens/s, and for the depth-1 chain the MTP's top-1
acceptance (MAT − 1). Every speculative run's tokens must equal the `ar` run's (exactness is
checked, not assumed). The verification budget is lifted to ``--max-nodes`` per request so MAT
measures the drafter, not the calibration table.

    python benchmarks/acceptance.py --model models/bole-tiny-coder --out benchmarks/results/acceptance.json
    python benchmarks/acceptance.py --random-tiny --num-prompts 4 --max-tokens 16   # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (name, depth, topk, beam): chains isolate the MTP's own accuracy, trees are what Bole verifies
CONFIGS = [("chain-d1", 1, 1, 1), ("chain-d4", 4, 1, 1), ("chain-d8", 8, 1, 1),
           ("tree-d4-k4", 4, 4, 4), ("tree-d8-k4", 8, 4, 4)]


def lifted_table(max_nodes: int, max_batch: int):
    """A one-bucket-per-batch table whose budget is ``max_nodes`` per request (source: default)."""
    from bole.spec.budget import CalibrationTable

    caps = sorted({max_nodes * b for b in range(1, max_batch + 1)})
    return CalibrationTable.from_dict(dict(
        hardware="any", model="any", dtype="any", tp_size=1, versions={}, date="2026-11-29", epsilon=0.1,
        source="default", capture_set=caps, notes=f"benchmark: {max_nodes} draft nodes per request",
        buckets=[dict(batch=[b, b if b < max_batch else 1 << 20], kv=[0, 1 << 30], depth=[1, 64],
                      b_ver=max_nodes * b, t_dec_ms=None, t_ver_ms=None) for b in range(1, max_batch + 1)]))


def random_tiny(tokenizer_dir: str) -> str:
    """A random 4-layer checkpoint with the embedded tokenizer's vocabulary (harness smoke runs)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from checkpoints import make_checkpoint
    from transformers import AutoTokenizer

    path = tempfile.mkdtemp(prefix="bole_acc_")
    make_checkpoint(path, "dense", len(AutoTokenizer.from_pretrained(tokenizer_dir)))
    for f in os.listdir(tokenizer_dir):
        if f.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tokenizer_dir, f), path)
    return path


def run(llm, prompts, sp):
    llm.engine.metrics.__init__()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    return [o.token_ids for o in outs], n / dt, llm.engine.metrics.snapshot()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "bole-tiny-coder"))
    ap.add_argument("--random-tiny", action="store_true")
    ap.add_argument("--prompts", default=os.path.join(ROOT, "benchmarks", "data", "heldout_prompts.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-nodes", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from bole import LLM, SamplingParams

    path = random_tiny(a.model) if a.random_tiny else a.model
    prompts = [json.loads(line)["prompt"] for line in open(a.prompts)][: a.num_prompts]
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    opts = dict(device=a.device, dtype=a.dtype, max_num_seqs=a.batch, num_blocks=4096)
    rows = []
    ar = LLM(path, mode="ar", **opts)
    ref, tps, _ = run(ar, prompts, sp)
    rows.append(dict(config="ar", depth=0, topk=0, beam=0, mat=1.0, tokens_per_s=round(tps, 1)))
    print(json.dumps(rows[-1]), flush=True)
    for name, depth, topk, beam in CONFIGS:
        llm = LLM(path, mode="bole", depth=depth, topk=topk, beam=beam, **opts)
        llm.engine.calibration = lifted_table(a.max_nodes, a.batch)
        toks, tps, m = run(llm, prompts, sp)
        if toks != ref:
            raise SystemExit(f"{name}: greedy tokens differ from ar: exactness broken")
        rows.append(dict(config=name, depth=depth, topk=topk, beam=beam, mat=round(m["mat"], 3),
                         tokens_per_s=round(tps, 1), mean_tree_nodes=round(m["mean_tree_nodes"], 1)))
        print(json.dumps(rows[-1]), flush=True)
    chain1 = next(r for r in rows if r["config"] == "chain-d1")
    result = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() and a.device != "cpu" else "cpu",
                  torch=torch.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  command=" ".join(sys.argv), model="random tiny (smoke)" if a.random_tiny else a.model,
                  num_prompts=len(prompts), max_tokens=a.max_tokens, batch=a.batch, max_nodes=a.max_nodes,
                  mtp_top1_acceptance=round(chain1["mat"] - 1.0, 4), rows=rows)
    if a.out:
        json.dump(result, open(a.out, "w"), indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
