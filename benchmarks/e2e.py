"""End-to-end measurements of the paper (issue 9), in one process on one GPU, every ratio inside the run.

Sections (``--sections``, letters or names; all by default):

  a  gdn_share     Share of the target's verification forward (``ModelRunner.verify``: context and
                   forest building, every layer, lm_head) spent in GDN layers, ``serial_tree`` (per-node
                   snapshots, the Triton serial verifier) vs ``bole`` (closed-form kernel), Qwen3.5-9B
                   shapes with random bf16 weights, batch 1 and 8, trees of 8..128 nodes per request
                   (root included). Method: ablation timing. The same forward is timed (CUDA events,
                   median) three ways: as is; with every GatedDeltaNet mixer replaced by a no-op returning
                   zeros (gdn_share = 1 - that / full: projections, conv, recurrence, gated norm and the
                   factor / snapshot stores of the GDN layers; their MLPs are not counted); and with only
                   the backend's tree verification call stubbed to empty outputs (recurrence_share).
                   Shares are of the forward replayed from a CUDA graph (GPU time: an eager forward at
                   batch 1 is launch bound, which hides every layer's cost); the eager times are kept.
                   The commit (eq. 10 for bole, snapshot copy for serial_tree) is timed on its own.
  b  state_bytes   Transient speculative state per request for T = 100 and 200 nodes, all GDN layers:
                   per-node fp32 snapshots vs the factors the commit needs, from the engine's own buffer
                   layout (``TreeFactors.transient_bytes``), Qwen3.5-4B / 9B / 27B / 122B-A10B shapes.
  c  throughput    Offline ar / serial_tree / bole, each eager and with CUDA graphs (decode graphs for ar,
                   verify graphs for the speculative modes), on the embedded trained model
                   (``--model``; held-out prompts), batch 1..16, greedy, tokens/s and MAT, each
                   speculative run's tokens checked against ar's (``benchmarks.engine_modes.run_mode``).
                   At Qwen3.5-9B shapes (random weights): per-step latency of verification (+ commit)
                   vs a decode step at equal tree sizes (``step_latency``, from the section-a timings)
                   and ar tokens/s = batch / decode step time.
  d  decode_floor  The ar decode step at Qwen3.5-9B shapes (eager, and replayed from a CUDA graph)
                   against its memory floor: (weights + KV read + GDN state read and written) bytes /
                   device-to-device copy bandwidth measured in this run.

``--scale`` runs the paper-scale benchmark instead (``benchmarks/e2e_scale.py``, its own flags: ar /
serial_tree / bole at batch 1..32 on widened Qwen3.5-9B / 27B-cost checkpoints, one process per model).

Results go to ``--out`` (default benchmarks/results/e2e_<hardware>.json) after every point, so a run cut
short keeps what it measured; ``--png`` plots a and c. ``--smoke`` runs everything at tiny shapes on
the CPU in seconds (tests/bench/test_e2e_harness.py).

    python benchmarks/e2e.py                                  # GPU, ~6 min on an H200
    python benchmarks/e2e.py --sections b d                   # just those
    python benchmarks/e2e.py --smoke --out /tmp/e2e.json      # CPU smoke
    python benchmarks/e2e.py --scale --help                   # the scale benchmark's flags
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bole import calibrate_sweep  # noqa: E402
from bole.cache.kv_cache import blocks_needed  # noqa: E402
from bole.config import ModelConfig  # noqa: E402
from bole.engine.runner import ModelRunner  # noqa: E402
from bole.engine.sequence import Request  # noqa: E402
from bole.layers.gdn import GatedDeltaNet  # noqa: E402
from bole.models.context import TreeFactors  # noqa: E402
from bole.sampling_params import SamplingParams  # noqa: E402

SECTIONS = {"a": "gdn_share", "b": "state_bytes", "c": "throughput", "d": "decode_floor"}
SHARE_MODES = ("serial_tree", "bole")
TREE_DEPTH = 8  # verified trees: random EAGLE-like, depth <= 8 with the root (as benchmarks/gdn_verify.py)

# GDN-relevant shapes for section b (DESIGN.md §5; 4B / 9B / 27B also in bole.calibrate_sweep.SHAPES, which
# says where the 4B's come from). The per-request ratio depends only on the head shapes, the totals on the
# layer count.
STATE_SHAPES = {
    "qwen3.5-4b": dict(layers=32, hidden=2560, hk=16, hv=32),
    "qwen3.5-9b": dict(layers=32, hidden=4096, hk=16, hv=32),
    "qwen3.5-27b": dict(layers=64, hidden=5120, hk=16, hv=48),
    "qwen3.5-122b-a10b": dict(layers=48, hidden=3072, hk=16, hv=64),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", action="store_true", help="run benchmarks/e2e_scale.py with the other flags")
    ap.add_argument("--sections", nargs="*", default=list(SECTIONS.values()),
                    help="a/gdn_share b/state_bytes c/throughput d/decode_floor (default: all)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, seconds")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/e2e_<tag>.json)")
    ap.add_argument("--tag", default=None, help="name suffix (default: the hardware class, 'smoke')")
    ap.add_argument("--png", default=None, help="plot of a and c (default: beside the JSON; 'none': off)")
    ap.add_argument("--model", default=str(REPO_ROOT / "models" / "bole-tiny-coder"))
    ap.add_argument("--prompts", default=str(REPO_ROOT / "benchmarks" / "data" / "heldout_prompts.jsonl"))
    ap.add_argument("--batches", type=int, nargs="*", default=None, help="throughput batches (1 2 4 8 16)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per request (256; smoke 6)")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--tiny-dtype", default="float32", help="dtype of the trained model's engine runs")
    ap.add_argument("--shapes", default="qwen3.5-9b", help="random-weight target for a, c and d")
    ap.add_argument("--tree-sizes", type=int, nargs="*", default=None, help="nodes per tree (8..128)")
    ap.add_argument("--share-batches", type=int, nargs="*", default=None, help="a: batches (1 8)")
    ap.add_argument("--decode-batches", type=int, nargs="*", default=None, help="d: batches (1 8)")
    ap.add_argument("--kv-len", type=int, default=None, help="committed tokens per request (1000)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=330.0, help="no new point starts after this")
    ap.add_argument("--eager-prefill", action="store_true",
                    help="c: prefills eager under CUDA graphs too (EngineConfig.cuda_graph_prefill=False)")
    ap.add_argument("--throughput-s", type=float, default=240.0, help="c's engine runs stop after this")
    ap.add_argument("--repeats", type=int, default=3, help="c: timed runs per point (the median is reported)")
    ap.add_argument("--graphs-only", action="store_true", help="c: on a GPU, only the CUDA-graph runs of each mode")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    names = [SECTIONS.get(s, s) for s in a.sections]
    bad = sorted(set(names) - set(SECTIONS.values()))
    if bad:
        ap.error(f"unknown sections {bad}; choose from {sorted(SECTIONS.items())}")
    a.sections = names
    smoke = a.smoke
    pick = lambda v, full, small: v if v is not None else (small if smoke else full)
    a.batches = pick(a.batches, [1, 2, 4, 8, 16], [1, 2])
    a.max_tokens = pick(a.max_tokens, 256, 6)
    a.tree_sizes = pick(a.tree_sizes, [8, 16, 32, 64, 128], [4, 8])
    a.share_batches = pick(a.share_batches, [1, 8], [1, 2])
    a.decode_batches = pick(a.decode_batches, [1, 8], [1, 2])
    a.kv_len = pick(a.kv_len, 1000, 20)
    a.warmup = pick(a.warmup, 2, 1)
    a.reps = pick(a.reps, 10, 2)
    return a


# ------------------------------------------------------------------------------------------ helpers
def time_ms(fn, warmup: int, reps: int, device: torch.device) -> float:
    """Median time of fn() in ms (``bole.calibrate_sweep.time_ms``: CUDA events around each synchronised call)."""
    return statistics.median(calibrate_sweep.time_ms({0: fn}, warmup, reps, device)[0])


def decode_step_fn(runner, reqs, graphed: bool = True) -> Callable[[], torch.Tensor]:
    """A callable running one decode forward of ``reqs`` and returning its logits [B, V].

    The requests are not advanced: every call rewrites the new token's K/V at ``num_computed`` and
    applies one GDN step to their state slots (values drift, costs do not). ``graphed``: replay the
    captured graph (inputs loaded once, so a call is the replay alone), which needs ``runner.graphs``
    (``ModelRunner(..., cuda_graph_batch_sizes=...)`` or ``runner.enable_cuda_graphs``); else the
    runner's eager decode forward, host-side context building included.
    """
    if not graphed:
        return lambda: runner.decode_forward(reqs, use_graphs=False)[0]
    graphs = runner.graphs
    if graphs is None or not graphs.supports(reqs):
        raise ValueError("the runner has no decode graph for this batch (enable_cuda_graphs first)")
    g = graphs.prepare(reqs)
    B = len(reqs)

    def step():
        graphs.replay(g)
        return graphs.out_logits[:B]
    return step


def copy_bandwidth(device: torch.device, smoke: bool) -> dict:
    """Device-to-device copy of one large buffer (read + write bytes / median time)."""
    nbytes = (16 if smoke else 1024) << 20
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 3, 5 if smoke else 20, device)
    return {"bytes_per_copy": nbytes, "copy_ms": round(ms, 4), "gb_per_s": round(2 * nbytes / ms / 1e6, 1)}


def tiny_config() -> ModelConfig:
    """--smoke: a 4-layer target with Qwen3.5's structure (3 GDN + 1 gated attention)."""
    return ModelConfig(model_type="qwen3_5_text", vocab_size=256, hidden_size=64, num_hidden_layers=4,
                       layer_types=("linear_attention",) * 3 + ("full_attention",), num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, rope_theta=1e6, partial_rotary_factor=0.25,
                       attention_bias=False, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                       gdn_layout="split", intermediate_size=128)


