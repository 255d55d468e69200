"""Live recalibration: re-measure a running engine's verification budget table, and validate it.

    table = recalibrate(engine)       # between steps: AsyncEngine.run_exclusive(recalibrate)

Recalibration exists to follow the hardware (a new driver, a changed GPU clock, a co-tenant), so a
new table is judged on its own merits, never by its distance from the old one (``check_table``,
``check_repeatable``, ``bole.hardware.table_mismatch``):

  sane        every T_dec and T_ver is finite and positive; 1 us < T_dec < 60 s; the smallest
              capacity's T_ver >= T_dec / 2 and the largest's <= 1000 T_dec
  monotone    within ``monotone_tolerance`` (a relative drop; more is noise or a bug): T_ver
              non-decreasing in N (the raw medians), T_dec non-decreasing in batch and in KV length
  repeatable  two quick sweeps agree on what the table holds: at every bucket point T_dec within
              a factor 1 + ``repeat_tolerance``, B_ver (each sweep's own eq. 12) at most
              ``repeat_capacities`` (1) capacities of G apart; the table is built from both sweeps'
              samples (medians over twice the iterations)
  identity    the table's model (shape signature), dtype, tp_size and hardware class are the
              engine's
  max_change  a guard, off by default: B_ver and T_dec within a factor ``max_change`` of the old
              table's at each new bucket point (skipped against the unmeasured default)

The sweep (``bole.calibrate_sweep.measure``) gets its own runner and never touches the engine's caches or
requests, so running generations are unaffected; the swap is one attribute assignment. A live
table's ``date`` is a UTC timestamp to the second, so every measurement has its own ``table_id``.
"""

from __future__ import annotations

import datetime
import logging
import math
import time
from dataclasses import dataclass, replace
from statistics import median

from bole.calibrate_sweep import QUICK_PLAN, SweepPlan, measure
from bole.calibrate_table import build_table, measured_header
from bole.hardware import detect_hardware, model_signature, table_mismatch
from bole.spec.budget import CalibrationTable, select_b_ver

logger = logging.getLogger(__name__)


class RecalibrationError(ValueError):
    """A re-measured table failed validation; the engine keeps its old table."""


@dataclass(frozen=True)
class TableChecks:
    """Tolerances of a re-measured table's validation (see the module docstring)."""

    monotone_tolerance: float = 0.25   # relative drop counted as noise (T_ver in N, T_dec in batch / KV)
    repeat_tolerance: float = 0.5      # two sweeps' T_dec agree within a factor 1 + this at every point
    repeat_capacities: int = 1         # and their B_ver at most this many capacities of G apart
    max_change: float | None = None    # off; else B_ver and T_dec within this factor of the old table

    def __post_init__(self):
        for name in ("monotone_tolerance", "repeat_tolerance"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        r = self.repeat_capacities
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"repeat_capacities must be an int >= 0, got {r!r}")
        m = self.max_change
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 1 < m < math.inf):
            raise ValueError(f"max_change must be None (off) or a factor > 1, got {m!r}")


def _where(i: int, b) -> str:
    return f"bucket {i} (batch {list(b.batch)}, kv {list(b.kv)}, depth {list(b.depth)})"


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def check_table(new: CalibrationTable, old: CalibrationTable | None = None,
                checks: TableChecks = TableChecks()) -> list[str]:
    """Sanity, monotonicity and the optional max-change guard; problems found (empty: fine)."""
    problems = []
    raw = new.provenance.get("raw") or []
    for i, b in enumerate(new.buckets):
        where = _where(i, b)
        if not _finite_positive(b.t_dec_ms) or not b.t_ver_ms \
                or not all(_finite_positive(t) for t in b.t_ver_ms.values()):
            problems.append(f"{where}: timings must be finite and positive, got T_dec {b.t_dec_ms} ms, "
                            f"T_ver {dict(b.t_ver_ms or {})}")
            continue
        worst = raw[i].get("monotone_fix_max_rel", 0.0) if i < len(raw) else 0.0
        if worst > checks.monotone_tolerance:
            problems.append(f"{where}: T_ver drops by {worst:.0%} as N grows (not monotone within "
                            f"{checks.monotone_tolerance:.0%})")
        if not 1e-3 < b.t_dec_ms < 6e4:
            problems.append(f"{where}: T_dec {b.t_dec_ms} ms is out of bounds (1 us .. 60 s)")
        ts = [b.t_ver_ms[n] for n in sorted(b.t_ver_ms)]
        if ts[0] < 0.5 * b.t_dec_ms or ts[-1] > 1000 * b.t_dec_ms:
            problems.append(f"{where}: T_ver {ts[0]}..{ts[-1]} ms is implausible against T_dec {b.t_dec_ms} ms")
    if problems:
        return problems
    problems += _t_dec_monotone(new, checks.monotone_tolerance)
    if checks.max_change is not None and old is not None and old.source != "default":
        problems += _changes(new, old, checks.max_change)
    return problems


