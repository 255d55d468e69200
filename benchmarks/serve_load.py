"""Serving benchmark: load a running OpenAI endpoint (``make serve``) the way users do and report what
its clients see.

    python benchmarks/serve_load.py --label bole --num-requests 48 --request-rate 2 \
        --out benchmarks/results/serve_load_cpu.json

Modelled on the shape of vLLM's ``benchmark_serving`` and SGLang's ``bench_serving`` (our own code):

* Arrivals: ``--arrival poisson`` (exponential gaps, mean 1 / ``--request-rate``) or ``fixed`` (equal
  gaps), from ``--seed``; ``--request-rate inf`` sends everything at once. ``--max-concurrency``
  caps requests in flight (a client-side semaphore).
* Workloads (``--workload``): ``heldout`` - single-turn completions of the held-out prompts
  (``benchmarks/data/heldout_prompts.jsonl``, the prompts ``e2e.py`` and ``acceptance.py`` use,
  taken in file order and cycled); ``multiturn`` - conversations of ``--turns`` turns: turn t+1 sends
  turn t's prompt + its answer + the next held-out prompt, so every turn shares a growing prefix with
  the previous one (what the prefix cache and the router's affinity are for); the turns of one
  conversation run one after another, conversations start on the arrival schedule; ``mixed`` - half
  of the requests each way.
* Every request goes through the official ``openai`` client, streaming with
  ``stream_options.include_usage``, greedy, ``ignore_eos`` (every request generates
  ``--max-tokens``, so runs are comparable across modes).
* Per request: TTFT (send -> first text chunk), ITL (gaps between text chunks: a speculative step
  can bring several tokens in one chunk), TPOT ((latency - TTFT) / (tokens - 1)), end-to-end latency.
  Reported: request throughput, output tokens/s, mean / p50 / p99 of TTFT, TPOT, ITL and latency,
  and the failures with their first messages. The last line printed is the run's JSON; ``--out``
  merges it into a results file under ``--label`` (one file for several runs, e.g. one per mode).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
HELDOUT = REPO_ROOT / "benchmarks" / "data" / "heldout_prompts.jsonl"


@dataclass
class Outcome:
    """What one request saw."""

    workload: str
    prompt_chars: int
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    text: str = ""

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def heldout_prompts(path: Path = HELDOUT) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def arrival_gaps(n: int, rate: float, kind: str, seed: int) -> list[float]:
    """Seconds to wait before each of ``n`` arrivals (the first at 0)."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}")
    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) if kind == "poisson" else 1.0 / rate for _ in range(n - 1)]
    return [0.0] + gaps


@dataclass(frozen=True)
class Plan:
    """One arrival: a single prompt, or a conversation's turn prompts (the first one ready, the
    next ones continued with the previous answer)."""

    workload: str
    prompts: tuple[str, ...]


def make_plans(workload: str, num_requests: int, turns: int, prompts: list[str]) -> list[Plan]:
    if workload not in ("heldout", "multiturn", "mixed"):
        raise ValueError(f"--workload must be heldout, multiturn or mixed, got {workload!r}")
    if turns < 1:
        raise ValueError(f"--turns must be >= 1, got {turns}")
    plans, used, k = [], 0, 0
    cycle = lambda i: prompts[i % len(prompts)]  # noqa: E731
    while used < num_requests:
        multi = workload == "multiturn" or (workload == "mixed" and len(plans) % 2 == 1)
        if multi:
            n = min(turns, num_requests - used)
            plans.append(Plan("multiturn", tuple(cycle(k + t) for t in range(n))))
            k, used = k + n, used + n
        else:
            plans.append(Plan("heldout", (cycle(k),)))
            k, used = k + 1, used + 1
    return plans


async def one_request(client, model: str, prompt: str, args, workload: str) -> Outcome:
    out = Outcome(workload, len(prompt))
    t0 = time.perf_counter()
    last = None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": args.ignore_eos})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if last is None:
                    out.ttft_s = now - t0
                else:
                    out.itl_s.append(now - last)
                last = now
                out.text += chunk.choices[0].text
            if chunk.usage is not None:
                out.output_tokens = chunk.usage.completion_tokens
                out.prompt_tokens = chunk.usage.prompt_tokens
        out.latency_s = time.perf_counter() - t0
        out.ok = out.ttft_s is not None and out.output_tokens > 0
        if not out.ok:
            out.error = "no tokens streamed"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, counted and reported
        out.error = f"{type(e).__name__}: {e}"[:300]
    return out