def state_config(name: str) -> ModelConfig:
    s = STATE_SHAPES[name]
    moe = name.endswith("a10b")
    extra = dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024,
                 shared_expert_intermediate_size=1024, intermediate_size=None) if moe else \
        dict(intermediate_size=4 * s["hidden"])
    return ModelConfig(model_type="qwen3_5_moe_text" if moe else "qwen3_5_text", vocab_size=248320,
                       hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                       layer_types=tuple("full_attention" if i % 4 == 3 else "linear_attention"
                                         for i in range(s["layers"])),
                       num_attention_heads=16, num_key_value_heads=4, head_dim=256, rope_theta=1e7,
                       partial_rotary_factor=0.25, attention_bias=False, linear_num_key_heads=s["hk"],
                       linear_num_value_heads=s["hv"], linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_conv_kernel_dim=4, gdn_layout="split", **extra)


class Report:
    """The JSON document, rewritten after every point."""

    def __init__(self, path: Path, doc: dict):
        self.path, self.doc = path, doc
        path.parent.mkdir(parents=True, exist_ok=True)
        self.save()

    def add(self, key: str, row: dict) -> None:
        self.doc[key].append(row)
        self.save()

    def note(self, text: str) -> None:
        print("note:", text, flush=True)
        self.doc["notes"].append(text)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1))
        tmp.replace(self.path)


