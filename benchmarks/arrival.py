"""An arrival's time to first token inside the engine while a batch decodes: per mode, with and without
``admit_during_forward``; no HTTP, no tokenizer, no event loop (``serve_modes.py`` measures those too).
Two variants of the option ask where an arrival's prefill is best run while the batch's forwards are on the
GPU (``--options``): ``main`` queues it behind the forward instead of beside it; ``hold`` (speculative
modes) admits between the draft and the verify until the draft is done, the verify launched after.

Per cell (mode x option), over one loaded model:
  1. ``--batch`` background requests (held-out prompts, greedy, long outputs) are prefilled, then the
     background step is timed (``--settle`` steps, no arrival): T;
  2. ``--arrivals`` times, one fresh request of ``--arrival-tokens`` tokens (no prefix-cache hit, one more
     output token asked so it goes on) arrives at a uniformly random moment of a step, ``u ~ U(0, T)``
     after that step's start. It is handed to the engine as ``AsyncEngine`` would: at the step's admission
     points (``LLMEngine.step``'s ``admit``) once its moment has passed, or at the next step's start. Its
     time to first token is the moment to its first token's emission (``emit_early``); where it was
     admitted (a step's start, inside a step, beside the step's forwards) and its admission to first
     token (``prefill_ms``; the rest of its TTFT is the wait for an admission point) are read from the
     engine's counters. The arrival is then aborted and the batch steps on (``--settle`` steps);
  3. the same arrivals on the idle engine (the background aborted): the prefill alone.
The background steps' wall times beside the arrivals are the price the running batch pays (TPOT). The
background requests' greedy tokens are checked over the length both reached against the first cell's
(``tokens``: no mode may change them; in bf16 a near-tie may, as between any two differently ordered
forwards) and against the first cell of their own mode (``tokens_in_mode``: no option, and no arrival
prefilled inside or beside a step, may change them, near-ties included, as the mode's forwards are the same).

    python benchmarks/arrival.py --model /tmp/bole-widened/qwen3.5-9b --draft-vocab 32768 \\
        --calibration-table calibration_tables/h100-qwen3.5-9b.yaml --out benchmarks/results/arrival_h100.json
    python benchmarks/arrival.py --smoke          # CPU, the embedded model: times mean nothing
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.serve_load import _pct, heldout_prompts  # noqa: E402


def stats_ms(xs: list[float]) -> dict:
    if not xs:
        return dict(n=0)
    return dict(n=len(xs), mean=round(1e3 * statistics.fmean(xs), 2), p50=round(1e3 * _pct(xs, 50), 2),
                p90=round(1e3 * _pct(xs, 90), 2), max=round(1e3 * max(xs), 2))


class Arrival:
    """One arrival: handed to the engine at its admission points once ``at`` has passed."""

    def __init__(self, eng, tokens: list[int], rid: str, at: float):
        self.eng, self.tokens, self.rid, self.at = eng, tokens, rid, at
        self.added = self.first = None

    def admit(self) -> int:   # LLMEngine.step's ``admit`` (and the step's start)
        if self.added is None and time.perf_counter() >= self.at:
            from bole.sampling_params import SamplingParams

            self.eng.add_request(self.tokens, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                                 request_id=self.rid)
            self.added = time.perf_counter()
            return 1
        return 0

    def emitted(self, outputs) -> None:   # ``emit_early``
        if self.first is None and any(o.request_id == self.rid for o in outputs):
            self.first = time.perf_counter()


def step(eng, arrival: Arrival | None = None) -> float:
    t0 = time.perf_counter()
    if arrival is None:
        eng.step()
    else:
        arrival.admit()
        eng.step(emit_early=arrival.emitted, admit=arrival.admit)
    if eng.runner.device.type == "cuda":
        torch.cuda.synchronize(eng.runner.device)
    return time.perf_counter() - t0


def arrivals(eng, tokens: list[list[int]], step_s: float, settle: int, rng: random.Random, tag: str,
             warm: int = 0) -> dict:
    """Each arrival at a random moment of a step; its TTFT, where it was admitted, the steps' wall times.
    The first ``warm`` arrivals, and any during whose steps a CUDA graph was captured, are not counted."""
    m = eng.metrics
    ttft, prefill, where, walls = [], [], {"start": 0, "mid_step": 0, "beside": 0}, []
    excluded = 0
    for i, toks in enumerate(tokens):
        mid, beside, pt = m.mid_step_admissions, m.beside_admissions, m.prefill_time
        captures = eng.runner.graph_captures()[0]
        a = Arrival(eng, [1000 + rng.randrange(4000)] + toks[1:], f"{tag}-{i}",
                    time.perf_counter() + rng.uniform(0, step_s))
        deadline = a.at + 60.0
        while a.first is None and time.perf_counter() < deadline:
            if a.added is None and not eng.has_unfinished():   # nothing to step: wait for the moment itself
                time.sleep(max(0.0, a.at - time.perf_counter()))
            walls.append(step(eng, a))
        if a.first is None:
            raise RuntimeError(f"arrival {a.rid} got no first token within 60 s of its moment")
        eng.abort(a.rid)
        counted = i >= warm and eng.runner.graph_captures()[0] == captures   # no graph captured meanwhile
        if counted:
            ttft.append(a.first - a.at)
            prefill.append(m.prefill_time - pt)   # its admission to its first token (the batch prefills nothing)
            kind = "beside" if m.beside_admissions > beside else "mid_step" if m.mid_step_admissions > mid else "start"
            where[kind] += 1
        excluded += i >= warm and not counted
        for _ in range(settle):
            walls.append(step(eng))
    return dict(ttft_ms=stats_ms(ttft), prefill_ms=stats_ms(prefill), admitted=where, step_ms=stats_ms(walls),
                excluded_for_captures=excluded)


def hold_verify(eng) -> None:
    """Option ``hold`` (speculative modes, a GPU): the step's admission between its draft and verify polls
    until the draft's GPU work is done, each arrival prefilled then on the forward's stream behind the
    draft (alone on the GPU), and only then launches the verify forward; beside the verify as ``on``."""
    from bole.engine.engine import ADMIT_POLL_S

    run = eng.spec_step.run

    def held(reqs, stats, calibration, between=None, during=None):
        def polled() -> None:
            drafted = torch.cuda.Event()
            drafted.record(torch.cuda.current_stream(eng.runner.device))
            while True:
                between()
                if drafted.query():
                    return
                time.sleep(ADMIT_POLL_S)
        return run(reqs, stats, calibration, between=polled if between is not None else None, during=during)
    eng.spec_step.run = held


def run_cell(model, args, mode: str, option: str, prompts: list[list[int]], arrival_tokens: list[list[int]]) -> dict:
    from bole.engine.sequence import RequestStatus
    from bole.llm import build_engine
    from bole.sampling_params import SamplingParams

    cuda = args.device == "cuda"
    longest = max(len(p) for p in prompts[:args.batch])
    blocks = args.batch * ((longest + args.max_tokens + 64) // 16 + 2) + 4 * (args.arrival_tokens // 16 + 4) + 64
    eng = build_engine(args.model, tokenizer=False, model=model, mode=mode, device=args.device,
                       dtype="bfloat16" if cuda else "float32", depth=args.depth, topk=args.topk, beam=args.beam,
                       draft_vocab=args.draft_vocab, calibration_table=args.calibration_table,
                       max_num_seqs=args.batch + 1, num_blocks=blocks, enable_cuda_graphs=cuda,
                       cuda_graph_capture_len=args.capture_len if cuda else None,
                       admit_during_forward=option != "off")
    if option == "main":   # the same polling, each prefill queued behind the forward on its stream
        eng.runner.beside = lambda fence: contextlib.nullcontext()
    if option == "hold" and cuda and eng.spec_step is not None:
        hold_verify(eng)
    rng = random.Random(args.seed)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(prompts[i], sp, request_id=f"bg-{i}")
    while any(not r.prefilled for r in eng.requests.values()):
        eng.step()
    for _ in range(3):   # warm: anything lazily captured or compiled
        step(eng)
    t = statistics.median(step(eng) for _ in range(max(3, args.settle)))
    cell = dict(mode=mode, option=option, background_step_ms=round(1e3 * t, 2))
    cell.update(arrivals(eng, arrival_tokens, t, args.settle, rng, "busy", warm=args.warm))
    # background requests still decoding at the end (fewer than --batch: later arrivals met a smaller batch)
    cell["background_left"] = sum(eng.requests[f"bg-{i}"].status != RequestStatus.FINISHED for i in range(args.batch))
    if args.trace:   # one more arrival under torch.profiler: the streams' kernels, for a timeline viewer
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if cuda else [])) as prof:
            arrivals(eng, arrival_tokens[:1], t, 1, rng, "traced")
        path = Path(args.trace) / f"arrival_{mode}_{option}.json.gz"   # torch gzips a .gz path
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        cell["trace"] = path.name
    tokens = [list(eng.requests[f"bg-{i}"].output_token_ids) for i in range(args.batch)]
    for i in range(args.batch):
        eng.abort(f"bg-{i}")
    alone = arrivals(eng, arrival_tokens[:max(3, len(arrival_tokens) // 4)], 0.0, 0, rng, "idle", warm=1)
    cell["idle_ttft_ms"] = alone["ttft_ms"]
    del eng
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return cell, tokens


def token_check(tokens: list[list[int]], ref: list[list[int]], against: str) -> dict:
    """The background requests' greedy tokens against another cell's, over the length both reached: every
    mode and option must leave them unchanged (the arrivals, prefilled inside or beside the steps, too)."""
    first = {}
    for i, (a, b) in enumerate(zip(tokens, ref)):
        n = min(len(a), len(b))
        bad = next((j for j in range(n) if a[j] != b[j]), None)
        if bad is not None:
            first[i] = bad
    return dict(against=against, compared=sum(min(len(a), len(b)) for a, b in zip(tokens, ref)),
                mismatched=len(first), first_mismatch=first)


def _verdict(check: dict) -> str:
    return "ok" if not check["mismatched"] else f"{check['mismatched']} DIFF"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "bole-tiny-coder"))
    ap.add_argument("--modes", nargs="+", default=["ar", "bole"])
    ap.add_argument("--options", nargs="+", default=["off", "on", "main", "hold"],
                    choices=["off", "on", "main", "hold"],
                    help="admit_during_forward per cell; main: on, but each prefill queued on the forward's stream "
                         "behind it (not beside it on the prefill stream); hold: on, and the speculative step's "
                         "admission between draft and verify polls until the draft is done (hold_verify; the "
                         "same as on in ar and on the CPU, so not run for ar)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--arrivals", type=int, default=40)
    ap.add_argument("--arrival-tokens", type=int, default=192)
    ap.add_argument("--max-tokens", type=int, default=2000, help="the background requests' outputs")
    ap.add_argument("--settle", type=int, default=2, help="background steps after each arrival")
    ap.add_argument("--capture-len", type=int, default=None,
                    help="cuda_graph_capture_len (every graph at start); default: captured when first needed, the "
                         "arrivals meanwhile not counted")
    ap.add_argument("--warm", type=int, default=3, help="arrivals first, not counted (their graphs captured)")
    ap.add_argument("--calibration-table", default="calibration_tables/default.yaml")
    ap.add_argument("--draft-vocab", type=int, default=None)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", default=None, help="a folder: one more arrival per cell under torch.profiler, its "
                                                  "chrome trace there (gzipped)")
    ap.add_argument("--smoke", action="store_true", help="CPU, small: batch 2, 4 arrivals, depth 3")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch, args.arrivals, args.arrival_tokens, args.max_tokens, args.warm = 2, 4, 24, 400, 1
        args.depth, args.topk, args.beam, args.settle = 3, 2, 2, 1
    args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    from transformers import AutoTokenizer

    from bole.models.loader import load_model

    tok = AutoTokenizer.from_pretrained(str(ROOT / "models" / "bole-tiny-coder"))
    texts = heldout_prompts()
    prompts = [tok.encode(t) for t in texts[:args.batch]]
    joined = tok.encode("\n".join(texts[args.batch:]))
    n = args.arrival_tokens
    arrival_tokens = [joined[i * n:(i + 1) * n] for i in range(args.warm + args.arrivals)]
    if len(arrival_tokens[-1]) < n:
        raise ValueError(f"--arrival-tokens {n} x {len(arrival_tokens)} arrivals: the held-out prompts are too short")
    model = load_model(args.model, dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device)
    doc = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
               date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), command=" ".join(sys.argv),
               model=args.model, batch=args.batch, arrival_tokens=n, cells=[])
    ref, mode_ref = None, {}   # (label, background tokens) of the first cell that ran, and of each mode's
    for mode in args.modes:
        for opt in args.options:
            if opt == "hold" and mode == "ar":
                continue
            try:
                cell, tokens = run_cell(model, args, mode, opt, prompts, arrival_tokens)
                ref = ref or (f"{mode}/{opt}", tokens)
                mode_ref.setdefault(mode, (f"{mode}/{opt}", tokens))
                cell["tokens"] = token_check(tokens, ref[1], ref[0])
                cell["tokens_in_mode"] = token_check(tokens, mode_ref[mode][1], mode_ref[mode][0])
            except Exception as e:   # recorded; the other cells still run
                cell = dict(mode=mode, option=opt, error=f"{type(e).__name__}: {e}"[:400])
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            doc["cells"].append(cell)
            print(json.dumps(cell), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"{'mode':>6} {'option':>6} {'bg step':>8} {'ttft mean':>9} {'p50':>7} {'p90':>7} {'prefill':>7} {'idle':>7}"
          f" {'tokens':>6} {'in mode':>7}  admitted")
    for c in doc["cells"]:
        if "error" in c:
            print(f"{c['mode']:>6} {c['option']:>6}  {c['error']}")
            continue
        t, opt = c["ttft_ms"], c["option"]
        print(f"{c['mode']:>6} {opt:>6} {c['step_ms']['mean']:>8} {t['mean']:>9} {t['p50']:>7} {t['p90']:>7} "
              f"{c['prefill_ms']['mean']:>7} {c['idle_ttft_ms']['mean']:>7} "
              f"{_verdict(c['tokens']):>6} {_verdict(c['tokens_in_mode']):>7}  {c['admitted']}")
    return doc


if __name__ == "__main__":
    main()