async def run_plan(client, model: str, plan: Plan, args, limit: asyncio.Semaphore | None) -> list[Outcome]:
    outcomes, context = [], ""
    for t, prompt in enumerate(plan.prompts):
        # turn t+1: the conversation so far (previous prompt + answer) and the next question
        text = prompt if t == 0 else context + "\n\n" + prompt
        if limit is not None:
            async with limit:
                o = await one_request(client, model, text, args, plan.workload)
        else:
            o = await one_request(client, model, text, args, plan.workload)
        outcomes.append(o)
        if not o.ok:
            break   # the conversation cannot continue without its answer
        context = text + o.text
    return outcomes


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean_ms": None, "p50_ms": None, "p99_ms": None}
    ms = [v * 1000 for v in values]
    return {"mean_ms": round(sum(ms) / len(ms), 2), "p50_ms": round(_pct(ms, 50), 2),
            "p99_ms": round(_pct(ms, 99), 2)}


def summarize(outcomes: list[Outcome], duration_s: float) -> dict:
    ok = [o for o in outcomes if o.ok]
    failures = [o.error for o in outcomes if not o.ok]
    out_tokens = sum(o.output_tokens for o in ok)
    return {
        "requests": len(outcomes), "completed": len(ok), "failed": len(failures),
        "failure_examples": sorted(set(failures))[:5],
        "duration_s": round(duration_s, 3),
        "request_throughput_per_s": round(len(ok) / duration_s, 4) if duration_s > 0 else None,
        "output_tokens": out_tokens, "prompt_tokens": sum(o.prompt_tokens for o in ok),
        "output_tokens_per_s": round(out_tokens / duration_s, 2) if duration_s > 0 else None,
        "ttft": _stats([o.ttft_s for o in ok]),
        "tpot": _stats([o.tpot_s for o in ok if o.tpot_s is not None]),
        "itl": _stats([g for o in ok for g in o.itl_s]),
        "latency": _stats([o.latency_s for o in ok]),
        "by_workload": {w: len([o for o in ok if o.workload == w]) for w in sorted({o.workload for o in outcomes})},
        # every completed request's TTFT and TPOT, sorted (the distributions: CDF plots)
        "samples_ms": {"ttft": sorted(round(o.ttft_s * 1000, 2) for o in ok),
                       "tpot": sorted(round(o.tpot_s * 1000, 3) for o in ok if o.tpot_s is not None)},
    }


async def run(args) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=args.timeout)
    model = args.served_model or (await client.models.list()).data[0].id
    plans = make_plans(args.workload, args.num_requests, args.turns, heldout_prompts(Path(args.prompts)))
    gaps = arrival_gaps(len(plans), args.request_rate, args.arrival, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    if args.warmup:
        await one_request(client, model, "def warmup():", args, "warmup")
    t0 = time.perf_counter()
    tasks = []
    for plan, gap in zip(plans, gaps):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.ensure_future(run_plan(client, model, plan, args, limit)))
    outcomes = [o for group in await asyncio.gather(*tasks) for o in group]
    duration = time.perf_counter() - t0
    await client.close()
    result = summarize(outcomes, duration)
    result["model"] = model
    return result


def print_table(label: str, r: dict) -> None:
    def row(name, s):
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        return f"  {name:<8} {f(s['mean_ms']):>10} {f(s['p50_ms']):>10} {f(s['p99_ms']):>10}"

    print(f"== {label}: {r['completed']}/{r['requests']} completed, {r['failed']} failed in {r['duration_s']:.1f} s")
    print(f"  request throughput {r['request_throughput_per_s']} req/s, output {r['output_tokens_per_s']} tok/s")
    print(f"  {'ms':<8} {'mean':>10} {'p50':>10} {'p99':>10}")
    for key in ("ttft", "tpot", "itl", "latency"):
        print(row(key, r[key]))
    for e in r["failure_examples"]:
        print(f"  failure: {e}")


def merge_into(path: Path, label: str, doc: dict) -> None:
    """Keep one results file: runs are stored under their label, a rerun replaces its own entry."""
    data = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    data["runs"][label] = doc
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default=os.environ.get("BOLE_API_KEY") or "unused")
    ap.add_argument("--served-model", default=None, help="model id (default: the first of /v1/models)")
    ap.add_argument("--workload", default="mixed", choices=("heldout", "multiturn", "mixed"))
    ap.add_argument("--prompts", default=str(HELDOUT))
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--turns", type=int, default=3, help="turns per multi-turn conversation")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="arrivals per second (inf: all at once)")
    ap.add_argument("--arrival", default="poisson", choices=("poisson", "fixed"))
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="client timeout per request, seconds")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="one request before timing (not counted)")
    ap.add_argument("--label", default="run", help="the run's name in --out (e.g. the engine mode)")
    ap.add_argument("--out", default=None, help="JSON results file to merge this run into")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result = asyncio.run(run(args))
    # on a shared machine the other processes' load moves every figure: record it beside them
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    doc = {"label": args.label, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
           "loadavg_1m_start": load_start, "loadavg_1m_end": load_end,
           "hardware": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs".strip(),
           "python": platform.python_version(),
           "args": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
                    if k != "api_key"},
           "result": result}
    print_table(args.label, result)
    if args.out:
        merge_into(Path(args.out), args.label, doc)
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    main()