def _t_dec_monotone(table: CalibrationTable, tolerance: float) -> list[str]:
    """T_dec may not drop by more than ``tolerance`` from one bucket to the next along batch or KV."""
    problems = []
    by_point = {(b.batch[1], b.kv[1], b.depth[1]): (i, b) for i, b in enumerate(table.buckets)}
    for axis, name in ((0, "batch"), (1, "KV length")):
        for key, (i, b) in sorted(by_point.items()):
            nxt = [(k, v) for k, v in by_point.items()
                   if k[axis] > key[axis] and all(k[a] == key[a] for a in range(3) if a != axis)]
            if not nxt:
                continue
            k, (j, c) = min(nxt)
            if c.t_dec_ms < (1 - tolerance) * b.t_dec_ms:
                problems.append(f"{_where(j, c)}: T_dec {c.t_dec_ms} ms drops below {_where(i, b)}'s "
                                f"{b.t_dec_ms} ms as the {name} grows (not monotone within {tolerance:.0%})")
    return problems


def _changes(new: CalibrationTable, old: CalibrationTable, max_change: float) -> list[str]:
    problems = []
    for i, b in enumerate(new.buckets):
        j, old_b_ver = old.lookup(b.batch[1], b.kv[1], b.depth[1])
        ratios = {"B_ver": b.b_ver / old_b_ver}
        if old.buckets[j].t_dec_ms:
            ratios["T_dec"] = b.t_dec_ms / old.buckets[j].t_dec_ms
        for what, ratio in ratios.items():
            if not 1 / max_change <= ratio <= max_change:
                problems.append(f"{_where(i, b)}: {what} changed by a factor {ratio:.2f} from the old table "
                                f"(--max-change {max_change:g})")
    return problems


def _b_ver(record: dict, epsilon: float) -> tuple[float, int]:
    """(T_dec, B_ver) of one sweep's record: eq. 12 on the running maximum of its medians."""
    t_dec, env, run = median(record["dec"]), {}, 0.0
    for n in sorted(record["ver"]):
        run = max(run, median(record["ver"][n]))
        env[n] = run
    return t_dec, select_b_ver(env, t_dec, epsilon)


def check_repeatable(first: list[dict], second: list[dict], tolerance: float,
                     epsilon: float = 0.1, capacities: int = 1) -> tuple[list[str], float]:
    """(problems, worst T_dec factor) of two sweeps' raw records (``measure``) of one plan: at every
    point T_dec within a factor 1 + ``tolerance`` and B_ver (eq. 12 on each sweep alone) at most
    ``capacities`` capacities of G apart. What the table is for must repeat; a single T_ver(N) far from B_ver's bound
    may wander without changing it."""
    problems, worst, max_apart = [], 1.0, capacities
    for a, b in zip(first, second, strict=True):
        (ta, ba), (tb, bb) = _b_ver(a, epsilon), _b_ver(b, epsilon)
        factor = max(ta / tb, tb / ta) if ta > 0 and tb > 0 else math.inf
        worst = max(worst, factor)
        where = f"point (batch, kv, depth) {tuple(a['at'])}: two sweeps disagree"
        if factor > 1 + tolerance:
            problems.append(f"{where} on T_dec: {ta:.4g} vs {tb:.4g} ms (a factor {factor:.2f} > {1 + tolerance:.2f})")
        capacities = sorted(a["ver"])
        if abs(capacities.index(ba) - capacities.index(bb)) > max_apart:
            problems.append(f"{where} on B_ver: {ba} vs {bb} (more than {max_apart} "
                            f"capacit{'y' if max_apart == 1 else 'ies'} of G apart)")
    return problems, worst


def merge_records(runs: list[list[dict]]) -> list[dict]:
    """One record per point holding every sweep's samples."""
    out = []
    for recs in zip(*runs, strict=True):
        out.append({"at": recs[0]["at"], "dec": [t for r in recs for t in r["dec"]],
                    "ver": {n: [t for r in recs for t in r["ver"][n]] for n in recs[0]["ver"]}})
    return out


