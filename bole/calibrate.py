"""Offline calibration sweep (Algorithm 3, eq. 12) and live recalibration of a running engine.

    python -m bole.calibrate --model models/bole-tiny-coder --out calibration_tables/cpu-bole-tiny-coder.yaml
    python -m bole.calibrate --shapes qwen3.5-9b --quick            # random weights, GPU only
    python -m bole.calibrate --modeled a100 --shapes qwen3.5-9b --fit h200.yaml --compare h200.yaml

Sweep. Buckets c = (batch, kv, depth) come from the listed points of each axis: a point is the
*upper edge* of its bucket (points 1,4,16 give batch buckets [1,1], [2,4], [5,16]; look-ups past
the last point clamp to it) and every bucket is measured at its upper edges. At each point the
sweep times, with the engine's own ``ModelRunner`` on the engine's model:
  T_dec(c)    ``runner.decode`` of B requests (one token each), and
  T_ver(N|c)  ``runner.verify`` of a forest of B trees holding N draft nodes in all (split evenly,
              shapes from ``random_tree``, depth <= d-1 under each request's root node, so the
              forest has N + B nodes: exactly what the engine verifies when the budget is N),
for every capacity N of the capture set G, as medians over interleaved rounds (CUDA events after a
synchronize on the GPU, perf_counter on the CPU), after warm-up. The sweep gets its own runner
(own KV cache and state pool, sharing the weights): its B dummy requests hold blocks and slots
whose contents are filled directly with random values instead of being prefilled, because the
forwards' cost depends on the lengths, not on the cached values. The runner has no CUDA-graph
capture yet, so forwards run eagerly (``provenance.execution: eager``), as the engine runs them.
B_ver(c) follows by eq. 12 on the running maximum over N of the medians (a longer forest never
costs less; the raw medians stay in ``provenance.raw``).

Recalibration of a running engine (re-sweep, validation, swap) is ``bole.recalibration``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass, replace
from statistics import median

import torch

from bole.cache.kv_cache import blocks_needed
from bole.calibrate_model import RooflineAssumptions, fit_overheads, model_error, model_point, split_nodes
from bole.config import ModelConfig
from bole.engine.runner import ModelRunner
from bole.engine.sequence import Request
from bole.hardware import SPECS, TABLE_DIR, detect_hardware, device_name, model_signature
from bole.sampling_params import SamplingParams
from bole.spec.budget import CalibrationTable, select_b_ver
from bole.spec.drafter import DraftBatch
from bole.spec.tree import feasible_capacities, random_tree

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepPlan:
    """Bucket points per axis (upper edges), the capture set G, ε and the timing repetitions."""

    batch_points: tuple[int, ...] = (1, 2, 4, 8, 16)
    kv_points: tuple[int, ...] = (512, 2048, 8192)
    depth_points: tuple[int, ...] = (5,)              # tree depth with the root: SpecConfig.depth + 1
    capture_set: tuple[int, ...] = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    epsilon: float = 0.1
    warmup: int = 2
    iters: int = 7
    seed: int = 0

    def __post_init__(self):
        for name, lowest in (("batch_points", 1), ("kv_points", 0), ("depth_points", 2), ("capture_set", 1)):
            pts = tuple(int(p) for p in getattr(self, name))
            if not pts or list(pts) != sorted(set(pts)) or pts[0] < lowest:
                raise ValueError(f"{name} must be a strictly increasing list of ints >= {lowest}, got {pts}")
            object.__setattr__(self, name, pts)
        if self.warmup < 0 or self.iters < 1 or not self.epsilon >= 0:
            raise ValueError(f"need warmup >= 0, iters >= 1, epsilon >= 0 (got {self.warmup}, {self.iters}, "
                             f"{self.epsilon})")

    def points(self) -> list[tuple[int, int, int]]:
        return list(itertools.product(self.batch_points, self.kv_points, self.depth_points))

    def ranges(self, batch: int, kv: int, depth: int) -> dict:
        """The bucket whose upper edges are this point."""
        out = {}
        for axis, pts, lowest, p in (("batch", self.batch_points, 1, batch), ("kv", self.kv_points, 0, kv),
                                     ("depth", self.depth_points, 1, depth)):
            i = pts.index(p)
            out[axis] = [lowest if i == 0 else pts[i - 1] + 1, p]
        return out


QUICK_PLAN = SweepPlan(batch_points=(1, 4, 16), kv_points=(1024, 8192), capture_set=(8, 16, 32, 64, 128, 256),
                       warmup=1, iters=4)

# Real Qwen3.5 shapes (DESIGN.md §5) for random-weight sweeps; vocabulary of the Qwen3.5 tokenizer.
_QWEN35 = dict(model_type="qwen3_5_text", vocab_size=248320, rope_theta=10_000_000.0,
               partial_rotary_factor=0.25, attention_bias=False, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, gdn_layout="split", head_dim=256,
               num_mtp_layers=0, dtype="bfloat16")
SHAPES = {
    "qwen3.5-9b": dict(hidden_size=4096, num_hidden_layers=32, linear_num_key_heads=16,
                       linear_num_value_heads=32, num_attention_heads=16, num_key_value_heads=4,
                       intermediate_size=12288),
    "qwen3.5-27b": dict(hidden_size=5120, num_hidden_layers=64, linear_num_key_heads=16,
                        linear_num_value_heads=48, num_attention_heads=24, num_key_value_heads=4,
                        intermediate_size=17408),
}


def shapes_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown shapes {name!r}; known: {sorted(SHAPES)}")
    s = SHAPES[name]
    layer_types = tuple("full_attention" if i % 4 == 3 else "linear_attention"   # 3 GDN : 1 attention
                        for i in range(s["num_hidden_layers"]))
    return ModelConfig(layer_types=layer_types, **_QWEN35, **s)


def random_model(cfg: ModelConfig, dtype: torch.dtype, device, seed: int = 0):
    """HybridForCausalLM with random weights (timing only: values do not change the cost)."""
    from bole.models.qwen3_5 import HybridForCausalLM

    with torch.device("meta"):
        model = HybridForCausalLM(cfg, num_mtp_layers=0, device=device)
    model = model.to(dtype=dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:  # zero-centred norms, A_log = 0, dt_bias = 1 (the layers' own initial values)
                p.fill_(1.0 if name.endswith("dt_bias") else 0.0)
    return model.eval().fuse_projections()


# ------------------------------------------------------------------------------------ measuring
def _time_ms(fns: dict, warmup: int, iters: int, device: torch.device, tick=lambda: None) -> dict:
    """{key: [ms per call]}: warm-up, then ``iters`` rounds calling every fn once (interleaved)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
            tick()
    out = {k: [] for k in fns}
    cuda = device.type == "cuda"
    for _ in range(iters):
        for k, fn in fns.items():
            if cuda:
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                out[k].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                out[k].append((time.perf_counter() - t0) * 1e3)
            tick()
    return out