def _r(x, n=4):
    return None if x is None else round(float(x), n)


# ---------------------------------------------------------------------------------------- section b
def section_state_bytes(rep: Report, smoke: bool) -> None:
    for name in STATE_SHAPES:
        cfg = state_config(name)
        for T in (100, 200):
            b = TreeFactors.transient_bytes(cfg, T, dtype=torch.bfloat16)
            row = dict(model=name, tree_nodes=T, gdn_layers=cfg.num_gdn_layers,
                       snapshot_bytes=b["snapshots"], factor_bytes=b["factors"], conv_input_bytes=b["conv_inputs"],
                       ratio=_r(b["snapshots"] / b["factors"], 2),
                       ratio_with_conv_inputs=_r((b["snapshots"] + b["conv_inputs"])
                                                 / (b["factors"] + b["conv_inputs"]), 2))
            rep.add("state_bytes", row)
    print("state_bytes: " + ", ".join(f"{r['model']} T={r['tree_nodes']}: {r['ratio']}x"
                                      for r in rep.doc["state_bytes"]), flush=True)


# ---------------------------------------------------------------------------------------- section c
def section_throughput(rep: Report, args, device: torch.device, t_end: float) -> None:
    from benchmarks.acceptance import random_tiny
    from benchmarks.engine_modes import run_mode

    path, name = args.model, Path(args.model).name
    has_weights = any(f.endswith(".safetensors") for f in os.listdir(path)) if os.path.isdir(path) else False
    if args.smoke or not has_weights:
        if not args.smoke:
            rep.note(f"{path} holds no weights: throughput runs a RANDOM checkpoint with its tokenizer "
                     "(MAT and speedups then say nothing about the trained drafter)")
        path, name = random_tiny(args.model), f"{name} (random weights)"
    prompts = [json.loads(line)["prompt"] for line in open(args.prompts)][: max(args.batches)]
    cuda = device.type == "cuda"
    configs = [("ar", False)] + ([("ar", True)] if cuda else []) + [("serial_tree", False), ("bole", False)] + \
        ([("serial_tree", True), ("bole", True)] if cuda else [])
    if cuda and args.graphs_only:
        configs = [c for c in configs if c[1]]
    opts = dict(device=str(device), dtype=args.tiny_dtype, num_blocks=2048, cuda_graph_prefill=not args.eager_prefill)
    for batch in args.batches:
        ref = None
        for mode, graphs in configs:
            label = mode + (" (CUDA graphs)" if graphs else "")
            if time.time() > t_end:
                rep.doc["skipped"].append(dict(section="throughput", mode=label, batch=batch))
                continue
            t0 = time.time()
            row, toks = run_mode(path, mode, batch, prompts, args.max_tokens, args.depth, args.topk,
                                 args.beam, repeats=args.repeats, enable_cuda_graphs=graphs, max_num_seqs=batch,
                                 **opts)
            ref = toks if ref is None else ref
            rep.add("throughput", dict(model=name, mode=mode, batch=batch, tokens_per_s=row["tokens_per_s"],
                                       tokens_per_s_runs=row["tokens_per_s_runs"], mat=row["mat"], cuda_graphs=graphs,
                                       mean_tree_nodes=row["mean_tree_nodes"],
                                       prefill_graphs=graphs and not args.eager_prefill,
                                       exact_vs_ar=toks == ref, source="engine", max_tokens=args.max_tokens))
            print(f"[{time.time() - T0:6.1f}s] throughput {label:<18} batch={batch:<3} "
                  f"{row['tokens_per_s']:8.1f} tok/s  MAT={row['mat']:.2f}  exact={toks == ref}  "
                  f"({time.time() - t0:.1f}s)", flush=True)


