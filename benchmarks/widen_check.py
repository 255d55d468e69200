"""Full-size check of a widened model (``bole.models.widen``): greedy output on held-out prompts equals
the embedded model's.

The embedded model (``--model``) is widened to a project shape (``bole.calibrate_sweep.SHAPES``) in
fp32, where the construction is exact up to summation order, and both are run greedily with the same
engine options on the same prompts; each prompt's tokens must be identical. With ``--bf16`` the widened
checkpoint is also run in bfloat16 beside the embedded model in bfloat16, and the agreement is recorded
(bf16 rounds the rescaled norm weights, ~1e-3 relative on the logits: near-ties may flip, which is
reported, not asserted).

    python benchmarks/widen_check.py --shape qwen3.5-9b --out benchmarks/results/widen_check_h200.json
    python benchmarks/widen_check.py --smoke --out /tmp/widen_check.json        # CPU, a small shape
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bole import LLM, SamplingParams  # noqa: E402
from bole.calibrate_sweep import SHAPES, shapes_config  # noqa: E402
from bole.models.widen import widen  # noqa: E402

SMOKE_SHAPE = dict(hidden_size=512, num_hidden_layers=20, linear_num_key_heads=4, linear_num_value_heads=8,
                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024,
                   vocab_size=16384)


def generate(path: str, prompts: list[str], max_tokens: int, **opts) -> tuple[list[list[int]], float, int]:
    """Greedy tokens of every prompt (one batch), the generate wall time and the weights' parameter count."""
    llm = LLM(path, **opts)
    params = sum(p.numel() for p in llm.engine.model.parameters())
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    tokens = [o.token_ids for o in llm.generate(prompts, sp)]
    wall = time.perf_counter() - t
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tokens, wall, params


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    first = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None if len(p) == len(q) else
                  min(len(p), len(q))) for p, q in zip(a, b)]
    return dict(identical=all(f is None for f in first), prompts_identical=sum(f is None for f in first),
                first_divergence=first)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "bole-tiny-coder"))
    ap.add_argument("--shape", default="qwen3.5-9b", choices=sorted(SHAPES))
    ap.add_argument("--widened", default=None, help="where the fp32 widened checkpoint goes (default /tmp/...)")
    ap.add_argument("--prompts", default=os.path.join(ROOT, "benchmarks", "data", "heldout_prompts.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mode", default="ar", help="engine mode of both runs")
    ap.add_argument("--bf16", action="store_true", help="also compare the two in bfloat16 (reported only)")
    ap.add_argument("--smoke", action="store_true", help="a small shape on the CPU (seconds)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    shape_name = "smoke" if args.smoke else args.shape
    if args.smoke:
        args.num_prompts, args.max_tokens = min(args.num_prompts, 2), min(args.max_tokens, 8)
    dst = args.widened or f"/tmp/bole-widened-{shape_name}-fp32"
    prompts = [json.loads(line)["prompt"] for line in open(args.prompts)][:args.num_prompts]
    t = time.perf_counter()
    SHAPES["smoke"] = SMOKE_SHAPE   # shapes_config reads the table; removed again right after
    try:
        shape = shapes_config(shape_name)
    finally:
        SHAPES.pop("smoke")
    report = widen(args.model, dst, shape, dtype="float32")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(args.model, name)):
            with open(os.path.join(args.model, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
                g.write(f.read())
    widen_s = time.perf_counter() - t
    opts = dict(mode=args.mode, device=device)
    rows = {}
    for dtype in ("float32",) + (("bfloat16",) if args.bf16 else ()):
        src_tok, src_wall, src_params = generate(args.model, prompts, args.max_tokens, dtype=dtype, **opts)
        dst_tok, dst_wall, dst_params = generate(dst, prompts, args.max_tokens, dtype=dtype, **opts)
        rows[dtype] = dict(compare(src_tok, dst_tok), embedded_params=src_params, widened_params=dst_params,
                           embedded_wall_s=src_wall, widened_wall_s=dst_wall)
        print(dtype, json.dumps({k: v for k, v in rows[dtype].items()}), flush=True)
    result = dict(
        benchmark="widen_check", date=datetime.date.today().isoformat(), device=device,
        gpu=torch.cuda.get_device_name() if device == "cuda" else None, torch=torch.__version__,
        command="python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv or sys.argv[1:])),
        label=f"{shape_name}-cost, embedded model's predictions", shape=shape_name,
        widened_config=dict(hidden_size=report.config.hidden_size, num_hidden_layers=report.config.num_hidden_layers,
                            vocab_size=report.config.vocab_size, copies=report.copies, eps=report.eps,
                            eps_bounds=report.eps_bounds),
        widen_s=widen_s, prompts=len(prompts), max_tokens=args.max_tokens, mode=args.mode, results=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if not rows["float32"]["identical"]:
        sys.exit(f"widened model's fp32 greedy output differs: {rows['float32']['first_divergence']}")


if __name__ == "__main__":
    main()
