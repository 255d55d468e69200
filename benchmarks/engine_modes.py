"""Offline throughput and MAT of the engine's modes (ar / serial_tree / bole) on one workload.

Same prompts, same greedy sampling, every mode in one process (STYLE 12). With ``--model PATH`` it
runs a checkpoint folder; with ``--random-tiny`` it writes a tiny random Qwen3.5 checkpoint (vocab
16, the tests' factory) so the harness runs anywhere: its MAT reflects a random drafter, and CPU
times are for the record only.

    python benchmarks/engine_modes.py --random-tiny --out benchmarks/results/engine_modes_cpu.json

``run_mode`` (one mode at one batch size) is what ``benchmarks/e2e.py`` reuses for its throughput section,
``time_llm`` (the timing of an engine already built) what ``benchmarks/e2e_scale.py`` reuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


MODES = ("ar", "serial_tree", "bole")


def run_mode(path: str, mode: str, batch: int, prompts, max_tokens: int = 48, depth: int = 4, topk: int = 3,
             beam: int = 3, repeats: int = 1, **engine_opts) -> tuple[dict, list[list[int]]]:
    """One (mode, batch) point on a fresh engine: ``bole.LLM(path, mode=..., **engine_opts)`` (device,
    dtype, enable_cuda_graphs, ...; the calibration table defaults to the repository's default one),
    then ``time_llm``."""
    from bole import LLM

    opts = {"calibration_table": "calibration_tables/default.yaml", **engine_opts}
    llm = LLM(path, mode=mode, depth=depth, topk=topk, beam=beam, **opts)
    return time_llm(llm, batch, prompts, max_tokens, repeats)


def time_llm(llm, batch: int, prompts, max_tokens: int = 48, repeats: int = 1,
             budget_s: float | None = None) -> tuple[dict, list[list[int]]]:
    """A short warm-up (4 tokens of the same prompts; CUDA graphs captured beforehand), then
    ``prompts[:batch]`` run together ``repeats`` times, greedy; returns (row: mode, batch,
    tokens_per_s (the median run), tokens_per_s_runs, mat, mean_tree_nodes, ``stats``: the engine's
    ``stats()`` over the timed runs, e.g. ``verify_time_share``, the share of step time in the decode
    forward, or draft + verify + sample + commit; the output token lists). Each run includes its
    prefills (offline throughput); with the engine's prefix cache on (its default), prompts the
    warm-up (or an earlier run) cached restore from it. ``budget_s``: no further run starts once this
    many seconds have passed since the first timed run began (at least one run); the captures and the
    warm-up do not count, so a process's first cell, which pays the compiles, still times ``repeats``.
    """
    from bole import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    runner = llm.engine.runner
    longest = max(len(llm.encode(p)) for p in prompts[:batch]) + max_tokens + 1
    # CUDA graphs: capture every graph the run can need (batch, tree width, KV length) before timing it
    for graphs in runner.all_graphs():
        graphs.capture_all(batch, longest)
    llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    rates, outs = [], None
    llm.engine.metrics.__init__()
    captures_before = runner.graph_captures()[0]
    # the garbage of earlier points (an earlier engine's graphs and pools sit in reference cycles) is
    # collected now, not inside a timed run of this point; no collection during the runs either
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    gc.disable()
    t_start = time.perf_counter()
    try:
        for _ in range(max(1, repeats)):
            if rates and budget_s is not None and time.perf_counter() - t_start > budget_s:
                break
            t0 = time.perf_counter()
            outs = llm.generate(prompts[:batch], sp)
            rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    finally:
        gc.enable()
    stats = llm.engine.stats()
    row = dict(mode=llm.engine.config.mode, batch=batch, tokens_per_s=round(sorted(rates)[len(rates) // 2], 1),
               tokens_per_s_runs=[round(r, 1) for r in rates], mat=round(stats.mat, 3),
               mean_tree_nodes=round(stats.mean_tree_nodes, 1), stats=dataclasses.asdict(stats),
               captures_in_runs=stats.graph_captures - captures_before)
    return row, [o.token_ids for o in outs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--random-tiny", action="store_true")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--beam", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    path = a.model
    if a.random_tiny:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from checkpoints import make_checkpoint

        path = tempfile.mkdtemp(prefix="bole_tiny_")
        make_checkpoint(path, "dense", 16)
    if path is None:
        ap.error("pass --model PATH or --random-tiny")
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [3] * 11, [5, 1], [2, 9, 4, 4, 6, 1, 0, 3]] * 4
    rows = []
    for mode in MODES:
        for bs in a.batches:
            row, _ = run_mode(path, mode, bs, prompts, a.max_tokens, a.depth, a.topk, a.beam)
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
    result = dict(device=("cuda:" + torch.cuda.get_device_name()) if torch.cuda.is_available()
                  else f"cpu ({platform.processor() or platform.machine()}, {a.threads} thread)",
                  torch=torch.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  command=" ".join(sys.argv), model=a.model or "random tiny (vocab 16)", rows=rows)
    if a.out:
        json.dump(result, open(a.out, "w"), indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