# ---------------------------------------------------------------------------- random-weight target
class Target:
    """A random-weight model at real shapes, its runner, and requests with ``kv_len`` committed tokens."""

    def __init__(self, args, device: torch.device, snapshots: bool):
        from bole.calibrate_sweep import random_model, shapes_config

        self.name = "tiny (smoke)" if args.smoke else args.shapes
        self.cfg = tiny_config() if args.smoke else shapes_config(args.shapes)
        self.dtype, self.device, self.kv_len = torch.bfloat16, device, args.kv_len
        self.model = random_model(self.cfg, self.dtype, device, seed=args.seed)
        b_max = max(args.share_batches + args.decode_batches)
        t_max = max(args.tree_sizes)
        bs = 16
        per_req = blocks_needed(self.kv_len + t_max + 2, bs)
        graphs = args.decode_batches if device.type == "cuda" else None
        self.runner = ModelRunner(self.model, b_max * per_req + 1, bs, b_max + 1, b_max * t_max, self.dtype,
                                  device, snapshot_verify=snapshots, cuda_graph_batch_sizes=graphs)
        if device.type != "cuda":  # the smoke run still drives the graphs' static forward (uncaptured)
            self.runner.enable_cuda_graphs(args.decode_batches, capture=False)
        self.factors = self.runner.factors
        gen = torch.Generator().manual_seed(args.seed)
        self.gen = gen
        pool = self.runner.state_pool
        with torch.no_grad():
            self.runner.kv_cache.kv.normal_(0.0, 1.0)
        self.reqs = []
        for b in range(b_max):
            r = Request(f"e2e-{b}", torch.randint(self.cfg.vocab_size, (self.kv_len + 1,), generator=gen).tolist(),
                        SamplingParams(), seed=0)
            r.block_table = self.runner.allocator.allocate(per_req)
            r.state_slot = pool.allocate()
            r.num_computed, r.prefilled = self.kv_len, True
            self.reqs.append(r)
        slots = torch.tensor([r.state_slot for r in self.reqs], device=device)
        with torch.no_grad():  # state-like random contents
            pool.ssm[:, slots] = 0.05 * torch.randn_like(pool.ssm[:, slots])
            pool.conv[:, slots] = torch.randn_like(pool.conv[:, slots])
        self.gdn = [m for m in self.model.modules() if isinstance(m, GatedDeltaNet)]

    def weight_bytes(self, batch: int) -> int:
        """Parameter bytes a decode step reads: all but the embedding table, of which ``batch`` rows."""
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        emb = self.model.model.embed_tokens.weight
        if not self.cfg.tie_word_embeddings:
            total -= emb.numel() * emb.element_size() - batch * emb.shape[1] * emb.element_size()
        return total

    def floor_bytes(self, batch: int) -> dict:
        c, kv = self.cfg, self.runner.kv_cache
        kv_b = c.num_attn_layers * batch * (self.kv_len + 1) * kv.num_kv_heads * kv.head_dim * 2 * kv.kv.element_size()
        pool = self.runner.state_pool
        per_slot = pool.ssm[0, 0].numel() * pool.ssm.element_size() + pool.conv[0, 0].numel() * pool.conv.element_size()
        gdn_b = c.num_gdn_layers * batch * per_slot * 2  # read and written back
        return {"weights": self.weight_bytes(batch), "kv_read": kv_b, "gdn_state_read_write": gdn_b}