def plan_for_engine(engine, quick: bool = True) -> SweepPlan:
    """The old table's bucket layout when it was measured or modeled (``quick``: only the powers of
    two of its capture set), else the (quick) default plan at the engine's tree depth; either way cut
    to what the engine can run (batch up to max_num_seqs, KV length up to its capacity): a larger
    point is never looked up, it would clamp to the last."""
    old, cfg = engine.calibration, engine.config
    base = QUICK_PLAN if quick else SweepPlan()
    if old.source in ("measured", "modeled"):
        edges = lambda axis: tuple(sorted({getattr(b, axis)[1] for b in old.buckets}))
        batch, kv, depth = edges("batch"), edges("kv"), edges("depth")
        capture = old.capture_set
        if quick:  # the powers of two of G (and its ends): a 10-capacity G is swept at 6
            capture = tuple(n for n in capture if n & (n - 1) == 0 or n in (capture[0], capture[-1]))
        base = replace(base, capture_set=capture, epsilon=old.epsilon)
    else:
        batch, kv, depth = base.batch_points, base.kv_points, (max(2, cfg.spec.depth + 1),)
    cap = cfg.cache.num_blocks * cfg.cache.block_size
    batch = tuple(sorted({p for p in batch if p < cfg.max_num_seqs} | {min(max(batch), cfg.max_num_seqs)}))
    kv = tuple(sorted({p for p in kv if p < cap} | {min(max(kv), cap)}))
    return replace(base, batch_points=batch, kv_points=kv, depth_points=depth)


def recalibrate(engine, quick: bool = True, force: bool = False, plan: SweepPlan | None = None,
                progress: bool = False, checks: TableChecks | None = None, hardware: str | None = None,
                model_name: str | None = None, install: bool = True) -> CalibrationTable:
    """Sweep ``engine``'s model twice, validate, and (``install``) swap ``engine.calibration``.

    Call between steps only (no concurrent ``engine.step``); with an ``AsyncEngine`` use
    ``async_engine.run_exclusive(recalibrate)``. ``hardware``: the class to record (default: the old
    table's, else detected); ``model_name``: the table's model id (default: the old table's when it
    was measured on these shapes, else the shape signature). Raises ``RecalibrationError`` (the old
    table stays) when a check fails, unless ``force``.
    """
    checks = checks or TableChecks()
    old, cfg = engine.calibration, engine.model.config
    plan = plan or plan_for_engine(engine, quick)
    signature = model_signature(cfg)
    if model_name is None:
        same_shapes = old.provenance.get("model_signature") == signature
        model_name = old.model if old.model != "any" and same_shapes else signature
    hardware = hardware or (old.hardware if old.hardware != "any" else detect_hardware(engine.config.device))
    dtype = engine.config.torch_dtype
    t0 = time.perf_counter()
    graphed = engine.limits().cuda_graphs  # time the forwards as this engine runs them (eager or graphed)
    runs = [measure(engine.model, plan, engine.config.device, dtype, progress, graphed) for _ in range(2)]
    header = measured_header(engine.model, engine.config.device, dtype, model_name, plan, "checkpoint", hardware,
                             graphed)
    header["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    repeat_problems, worst = check_repeatable(runs[0], runs[1], checks.repeat_tolerance, plan.epsilon,
                                             checks.repeat_capacities)
    new = build_table(plan, merge_records(runs), header)
    new = replace(new, provenance={**new.provenance, "recalibrated_from": old.table_id, "sweeps": 2,
                                   "repeat_worst_factor": round(worst, 3),
                                   "sweep_seconds": round(time.perf_counter() - t0, 2)})
    mismatch = table_mismatch(new, cfg, engine.config.dtype, engine.config.tp_size, hardware, graphed)
    problems = check_table(new, old, checks) + repeat_problems + [
        f"{field} {have!r} is not the engine's {want!r}" for field, (have, want) in mismatch.items()]
    if problems and not force:
        raise RecalibrationError("new calibration table refused: " + "; ".join(problems))
    if problems:
        logger.warning("forced calibration table despite: %s", "; ".join(problems))
    if install:
        engine.calibration = new  # one attribute assignment: a step sees the old table or the new one
    logger.info("recalibrated %s -> %s (%.1fs%s)", old.table_id, new.table_id, time.perf_counter() - t0,
                "" if install else ", not installed")
    return new
