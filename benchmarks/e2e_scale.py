"""Paper-scale end to end (``python benchmarks/e2e.py --scale``): ar / serial_tree / bole at batch 1..32
on widened checkpoints, one worker process per model, on one GPU.

Models: models/bole-tiny-coder widened (``bole.models.widen``) to each shape of ``--models``
(``bole.calibrate_sweep.SHAPES``: qwen3.5-4b, qwen3.5-9b, qwen3.5-27b by default; qwen3.5-35b-a3b, the MoE
shape, when named: every dense layer of the source becomes a MoE block, ``bole.models.widen``; 71 GB in bf16,
so its ``--widen-dir`` must have the room, e.g. /dev/shm, which is checked before widening). A widened model
costs what its shape costs (layers, GEMMs, GDN states, KV cache, the 248,320-row vocabulary: embedding and
lm_head) and predicts what the embedded model predicts, so MAT is the trained drafter's: every row is
labelled "<shape>-cost, embedded model's predictions". Checkpoints are written once under ``--widen-dir``
(bf16) and reused while their ``widen.json`` (source files, shape, dtype) matches; with
``--widen-in-memory`` each model's worker widens into host memory instead (no disk holds the weights).

Per model a worker subprocess runs the cells batch x mode (ar first at each batch), each on a fresh
``bole.LLM`` over the worker's one loaded model (``build_engine(model=...)``: the weights load once per
model; bf16 and CUDA graphs on CUDA; prefix cache off, so every run prefills its prompts):
held-out prompts[:batch], greedy, ``--max-tokens`` each (ignore_eos), timed by
``benchmarks.engine_modes.time_llm`` (warm-up, then the median of ``--repeats`` runs). Columns:
tokens/s, MAT, the step's phases the engine exposes (``LLMEngine.stats().verify_time_share``: the share
of step time in the decode forward, or in draft + verify + sample + commit; the rest is prefill,
scheduling and emission; mean TTFT / TPOT; wall ms per engine step; the timed steps whose parts ran
without a CUDA graph and the graphs a timed step had to capture, both 0 in a clean GPU cell), peak memory
(``torch.cuda.max_memory_allocated`` from the engine's construction on) and ``exact_vs_ar`` (the cell's
tokens equal the ar cell's at the same batch; None on ar rows, the reference). A cell out of memory is
``oom`` (the mode's larger batches then ``skipped_after_oom``), one whose engine construction raises
ValueError ``refused``. The worker computes the ratios (bole/ar, bole/serial_tree, serial_tree/ar per
batch; geometric means over batches 1-16) from its own cells: every ratio is of one process.
``--draft-vocab N ...`` adds a bole cell ``bole_fr<N>`` per N at every batch (``SpecConfig.draft_vocab``:
the drafter scores the N most frequent training tokens), with its ratio to ar (and to ``serial_tree_fr<N>``,
the like-for-like baseline, where ``--also-cell`` adds it); ``--also-table NAME ...``
a cell ``bole@NAME`` per NAME (bole with calibration_tables/NAME.yaml as its budget table, e.g. the
unmeasured defaults beside a calibrated ``--calibration-table``).

Budgets: ``--budget-s`` for the whole run, widening included (no cell starts after it; a worker still
running ``--grace-s`` later is killed), ``--cell-budget-s`` per cell (no further timed run starts after
it; a cell still running at twice it plus ``--grace-s`` has its worker killed: ``timeout``). The JSON
(``--out``, default benchmarks/results/e2e_scale_<hardware>.json) is rewritten after every cell.

    python benchmarks/e2e.py --scale --models qwen3.5-9b          # GPU (benchmarks/run_gpu_scale.sh)
    python benchmarks/e2e.py --scale --smoke --out /tmp/s.json   # CPU, a tiny widening, < 1 min
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import gc
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bole.calibrate_sweep import DENSE_SHAPES, SHAPES, shapes_config  # noqa: E402
from bole.models.widen import TARGET_FIELDS, copy_tokenizer_files, widen  # noqa: E402

MODES = ("ar", "serial_tree", "bole")
RATIOS = (("bole", "ar"), ("bole", "serial_tree"), ("serial_tree", "ar"))
FR_SEP = "_fr"  # <mode>_fr<N>: the speculative cell with draft_vocab=N
FR_PREFIX = "bole" + FR_SEP  # --draft-vocab N adds bole_fr<N>
TABLE_SEP = "@"        # bole@<table>: the bole cell with calibration_tables/<table>.yaml as its budget table
GEOMEAN_MAX_BATCH = 16
TAG = "@@e2e_scale "  # a worker's stdout lines that carry an event (JSON) for the parent
SMOKE_SHAPE = dict(hidden_size=512, num_hidden_layers=20, linear_num_key_heads=4, linear_num_value_heads=8,
                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024,
                   vocab_size=16384)  # Qwen3.5 head dims


def label(shape: str) -> str:
    return f"{shape}-cost, embedded model's predictions"


SPEC_RE = re.compile(r"-d(\d+)k(\d+)b(\d+)$")  # a cell's drafting suffix: -d<depth>k<topk>b<beam>
EPS_RE = re.compile(r"-e(\d+(?:\.\d+)?)$")     # a cell's budget suffix: -e<budget_epsilon>
CAP_RE = re.compile(r"-(w|no)cap$")             # a cell's tree-width suffix: cap_tree_width True / False
FLOOR_RE = re.compile(r"-(best1|kids)$")        # a cell's floor suffix: budget_floor "best_child" / "children"
ROWS_RE = re.compile(r"-r(\d+)$")               # a cell's verify-rows suffix: max_verify_rows
RULE_RE = re.compile(r"-(gp|eq12)$")            # a cell's budget-rule suffix: budget_rule "goodput" / "epsilon"
CELL_FORM = "MODE[_fr<N>][@<table>][-d<D>k<K>b<B>][-e<E>][-wcap|-nocap][-best1|-kids][-r<R>][-gp|-eq12]"
PAPER = "-nocap-kids"  # the paper's budget (Algorithm 3: all first-level drafts as the floor, trees uncapped)


def _strip(name: str, pattern: re.Pattern) -> tuple[str, re.Match | None]:
    m = pattern.search(name)
    return (name[:m.start()], m) if m else (name, None)


def engine_mode(cell_mode: str) -> tuple[str, dict]:
    """A cell's engine mode and extra options, from its name ``CELL_FORM``: ``bole_fr<N>`` is bole with
    ``draft_vocab=N``, ``@<name>`` the budget table calibration_tables/<name>.yaml, ``-d<D>k<K>b<B>`` the
    drafting settings depth D, topk K, beam B instead of the run's, ``-e<E>`` ``budget_epsilon=E`` (B_ver
    re-derived from the table's timings at ε = E), ``-wcap`` / ``-nocap`` ``cap_tree_width`` True / False,
    ``-best1`` / ``-kids`` ``budget_floor`` "best_child" / "children" (without them, the engine's
    defaults), ``-r<R>`` ``max_verify_rows=R``, ``-gp`` / ``-eq12`` ``budget_rule`` "goodput" / "epsilon"
    (without them, the engine's "auto": goodput on the MoE shape). ValueError naming the cell for any
    other name."""
    extra, rest = {}, cell_mode
    rest, m = _strip(rest, RULE_RE)
    if m:
        extra["budget_rule"] = "goodput" if m[1] == "gp" else "epsilon"
    rest, m = _strip(rest, ROWS_RE)
    if m:
        extra["max_verify_rows"] = int(m[1])
    rest, m = _strip(rest, FLOOR_RE)
    if m:
        extra["budget_floor"] = "best_child" if m[1] == "best1" else "children"
    rest, m = _strip(rest, CAP_RE)
    if m:
        extra["cap_tree_width"] = m[1] == "w"
    rest, m = _strip(rest, EPS_RE)
    if m:
        extra["budget_epsilon"] = float(m[1])
    rest, m = _strip(rest, SPEC_RE)
    if m:
        extra.update(depth=int(m[1]), topk=int(m[2]), beam=int(m[3]))
    if TABLE_SEP in rest:
        rest, table = rest.split(TABLE_SEP, 1)
        extra["calibration_table"] = f"calibration_tables/{table}.yaml"
    mode, _, n = rest.rpartition(FR_SEP)
    if mode in MODES and mode != "ar" and n.isdigit():  # serial_tree_fr<N>: bole_fr<N>'s like-for-like baseline
        extra["draft_vocab"] = int(n)
        rest = mode
    if rest not in MODES or (rest == "ar" and extra):
        raise ValueError(f"cell {cell_mode!r}: not {CELL_FORM} with MODE in {MODES} (ar takes no options)")
    return rest, extra


def base_mode(cell_mode: str) -> str:
    """The mode a cell compares as: its drafting, budget, width and floor suffixes dropped
    (``serial_tree-d8k2b2`` pairs with ``bole-d8k2b2`` as serial_tree with bole)."""
    for pattern in (ROWS_RE, FLOOR_RE, CAP_RE, EPS_RE, SPEC_RE):
        cell_mode = _strip(cell_mode, pattern)[0]
    return cell_mode


def shape_config(name: str):
    """``shapes_config(name)``; "smoke": the 9B's head dims (256 / 128) at a tiny width, 20 layers."""
    if name != "smoke":
        return shapes_config(name)
    n = SMOKE_SHAPE["num_hidden_layers"]
    types = tuple("full_attention" if i % 4 == 3 else "linear_attention" for i in range(n))
    return dataclasses.replace(shapes_config("qwen3.5-9b"), layer_types=types, **SMOKE_SHAPE)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=None,
                    help=f"shapes, of {sorted(SHAPES)} (default: {sorted(DENSE_SHAPES)})")
    ap.add_argument("--source", default=str(REPO_ROOT / "models" / "bole-tiny-coder"), help="model to widen")
    ap.add_argument("--widen-dir", default=os.path.join(tempfile.gettempdir(), "bole-widened"),
                    help="widened checkpoints are written (once) and reused here")
    ap.add_argument("--prompts", default=str(REPO_ROOT / "benchmarks" / "data" / "heldout_prompts.jsonl"))
    ap.add_argument("--batches", type=int, nargs="*", default=None, help="1 2 4 8 16 32 (smoke: 1 2)")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per request (128; smoke 4)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per cell (the median is reported)")
    ap.add_argument("--depth", type=int, default=None, help="draft tree depth (4; smoke 2)")
    ap.add_argument("--topk", type=int, default=None, help="(4; smoke 2)")
    ap.add_argument("--beam", type=int, default=None, help="(4; smoke 2)")
    ap.add_argument("--draft-vocab", type=int, nargs="+", default=[],
                    help="a bole_fr<N> cell per N: the drafter scores the N most frequent tokens")
    ap.add_argument("--calibration-table", default="calibration_tables/default.yaml")
    ap.add_argument("--also-table", nargs="+", default=[], metavar="NAME",
                    help="a bole@<NAME> cell per NAME: bole with calibration_tables/<NAME>.yaml as its table")
    ap.add_argument("--also-spec", nargs="+", default=[], metavar="D,K,B",
                    help="every speculative cell again per D,K,B with depth D, topk K, beam B: <cell>-d<D>k<K>b<B>")
    ap.add_argument("--also-epsilon", type=float, nargs="+", default=[], metavar="E",
                    help="every bole cell again per E with budget_epsilon=E (B_ver re-derived from the table's "
                         "timings at that ε): <cell>-e<E>")
    ap.add_argument("--also-paper", action="store_true",
                    help=f"every speculative cell again with the paper's budget (cap_tree_width=False, "
                         f"budget_floor='children'; the engine's defaults are the opposite): <cell>{PAPER}")
    ap.add_argument("--also-cell", nargs="+", default=[], metavar="CELL",
                    help=f"cells named in full ({CELL_FORM}), added last: one combination without the others")
    ap.add_argument("--budget-s", type=float, default=None, help="whole run, widening included (480; smoke 150)")
    ap.add_argument("--cell-budget-s", type=float, default=None,
                    help="per cell: no timed run starts after this many seconds of them (the engine's construction, "
                         "captures and warm-up excluded: a process's first cell pays the compiles; 60; smoke 40); a "
                         "cell whose construction, or whose captures and runs, take more than twice this and "
                         "--grace-s is killed")
    ap.add_argument("--grace-s", type=float, default=60.0, help="a late worker is killed this much after a budget")
    ap.add_argument("--widen-in-memory", action="store_true",
                    help="each model's worker widens into host memory and loads from there: no disk holds the "
                         "weights (--widen-dir gets the config and tokenizer files only)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="every cell's step token budget (the engine's default: 1024); it bounds the widest lm_head "
                         "call, whose logits the memory plan reserves: 512 lets the 35B-A3B MoE shape's cells "
                         "plan beside its 66 GiB of weights on an 80 GB card")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="every cell's share of the device the memory plan may fill (the engine's default: 0.9); "
                         "the 35B-A3B MoE shape's 66 GiB of weights leave its bole cells too little at 0.9 on an "
                         "80 GB card")
    ap.add_argument("--no-prefill-split", dest="prefill_split", action="store_false",
                    help="every cell with cuda_graph_prefill_split=False (the engine's default is True): a prefill "
                         "longer than the largest prefill graph runs as one eager forward, not as graphed waves")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny widening of the embedded model")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/e2e_scale_<tag>.json)")
    ap.add_argument("--tag", default=None, help="name suffix (default: the hardware class, 'smoke')")
    ap.add_argument("--png", default=None, help="tokens/s against batch per model (default: beside the JSON; "
                                                "'none': off)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one model's cells (JSON), internal
    a = ap.parse_args(argv)
    pick = lambda v, full, small: v if v is not None else (small if a.smoke else full)
    a.models = pick(a.models, sorted(DENSE_SHAPES), ["smoke"])
    bad = sorted(set(a.models) - set(SHAPES) - ({"smoke"} if a.smoke else set()))
    if bad:
        ap.error(f"unknown models {bad}; choose from {sorted(SHAPES)}")
    missing = [n for n in a.also_table if not (REPO_ROOT / "calibration_tables" / f"{n}.yaml").is_file()]
    if missing:
        ap.error(f"--also-table: no calibration_tables/<name>.yaml for {missing}")
    a.modes = [m for m in MODES if m in a.modes] + [f"{FR_PREFIX}{n}" for n in a.draft_vocab] + \
        [f"bole{TABLE_SEP}{n}" for n in a.also_table]  # ar first
    try:
        specs = [tuple(int(x) for x in v.split(",")) for v in a.also_spec]
    except ValueError:
        specs = [()]
    if any(len(t) != 3 or min(t) < 1 for t in specs):
        ap.error(f"--also-spec: each value is D,K,B (three ints >= 1), got {a.also_spec}")
    a.modes += [f"{m}-d{d}k{k}b{b}" for d, k, b in specs for m in a.modes if m != "ar"]
    if any(not 0 <= e < math.inf for e in a.also_epsilon):
        ap.error(f"--also-epsilon: each value is a finite number >= 0, got {a.also_epsilon}")
    a.modes += [f"{m}-e{e:g}" for e in a.also_epsilon for m in a.modes if base_mode(m).startswith("bole")]
    if a.also_paper:
        a.modes += [f"{m}{PAPER}" for m in a.modes if m != "ar"]
    for cell in a.also_cell:
        try:
            engine_mode(cell)
        except ValueError as e:
            ap.error(f"--also-cell: {e}")
    a.modes += [c for c in a.also_cell if c not in a.modes]
    a.batches = pick(a.batches, [1, 2, 4, 8, 16, 32], [1, 2])
    a.max_tokens = pick(a.max_tokens, 128, 4)
    a.depth, a.topk, a.beam = (pick(v, 4, 2) for v in (a.depth, a.topk, a.beam))
    a.budget_s = pick(a.budget_s, 480.0, 150.0)
    a.cell_budget_s = pick(a.cell_budget_s, 60.0, 40.0)
    return a


# ------------------------------------------------------------------------------------------ widening
def widened(source: str, shape: str, widen_dir: str) -> tuple[str, dict]:
    """The widened checkpoint folder of ``shape`` (built now unless a matching one is there) and its record."""
    cfg = shape_config(shape)
    files = sorted(f for f in os.listdir(source) if f.endswith(".safetensors") or f == "config.json")
    want = json.loads(json.dumps(dict(
        source=os.path.abspath(source), dtype="bfloat16", shape={f: getattr(cfg, f) for f in TARGET_FIELDS},
        source_files={f: hashlib.sha256(open(os.path.join(source, f), "rb").read()).hexdigest()[:16]
                      for f in files})))
    dst = Path(widen_dir) / shape
    record = dst / "widen.json"
    if record.exists() and json.loads(record.read_text()).get("input") == want:
        copy_tokenizer_files(source, str(dst))  # files added to the source since (token_frequencies.json)
        return str(dst), dict(json.loads(record.read_text()), reused=True)
    t0 = time.time()
    tmp = dst.with_name(shape + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(dst, ignore_errors=True)  # stale: replaced, and its room is needed while the new one is written
    need, free = widened_bytes(cfg), free_bytes(widen_dir)
    if need * 1.02 > free:
        raise NoRoom(f"widening {shape} writes {need / 2**30:.1f} GiB, {widen_dir} has {free / 2**30:.1f} GiB "
                     "free: pass --widen-dir on a larger disk or a large enough /dev/shm")
    try:
        report = widen(source, str(tmp), cfg, dtype="bfloat16")
        copy_tokenizer_files(source, str(tmp))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial widening (a full disk, or tmpfs RAM) is not kept
        raise
    size = sum(f.stat().st_size for f in tmp.iterdir() if f.suffix == ".safetensors")
    done = dict(input=want, **report_fields(report), weight_bytes=size, widen_s=round(time.time() - t0, 1))
    (tmp / "widen.json").write_text(json.dumps(done, indent=1))
    os.replace(tmp, dst)
    return str(dst), dict(done, reused=False)


def widened_in_memory(source: str, shape: str, widen_dir: str) -> tuple[str, dict]:
    """``--widen-in-memory``: only the config.json and tokenizer files of ``shape``'s widening, in
    ``widen_dir``/<shape>.config; the model's worker widens the weights into host memory and loads them
    from there (``load_model(tensors=...)``), so no disk need hold them (the 71 GB MoE shape on a 64 GiB
    disk). Refused before anything is written when the host's available memory cannot hold them."""
    cfg = shape_config(shape)
    need, free = widened_bytes(cfg), available_memory()
    if need * 1.1 > free:
        raise NoRoom(f"widening {shape} into memory holds {need / 2**30:.1f} GiB, the host has "
                     f"{free / 2**30:.1f} GiB available")
    dst = Path(widen_dir) / (shape + ".config")
    shutil.rmtree(dst, ignore_errors=True)
    from bole.models.widen import write_widened_config

    report = write_widened_config(source, str(dst), cfg)
    copy_tokenizer_files(source, str(dst))
    return str(dst), dict(**report_fields(report), weight_bytes=need, in_memory=True, reused=False)


def report_fields(report) -> dict:
    """What a model's record keeps of its ``WidenReport``."""
    return dict(copies=report.copies, eps=report.eps, exact_norms=not any(report.eps_bounds.values()))


def available_memory() -> int:
    """Bytes of host memory available (``MemAvailable`` of /proc/meminfo; the physical pages elsewhere)."""
    try:
        with open("/proc/meminfo") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class NoRoom(OSError):
    """The widening does not fit where it would be written (checked before writing)."""


def widened_bytes(cfg) -> int:
    """bf16 bytes of the widened checkpoint of ``cfg`` (its parameters, the MTP layer's included)."""
    from bole.models.qwen3_5 import HybridForCausalLM

    with torch.device("meta"):
        model = HybridForCausalLM(cfg, backend="torch", num_mtp_layers=max(1, cfg.num_mtp_layers), device="meta")
    return 2 * sum(p.numel() for p in model.parameters())


def free_bytes(path: str) -> int:
    """Free bytes where ``path`` is (or would be created)."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


# -------------------------------------------------------------------------------------------- worker
def num_blocks(prompt_tokens: list[int], max_tokens: int, depth: int, block: int = 16) -> int:
    """KV blocks for the batch: prompt + output + a step's lookahead per request, a quarter spare."""
    need = sum(math.ceil((n + max_tokens + depth + 2) / block) + 1 for n in prompt_tokens)
    return int(need * 1.25) + 16


_LOADED: dict = {}  # the worker's model, loaded by its first cell and shared by every cell's engine


def shared_model(spec: dict, dtype: str):
    """The worker's one model (a 71 GB MoE widening loads once, not once per cell)."""
    from bole.models.loader import load_model
    from bole.models.widen import widened_tensors

    key = (spec["path"], dtype, spec["device"])
    if key not in _LOADED:
        _LOADED.clear()
        tensors = None
        if spec.get("in_memory"):  # --widen-in-memory: the weights exist only here, widened now
            t0 = time.time()
            tensors = dict(widened_tensors(spec["source"], shape_config(spec["shape"]), dtype="bfloat16"))
            print(f"{spec['shape']}: widened into memory in {time.time() - t0:.1f}s", flush=True)
        _LOADED[key] = load_model(spec["path"], dtype=dtype, device=spec["device"], tensors=tensors)
    return _LOADED[key]


def run_cell(spec: dict, mode: str, batch: int, prompts: list[dict],
             on_timing=lambda: None) -> tuple[dict, list | None]:
    """One (mode, batch) cell on a fresh engine over the worker's loaded model (``shared_model``): its row
    and output tokens (None unless it ran)."""
    from benchmarks.engine_modes import time_llm
    from bole import LLM

    cuda = spec["device"] == "cuda"
    row = dict(model=label(spec["shape"]), shape=spec["shape"], mode=mode, batch=batch, status="ok",
               cuda_graphs=cuda, dtype="bfloat16" if cuda else "float32", max_tokens=spec["max_tokens"])
    run_mode, extra = engine_mode(mode)
    row.update(extra)
    t0 = time.time()
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    llm, toks = None, None
    model = shared_model(spec, row["dtype"])  # a load that fails is the run's error, not the cell's
    on_timing()   # loaded (a first cell widens and loads the model: --widen-in-memory's 71 GB): the clock restarts
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # the cell's peak (the resident weights included)
    try:
        opts = {**dict(calibration_table=spec["calibration_table"], depth=spec["depth"], topk=spec["topk"],
                       beam=spec["beam"]), **extra}
        for k in ("max_num_batched_tokens", "gpu_memory_utilization"):
            if spec.get(k):
                opts[k] = spec[k]
        llm = LLM(spec["path"], model=model, mode=run_mode, **opts,
                  device=spec["device"], dtype=row["dtype"], enable_cuda_graphs=cuda, max_num_seqs=batch,
                  enable_prefix_cache=False, cuda_graph_prefill_split=spec.get("prefill_split", True),
                  num_blocks=num_blocks([p["prompt_tokens"] for p in prompts[:batch]], spec["max_tokens"],
                                        opts["depth"]))
        row["cuda_graph_prefill_split"] = llm.engine.config.cuda_graph_prefill_split   # as the engine took it
        row["max_num_batched_tokens"] = llm.engine.config.max_num_batched_tokens
        row["gpu_memory_utilization"] = llm.engine.config.cache.gpu_memory_utilization
        if run_mode != "ar":   # as the engine fixed it ("auto": goodput on a MoE shape with a timed table)
            row["budget_rule"] = llm.engine.config.spec.budget_rule
        if cuda:
            row["loaded_memory_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        on_timing()   # the engine is built: the watchdog's clock restarts for the captures and the runs
        res, toks = time_llm(llm, batch, [p["prompt"] for p in prompts], spec["max_tokens"], spec["repeats"],
                             budget_s=spec["cell_budget_s"])   # the timed runs'; a first cell's compiles excluded
        st = res["stats"]
        run_s = sum(batch * spec["max_tokens"] / r for r in res["tokens_per_s_runs"])
        row.update(tokens_per_s=res["tokens_per_s"], tokens_per_s_runs=res["tokens_per_s_runs"], mat=res["mat"],
                   mean_tree_nodes=res["mean_tree_nodes"], mean_b_ver=round(st["mean_b_ver"], 1),
                   budget_used=round(st["budget_used"], 3), steps=st["steps"], preemptions=st["preemptions"],
                   phases=dict(verify_time_share=round(st["verify_time_share"], 3),
                               other_time_share=round(1 - st["verify_time_share"], 3),
                               wall_ms_per_step=round(1e3 * run_s / st["steps"], 3) if st["steps"] else None,
                               mean_ttft_s=round(st["mean_ttft_s"], 4), mean_tpot_s=round(st["mean_tpot_s"], 5),
                               eager_steps={k: st[f"eager_{k}s"] for k in ("prefill", "forward", "draft", "tail")},
                               graphs_captured_in_runs=res["captures_in_runs"]))
        if len(res["tokens_per_s_runs"]) < spec["repeats"]:
            row["note"] = f"cell budget: {len(res['tokens_per_s_runs'])} of {spec['repeats']} runs"
    except torch.cuda.OutOfMemoryError as e:
        row.update(status="oom", error=str(e).split("\n")[0][:300])
    except ValueError as e:
        if llm is not None:  # only a refusal at engine construction is a result; anything later is a bug
            raise
        row.update(status="refused", error=str(e)[:300])
    finally:
        if cuda:
            row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    row["cell_s"] = round(time.time() - t0, 1)
    return row, toks


def first_divergence(toks: list[list[int]], ref: list[list[int]]) -> list[dict]:
    """Per request whose tokens differ from ar's: its index, the first differing position, both tokens."""
    out = []
    for i, (a, b) in enumerate(zip(toks, ref)):
        if a != b:
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append(dict(request=i, position=j, token=a[j] if j < len(a) else None,
                            ar_token=b[j] if j < len(b) else None))
    return out


def ratios(rows: list[dict]) -> dict:
    """Tokens/s ratios of one worker's cells per batch, and their geometric means over batches <= 16:
    ``RATIOS``, every other speculative cell's to ar, per drafting suffix its bole cell's to its
    serial_tree cell (``bole-d8k2b2/serial_tree-d8k2b2``), and each cell with a width, floor, rows or
    budget-rule suffix to the same cell without them (``bole-nocap-kids/bole``, ``bole-gp/bole``,
    ``bole-eq12/bole``)."""
    ok = {(r["mode"], r["batch"]): r for r in rows if r["status"] == "ok"}
    cells = list(dict.fromkeys(r["mode"] for r in rows))
    plain = lambda m: _strip(_strip(_strip(_strip(m, RULE_RE)[0], ROWS_RE)[0], FLOOR_RE)[0], CAP_RE)[0]
    pairs = RATIOS + tuple((m, "ar") for m in cells if m not in MODES) + tuple(
        (m, "serial_tree" + m[len("bole"):]) for m in cells if m != "bole" and m.startswith("bole")) + tuple(
        (m, plain(m)) for m in cells if plain(m) != m)
    pairs = tuple(p for p in pairs if p[0] in cells and p[1] in cells)  # pairs whose cells both ran
    per_batch = []
    for b in sorted({b for _, b in ok}):
        d = dict(batch=b)
        for num, den in pairs:
            if (num, b) in ok and (den, b) in ok:
                d[f"{num}/{den}"] = round(ok[num, b]["tokens_per_s"] / ok[den, b]["tokens_per_s"], 3)
        d["all_exact_vs_ar"] = all(r["exact_vs_ar"] is not False for (_, rb), r in ok.items() if rb == b)
        per_batch.append(d)
    geo = {}
    for num, den in pairs:
        pts = [(d["batch"], d[f"{num}/{den}"]) for d in per_batch if f"{num}/{den}" in d
               and d["batch"] <= GEOMEAN_MAX_BATCH]
        geo[f"{num}/{den}"] = None if not pts else dict(
            value=round(math.exp(sum(math.log(x) for _, x in pts) / len(pts)), 3), batches=[b for b, _ in pts])
    return dict(pid=os.getpid(), per_batch=per_batch, geomean_batches_1_16=geo)


def worker(spec: dict) -> None:
    """One model's cells in this process; events go to stdout as TAG + JSON lines."""
    emit = lambda kind, payload: print(TAG + json.dumps(dict(kind=kind, payload=payload)), flush=True)
    if spec["device"] == "cpu":
        torch.set_num_threads(1)
    prompts = [json.loads(line) for line in open(spec["prompts"])][: max(spec["batches"])]
    rows, refs, oom = [], {}, {}
    for batch in spec["batches"]:
        for mode in spec["modes"]:
            base = dict(model=label(spec["shape"]), shape=spec["shape"], mode=mode, batch=batch)
            if time.time() > spec["deadline"]:
                row, toks = dict(base, status="skipped_budget"), None
            elif mode in oom:
                row, toks = dict(base, status="skipped_after_oom", note=f"out of memory at batch {oom[mode]}"), None
            else:
                emit("start", base)
                row, toks = run_cell(spec, mode, batch, prompts, on_timing=lambda base=base: emit("timing", base))
            if row["status"] == "oom":
                oom[mode] = batch
            if toks is not None and mode == "ar":
                refs[batch] = toks
            row["exact_vs_ar"] = None if toks is None or mode == "ar" or batch not in refs else toks == refs[batch]
            if row["exact_vs_ar"] is False:
                row["divergence"] = first_divergence(toks, refs[batch])
            rows.append(row)
            emit("row", row)
            emit("ratios", ratios(rows))
            if row["status"] == "ok":
                print(f"{spec['shape']} {mode:<11} batch={batch:<3} {row['tokens_per_s']:9.1f} tok/s  MAT "
                      f"{row['mat']:.2f}  exact={row['exact_vs_ar']}  peak {row.get('peak_memory_gib')} GiB  "
                      f"({row['cell_s']}s)", flush=True)
            else:
                print(f"{spec['shape']} {mode:<11} batch={batch:<3} {row['status']}", flush=True)


# -------------------------------------------------------------------------------------------- parent
def past_budget(state: dict, now: float, spec: dict, grace_s: float) -> str | None:
    """Why a worker must be killed now, or None: the run's deadline is ``grace_s`` past, or the running cell's
    current phase (``clock_t0``: reset at the cell's "start" event, at its first "timing" event once the model
    is loaded (a first cell's widening and load) for its engine's construction, then at the second for its
    captures and timed runs) has taken more than 2 x cell_budget_s + grace_s (a first
    cell's construction pays the compiles)."""
    if now > spec["deadline"] + grace_s:
        return "total budget"
    if state["cell"] and now - state["clock_t0"] > 2 * spec["cell_budget_s"] + grace_s:
        return "cell budget"
    return None


def run_worker(rep, spec: dict, grace_s: float) -> None:
    """Run one model's worker, recording its events as they come; kill it when a budget is past."""
    # the repository first, then the caller's path (the GPU machine's carried wheels: fla, the serving stack)
    path = [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    proc = subprocess.Popen([sys.executable, str(Path(__file__)), "--worker", json.dumps(spec)], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(path)})
    state = dict(cell=None, cell_t0=time.time(), clock_t0=time.time(), killed=None)   # see past_budget
    tail = collections.deque(maxlen=30)

    def watch():
        while proc.poll() is None:
            state["killed"] = past_budget(state, time.time(), spec, grace_s)
            if state["killed"]:
                proc.kill()
                return
            time.sleep(0.5)
    threading.Thread(target=watch, daemon=True).start()
    for line in proc.stdout:
        if not line.startswith(TAG):
            print(line, end="", flush=True)
            tail.append(line.rstrip())
            continue
        ev = json.loads(line[len(TAG):])
        if ev["kind"] == "start":
            state.update(cell=ev["payload"], cell_t0=time.time(), clock_t0=time.time())
        elif ev["kind"] == "timing":
            state["clock_t0"] = time.time()
        elif ev["kind"] == "row":
            state["cell"] = None
            rep.add("rows", ev["payload"])
        else:
            rep.doc["ratios"][label(spec["shape"])] = ev["payload"]
            rep.save()
    rc = proc.wait()
    if state["cell"] is not None:  # the cell it was running when it died
        rep.add("rows", dict(state["cell"], status="timeout" if state["killed"] else "worker_failed",
                             cell_s=round(time.time() - state["cell_t0"], 1), exact_vs_ar=None))
    done = {(r["mode"], r["batch"]) for r in rep.doc["rows"] if r["shape"] == spec["shape"]}
    for batch in spec["batches"]:
        for mode in spec["modes"]:
            if (mode, batch) not in done:  # after the worker died
                rep.add("rows", dict(model=label(spec["shape"]), shape=spec["shape"], mode=mode, batch=batch,
                                     status="not_run", exact_vs_ar=None))
    if rc != 0:
        rep.note(f"{spec['shape']}: worker exited with {rc}" + (f" (killed: {state['killed']})" if state["killed"]
                                                                 else "") + "; last output: " + " | ".join(tail))


def main(argv=None) -> dict | None:
    t_start = time.time()
    args = parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    from benchmarks.e2e import Report
    from bole.hardware import detect_hardware

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        sys.exit("needs a CUDA GPU (use --smoke on the CPU)")
    tag = args.tag or ("smoke" if args.smoke else detect_hardware("cuda"))
    out = Path(args.out) if args.out else REPO_ROOT / "benchmarks" / "results" / f"e2e_scale_{tag}.json"
    argv_list = sys.argv[1:] if argv is None else list(argv)
    deadline = t_start + args.budget_s
    rep = Report(out, dict(
        gpu=torch.cuda.get_device_name() if cuda else "cpu (smoke)", torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=shlex.join(["python", "benchmarks/e2e.py", "--scale", *argv_list]), smoke=args.smoke,
        settings=dict(models=args.models, batches=args.batches, modes=args.modes, max_tokens=args.max_tokens,
                      repeats=args.repeats, spec=dict(depth=args.depth, topk=args.topk, beam=args.beam),
                      draft_vocab=args.draft_vocab,
                      calibration_table=args.calibration_table, budget_s=args.budget_s,
                      cell_budget_s=args.cell_budget_s, source=args.source, widen_dir=args.widen_dir,
                      cuda_graph_prefill_split=args.prefill_split, max_num_batched_tokens=args.max_num_batched_tokens,
                      gpu_memory_utilization=args.gpu_memory_utilization),
        methods=dict(
            models="the source widened to each shape (bole.models.widen, bf16): the shape's cost, the source's "
                   "predictions (the shape's vocabulary: padded rows never win, bole.models.widen)",
            cell="fresh bole.LLM per (model, mode, batch), max_num_seqs=batch, prefix cache off; "
                 "benchmarks.engine_modes.time_llm: warm-up, median of the timed runs, greedy, ignore_eos, "
                 "tokens/s of the batch with its prefills",
            phases="LLMEngine.stats(): verify_time_share = time in the decode forward / draft + verify + sample + "
                   "commit over engine step time; other = prefill, scheduling, emission; eager_steps = the timed "
                   "runs' steps whose prefill / decode or verify forward / draft / acceptance tail ran without a "
                   "CUDA graph; graphs_captured_in_runs = graphs a timed step had to capture (0: all at start)",
            peak_memory="torch.cuda.max_memory_allocated from the engine's construction to the cell's end",
            ratios="computed by the model's worker process from its own cells (geometric mean over batches "
                   f"<= {GEOMEAN_MAX_BATCH})"),
        models=[], rows=[], ratios={}, skipped=[], notes=[], elapsed_s=None, plot=None))
    print(f"e2e --scale on {rep.doc['gpu']}: {args.models} -> {out}", flush=True)
    for shape in args.models:
        if time.time() > deadline:
            rep.add("skipped", dict(model=label(shape), reason="total budget spent before its widening"))
            continue
        t0 = time.time()
        try:
            path, record = (widened_in_memory if args.widen_in_memory else widened)(args.source, shape,
                                                                                     args.widen_dir)
        except OSError as e:  # no room (NoRoom, or a full disk): the next (smaller) model may still fit
            rep.note(f"{shape}: widening failed ({e}); model skipped")
            continue
        rep.add("models", dict(shape=shape, label=label(shape), path=path,
                               **{k: v for k, v in record.items() if k != "input"}))
        how = "to be widened into memory" if args.widen_in_memory else "reused" if record["reused"] else "widened"
        print(f"[{time.time() - t_start:6.1f}s] {shape}: {how} {path} "
              f"({record['weight_bytes'] / 1e9:.2f} GB, {time.time() - t0:.1f}s)", flush=True)
        spec = dict(shape=shape, path=path, device="cuda" if cuda else "cpu", prompts=args.prompts,
                    batches=args.batches, modes=args.modes, max_tokens=args.max_tokens, repeats=args.repeats,
                    depth=args.depth, topk=args.topk, beam=args.beam, calibration_table=args.calibration_table,
                    cell_budget_s=args.cell_budget_s, deadline=deadline, smoke=args.smoke,
                    in_memory=args.widen_in_memory, source=args.source, prefill_split=args.prefill_split,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    gpu_memory_utilization=args.gpu_memory_utilization)
        run_worker(rep, spec, args.grace_s)
    if args.png != "none":
        from benchmarks.e2e_scale_plot import plot

        rep.doc["plot"] = plot(rep.doc, Path(args.png) if args.png else out.with_suffix(".png"))
    rep.doc["elapsed_s"] = round(time.time() - t_start, 1)
    rep.save()
    print(f"wrote {out}" + (f" and {rep.doc['plot']}" if rep.doc["plot"] else "") + f" in {rep.doc['elapsed_s']}s",
          flush=True)
    return rep.doc


if __name__ == "__main__":
    main()