# ---------------------------------------------------------------------------------------- section d
def section_decode_floor(rep: Report, tgt: Target, args, bw_bps: float, t_end: float, record: bool = True) -> dict:
    """Returns {batch: {"eager": ms, <graph mode>: ms}} for the step-latency rows; ``record``: add the
    decode_floor and ar-throughput rows (else the times are only measured for section c)."""
    dev, runner, out = tgt.device, tgt.runner, {}
    graph_mode = "cuda_graph" if dev.type == "cuda" else "static_uncaptured"
    for B in args.decode_batches:
        if time.time() > t_end:
            rep.doc["skipped"].append(dict(section="decode_floor", batch=B))
            continue
        reqs = tgt.reqs[:B]
        fb = tgt.floor_bytes(B)
        floor_ms = sum(fb.values()) / bw_bps * 1e3
        pool = runner.state_pool
        slots = torch.tensor([r.state_slot for r in reqs], device=dev)
        saved = pool.ssm[:, slots].clone(), pool.conv[:, slots].clone()
        eager = decode_step_fn(runner, reqs, graphed=False)
        logits_e = eager().float()
        pool.ssm[:, slots], pool.conv[:, slots] = saved
        step = decode_step_fn(runner, reqs, graphed=True)  # captures (or builds) the graph for this batch
        logits_g = step().float()
        err = float((logits_g - logits_e).abs().max() / logits_e.abs().max().clamp_min(1e-30))
        del saved, logits_e, logits_g
        times = {"eager": time_ms(eager, args.warmup, args.reps, dev),
                 graph_mode: time_ms(step, args.warmup, args.reps, dev)}
        out[B] = times
        g = runner.graphs.key(B, tgt.kv_len + 1)
        for mode, ms in times.items() if record else ():
            rep.add("decode_floor", dict(
                model=tgt.name, batch=B, mode=mode, step_ms=_r(ms), floor_ms=_r(floor_ms),
                step_over_floor=_r(ms / floor_ms, 2), kv_len=tgt.kv_len,
                graph_kv_bucket=g[1] if mode != "eager" else None, floor_bytes=fb,
                graph_vs_eager_logits_rel_err=_r(err, 6) if mode != "eager" else None))
            rep.add("throughput", dict(model=f"{tgt.name} (random weights)", mode="ar", batch=B,
                                       tokens_per_s=_r(B * 1e3 / ms, 1), mat=1.0, cuda_graphs=mode == "cuda_graph",
                                       source="decode step time"))
        print(f"[{time.time() - T0:6.1f}s] decode_floor {tgt.name} batch={B}: eager {times['eager']:.3f} ms, "
              f"{graph_mode} {times[graph_mode]:.3f} ms, floor {floor_ms:.3f} ms, graph/eager logits "
              f"rel err {err:.1e}", flush=True)
    return out


# ---------------------------------------------------------------------------------------- section a
def _stub_verify(q, k, v, g, beta, forest, initial_state, state_indices=None, scale=None, use_qk_l2norm=False,
                 u_out=None, logp_out=None):
    N, HV, V = v.shape[1], v.shape[2], v.shape[3]
    f32 = dict(dtype=torch.float32, device=v.device)
    return (torch.empty_like(v), torch.empty(N, HV, V, **f32) if u_out is None else u_out,
            torch.empty(N, HV, **f32) if logp_out is None else logp_out)


