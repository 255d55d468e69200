"""Fig. 11: the engine's tokens/s and MAT against a fixed verification budget B, per batch size,
with the calibrated B_ver (eq. 12) marked.

Every point runs the engine in ``bole`` mode on the held-out prompts (greedy, ``ignore_eos``) with
the budget forced to B: the engine gets a one-bucket calibration table whose B_ver is B for every
(batch, kv, depth), passed through ``LLMEngine(..., calibration=...)`` (no engine hook needed).
B counts *draft* nodes verified per step for the whole batch, the unit of B_ver and of the
calibration table's capacities N; the verified forest also holds one root (committed) token per
request, so a step verifies up to B + batch tokens (``mean_verified_nodes``). The fairness floor
keeps every request's first-level nodes (top-k each), so budgets below batch * topk verify the
floor, and a request's tree holds at most ``tree_max`` drafts (``mean_draft_nodes`` is what was
really verified). That is the paper's budget (``budget_floor="children"``, ``cap_tree_width=False``),
pinned here; the engine's defaults differ (docs/DESIGN.md §5).

The B_ver the calibrated table would choose comes from ``--table PATH`` or from a quick in-process
sweep (``--calibrate``, ``bole.calibrate.sweep`` on the loaded model, capacities = the budgets):
every lookup the engine made during the sweep at that batch size is recorded (batch, kv, depth) and
looked up in the calibrated table; ``b_ver`` is the most frequent answer (``b_ver_share`` has the
distribution). One more run per batch uses the calibrated table itself (``calibrated_run``).

    python benchmarks/budget_sweep.py --model models/bole-tiny-coder \
        --table calibration_tables/h200-bole-tiny-coder.yaml
    python benchmarks/budget_sweep.py --random full --calibrate        # random weights, bole-tiny-coder shapes
    python benchmarks/budget_sweep.py --smoke                           # CPU harness check (seconds)

Writes a JSON (``--out``) and a PNG next to it (``--png``). On the GPU: benchmarks/run_gpu_budget.sh.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULT_BUDGETS = (8, 16, 32, 64, 128, 256)
TOKENIZER_DIR = os.path.join(ROOT, "models", "bole-tiny-coder")
PROMPTS = os.path.join(ROOT, "benchmarks", "data", "heldout_prompts.jsonl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# ------------------------------------------------------------------------------------ budget override
def fixed_table(budget: int):
    """A calibration table whose every bucket says B_ver = ``budget`` (source: default, no timings)."""
    from bole.spec.budget import CalibrationTable

    return CalibrationTable.from_dict(dict(
        hardware="any", model="any", dtype="any", tp_size=1, versions={}, date="2026-01-01", epsilon=0.0,
        source="default", capture_set=[int(budget)], notes=f"budget_sweep: fixed budget {budget}",
        buckets=[dict(batch=[1, 1 << 20], kv=[0, 1 << 40], depth=[1, 64], b_ver=int(budget),
                      t_dec_ms=None, t_ver_ms=None)]))


class RecordingTable:
    """Wraps a table; every ``lookup`` the engine makes is recorded as (batch, kv, depth)."""

    def __init__(self, table):
        self.table, self.queries = table, []

    def lookup(self, batch_size: int, kv_len: int, depth: int):
        self.queries.append((int(batch_size), int(kv_len), int(depth)))
        return self.table.lookup(batch_size, kv_len, depth)

    def __getattr__(self, name):
        return getattr(self.table, name)


def b_ver_choice(table, queries: list[tuple[int, int, int]], batch: int) -> tuple[int, dict]:
    """(most frequent B_ver, {B_ver: share}) of ``table`` over the lookups made with ``batch`` requests
    (all lookups when none had exactly ``batch``)."""
    full = [q for q in queries if q[0] == batch] or queries
    if not full:
        return table.lookup(batch, 0, 1)[1], {}
    counts = Counter(table.lookup(*q)[1] for q in full)
    share = {str(b): round(n / len(full), 3) for b, n in sorted(counts.items())}
    return max(counts, key=lambda b: (counts[b], b)), share


# ------------------------------------------------------------------------------------ checkpoints
def random_checkpoint(kind: str, out: str, tokenizer_dir: str = TOKENIZER_DIR, seed: int = 0) -> str:
    """Random weights with bole-tiny-coder's tokenizer: ``full`` = its shapes and file layout
    (scripts/train_tiny.py's model, MTP and save_model), ``test`` = the tests' 4-layer factory."""
    tok_cfg = json.load(open(os.path.join(tokenizer_dir, "tokenizer_config.json")))
    tok_json = json.load(open(os.path.join(tokenizer_dir, "tokenizer.json")))
    added = {t["content"]: t["id"] for t in tok_json["added_tokens"]}
    vocab = len(tok_json["model"]["vocab"]) + len([t for t in added if t not in tok_json["model"]["vocab"]])
    torch.manual_seed(seed)
    if kind == "test":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from checkpoints import make_checkpoint

        make_checkpoint(out, "dense", vocab, seed=seed)
        for f in TOKENIZER_FILES:
            shutil.copy(os.path.join(tokenizer_dir, f), out)
    elif kind == "full":
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
        from train_tiny import FULL, MTP, make_config, save_model
        from transformers import Qwen3_5ForCausalLM

        cfg = make_config(FULL, vocab, added[tok_cfg["eos_token"]], added[tok_cfg["pad_token"]])
        model = Qwen3_5ForCausalLM(cfg).eval()
        save_model(model, MTP(model.config).eval(), Path(out), Path(tokenizer_dir))
    else:
        raise ValueError(f"unknown random checkpoint kind {kind!r} (full | test)")
    return out


# ------------------------------------------------------------------------------------ one point
def run_point(model, tokenizer_eos, prompts, warm, batch: int, table, a) -> dict:
    """Warm up, then generate ``prompts`` at ``batch`` concurrent requests with ``table``; returns the
    measurements, the emitted tokens and the recorded table lookups."""
    from bole.config import EngineConfig
    from bole.engine.engine import LLMEngine
    from bole.engine.metrics import EngineMetrics
    from bole.sampling_params import SamplingParams

    longest = max(len(p) for p in prompts + warm)
    lookahead = 1 + a.tree_max
    per_req = -(-(longest + a.max_tokens + lookahead + 1) // a.block_size)
    cfg = EngineConfig.from_options(
        mode="bole", device=a.device, dtype=a.dtype, max_num_seqs=batch, max_num_batched_tokens=a.max_batched_tokens,
        num_blocks=batch * per_req + 8, block_size=a.block_size, depth=a.depth, topk=a.topk, beam=a.beam,
        enable_prefix_cache=not a.no_prefix_cache, eos_token_ids=tokenizer_eos,
        budget_floor="children", cap_tree_width=False,  # Fig. 11's budget: the paper's floor, trees uncapped
        max_verify_rows=batch * lookahead)              # and the rows too (bole's default bounds them)
    rec = RecordingTable(table)
    eng = LLMEngine(model, cfg, tokenizer=None, calibration=rec)

    def generate(ps, max_tokens):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        ids = [eng.add_request(p, sp) for p in ps]
        while eng.has_unfinished():
            eng.step()
        return [eng.pop_finished(i).output_token_ids for i in ids]

    generate(warm[:batch], a.warmup_tokens)   # compiles / caches the shapes of this batch and budget
    eng.metrics = EngineMetrics()
    rec.queries.clear()
    sync = torch.cuda.synchronize if eng.runner.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    outs = generate(prompts, a.max_tokens)
    sync()
    dt = time.perf_counter() - t0
    m = eng.metrics
    steps = max(m.decode_steps, 1)
    n = sum(len(o) for o in outs)
    res = dict(tokens_per_s=round(n / dt, 2),
               decode_tokens_per_s=round(m.emitted_tokens / m.verify_time, 2) if m.verify_time else None,
               mat=round(m.mat, 4), mean_b_ver=round(m.b_ver_sum / steps, 2),
               mean_verified_nodes=round(m.tree_nodes / steps, 2),
               mean_draft_nodes=round((m.tree_nodes - m.request_steps) / steps, 2),
               mean_batch=round(m.request_steps / steps, 3), decode_steps=m.decode_steps, tokens=n,
               seconds=round(dt, 3))
    return res, outs, list(rec.queries)


# ------------------------------------------------------------------------------------ calibration
def calibrate_in_process(model, a, name: str, weights: str):
    from bole.calibrate import SweepPlan, sweep

    plan = SweepPlan(batch_points=tuple(sorted(set(a.batches))), kv_points=tuple(a.calib_kv),
                     depth_points=(a.depth + 1,), capture_set=tuple(sorted(set(a.budgets))),
                     epsilon=a.epsilon, warmup=a.calib_warmup, iters=a.calib_iters)
    return sweep(model, plan, a.device, getattr(torch, a.dtype), name, weights, progress=False)


def table_summary(table, origin: str) -> dict:
    return dict(origin=origin, table_id=table.table_id, source=table.source, epsilon=table.epsilon,
                model_signature=table.provenance.get("model_signature"),
                buckets=[dict(batch=list(b.batch), kv=list(b.kv), depth=list(b.depth), b_ver=b.b_ver,
                              t_dec_ms=b.t_dec_ms, t_ver_ms=None if b.t_ver_ms is None else
                              {str(n): t for n, t in b.t_ver_ms.items()}) for b in table.buckets])


# ------------------------------------------------------------------------------------ plot
def plot(result: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for pb in result["per_batch"]:
        pts = sorted((p for p in result["points"] if p["batch"] == pb["batch"]), key=lambda p: p["budget"])
        if not pts:
            continue
        xs = [p["budget"] for p in pts]
        line, = ax.plot(xs, [p["tokens_per_s"] for p in pts], marker="o", label=f"batch {pb['batch']}")
        c = line.get_color()
        ax2.plot(xs, [p["mat"] for p in pts], marker="o", color=c, label=f"batch {pb['batch']}")
        if pb.get("b_ver") is not None:
            for axis in (ax, ax2):
                axis.axvline(pb["b_ver"], color=c, linestyle="--", linewidth=1)
            ax.annotate(f"B_ver={pb['b_ver']}", (pb["b_ver"], max(p["tokens_per_s"] for p in pts)),
                        color=c, fontsize=7, rotation=90, va="top", ha="right")
        if pb.get("peak_budget") is not None:
            ax.plot([pb["peak_budget"]], [pb["peak_tokens_per_s"]], marker="*", markersize=14, color=c)
    for axis, label in ((ax, "tokens/s (★ = peak)"), (ax2, "MAT (tokens per request-step)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(result["config"]["budgets"], [str(b) for b in result["config"]["budgets"]])
        axis.set_xlabel("verification budget B (draft nodes per step, whole batch)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(f"bole mode vs budget: {result['model']} on {result['device']} (dashed: calibrated B_ver, "
                 f"{result['calibration']['origin'] if result.get('calibration') else 'none'})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------ main
def _versions() -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    for mod in ("triton", "transformers", "bole"):
        try:
            out[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception:  # noqa: BLE001 - absent or broken: just not recorded
            pass
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint folder (default models/bole-tiny-coder)")
    src.add_argument("--random", choices=("full", "test"),
                     help="random weights with bole-tiny-coder's tokenizer: its shapes (full) or the tests' tiny ones")
    cal = ap.add_mutually_exclusive_group()
    cal.add_argument("--table", help="calibrated table whose B_ver is reported (and run) per batch")
    cal.add_argument("--calibrate", action="store_true", help="quick in-process calibration sweep instead")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--budgets", type=int, nargs="+", default=list(DEFAULT_BUDGETS))
    ap.add_argument("--prompts", default=PROMPTS)
    ap.add_argument("--waves", type=int, default=4, help="prompts per point = waves x batch (same prompts at every "
                    "budget of a batch; a batch's prompts start with the smaller batches')")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warmup-tokens", type=int, default=8)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--beam", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=1024)
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--no-calibrated-run", action="store_true", help="skip the run with the calibrated table")
    ap.add_argument("--calib-kv", type=int, nargs="+", default=[128, 512], help="--calibrate: KV bucket points")
    ap.add_argument("--calib-warmup", type=int, default=1)
    ap.add_argument("--calib-iters", type=int, default=4)
    ap.add_argument("--epsilon", type=float, default=0.1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", help="default bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--time-budget-s", type=float, default=None, help="start no point after this many seconds")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/budget_sweep_<hw>.json)")
    ap.add_argument("--png", default=None, help="plot path (default: --out with .png); 'none' to skip")
    ap.add_argument("--smoke", action="store_true", help="CPU harness check: random test checkpoint, batches 1 2, "
                    "budgets 2 8 32, depth 3 / top-k 4 / beam 4, 8 tokens, in-process calibration")
    a = ap.parse_args(argv)
    if a.smoke:
        a.random = a.random or "test"
        if not a.table:
            a.calibrate = True
        a.batches, a.budgets, a.waves, a.max_tokens, a.warmup_tokens = [1, 2], [2, 8, 32], 1, 8, 2
        a.depth, a.topk, a.beam, a.calib_kv, a.calib_warmup, a.calib_iters = 3, 4, 4, [64], 0, 1
    a.dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    if min(a.budgets) < 1 or min(a.batches) < 1 or a.waves < 1:
        ap.error("budgets, batches and waves must be >= 1")
    a.budgets, a.batches = sorted(set(a.budgets)), sorted(set(a.batches))
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    from bole.hardware import detect_hardware, device_name, model_signature
    from bole.llm import resolve_repo_path
    from bole.models.loader import load_model
    from bole.spec.budget import CalibrationTable
    from bole.spec.drafter import tree_size

    t_start = time.perf_counter()
    tmp = None
    try:
        if a.random:
            tmp = tempfile.mkdtemp(prefix="bole_budget_")
            path, weights = random_checkpoint(a.random, tmp), f"random-{a.random}"
            model_name = "bole-tiny-coder (random weights)" if a.random == "full" else "random test model"
        else:
            path = resolve_repo_path(a.model or "models/bole-tiny-coder")
            if not any(f.endswith(".safetensors") for f in os.listdir(path)):
                raise SystemExit(f"{path} has no weights yet: use --random full (same shapes) until they arrive")
            weights, model_name = "checkpoint", os.path.basename(os.path.normpath(path))
        model = load_model(path, dtype=a.dtype, device=a.device)
        tok = AutoTokenizer.from_pretrained(path)
        hw = detect_hardware(a.device)
        a.tree_max = tree_size(model.config.vocab_size, a.depth, a.topk, a.beam)
        texts = [json.loads(line)["prompt"] for line in open(a.prompts)]
        need = a.waves * max(a.batches) + max(a.batches)
        if len(texts) < need:
            raise SystemExit(f"{a.prompts} has {len(texts)} prompts, {need} needed")
        ids = [tok.encode(t) for t in texts[:need]]
        timed_all, warm = ids[: a.waves * max(a.batches)], ids[a.waves * max(a.batches):]
        eos = tuple(x for x in (tok.eos_token_id,) if x is not None)

        calib, calib_info = None, None
        if a.table:
            calib = CalibrationTable.load(resolve_repo_path(a.table))
            calib_info = table_summary(calib, a.table)
        elif a.calibrate:
            t0 = time.perf_counter()
            calib = calibrate_in_process(model, a, model_name, weights)
            calib_info = {**table_summary(calib, "in-process quick sweep (--calibrate)"),
                          "seconds": round(time.perf_counter() - t0, 2)}
        if calib_info is not None:
            sig = model_signature(model.config)
            calib_info["matches_model"] = calib_info["model_signature"] in (None, sig)
            if not calib_info["matches_model"]:
                print(f"warning: table measured for {calib_info['model_signature']}, model is {sig}", file=sys.stderr)

        out = a.out or os.path.join(ROOT, "benchmarks", "results", f"budget_sweep_{hw}.json")
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        result = dict(
            device=device_name(a.device) if a.device.startswith("cuda") else
            f"cpu ({platform.processor() or platform.machine()}, {a.threads} thread)",
            hardware=hw, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command=" ".join(["python benchmarks/budget_sweep.py"] + list(sys.argv[1:] if argv is None else argv)),
            versions=_versions(), model=model_name, weights=weights, model_signature=model_signature(model.config),
            dtype=a.dtype,
            config=dict(mode="bole", batches=a.batches, budgets=a.budgets, depth=a.depth, topk=a.topk, beam=a.beam,
                        tree_max=a.tree_max, waves=a.waves, max_tokens=a.max_tokens, greedy=True,
                        prefix_cache=not a.no_prefix_cache, prompts=os.path.relpath(a.prompts, ROOT),
                        budget_unit="draft nodes verified per step for the whole batch (= B_ver's unit); "
                                    "each step also verifies one root token per request"),
            calibration=calib_info, points=[], per_batch=[], skipped=[], notes=[])

        def save():
            with open(out + ".tmp", "w") as f:
                json.dump(result, f, indent=1)
            os.replace(out + ".tmp", out)

        reference: dict[int, list[int]] = {}   # prompt index -> greedy tokens (first run that made them)
        for batch in a.batches:
            prompts = timed_all[: a.waves * batch]
            queries, row = [], dict(batch=batch, floor=batch * min(a.topk, model.config.vocab_size),
                                    tree_max=batch * a.tree_max)
            for budget in a.budgets:
                if a.time_budget_s is not None and time.perf_counter() - t_start > a.time_budget_s:
                    result["skipped"].append(dict(batch=batch, budget=budget))
                    continue
                res, outs, q = run_point(model, eos, prompts, warm, batch, fixed_table(budget), a)
                queries += q
                same = 0
                for i, o in enumerate(outs):
                    same += reference.setdefault(i, o) == o
                point = dict(batch=batch, budget=budget, **res, match_reference=round(same / len(outs), 4))
                result["points"].append(point)
                print(json.dumps(point), flush=True)
                save()
            pts = [p for p in result["points"] if p["batch"] == batch]
            if pts:
                best = max(pts, key=lambda p: p["tokens_per_s"])
                row.update(peak_budget=best["budget"], peak_tokens_per_s=best["tokens_per_s"])
            if calib is not None:
                row["b_ver"], row["b_ver_share"] = b_ver_choice(calib, queries, batch)
                at = [p for p in pts if p["budget"] == row["b_ver"]]
                row["tokens_per_s_at_b_ver"] = at[0]["tokens_per_s"] if at else None
                timed_out = a.time_budget_s is not None and time.perf_counter() - t_start > a.time_budget_s
                if not a.no_calibrated_run and not timed_out:
                    res, outs, _ = run_point(model, eos, prompts, warm, batch, calib, a)
                    same = sum(reference.setdefault(i, o) == o for i, o in enumerate(outs))
                    row["calibrated_run"] = dict(**res, match_reference=round(same / len(outs), 4))
            result["per_batch"].append(row)
            print(json.dumps(row), flush=True)
            save()
        if any(p["match_reference"] < 1 for p in result["points"]):
            result["notes"].append("greedy tokens differ between points on some prompts (match_reference < 1): "
                                   "numerics of different tree shapes / batch sizes, or a bug")
        result["seconds"] = round(time.perf_counter() - t_start, 1)
        save()
        png = a.png or os.path.splitext(out)[0] + ".png"
        if png != "none" and plot(result, png):
            print(f"plot: {png}")
        print(f"json: {out}")
        summary = {pb["batch"]: {k: pb.get(k) for k in ("b_ver", "peak_budget")} for pb in result["per_batch"]}
        print(json.dumps({"device": result["device"], "seconds": result["seconds"], "per_batch": summary}))
        return result
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
