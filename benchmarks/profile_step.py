"""Where a step's time goes: torch.profiler over the engine's forwards, host overhead per step.

For each case it reports the wall time of one synchronised call, the GPU busy time (sum of device
kernel / memcpy time inside it), their difference (host overhead: time the GPU waits on Python and the
CUDA driver), the number of kernel launches and of host syncs, and the top operators by self CPU time.

Cases (``--cases``):
  decode9b     eager decode forward, Qwen3.5-9B shapes (random bf16 weights; ``--shapes`` another of
               bole.calibrate_sweep.SHAPES, e.g. the MoE qwen3.5-35b-a3b), ``--batch`` requests (1),
               ``--kv-len`` committed tokens each (1000)
  verify9b     verify forward of ``--tree-nodes`` nodes (64; several values: one case each, name@T) at
               the same shapes, split over the batch's requests
  ar_tiny      one engine step of ``ar`` on the embedded model, batch 1 (eager)
  bole_tiny    one engine step of ``bole`` on the embedded model, batch 1 (draft, budget, verify, commit)
  ar_tiny_graphs, bole_tiny_graphs   the same with CUDA graphs (decode / verify forwards replayed)
  decode9b_graph, verify9b_graph     the 9B forwards replayed from CUDA graphs (their kernels listed)
  verify9b_graph_sdpa                the same verify with its attention through the batched SDPA path
                     (gathered, padded keys) instead of kernels.tree_attention; ``--kv-len`` sets the prefix
  {ar,serial_tree,bole}_tiny_graphs_b16   engine steps at batch 16 with graphs
  {bole,serial_tree}_tiny_phases   a graphed step at batch 1 split into its graph replays (draft, verify
                     forward, tail): per graph the GPU kernels and the replay time, and the host time
                     beside them
  {ar,bole,serial_tree}_phases     the same at ``--batch`` requests
  {ar,serial_tree,bole}_tiny_generate   one timed ``generate`` as e2e.py runs it: per-step wall times,
                     then a cProfile of a second call; ``{mode}_generate`` is its alias for ``--model`` /
                     ``--batch`` / ``--max-tokens`` runs (e.g. a widened 9B at batch 16)
  {ar,serial_tree,bole}_tiny_prefill    one warm prefill step of the held-out prompt (a fresh one-token request)
  {ar,serial_tree,bole}_prefill   one prefill step of ``--prefill-tokens`` fresh tokens on ``--model`` (one
                     forward; a chunk and a tail forward past a checkpoint boundary with ``--two-forward-prefill``)
Each case also lists the top GPU kernels by device time. The engine cases run ``--model`` (default the
embedded model; a widened checkpoint gives a 9B-cost step with real acceptance), ``--calibration-table``,
``--draft-vocab``, ``--depth/--topk/--beam``.

    python benchmarks/profile_step.py --out benchmarks/results/profile_h200.json
    python benchmarks/profile_step.py --smoke          # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bole.calibrate_sweep import SHAPES  # noqa: E402

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaEventSynchronize",
               "aten::item", "aten::_local_scalar_dense")
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def profile(fn, device: torch.device, warmup: int = 3, reps: int = 5, top: int = 25) -> dict:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                    if device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    ev = prof.key_averages()
    # device time: kernels + memcpy/memset on the GPU, from the trace events
    gpu_us = sum(e.device_time_total for e in ev if e.device_type == torch.autograd.DeviceType.CUDA) \
        if device.type == "cuda" else 0.0
    counts = {k: 0 for k in SYNC_EVENTS + LAUNCH_EVENTS}
    for e in ev:
        if e.key in counts:
            counts[e.key] += e.count
    rows = sorted((e for e in ev if e.device_type != torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    kernels = sorted((e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.device_time_total, reverse=True)[:top]
    wall = sorted(walls)[len(walls) // 2]
    return dict(wall_ms=round(wall, 3), gpu_busy_ms=round(gpu_us / 1e3, 3),
                host_overhead_ms=round(max(0.0, wall - gpu_us / 1e3), 3),
                launches=sum(counts[k] for k in LAUNCH_EVENTS), counts={k: v for k, v in counts.items() if v},
                top_self_cpu=[dict(op=e.key, calls=e.count, self_cpu_ms=round(e.self_cpu_time_total / 1e3, 3))
                              for e in rows],
                top_gpu=[dict(kernel=e.key[:120], calls=e.count, gpu_ms=round(e.device_time_total / 1e3, 3))
                         for e in kernels],
                gpu_kernel_calls=sum(e.count for e in ev if e.device_type == torch.autograd.DeviceType.CUDA),
                table=prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def case_target(name: str, args, device) -> dict:
    from benchmarks.e2e import Target, parse_args
    from bole.calibrate_sweep import synthetic_batch

    B, T = args.batch, args.tree_nodes_one
    eargs = parse_args((["--smoke"] if args.smoke else []) + ["--share-batches", str(B), "--decode-batches", str(B),
                                                              "--tree-sizes", str(T), "--kv-len", str(args.kv_len),
                                                              "--shapes", args.shapes])
    tgt = Target(eargs, device, snapshots=False)
    reqs = tgt.reqs[:B]
    runner = tgt.runner
    if name.endswith("_sdpa"):  # the verify forward's attention through the batched SDPA path (gathered keys)
        from bole.layers.attention import GatedAttention

        for m in runner.model.modules():
            if isinstance(m, GatedAttention):
                m.tree_attention = None
        name = name[: -len("_sdpa")]
    if name == "decode9b":
        return profile(lambda: runner.decode_forward(reqs, use_graphs=False), device)
    if name == "decode9b_graph":  # kernels inside the replayed graph (CUPTI records them)
        runner.enable_cuda_graphs([B], capture=device.type == "cuda")
        runner.decode_forward(reqs)
        return profile(lambda: runner.decode_forward(reqs), device)
    batch = synthetic_batch(T - B, B, 8, tgt.cfg.vocab_size, tgt.gen, device,
                            [r.all_token_ids[r.num_computed] for r in reqs])
    if name == "verify9b_graph":
        runner.enable_verify_graphs([B], [T], 9, capture=device.type == "cuda")
        runner.verify(reqs, batch)
    return profile(lambda: runner.verify(reqs, batch), device)


def _engine(mode: str, args, device, graphs: bool, batch: int, capture_all: bool = True):
    from bole import LLM, SamplingParams

    dtype = "float32" if args.smoke else args.tiny_dtype
    llm = LLM(args.model, mode=mode, depth=args.depth, topk=args.topk, beam=args.beam, draft_vocab=args.draft_vocab,
              device=str(device), dtype=dtype, num_blocks=1024, max_num_seqs=batch,
              calibration_table=args.calibration_table, enable_cuda_graphs=graphs)
    lines = open(REPO_ROOT / "benchmarks" / "data" / "heldout_prompts.jsonl").readlines()
    eng = llm.engine
    for i in range(batch):
        eng.add_request(llm.encode(json.loads(lines[i % len(lines)])["prompt"]),
                        SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:   # a request's first output comes with the end of its prefill
        started.update(o.request_id for o in eng.step())
    if capture_all:  # else the steps capture the keys they need (lazily, as serving does)
        for g in eng.runner.all_graphs():
            g.capture_all(batch, 1024)
    return eng


def case_engine(mode: str, args, device, graphs: bool = False, batch: int = 1) -> dict:
    return profile(_engine(mode, args, device, graphs, batch).step, device, warmup=3, reps=5)


def case_phases(name: str, args, device) -> dict:
    """One graphed ``bole`` step split into the graphs it replays, each timed on its own (CUDA events
    over repeated replays) and profiled once for its kernel count; ``host_ms`` is the step's wall time
    less the replays' (Python, host-to-device row copies, the one device-to-host read). The repeated
    tail replays commit the same path again: the engine's state is spent afterwards (the case's last use)."""
    if device.type != "cuda":
        return dict(skipped="needs CUDA graphs")
    import cProfile
    import io
    import pstats

    # graphs captured by the warm-up steps below (this batch's keys only: capturing every key up to it
    # takes minutes at 9B)
    eng = _engine(name.split("_tiny")[0].split("_phases")[0], args, device, True, args.batch, capture_all=False)
    for _ in range(3):
        eng.step()
    n_graphs = lambda: sum(len(g.graphs) for g in eng.runner.all_graphs())
    seen: list = []
    replay = torch.cuda.CUDAGraph.replay
    torch.cuda.CUDAGraph.replay = lambda g: (seen.append(g), replay(g))[1]
    try:
        for _ in range(3):
            seen.clear()
            eng.step()
    finally:
        torch.cuda.CUDAGraph.replay = replay
    captured = n_graphs()
    step = profile(eng.step, device, warmup=2, reps=9)
    captured = n_graphs() - captured   # graphs captured inside the timed steps (a new KV-length bucket)
    prof = cProfile.Profile()   # the host's share: Python functions over 5 steps
    prof.enable()
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    names = {1: ["step"], 3: ["draft", "verify", "tail"]}.get(len(seen), [f"graph{i}" for i in range(len(seen))])
    out = dict(step_wall_ms=step["wall_ms"], step_gpu_ms=step["gpu_busy_ms"],
               step_kernels=step["gpu_kernel_calls"], graphs={})
    total = 0.0
    for nm, g in zip(names, seen):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            g.replay()
        start.record()
        for _ in range(20):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 20
        p = profile(g.replay, device, warmup=1, reps=3, top=40)
        total += ms
        out["graphs"][nm] = dict(replay_ms=round(ms, 3), gpu_ms=p["gpu_busy_ms"], kernels=p["gpu_kernel_calls"],
                                 top_gpu=p["top_gpu"])
    out["host_ms"] = round(step["wall_ms"] - total, 3)
    out["captured_during_timing"] = captured
    out["config"] = dict(depth=args.depth, topk=args.topk, beam=args.beam, dtype=args.tiny_dtype,
                         batch=args.batch, model=args.model, draft_vocab=args.draft_vocab,
                         calibration_table=args.calibration_table)
    last = eng.metrics.last_step
    out["last_step"] = dict(requests=last.decode_requests, emitted=last.emitted_tokens, nodes=last.tree_nodes,
                            b_ver=last.b_ver)
    out["host_cprofile_5_steps"] = buf.getvalue()
    print(json.dumps({k: v for k, v in out.items() if k not in ("graphs", "host_cprofile_5_steps")}),
          {k: (v["replay_ms"], v["kernels"]) for k, v in out["graphs"].items()}, flush=True)
    out["table"] = step["table"]
    for k in ("wall_ms", "gpu_busy_ms", "host_overhead_ms", "launches", "counts"):
        out[k] = step[k]
    return out


def case_generate(name: str, args, device) -> dict:
    """Where a whole ``generate`` call goes, as ``benchmarks/e2e.py`` times it (the held-out
    prompts[:--batch], --max-tokens each, greedy, graphs captured and the prefix cache warmed first): every engine
    step's wall time with what it did (prefill tokens, requests decoded, tokens emitted), and the top
    functions of a cProfile of the call. Name suffixes: ``_eager_prefill`` (no prefill graphs),
    ``_sampled`` (temperature 0.8, seed 0: sampled steps through the verify graphs' sampled tail) and
    ``_sampled_eager_accept`` (the same with the sampled tails dropped: eager acceptance and commit)."""
    import cProfile
    import io
    import pstats

    from benchmarks.engine_modes import run_mode
    from bole import LLM, SamplingParams

    mode = name.split("_tiny")[0].split("_generate")[0]
    prompts = [json.loads(line)["prompt"] for line in open(REPO_ROOT / "benchmarks" / "data" / "heldout_prompts.jsonl")]
    dtype = "float32" if args.smoke else args.tiny_dtype
    B = args.batch
    opts = dict(device=str(device), dtype=dtype, num_blocks=2048, enable_cuda_graphs=device.type == "cuda",
                max_num_seqs=B, cuda_graph_prefill=not name.endswith("_eager_prefill"),
                calibration_table=args.calibration_table, draft_vocab=args.draft_vocab)
    made = []
    real_init = LLM.__init__
    LLM.__init__ = lambda self, *a, **k: (real_init(self, *a, **k), made.append(self))[0]
    try:
        row, _ = run_mode(args.model, mode, B, prompts, args.max_tokens, args.depth, args.topk, args.beam, repeats=1,
                          **opts)
    finally:
        LLM.__init__ = real_init
    llm = made[-1]
    eng, steps = llm.engine, []
    real_step = eng.step

    def timed():
        t0 = time.perf_counter()
        out = real_step()
        st = eng.metrics.last_step
        steps.append(dict(ms=round((time.perf_counter() - t0) * 1e3, 3), prefill=st.prefill_tokens,
                          emitted=st.emitted_tokens, nodes=st.tree_nodes,
                          verify_ms=round(st.verify_time * 1e3, 3)))
        return out
    eng.step = timed
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    if "_sampled" in name:
        sp = SamplingParams(temperature=0.8, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
        if name.endswith("_eager_accept") and eng.runner.verify_graphs is not None:
            for g in eng.runner.verify_graphs.graphs.values():
                g.sampled_tail = None
        llm.generate(prompts[:B], sp)  # the sampled path once before timing
        steps.clear()
    # the per-step times from a plain call, then a second call under cProfile (which slows Python)
    t0 = time.perf_counter()
    outs = llm.generate(prompts[:B], sp)
    wall = time.perf_counter() - t0
    plain_steps, steps[:] = list(steps), []
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts[:B], sp)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
    n = sum(len(o.token_ids) for o in outs)
    return dict(wall_ms=round(wall * 1e3, 3), gpu_busy_ms=0.0, host_overhead_ms=0.0, launches=0, counts={},
                tokens=n, tokens_per_s=round(n / wall, 1), run_mode_row=row, steps=plain_steps,
                steps_under_cprofile=steps, cprofile=buf.getvalue(), table="")


def case_prefill(name: str, args, device) -> dict:
    """One prefill step of the engine (held-out prompt 0, graphs captured, warm): a fresh request of one
    token each call, so the step runs the prompt's forward and samples its first token."""
    from bole import LLM, SamplingParams

    mode = name.split("_tiny")[0]
    dtype = "float32" if args.smoke else args.tiny_dtype
    llm = LLM(str(REPO_ROOT / "models" / "bole-tiny-coder"), mode=mode, depth=args.depth, topk=args.topk,
              beam=args.beam, device=str(device), dtype=dtype, num_blocks=1024, max_num_seqs=1,
              calibration_table="calibration_tables/default.yaml", enable_cuda_graphs=device.type == "cuda",
              cuda_graph_prefill=not name.endswith("_eager_prefill"))
    eng = llm.engine
    prompt = llm.encode(json.loads(open(REPO_ROOT / "benchmarks" / "data" / "heldout_prompts.jsonl").readline())
                         ["prompt"])
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def fn():
        rid = eng.add_request(prompt, sp)
        eng.step()
        eng.pop_finished(rid)
    out = profile(fn, device, warmup=3, reps=7)
    out["prompt_tokens"] = len(prompt)
    return out


def case_model_prefill(name: str, args, device) -> dict:
    """One prefill step on ``--model`` (e.g. a widened 9B): a fresh request of ``--prefill-tokens`` tokens
    (the held-out prompt, repeated; its first token differs every call, so no prefix-cache hit), one output
    token, graphs enabled as served: up to ``cuda_graph_prefill_tokens`` (256) tokens a forward replays a
    captured prefill graph. With the prefix cache (unless ``--no-prefix-cache``) a length past a multiple of
    16 has a checkpoint at its last boundary, written from inside the one forward; ``--two-forward-prefill``
    runs the chunk to that boundary and the tail apart, as before (the engine's path where no graph fits).
    In the speculative modes the finishing request's drafter catch-up over the prompt is part of the step."""
    from bole import LLM, SamplingParams

    mode = name.split("_prefill")[0]
    llm = LLM(args.model, mode=mode, depth=args.depth, topk=args.topk, beam=args.beam, draft_vocab=args.draft_vocab,
              device=str(device), dtype="float32" if args.smoke else args.tiny_dtype, num_blocks=2048,
              max_num_seqs=4, calibration_table=args.calibration_table, enable_cuda_graphs=device.type == "cuda",
              enable_prefix_cache=not args.no_prefix_cache)
    eng = llm.engine
    if args.two_forward_prefill:
        eng.runner.checkpoints_in_forward = lambda chunks: False
    base = llm.encode(json.loads(open(REPO_ROOT / "benchmarks" / "data" / "heldout_prompts.jsonl").readline())
                      ["prompt"])
    tokens = (base * (args.prefill_tokens // len(base) + 1))[:args.prefill_tokens]
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    calls = iter(range(10 ** 6))

    def fn():
        rid = eng.add_request([100 + next(calls) % 1000] + tokens[1:], sp)
        eng.step()
        eng.pop_finished(rid)
    out = profile(fn, device, warmup=3, reps=7)
    out["prompt_tokens"] = len(tokens)
    return out


CASES = {"decode9b": case_target, "verify9b": case_target,
         "ar_tiny": lambda n, a, d: case_engine("ar", a, d), "bole_tiny": lambda n, a, d: case_engine("bole", a, d),
         "ar_tiny_graphs": lambda n, a, d: case_engine("ar", a, d, True),
         "bole_tiny_graphs": lambda n, a, d: case_engine("bole", a, d, True),
         "decode9b_graph": case_target, "verify9b_graph": case_target, "verify9b_graph_sdpa": case_target,
         **{f"{m}_tiny_graphs_b16": (lambda n, a, d, m=m: case_engine(m, a, d, True, 16))
            for m in ("ar", "serial_tree", "bole")},
         "bole_tiny_phases": case_phases, "serial_tree_tiny_phases": case_phases,
         "ar_phases": case_phases, "bole_phases": case_phases, "serial_tree_phases": case_phases,
         **{f"{m}_tiny_generate{e}": case_generate for m in ("ar", "serial_tree", "bole")
            for e in ("", "_eager_prefill", "_sampled", "_sampled_eager_accept")},
         **{f"{m}_generate": case_generate for m in ("ar", "serial_tree", "bole")},
         **{f"{m}_tiny_prefill{e}": case_prefill for m in ("ar", "serial_tree", "bole")
            for e in ("", "_eager_prefill")},
         **{f"{m}_prefill": case_model_prefill for m in ("ar", "serial_tree", "bole")}}
DEFAULT_CASES = ["decode9b", "verify9b", "ar_tiny", "bole_tiny", "ar_tiny_graphs", "bole_tiny_graphs"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="*", default=DEFAULT_CASES, choices=list(CASES))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--kv-len", type=int, default=1000, help="committed tokens of the 9B cases' request")
    ap.add_argument("--shapes", default="qwen3.5-9b", choices=sorted(SHAPES),
                    help="the random-weight model of the *9b* cases (qwen3.5-35b-a3b: the MoE shape, its routed "
                         "experts through kernels.moe_experts on the GPU)")
    ap.add_argument("--tiny-dtype", default="bfloat16", help="dtype of the embedded model's engine cases")
    ap.add_argument("--model", default=str(REPO_ROOT / "models" / "bole-tiny-coder"),
                    help="checkpoint of the engine cases (a widened one: scripts/widen_model.py)")
    ap.add_argument("--batch", type=int, default=1, help="requests of the *_phases and 9B cases")
    ap.add_argument("--tree-nodes", type=int, nargs="+", default=[64],
                    help="tree nodes (all requests together) of the verify9b cases, one case per value: name@T")
    ap.add_argument("--calibration-table", default="calibration_tables/default.yaml")
    ap.add_argument("--draft-vocab", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens per request of the *_generate cases")
    ap.add_argument("--prefill-tokens", type=int, default=128, help="prompt tokens of the {mode}_prefill cases")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="{mode}_prefill without the prefix cache (no checkpoint at the prompt's last boundary)")
    ap.add_argument("--two-forward-prefill", action="store_true",
                    help="{mode}_prefill with the prefix cache as a chunk to the checkpoint boundary plus a tail "
                         "forward, not one forward that writes the checkpoint")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu":
        torch.set_num_threads(1)
    doc = dict(gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
               date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), command=" ".join(sys.argv), cases={})
    runs = [(n, None) for n in args.cases if not n.startswith("verify9b")] + \
        [(n, t) for n in args.cases if n.startswith("verify9b") for t in args.tree_nodes]
    for name, nodes in runs:
        args.tree_nodes_one = nodes or args.tree_nodes[0]
        r = CASES[name](name, args, device)
        name = name if nodes is None or len(args.tree_nodes) == 1 else f"{name}@{nodes}"
        if "skipped" in r:
            print(f"== {name}: skipped ({r['skipped']})", flush=True)
            continue
        print(f"== {name}: wall {r['wall_ms']} ms, gpu busy {r['gpu_busy_ms']} ms, host overhead "
              f"{r['host_overhead_ms']} ms, launches {r['launches']}, {r['counts']}", flush=True)
        print(r.pop("table"), flush=True)
        doc["cases"][name] = r
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