def _stub_serial(q, k, v, g, beta, forest, initial_state, state_indices=None, scale=None, use_qk_l2norm=False):
    N, HV, V, K = v.shape[1], v.shape[2], v.shape[3], q.shape[3]
    return torch.empty_like(v), torch.empty(N, HV, V, K, dtype=torch.float32, device=v.device)


@contextlib.contextmanager
def _patched(objs, name: str, value):
    """Set attribute ``name`` of every object to ``value`` for the block (ablations), then restore it
    (an instance attribute that was not there is removed again)."""
    missing = object()
    old = [o.__dict__.get(name, missing) for o in objs]
    for o in objs:
        setattr(o, name, value)
    try:
        yield
    finally:
        for o, v in zip(objs, old, strict=True):
            if v is missing:
                delattr(o, name)
            else:
                setattr(o, name, v)


def _graph_verify_ms(runner, reqs, batch, args, dev) -> float:
    """Median time of the verify forward replayed from a CUDA graph (``bole.engine.graphs.verify``:
    the host's launch cost removed, so shares are of GPU time); the uncaptured static forward on a CPU."""
    from bole.engine.graphs.verify import VerifyGraphs

    T = batch.tokens.shape[1]
    vg = VerifyGraphs(runner, [len(reqs)], [T], TREE_DEPTH, *runner.padding(), capture=dev.type == "cuda",
                      tail=False)
    vg.run(reqs, batch)  # builds (captures) the one graph
    g = next(iter(vg.graphs.values()))
    ms = time_ms(g.graph.replay if g.graph is not None else torch.inference_mode()(g.run), args.warmup, args.reps, dev)
    del vg, g
    gc.collect()
    return ms