def synthetic_batch(num_drafts: int, batch: int, depth: int, vocab: int, gen: torch.Generator,
                    device) -> DraftBatch:
    """N drafts split evenly over B requests as random EAGLE-like trees of depth <= depth - 1."""
    shares = [t - 1 for t in split_nodes(num_drafts, batch)]
    T = max(1, max(shares))
    tokens = torch.full((batch, T), -1, dtype=torch.long)
    parents = torch.full((batch, T), -1, dtype=torch.long)
    depths = torch.zeros(batch, T, dtype=torch.long)
    for b, n in enumerate(shares):
        if n:
            tree = random_tree(n, depth - 1, generator=gen)
            parents[b, :n] = torch.tensor(tree.parents)
            depths[b, :n] = torch.tensor(tree.depths)
            tokens[b, :n] = torch.randint(vocab, (n,), generator=gen)
    valid = tokens >= 0
    return DraftBatch(tokens=tokens.to(device), parents=parents.to(device), depth=depths.to(device),
                      rho=torch.where(valid, 0.0, float("-inf")).to(device),
                      source_index=torch.where(valid, torch.arange(T).expand(batch, T), -1).to(device),
                      num_nodes=torch.tensor(shares, device=device))


def _dummy_requests(runner: ModelRunner, batch: int, kv: int, max_nodes: int, vocab: int,
                    gen: torch.Generator) -> list[Request]:
    """B decoding requests with kv committed tokens, holding blocks for kv + their tree and a state slot."""
    reqs = []
    for b in range(batch):
        prompt = torch.randint(vocab, (kv + 1,), generator=gen).tolist()
        r = Request(f"calib-{b}", prompt, SamplingParams(), seed=0)
        # verify writes the tree's K/V at kv + local index: up to 1 + ceil(N / B) positions past kv
        need = blocks_needed(kv + 3 + max_nodes // batch, runner.block_size)
        r.block_table = runner.allocator.allocate(need)
        r.state_slot = runner.state_pool.allocate()
        r.num_computed, r.prefilled = kv, True
        reqs.append(r)
    slots = torch.tensor([r.state_slot for r in reqs], device=runner.device)
    pool = runner.state_pool
    with torch.no_grad():  # allocate() zeroed the slots: give them state-like random contents
        pool.ssm[:, slots] = 0.05 * torch.randn_like(pool.ssm[:, slots])
        pool.conv[:, slots] = torch.randn_like(pool.conv[:, slots])
    return reqs


def _point_fns(runner: ModelRunner, reqs: list[Request], kv: int, depth: int, capture_set,
               gen: torch.Generator) -> dict:
    """{"dec": decode step, N: verify of an N-draft forest} for one bucket point."""
    def decode():
        runner.decode(reqs, keep_hidden=False)
        for r in reqs:  # decode advanced the requests: rewind (their KV entry is simply rewritten)
            r.num_computed = kv

    fns = {"dec": decode}
    for n in feasible_capacities(capture_set, len(reqs)):  # a tree never exceeds MAX_TREE_NODES
        batch = synthetic_batch(n, len(reqs), depth, runner.cfg.vocab_size, gen, runner.device)
        fns[n] = (lambda batch=batch: runner.verify(reqs, batch))
    return fns


def measure(model, plan: SweepPlan, device, dtype: torch.dtype, progress: bool = True) -> list[dict]:
    """Time T_dec and T_ver(N) at every plan point; returns one raw record per point."""
    from tqdm import tqdm

    device = torch.device(device)
    max_b, max_n, bs = max(plan.batch_points), max(plan.capture_set), 16
    per_req = blocks_needed(max(plan.kv_points) + max_n + 3, bs)
    runner = ModelRunner(model, max_b * per_req, bs, max_b, max_n + max_b, dtype, device)
    gen = torch.Generator().manual_seed(plan.seed)
    with torch.no_grad():
        runner.kv_cache.kv.normal_(0.0, 1.0)
    records = []
    calls = len(plan.points()) * (1 + len(plan.capture_set)) * (plan.warmup + plan.iters)
    bar = tqdm(total=calls, desc="calibrate", unit="fwd", disable=not progress)
    for B, kv, d in plan.points():
        reqs = _dummy_requests(runner, B, kv, max_n, model.config.vocab_size, gen)
        fns = _point_fns(runner, reqs, kv, d, plan.capture_set, gen)
        samples = _time_ms(fns, plan.warmup, plan.iters, device, tick=lambda: bar.update(1))
        for r in reqs:
            runner.allocator.free(r.block_table)
            runner.state_pool.free(r.state_slot)
        records.append({"at": [B, kv, d], "dec": samples.pop("dec"), "ver": samples})
    bar.close()
    return records


# ------------------------------------------------------------------------------------ tables
def _r(x: float) -> float:
    return float(round(x, 4))


def build_table(plan: SweepPlan, records: list[dict], header: dict,
                keep_samples: bool = True) -> CalibrationTable:
    """Eq. 12 per bucket from raw records ({"at", "dec": [ms], "ver": {N: [ms]}}); validated."""
    buckets, raw = [], []
    for rec in records:
        B, kv, d = rec["at"]
        t_dec = median(rec["dec"])
        raw_ver = {n: median(s) for n, s in sorted(rec["ver"].items())}
        env, run, worst = {}, 0.0, 0.0
        for n, t in raw_ver.items():
            run = max(run, t)
            env[n] = _r(run)
            worst = max(worst, (run - t) / run)
        t_dec = _r(t_dec)
        buckets.append({**plan.ranges(B, kv, d), "b_ver": select_b_ver(env, t_dec, plan.epsilon),
                        "t_dec_ms": t_dec, "t_ver_ms": env})
        entry = {"at": [B, kv, d], "t_dec_ms": t_dec, "t_ver_ms": {n: _r(t) for n, t in raw_ver.items()},
                 "monotone_fix_max_rel": _r(worst)}
        if keep_samples and len(rec["dec"]) > 1:
            entry["t_dec_samples_ms"] = [_r(t) for t in rec["dec"]]
            entry["t_ver_samples_ms"] = {n: [_r(t) for t in s] for n, s in sorted(rec["ver"].items())}
        raw.append(entry)
    data = dict(header)
    data.update(epsilon=plan.epsilon, capture_set=list(plan.capture_set), buckets=buckets)
    data["provenance"] = {**header.get("provenance", {}), "raw": raw}
    return CalibrationTable.from_dict(data)


def write_table(table: CalibrationTable, path: str) -> None:
    """YAML with a short header comment; leaves in flow style so a bucket reads as one block."""
    import yaml

    CalibrationTable.from_dict(table.to_dict())  # what is written must load
    head = (f"# {table.table_id}: {table.source} verification budgets (eq. 12, epsilon {table.epsilon}).\n"
            "# Written by `python -m bole.calibrate`; how it was obtained is under `provenance`.\n")
    with open(path, "w") as f:
        f.write(head)
        yaml.safe_dump(table.to_dict(), f, sort_keys=False, default_flow_style=None, width=110)


def _versions() -> dict:
    import bole

    out = {"bole": getattr(bole, "__version__", "0.1.0"), "torch": torch.__version__,
           "python": platform.python_version()}
    for mod in ("triton", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # an optional package that is absent or broken is simply not listed
            pass
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    return out


def measured_header(model, device, dtype: torch.dtype, model_name: str, plan: SweepPlan, weights: str,
                    hardware: str | None = None) -> dict:
    dev = torch.device(device)
    return {
        "hardware": hardware or detect_hardware(dev), "model": model_name,
        "dtype": str(dtype).replace("torch.", ""), "tp_size": getattr(model, "tp_size", 1), "versions": _versions(),
        "date": datetime.date.today().isoformat(), "source": "measured",
        "notes": f"measured by bole.calibrate on {device_name(dev)}",
        "provenance": {
            "device_name": device_name(dev), "model_signature": model_signature(model.config),
            "weights": weights, "gdn_backend": model.backend.name,
            "execution": "eager (ModelRunner has no CUDA-graph capture)",
            "timing": {"method": "cuda events after synchronize" if dev.type == "cuda" else "perf_counter",
                       "warmup": plan.warmup, "iters": plan.iters, "statistic": "median",
                       "order": "interleaved rounds over decode and every N",
                       "cpu_threads": torch.get_num_threads()},
            "cache_fill": "blocks and state slots filled directly with random values; no prefill",
            "trees": "N drafts split evenly over B requests, random_tree shapes of depth <= d-1 under "
                     "each request's root: forest of N + B nodes",
            "bucket_point": "each bucket measured at its upper edges (batch, kv, depth)",
            "monotone": "t_ver_ms = running max over N of the raw medians (raw.t_ver_ms)",
            "command": " ".join(["python -m bole.calibrate"] + sys.argv[1:]) if sys.argv else "",
        },
    }


def sweep(model, plan: SweepPlan, device, dtype: torch.dtype, model_name: str, weights: str = "checkpoint",
          hardware: str | None = None, progress: bool = True) -> CalibrationTable:
    records = measure(model, plan, device, dtype, progress)
    header = measured_header(model, device, dtype, model_name, plan, weights, hardware)
    return build_table(plan, records, header)


def modeled_table(cfg: ModelConfig, hardware: str, plan: SweepPlan, model_name: str,
                  assumptions: RooflineAssumptions | None = None, dtype: str = "bfloat16",
                  compare: CalibrationTable | None = None) -> CalibrationTable:
    """A ``source: modeled`` table from the roofline model with ``hardware``'s datasheet figures."""
    assumptions = assumptions or RooflineAssumptions()
    hw = SPECS[hardware]
    wb = 4 if dtype == "float32" else 2
    records = []
    for B, kv, d in plan.points():
        t_dec, t_ver = model_point(cfg, hw, assumptions, B, kv, d, plan.capture_set, wb)
        records.append({"at": [B, kv, d], "dec": [t_dec], "ver": {n: [t] for n, t in t_ver.items()}})
    header = {
        "hardware": hardware, "model": model_name, "dtype": dtype, "tp_size": 1, "versions": _versions(),
        "date": datetime.date.today().isoformat(), "source": "modeled",
        "notes": f"roofline model (bole.calibrate_model) with {hardware} datasheet figures; not measured",
        "provenance": {"model_signature": model_signature(cfg),
                       "method": "roofline (bole/calibrate_model.py)",
                       "formula": "sum over {linear, attention, gdn} of max(flops / (peak * "
                                  "compute_efficiency), bytes / (bandwidth * memory_efficiency)) + fixed + "
                                  "per_layer * layers + per_request_attn * batch * attn_layers + "
                                  "per_node * verified nodes",
                       "hardware_figures": {"bf16_tflops": hw.bf16_tflops, "bandwidth_tbs": hw.bandwidth_tbs},
                       "assumptions": assumptions.to_dict(),
                       "bucket_point": "each bucket modeled at its upper edges (batch, kv, depth)",
                       "command": " ".join(["python -m bole.calibrate"] + sys.argv[1:]) if sys.argv else ""},
    }
    table = build_table(plan, records, header, keep_samples=False)
    if compare is not None:
        err = model_error(cfg, compare, assumptions, wb)
        if assumptions.fitted_on:
            prior = RooflineAssumptions(state_bytes=assumptions.state_bytes)
            err["a_priori"] = model_error(cfg, compare, prior, wb)
        table = replace(table, model_error=err)
    else:
        note = ("unknown: no measured table was given (--compare); scripts/run_gpu_calibrate.sh "
                "reports it against an H200 measurement")
        table = replace(table, provenance={**table.provenance, "model_error": note})
    return table


# ------------------------------------------------------------------------------------ plot and CLI
def plot_table(table: CalibrationTable, path: str) -> bool:
    """T_ver(N)/T_dec curves per bucket with the (1+ε) bound and B_ver marked; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot")
        return False
    kvs = sorted({b.kv for b in table.buckets})
    fig, axes = plt.subplots(1, len(kvs), figsize=(5 * len(kvs), 4), squeeze=False, sharey=True)
    for ax, kv in zip(axes[0], kvs, strict=True):
        for b in (b for b in table.buckets if b.kv == kv):
            ns = sorted(b.t_ver_ms)
            line, = ax.plot(ns, [b.t_ver_ms[n] / b.t_dec_ms for n in ns], marker=".",
                            label=f"batch {b.batch[0]}-{b.batch[1]}, depth {b.depth[1]}")
            ax.plot([b.b_ver], [b.t_ver_ms[b.b_ver] / b.t_dec_ms], marker="*", markersize=14,
                    color=line.get_color())
        ax.axhline(1 + table.epsilon, color="k", linestyle="--", linewidth=1,
                   label=f"1 + ε = {1 + table.epsilon}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("capacity N (draft nodes in the batch)")
        ax.set_title(f"kv {kv[0]}-{kv[1]}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("T_ver(N) / T_dec   (★ = B_ver)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"{table.table_id} ({table.source})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.replace(",", " ").split())


def main(argv=None) -> CalibrationTable:
    ap = argparse.ArgumentParser(prog="python -m bole.calibrate", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint folder (HF format)")
    src.add_argument("--shapes", choices=sorted(SHAPES), help="random-weight model of these shapes (GPU only "
                     "when measuring)")
    ap.add_argument("--out", help="YAML path (default calibration_tables/<hardware>-<model>.yaml)")
    ap.add_argument("--png", help="plot path (default: --out with .png); 'none' to skip")
    ap.add_argument("--model-name", help="model id in the table (default: folder name or shapes name)")
    ap.add_argument("--quick", action="store_true", help=f"quick plan: batch {QUICK_PLAN.batch_points}, kv "
                    f"{QUICK_PLAN.kv_points}, G {QUICK_PLAN.capture_set}, {QUICK_PLAN.iters} iters")
    d = SweepPlan()
    ap.add_argument("--epsilon", type=float, default=d.epsilon)
    ap.add_argument("--batch-buckets", type=_ints, help=f"batch points (default {d.batch_points})")
    ap.add_argument("--kv-buckets", type=_ints, help=f"KV-length points (default {d.kv_points})")
    ap.add_argument("--depths", type=_ints, help=f"tree depths with the root (default {d.depth_points})")
    ap.add_argument("--capture-set", type=_ints, help=f"capacities G (default {d.capture_set})")
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--iters", type=int)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", help="float32 | bfloat16 | float16 (default bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--hardware", help="hardware class to record (default: detected)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    ap.add_argument("--modeled", choices=sorted(k for k, v in SPECS.items() if v.gpu),
                    help="write a roofline-modeled table for this class instead of measuring")
    ap.add_argument("--fit", help="measured table to fit the model's overhead terms on (--modeled)")
    ap.add_argument("--compare", help="measured table to report the model's error against (--modeled)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)

    base = QUICK_PLAN if args.quick else d
    over = {k: v for k, v in (("batch_points", args.batch_buckets), ("kv_points", args.kv_buckets),
                              ("depth_points", args.depths), ("capture_set", args.capture_set),
                              ("warmup", args.warmup), ("iters", args.iters)) if v is not None}
    plan = replace(base, epsilon=args.epsilon, **over)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") or args.modeled else "float32")
    if args.model:
        from bole.llm import resolve_repo_path
        from bole.models.loader import read_config

        path = resolve_repo_path(args.model)
        name = args.model_name or os.path.basename(os.path.normpath(path))
        cfg = read_config(path)[1]
    else:
        name, cfg = args.model_name or args.shapes, shapes_config(args.shapes)

    if args.modeled:
        a = RooflineAssumptions()
        if args.fit:
            a = fit_overheads(cfg, CalibrationTable.load(args.fit), a)
        compare = CalibrationTable.load(args.compare) if args.compare else None
        table = modeled_table(cfg, args.modeled, plan, name, a, dtype, compare)
    else:
        tdtype = getattr(torch, dtype)
        if args.model:
            from bole.models.loader import load_model

            model, weights = load_model(path, dtype=dtype, device=args.device), "checkpoint"
        else:
            if not args.device.startswith("cuda"):
                raise SystemExit(f"--shapes {args.shapes} measures a full-size model: it needs --device cuda")
            model, weights = random_model(cfg, tdtype, args.device, plan.seed), "random"
        table = sweep(model, plan, args.device, tdtype, name, weights, args.hardware, not args.no_progress)

    out = args.out or os.path.join(TABLE_DIR, f"{table.hardware}-{name}.yaml")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_table(table, out)
    png = args.png or os.path.splitext(out)[0] + ".png"
    if png != "none" and plot_table(table, png):
        logger.info("plot: %s", png)
    rows = [f"  batch {b.batch} kv {b.kv} depth {b.depth}: T_dec {b.t_dec_ms:.3f} ms  B_ver {b.b_ver}"
            for b in table.buckets]
    print(f"{table.table_id} ({table.source}) -> {out}\n" + "\n".join(rows))
    if table.model_error:
        print("model_error:", dict(table.model_error))
    return table


if __name__ == "__main__":
    main()
