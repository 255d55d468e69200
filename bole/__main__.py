"""Command line: ``python -m bole generate --model PATH --prompt ... [--mode bole|ar|serial_tree]``.

A user's mistake (a bad option value, a model folder or file that is missing or malformed: the library's
``ValueError`` naming it, or an ``OSError``) prints one line ``error: <message>`` and exits with status 2, as
argparse does for a bad flag; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bole.config import ENGINE_MODES, CacheConfig, EngineConfig, SpecConfig
from bole.spec.budget import BUDGET_FLOORS, BUDGET_RULES


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bole")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate completions for prompts")
    g.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    g.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    g.add_argument("--mode", choices=ENGINE_MODES, default=EngineConfig.mode)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default=EngineConfig.device)
    g.add_argument("--dtype", default=EngineConfig.dtype)
    g.add_argument("--depth", type=int, default=SpecConfig.depth)
    g.add_argument("--topk", type=int, default=SpecConfig.topk)
    g.add_argument("--beam", type=int, default=SpecConfig.beam)
    g.add_argument("--draft-vocab", type=int, default=SpecConfig.draft_vocab,
                   help="the drafter scores only the N most frequent tokens (token_frequencies.json)")
    g.add_argument("--budget-epsilon", type=float, default=SpecConfig.budget_epsilon,
                   help="eq. 12's ε: B_ver re-derived from the calibration table's timings (None: as written)")
    g.add_argument("--cap-tree-width", action=argparse.BooleanOptionalAction, default=SpecConfig.cap_tree_width,
                   help="cap every request's tree at the width the calibration timed B_ver at (--no-...: the paper's)")
    g.add_argument("--budget-floor", default=SpecConfig.budget_floor, choices=BUDGET_FLOORS,
                   help="the budget's fairness floor: the best first-level draft, or every one (children: the paper's)")
    g.add_argument("--budget-rule", default=SpecConfig.budget_rule, choices=BUDGET_RULES,
                   help="B_ver: the table's bucket value (epsilon, eq. 12) or chosen each step from the bucket's "
                        "timed curve and the drafts' confidence (goodput); auto: goodput for a routed-expert "
                        "model whose table has timings, else epsilon")
    g.add_argument("--num-blocks", type=int, default=CacheConfig.num_blocks)
    g.add_argument("--gpu-memory-utilization", type=float, default=CacheConfig.gpu_memory_utilization)
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt and the metrics")
    a = p.parse_args(argv)
    try:
        return generate(a)
    except (ValueError, OSError) as e:
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"error: {message or type(e).__name__}", file=sys.stderr)
        return 2


def generate(a: argparse.Namespace) -> int:
    from bole import LLM, SamplingParams

    # every option is checked before the model loads
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                            seed=a.seed)
    options = dict(mode=a.mode, device=a.device, dtype=a.dtype, depth=a.depth, topk=a.topk, beam=a.beam,
                   draft_vocab=a.draft_vocab, budget_epsilon=a.budget_epsilon, cap_tree_width=a.cap_tree_width,
                   budget_floor=a.budget_floor, budget_rule=a.budget_rule,
                   num_blocks=a.num_blocks, gpu_memory_utilization=a.gpu_memory_utilization)
    llm = LLM(a.model, **options)   # build_engine checks the options before the weights load
    t0 = time.perf_counter()
    outs = llm.generate(a.prompt, params, use_tqdm=True)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    m = llm.engine.metrics.snapshot()
    for o in outs:
        if a.json:
            print(json.dumps({"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}))
        else:
            print(o.text)
    summary = {"mode": a.mode, "tokens": n, "seconds": round(dt, 3), "tokens_per_s": round(n / dt, 2),
               "mat": round(m["mat"], 3)}
    print(json.dumps(summary) if a.json else summary, file=sys.stdout if a.json else sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