def section_gdn_share(rep: Report, tgt: Target, args, decode_ms: dict, t_end: float, share: bool) -> None:
    from bole.calibrate_sweep import synthetic_batch

    dev, runner, model = tgt.device, tgt.runner, tgt.model
    full_factors = tgt.factors
    backend = tgt.gdn[0].backend
    stubbed = dataclasses.replace(backend, tree_verify=_stub_verify, tree_serial=_stub_serial)
    zeros = lambda x, ctx: torch.zeros_like(x)
    points = [(B, T, mode) for B in args.share_batches for T in args.tree_sizes for mode in SHARE_MODES]
    for B, T, mode in points:
        if time.time() > t_end:
            rep.doc["skipped"].append(dict(section="gdn_share", mode=mode, batch=B, tree_nodes=T))
            continue
        t0 = time.time()
        reqs = tgt.reqs[:B]
        runner.factors = full_factors if mode == "serial_tree" else dataclasses.replace(full_factors, snapshots=None)
        batch = synthetic_batch(B * (T - 1), B, TREE_DEPTH, tgt.cfg.vocab_size, tgt.gen, dev,
                                [r.all_token_ids[r.num_computed] for r in reqs])
        verify = lambda reqs=reqs, batch=batch: runner.verify(reqs, batch)
        graph = lambda reqs=reqs, batch=batch: _graph_verify_ms(runner, reqs, batch, args, dev)
        try:
            full = time_ms(verify, args.warmup, args.reps, dev)
            full_g = graph()
            no_mixer = no_rec = no_mixer_g = no_rec_g = None
            if share:
                with _patched(tgt.gdn, "forward", zeros):
                    no_mixer = time_ms(verify, args.warmup, args.reps, dev)
                    no_mixer_g = graph()
                with _patched(tgt.gdn, "backend", stubbed):
                    no_rec = time_ms(verify, args.warmup, args.reps, dev)
                    no_rec_g = graph()
            res = runner.verify(reqs, batch)
            deepest = [int(torch.argmax(torch.where(batch.tokens[b] >= 0, batch.depth[b], -1))) for b in range(B)]
            commit = time_ms(lambda res=res, deepest=deepest: model.commit(res.ctx, deepest),
                             args.warmup, args.reps, dev)
            res = None
        except torch.OutOfMemoryError as e:
            rep.note(f"gdn_share {mode} batch={B} T={T}: out of memory ({e}); point skipped")
            torch.cuda.empty_cache()
            continue
        finally:
            runner.factors = full_factors
        depth = int(batch.depth.max()) + 1
        if share:
            rep.add("gdn_share", dict(model=tgt.name, mode=mode, batch=B, tree_nodes=T, depth=depth,
                                      verify_graph_ms=_r(full_g), without_gdn_mixers_graph_ms=_r(no_mixer_g),
                                      without_gdn_recurrence_graph_ms=_r(no_rec_g),
                                      gdn_share=_r(1 - no_mixer_g / full_g),
                                      recurrence_share=_r(1 - no_rec_g / full_g),
                                      verify_ms=_r(full), without_gdn_mixers_ms=_r(no_mixer),
                                      without_gdn_recurrence_ms=_r(no_rec), gdn_share_eager=_r(1 - no_mixer / full),
                                      recurrence_share_eager=_r(1 - no_rec / full), commit_ms=_r(commit)))
        dec = decode_ms.get(B, {})
        d_e, d_g = dec.get("eager"), dec.get("cuda_graph", dec.get("static_uncaptured"))
        rep.add("step_latency", dict(model=tgt.name, mode=mode, batch=B, tree_nodes=T, depth=depth,
                                     verify_ms=_r(full), verify_graph_ms=_r(full_g), commit_ms=_r(commit),
                                     step_ms=_r(full + commit), decode_ms=_r(d_e), decode_graph_ms=_r(d_g),
                                     verify_over_decode=_r(full / d_e, 2) if d_e else None,
                                     graph_verify_over_graph_decode=_r(full_g / d_g, 2) if d_g else None,
                                     step_over_graph_decode=_r((full + commit) / d_g, 2) if d_g else None))
        share_txt = f"gdn {1 - no_mixer_g / full_g:5.1%} rec {1 - no_rec_g / full_g:5.1%} " if share else ""
        print(f"[{time.time() - T0:6.1f}s] {mode:<11} batch={B} T={T:<3}: verify {full:8.2f} ms eager, "
              f"{full_g:7.3f} ms graph  {share_txt}commit {commit:.2f} ms ({time.time() - t0:.1f}s)", flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- plot
def plot(doc: dict, path: Path) -> str | None:
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    ax = axes[0]
    for mode in SHARE_MODES:
        for B in sorted({r["batch"] for r in doc["gdn_share"]}):
            pts = sorted((r["tree_nodes"], r["gdn_share"], r["recurrence_share"]) for r in doc["gdn_share"]
                         if r["mode"] == mode and r["batch"] == B)
            if pts:
                line, = ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o",
                                label=f"{mode} b={B}: GDN layers")
                ax.plot([p[0] for p in pts], [100 * p[2] for p in pts], ls="--", color=line.get_color(),
                        label=f"{mode} b={B}: tree verification call")
    ax.set(xscale="log", xlabel="tree nodes per request", ylabel="% of verification forward",
           title="(a) GDN share of verification time", ylim=(0, 100))
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax = axes[1]
    tiny = [r for r in doc["throughput"] if r.get("source") == "engine"]
    for mode, graphs in (("ar", False), ("ar", True), ("serial_tree", False), ("bole", False),
                         ("serial_tree", True), ("bole", True)):
        pts = sorted((r["batch"], r["tokens_per_s"], r["mat"]) for r in tiny
                     if r["mode"] == mode and r["cuda_graphs"] == graphs)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=mode + (" + CUDA graphs" if graphs else "") + (f" (MAT {pts[0][2]:.2f} @b=1)"
                                                                         if mode != "ar" else ""))
    ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s",
           title=f"(c) throughput: {tiny[0]['model'] if tiny else '-'}")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax = axes[2]
    for mode in SHARE_MODES:
        for B in sorted({r["batch"] for r in doc["step_latency"]}):
            pts = sorted((r["tree_nodes"], r["verify_over_decode"]) for r in doc["step_latency"]
                         if r["mode"] == mode and r["batch"] == B and r["verify_over_decode"])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{mode} b={B}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="tree nodes per request", ylabel="verify / eager decode step",
           title="(c) verification vs decoding latency, random-weight target")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    sizes = sorted({r["tree_nodes"] for r in doc["step_latency"]} | {r["tree_nodes"] for r in doc["gdn_share"]})
    batches = sorted({r["batch"] for r in tiny})
    for ax, ticks in ((axes[0], sizes), (axes[1], batches), (axes[2], sizes)):
        if ticks:
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


# --------------------------------------------------------------------------------------------- main
T0 = time.time()


def main(argv=None) -> dict:
    global T0
    T0 = time.time()
    argv_list = sys.argv[1:] if argv is None else list(argv)
    if "--scale" in argv_list:
        from benchmarks.e2e_scale import main as scale_main

        return scale_main([a for a in argv_list if a != "--scale"])
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        sys.exit("needs a CUDA GPU (use --smoke on the CPU)")
    from bole.hardware import detect_hardware

    tag = args.tag or ("smoke" if args.smoke else detect_hardware(device))
    out = Path(args.out) if args.out else REPO_ROOT / "benchmarks" / "results" / f"e2e_{tag}.json"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)"
    rep = Report(out, dict(
        gpu=gpu, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=shlex.join(["python", "benchmarks/e2e.py", *argv_list]), torch=torch.__version__,
        smoke=args.smoke, sections=args.sections, settings=dict(
            shapes=args.shapes, kv_len=args.kv_len, tree_sizes=args.tree_sizes, tree_depth_max=TREE_DEPTH,
            share_batches=args.share_batches, decode_batches=args.decode_batches, batches=args.batches,
            max_tokens=args.max_tokens, spec=dict(depth=args.depth, topk=args.topk, beam=args.beam),
            warmup=args.warmup, reps=args.reps, weights_dtype="bfloat16 (random-weight target)"),
        methods=dict(
            timing="median of --reps calls after --warmup, CUDA events around each synchronised call",
            gdn_share="ablation on CUDA-graph replays: 1 - t(verify forward with every GatedDeltaNet mixer a "
                      "no-op) / t(verify forward); gdn_share_eager: the same on eager forwards",
            recurrence_share="ablation: 1 - t(forward with the backend's tree_verify / tree_serial stubbed) / t",
            state_bytes="TreeFactors.transient_bytes: the engine's buffers per request, all GDN layers; "
                        "snapshots fp32 [HV,V,K] per node, factors k (bf16) + u (fp32) + logP (fp32) per node",
            floor="(weights read + KV read + GDN state read and written) bytes / measured D2D copy bandwidth",
            throughput="benchmarks.engine_modes.run_mode: fresh engine, warm-up, greedy, tokens/s of the batch"),
        copy_bandwidth=None, gdn_share=[], state_bytes=[], throughput=[], step_latency=[], decode_floor=[],
        skipped=[], notes=[], elapsed_s=None, plot=None))
    print(f"e2e on {gpu}: sections {args.sections} -> {out}", flush=True)
    t_end = T0 + args.budget_s

    if "state_bytes" in args.sections:
        section_state_bytes(rep, args.smoke)
    bw = copy_bandwidth(device, args.smoke)
    rep.doc["copy_bandwidth"] = bw
    rep.save()
    print(f"[{time.time() - T0:6.1f}s] copy bandwidth (read+write): {bw['gb_per_s']} GB/s", flush=True)
    if "throughput" in args.sections:
        section_throughput(rep, args, device, min(t_end, T0 + args.throughput_s))
        gc.collect()  # engines (and their captured graphs' memory pools) of the runs above
        if device.type == "cuda":
            torch.cuda.empty_cache()
    need_share = "gdn_share" in args.sections
    need_target = need_share or "decode_floor" in args.sections or "throughput" in args.sections
    if need_target and time.time() < t_end:
        t0 = time.time()
        tgt = Target(args, device, snapshots=need_share or "throughput" in args.sections)
        print(f"[{time.time() - T0:6.1f}s] built {tgt.name} random bf16 target in {time.time() - t0:.1f}s",
              flush=True)
        decode_ms = section_decode_floor(rep, tgt, args, bw["gb_per_s"] * 1e9, t_end,
                                         record="decode_floor" in args.sections)
        if need_share or "throughput" in args.sections:
            section_gdn_share(rep, tgt, args, decode_ms, t_end, share=need_share)
        del tgt
    elif need_target:
        rep.note("time budget spent before the random-weight target was built: a / d skipped")
    if rep.doc["skipped"]:
        rep.note(f"time budget: {len(rep.doc['skipped'])} points skipped (see 'skipped')")
    if args.png != "none":
        rep.doc["plot"] = plot(rep.doc, Path(args.png) if args.png else out.with_suffix(".png"))
    rep.doc["elapsed_s"] = round(time.time() - T0, 1)
    rep.save()
    print(f"wrote {out}" + (f" and {rep.doc['plot']}" if rep.doc["plot"] else "") +
          f" in {rep.doc['elapsed_s']}s", flush=True)
    return rep.doc


if __name__ == "__main__":
    main()
