"""The batch-shared verification budget (Algorithm 3): calibration tables and online node selection.

Offline, ``bole.calibrate`` sweeps each bucket c = (batch size, KV length, tree depth) and writes
the largest capture capacity N whose verification time stays within (1+ε) of one decode step
(eq. 12, ``select_b_ver``). Online, every step looks up its bucket's B_ver and ``select_nodes``
keeps, across the whole batch, every request's first-level nodes plus the highest-ρ nodes up to
B_ver in total. With ``budget_rule="goodput"`` the step's budget is instead chosen on the device from
the bucket's timed T_ver(N) and the drafts' ρ (``select_nodes``'s ``costs``; docs/DESIGN.md §5).

Calibration table (YAML; ``calibration_tables/default.yaml`` is the reference):

    hardware: h200            # hardware class (bole.hardware)
    model: qwen3.5-9b         # model id the table was measured with
    dtype: bfloat16
    tp_size: 1
    versions: {torch: "2.13.0", triton: "3.6.0", bole: "0.1.0"}
    date: "2026-01-31"
    epsilon: 0.1              # ε of eq. 12
    source: measured          # measured | modeled | default
    capture_set: [8, 16, 32, 64]   # G: the capacities N that were (or can be) captured
    notes: "..."              # optional free text: where/how it was measured
    provenance: {...}         # optional mapping: device name, model signature, method, raw timings
    model_error: {...}        # optional mapping (modeled tables): the model's error vs a measurement
    buckets:                  # inclusive integer ranges; together an exact partition of a box
      - {batch: [1, 1], kv: [0, 4095], depth: [1, 16], b_ver: 64,
         t_dec_ms: 7.1, t_ver_ms: {8: 7.2, 16: 7.3, 32: 7.5, 64: 7.8}}

The bucket box must start at batch 1, kv 0, depth 1; look-ups beyond its upper ends clamp to the
last bucket. ``t_dec_ms`` / ``t_ver_ms`` may be null only in ``source: default`` tables; where they
are given, ``b_ver`` must be what eq. 12 gives for them.
"""

from __future__ import annotations

import datetime
import itertools
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Mapping

import torch
import yaml

from bole.option_checks import check_epsilon
from bole.spec.tree import tree_widths

SOURCES = ("measured", "modeled", "default")
_TOP_KEYS = {"hardware", "model", "dtype", "tp_size", "versions", "date", "epsilon", "source",
             "capture_set", "buckets"}
_OPTIONAL_TOP_KEYS = {"notes", "provenance", "model_error"}
_BUCKET_KEYS = {"batch", "kv", "depth", "b_ver", "t_dec_ms", "t_ver_ms"}
_AXES = (("batch", 1), ("kv", 0), ("depth", 1))  # axis name, lowest allowed value


def select_b_ver(t_ver: Mapping[int, float], t_dec: float, epsilon: float) -> int:
    """Eq. 12 over the verify forward's floor: B_ver = max{N ∈ G : T_ver(N) <= (1+ε) T_ref}, G = the keys
    of ``t_ver``, T_ref = max(T_dec, T_ver(min G)).

    The paper bounds T_ver(N) by (1+ε) T_dec, where a verify forward of few nodes costs what a decode
    step costs. Ours has a fixed premium over decode that no N avoids (the forest layout, the GDN
    verifier's Neumann rounds, trees padded to a captured width): measured at the 9B shapes on the
    H200 it is 25-60% (calibration_tables/h200-qwen3.5-9b.yaml), so every bucket's bound fell below
    even the smallest capacity and eq. 12 as written chose the floor everywhere. What ε bounds here is
    the cost of the nodes past that floor, which is where the T_ver(N) curve leaves its memory-bound
    plateau; where verify's floor is decode's (T_ver(min G) <= T_dec) this is eq. 12 unchanged.
    The smallest capacity always fits: the fairness floor keeps a request's first-level nodes
    anyway, so "no speculation" is not an option here.
    """
    if not t_ver:
        raise ValueError("t_ver is empty: no capacities to choose from")
    bound = (1.0 + epsilon) * max(t_dec, t_ver[min(t_ver)])
    fits = [n for n, t in t_ver.items() if t <= bound]
    return max(fits) if fits else min(t_ver)


@dataclass(frozen=True)
class Bucket:
    batch: tuple[int, int]
    kv: tuple[int, int]
    depth: tuple[int, int]
    b_ver: int
    t_dec_ms: float | None = None
    t_ver_ms: Mapping[int, float] | None = None

    def contains(self, batch_size: int, kv_len: int, depth: int) -> bool:
        return all(lo <= x <= hi for (lo, hi), x in
                   zip((self.batch, self.kv, self.depth), (batch_size, kv_len, depth), strict=True))


@dataclass(frozen=True)
class CalibrationTable:
    hardware: str
    model: str
    dtype: str
    tp_size: int
    versions: Mapping[str, str]
    date: str
    epsilon: float
    source: str
    capture_set: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    notes: str = ""
    provenance: Mapping = field(default_factory=dict)
    model_error: Mapping | None = None

    @cached_property
    def _box(self) -> tuple[tuple[int, int], ...]:
        """(lo, hi) of the bucket box per axis (batch, kv, depth)."""
        return tuple((min(getattr(b, a)[0] for b in self.buckets),
                      max(getattr(b, a)[1] for b in self.buckets)) for a, _ in _AXES)

    @cached_property
    def goodput_curves(self) -> tuple[list[tuple[int, float]], ...]:
        """Per bucket, its ``goodput_costs`` (the goodput rule's inputs), formed once per table. ValueError
        naming the table when a bucket lacks timings, or naming the count when it holds too many."""
        self.require_timings("budget_rule='goodput' chooses each step's B_ver from them")
        return tuple(goodput_costs(b.t_ver_ms) for b in self.buckets)

    @property
    def table_id(self) -> str:
        """Short provenance id, e.g. for routing stats: ``h200/qwen3.5-9b/bfloat16/tp1@2026-01-31``."""
        return f"{self.hardware}/{self.model}/{self.dtype}/tp{self.tp_size}@{self.date}"

    @staticmethod
    def load(path) -> "CalibrationTable":
        try:
            with open(path) as f:
                data = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as e:   # the library refuses a bad input with a ValueError naming it
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValueError(f"{path}: cannot read this calibration table: {why}") from None
        try:
            return CalibrationTable.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @staticmethod
    def from_dict(data) -> "CalibrationTable":
        if not isinstance(data, dict):
            raise ValueError("a calibration table must be a mapping")
        missing = sorted(_TOP_KEYS - data.keys())
        if missing:
            raise ValueError(f"missing keys: {missing}")
        unknown = sorted(data.keys() - _TOP_KEYS - _OPTIONAL_TOP_KEYS)
        if unknown:
            raise ValueError(f"unknown keys: {unknown}")
        for k in ("hardware", "model", "dtype"):
            if not isinstance(data[k], str) or not data[k]:
                raise ValueError(f"{k} must be a non-empty string, got {data[k]!r}")
        if not _is_int(data["tp_size"]) or data["tp_size"] < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {data['tp_size']!r}")
        if not isinstance(data["versions"], dict):
            raise ValueError(f"versions must be a mapping of package -> version, got {data['versions']!r}")
        date = data["date"]
        if isinstance(date, (datetime.date, datetime.datetime)):
            date = date.isoformat()
        if not isinstance(date, str):
            raise ValueError(f"date must be an ISO date string, got {date!r}")
        eps = check_epsilon("epsilon", data["epsilon"])
        if data["source"] not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {data['source']!r}")
        cap = data["capture_set"]
        if (not isinstance(cap, list) or not cap or not all(_is_int(n) and n >= 1 for n in cap)
                or sorted(set(cap)) != cap):
            raise ValueError(f"capture_set must be a strictly increasing list of ints >= 1, got {cap!r}")
        if not isinstance(data["buckets"], list) or not data["buckets"]:
            raise ValueError("buckets must be a non-empty list")
        buckets = tuple(_parse_bucket(i, b, set(cap), float(eps), data["source"])
                        for i, b in enumerate(data["buckets"]))
        _check_partition(buckets)
        for k in ("provenance", "model_error"):
            if data.get(k) is not None and not isinstance(data[k], dict):
                raise ValueError(f"{k} must be a mapping, got {data[k]!r}")
        return CalibrationTable(
            hardware=data["hardware"], model=data["model"], dtype=data["dtype"],
            tp_size=data["tp_size"], versions={str(k): str(v) for k, v in data["versions"].items()},
            date=date, epsilon=float(eps), source=data["source"], capture_set=tuple(cap),
            buckets=buckets, notes=str(data.get("notes", "")), provenance=dict(data.get("provenance") or {}),
            model_error=data.get("model_error"))

    def with_epsilon(self, epsilon: float) -> "CalibrationTable":
        """This table with every bucket's B_ver re-derived by eq. 12 (``select_b_ver``) from its own timings
        at ``epsilon`` (``SpecConfig.budget_epsilon``): the same measurements, another latency tolerance.
        ValueError naming the table when a bucket has no timings (a default table's B_ver is written, not
        derived) or when epsilon is not a finite number >= 0."""
        epsilon = check_epsilon("budget epsilon", epsilon)
        self.require_timings(f"its B_ver cannot be re-derived at budget epsilon {epsilon}")
        buckets = tuple(replace(b, b_ver=select_b_ver(b.t_ver_ms, b.t_dec_ms, epsilon)) for b in self.buckets)
        return replace(self, epsilon=epsilon, buckets=buckets)

    def require_timings(self, why: str) -> "CalibrationTable":
        """This table, or ValueError naming it when a bucket lacks its timings (a default table's)."""
        if any(b.t_dec_ms is None or not b.t_ver_ms for b in self.buckets):
            raise ValueError(f"calibration table {self.table_id} ({self.source}) has buckets without timings: {why}")
        return self

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("hardware", "model", "dtype", "tp_size", "date",
                                             "epsilon", "source")}
        out["versions"] = dict(self.versions)
        out["capture_set"] = list(self.capture_set)
        if self.notes:
            out["notes"] = self.notes
        out["buckets"] = [{"batch": list(b.batch), "kv": list(b.kv), "depth": list(b.depth),
                           "b_ver": b.b_ver, "t_dec_ms": b.t_dec_ms,
                           "t_ver_ms": None if b.t_ver_ms is None else dict(b.t_ver_ms)}
                          for b in self.buckets]
        if self.provenance:
            out["provenance"] = dict(self.provenance)
        if self.model_error is not None:
            out["model_error"] = dict(self.model_error)
        return out

    def dump(self, path) -> None:
        with open(path, "w") as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False)

    def lookup(self, batch_size: int, kv_len: int, depth: int) -> tuple[int, int]:
        """(bucket index, B_ver) of a step; values past the table's upper ends clamp to them."""
        if batch_size < 1 or kv_len < 0 or depth < 1:
            raise ValueError(f"bad bucket query batch_size={batch_size} kv_len={kv_len} depth={depth}")
        q = [min(x, hi) for x, (_, hi) in zip((batch_size, kv_len, depth), self._box, strict=True)]
        for i, b in enumerate(self.buckets):
            if b.contains(*q):
                return i, b.b_ver
        raise AssertionError("validated buckets cover their box")  # unreachable


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_bucket(i: int, b, capture: set[int], eps: float, source: str) -> Bucket:
    if not isinstance(b, dict):
        raise ValueError(f"bucket {i} must be a mapping, got {b!r}")
    missing = sorted(_BUCKET_KEYS - b.keys() - {"t_dec_ms", "t_ver_ms"})
    if missing:
        raise ValueError(f"bucket {i}: missing keys {missing}")
    unknown = sorted(b.keys() - _BUCKET_KEYS)
    if unknown:
        raise ValueError(f"bucket {i}: unknown keys {unknown}")
    ranges = {}
    for axis, lowest in _AXES:
        r = b[axis]
        if (not isinstance(r, list) or len(r) != 2 or not all(_is_int(x) for x in r)
                or r[0] > r[1] or r[0] < lowest):
            raise ValueError(f"bucket {i}: {axis} must be [lo, hi] ints with {lowest} <= lo <= hi, got {r!r}")
        ranges[axis] = (r[0], r[1])
    b_ver = b["b_ver"]
    if not _is_int(b_ver) or b_ver < 1 or b_ver not in capture:
        raise ValueError(f"bucket {i}: b_ver={b_ver!r} must be an int >= 1 in capture_set {sorted(capture)}")
    t_dec, t_ver = b.get("t_dec_ms"), b.get("t_ver_ms")
    if (t_dec is None or t_ver is None) and source != "default":
        raise ValueError(f"bucket {i}: t_dec_ms and t_ver_ms are required in a '{source}' table")
    if t_dec is not None and (not isinstance(t_dec, (int, float)) or not 0 < t_dec < math.inf):
        raise ValueError(f"bucket {i}: t_dec_ms must be a positive number, got {t_dec!r}")
    if t_ver is not None:
        if not isinstance(t_ver, dict) or not t_ver:
            raise ValueError(f"bucket {i}: t_ver_ms must be a non-empty mapping N -> ms, got {t_ver!r}")
        bad = [n for n in t_ver if n not in capture]
        if bad:
            raise ValueError(f"bucket {i}: t_ver_ms capacities {bad} are not in capture_set")
        items = sorted(t_ver.items())
        for n, t in items:
            if not isinstance(t, (int, float)) or not 0 < t < math.inf:
                raise ValueError(f"bucket {i}: t_ver_ms[{n}]={t!r} must be a positive number")
        for (n0, t0), (n1, t1) in zip(items, items[1:], strict=False):
            if t1 < t0:
                raise ValueError(
                    f"bucket {i}: non-monotone timings t_ver_ms[{n1}]={t1} < t_ver_ms[{n0}]={t0}")
        t_ver = {int(n): float(t) for n, t in items}
        if t_dec is not None and select_b_ver(t_ver, t_dec, eps) != b_ver:
            raise ValueError(f"bucket {i}: b_ver={b_ver} disagrees with eq. 12 on its timings "
                             f"(gives {select_b_ver(t_ver, t_dec, eps)})")
    return Bucket(batch=ranges["batch"], kv=ranges["kv"], depth=ranges["depth"], b_ver=b_ver,
                  t_dec_ms=None if t_dec is None else float(t_dec), t_ver_ms=t_ver)


def _check_partition(buckets: tuple[Bucket, ...]) -> None:
    """Check that the buckets partition their bounding box exactly.

    Every bucket boundary cuts the box into elementary cells, each either inside a bucket or not;
    testing one point per cell finds every gap and every overlap.
    """
    starts = []
    for axis, lowest in _AXES:
        lo = min(getattr(b, axis)[0] for b in buckets)
        hi = max(getattr(b, axis)[1] for b in buckets)
        if lo != lowest:
            raise ValueError(f"buckets must start at {axis}={lowest}, the lowest starts at {lo}")
        cuts = {getattr(b, axis)[0] for b in buckets} | {getattr(b, axis)[1] + 1 for b in buckets}
        starts.append(sorted(c for c in cuts if c <= hi))
    for point in itertools.product(*starts):
        inside = [i for i, b in enumerate(buckets) if b.contains(*point)]
        where = ", ".join(f"{axis}={x}" for (axis, _), x in zip(_AXES, point, strict=True))
        if not inside:
            raise ValueError(f"gap in buckets: no bucket covers {where}")
        if len(inside) > 1:
            raise ValueError(f"overlapping buckets {inside[0]} and {inside[1]} both cover {where}")


def width_cap(b_ver: int, batch: int, widths, max_drafts: int) -> int:
    """Drafts per request (root excluded) that keep a step's padded verify rows at the calibration's:
    the sweep times B_ver nodes split evenly over ``batch`` requests, so its trees fit the smallest width
    in ``widths`` (captured tree widths, root included, ascending) holding ceil(b_ver / batch) + 1 nodes;
    that width less the root, at most ``max_drafts``. Past the widest width: ``max_drafts``."""
    if batch < 1 or b_ver < 0:
        raise ValueError(f"width_cap needs batch >= 1 and b_ver >= 0, got batch={batch} b_ver={b_ver}")
    need = -(-int(b_ver) // batch) + 1
    return min(next((int(w) - 1 for w in sorted(widths) if w >= need), max_drafts), max_drafts)


def floor_drafts(floor: str, topk: int) -> int:
    """Drafts a request keeps whatever the budget (``select_nodes``'s fairness floor)."""
    return 1 if floor == "best_child" else topk


def verify_rows_floor(max_num_seqs: int, lookahead: int, floor_nodes: int) -> tuple[int, int]:
    """The fewest verify rows ``max_num_seqs`` requests can hold, and the tree width it pads to: each request's
    fairness floor (``floor_nodes`` drafts and the root) padded to the smallest of ``tree_widths(lookahead)``
    holding it."""
    widths = tree_widths(lookahead)
    floor_w = next((w for w in widths if w >= 1 + floor_nodes), widths[-1])
    return max_num_seqs * floor_w, floor_w


def verify_rows_limit(max_num_seqs: int, lookahead: int, floor_nodes: int, requested: int | None = None,
                      check: bool = True) -> int:
    """The most tree rows one verify forward may hold (``EngineConfig.max_verify_rows`` resolved by
    ``engine_verify_rows``): ``max_num_seqs`` trees padded to one of ``tree_widths(lookahead)``. None:
    every request's whole tree (``max_num_seqs`` × the widest width). ``requested``: at least what every
    request's fairness floor needs (``floor_nodes`` drafts and the root, padded to the smallest width
    holding them; below it raises when ``check``, else is raised to it), at most the whole trees.

    Why a limit: the batch-shared budget verifies far fewer rows than every request's whole tree (at
    batch 32, B_ver 192 drafts against 32 × 117 nodes), while the buffers the rows size (the verify
    factors, the logits over a 248k vocabulary) are what the memory plan reserves at start; each step's
    drafts per request are capped to it (``rows_width``)."""
    (least, floor_w), full = verify_rows_floor(max_num_seqs, lookahead, floor_nodes), max_num_seqs * lookahead
    if requested is None:
        return full
    if requested < least and check:
        raise ValueError(f"max_verify_rows={requested} is below the {least} rows that max_num_seqs={max_num_seqs} "
                         f"trees of the fairness floor need ({floor_nodes} drafts and the root, padded to "
                         f"{floor_w}); raise it or lower max_num_seqs")
    return min(max(requested, least), full)


def engine_verify_rows(config, seqs: int, lookahead: int, check: bool = True) -> int:
    """An ``EngineConfig``'s verify rows for ``seqs`` requests whose trees hold ``lookahead`` nodes, root
    included (``verify_rows_limit`` with its ``max_verify_rows`` and fairness floor; ar: one row a
    request): what the engine allocates and the memory plan counts. ``max_verify_rows=None`` is, for bole,
    the step's token budget, ``max_num_batched_tokens`` (vLLM counts draft tokens against it too), raised to
    the fairness floor's rows where it is below them rather than refused; for serial_tree, every request's
    whole tree, since its per-node snapshot buffers, sized by these rows, are the cost that baseline stands
    for (what SGLang keeps: each request's draft tokens)."""
    if config.mode == "ar":
        return seqs * lookahead
    spec, requested = config.spec, config.max_verify_rows
    if requested is None and config.mode == "bole":
        requested, check = config.max_num_batched_tokens, False
    return verify_rows_limit(seqs, lookahead, floor_drafts(spec.budget_floor, spec.topk), requested, check)


def rows_width(rows: int, padded_batch: int, widths) -> int:
    """The widest tree width in ``widths`` whose ``padded_batch`` trees fit ``rows``
    (``verify_rows_limit`` guarantees one: the floor's width)."""
    fit = [int(w) for w in widths if padded_batch * int(w) <= rows]
    if not fit:
        raise ValueError(f"no tree width of {sorted(widths)} fits {padded_batch} trees in {rows} verify rows")
    return max(fit)


BUDGET_FLOORS = ("children", "best_child")
BUDGET_RULES = ("auto", "epsilon", "goodput")
GOODPUT_SLOTS = 16   # capacities a goodput cost row holds (a goodput engine refuses a table with more)


def resolve_budget_rule(rule: str, moe: bool, table: CalibrationTable) -> str:
    """``SpecConfig.budget_rule`` as an engine runs it: "auto" is "goodput" for a model with routed experts
    (``moe``) whose ``table`` can feed that rule (timings, at most ``GOODPUT_SLOTS`` capacities a bucket), and
    "epsilon" otherwise; the other rules are themselves.

    Why by the model's kind: a dense verify forward's T_ver is flat up to eq. 12's B_ver, which is then the
    right budget, and the goodput rule ran level to 7% slower there (9B cost, H100, run GP9). A MoE
    forward's T_ver climbs with the experts its tokens read, so ε holds B_ver at the smallest capacity, one
    draft a request, where the goodput rule keeps what pays: 1.12 / 1.37 / 1.62x eq. 12's tokens/s at
    batches 4 / 8 / 16 and 0.96-0.97x at 1-2 (35B-A3B cost, H100, run MG1; benchmarks/README.md)."""
    if rule != "auto":
        return rule
    if not moe:
        return "epsilon"
    try:
        _ = table.goodput_curves
    except ValueError:   # a table without timings (the defaults) or with too many capacities: eq. 12's
        return "epsilon"
    return "goodput"


def goodput_costs(t_ver_ms: Mapping[int, float]) -> list[tuple[int, float]]:
    """A bucket's (capacity N, T_ver(N) ms) pairs for ``select_nodes``'s goodput rule, ascending in N.
    ValueError when there are more than ``GOODPUT_SLOTS`` or none."""
    pairs = sorted((int(n), float(t)) for n, t in (t_ver_ms or {}).items())
    if not pairs or len(pairs) > GOODPUT_SLOTS:
        raise ValueError(f"the goodput budget needs 1 to {GOODPUT_SLOTS} timed capacities, got {len(pairs)}")
    return pairs


def goodput_rows(pairs, batch: int, widths, cap: int, cap_tree_width: bool) -> list[tuple[int, float, int]]:
    """A step's goodput costs (``select_nodes``'s ``costs``, one triple per column): each (N, T_ver(N)) pair
    of the bucket (``goodput_costs``) with the drafts a request may keep at N: ``width_cap`` of N over
    ``batch`` requests (the tree width the calibration timed N at) when ``cap_tree_width``, at most
    ``cap`` (the step's own limit: the verifier's, or the verify rows')."""
    return [(n, t, width_cap(n, batch, widths, cap) if cap_tree_width else cap) for n, t in pairs]


def select_nodes(rho: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, depth: torch.Tensor,
                 b_ver, max_per_request: int | None = None, *, floor: str,
                 costs: torch.Tensor | None = None, chosen: torch.Tensor | None = None) -> torch.Tensor:
    """Algorithm 3 online: which draft nodes of the batch to verify. Returns bool keep [B, T].

    Args:
        rho:     [B, T] cumulative draft probability of every node (probabilities or their logs:
                 only the order matters); padding may hold anything.
        parents: int [B, T] local parent, -1 = root; nodes in topological order.
        valid:   bool [B, T] real nodes.
        depth:   int [B, T] 1 for children of the root.
        b_ver:   the bucket's capacity (int or 0-d tensor).
        max_per_request: at most this many kept nodes per request (the verifier's tree limit, see
                 ``bole.spec.tree.MAX_TREE_NODES``); a request's nodes past it in its own order are
                 not candidates, and the budget they would have taken goes to the other requests.
        floor:   the fairness floor: "children" (the paper's Algorithm 3: every depth-1 node) or
                 "best_child" (each request's highest-ρ depth-1 node; its other children compete
                 for the budget like deeper nodes). Both give every running request a verified draft.
                 Required, with no default here or in the layers that pass it on (the draft graphs,
                 ``ModelRunner.draft_batch``): the engine's choice is ``SpecConfig.budget_floor``.
        costs:   None (eq. 12's rule: ``b_ver`` is the budget) or float [3, K] (``goodput_rows``): capacities
                 N (row 0, ascending; 0 pads), their timed T_ver(N) (row 1) and the drafts a request may keep
                 at each (row 2: the tree width the calibration timed N at, so that the verify rows padded to
                 the widest tree are the timed ones), for the goodput rule (``SpecConfig.budget_rule``): each
                 capacity is eq. 12's selection at N under its own per-request cap, and the budget is the one
                 N <= ``b_ver`` that maximises the batch's expected tokens per verify time,
                 (requests + Σ exp ρ of the kept nodes) / T_ver(N), ρ being log-probabilities here. Σ exp ρ
                 over a prefix-closed set is the expected number of its drafts a greedy target accepts when
                 the drafter is calibrated (a node is accepted exactly when its whole path is). Ties go to
                 the smaller N. The budget then moves per step, on the device, with the drafts' own confidence.
        chosen:  with ``costs``, a 0-d int64 tensor that receives the N chosen (a copy on the device: what the
                 step's metrics report as its B_ver, read on the host with the widest tree).

    Every request keeps its valid depth-1 nodes (fairness floor; "best_child": the best one). The
    remaining budget, max(b_ver - #floor, 0), goes to the other nodes in the order (ρ desc, depth asc, flat index
    asc), so the kept count is exactly max(#floor, min(b_ver, #valid)). ρ is first clamped to the
    running minimum along each path (pointer jumping, ceil(log2 T) gathers): a no-op for real
    drafts, whose ρ never increases down a path, and a guarantee of prefix closure otherwise,
    since a parent then sorts before each of its children.

    Fixed-shape sorts, gathers and scatters only; ``b_ver`` may be a device tensor: no host sync.
    """
    if not (rho.shape == parents.shape == valid.shape == depth.shape) or rho.dim() != 2:
        raise ValueError(f"rho, parents, valid, depth must share one [B, T] shape, got "
                         f"{[tuple(x.shape) for x in (rho, parents, valid, depth)]}")
    B, T = rho.shape
    N = B * T
    dev = rho.device
    valid = valid.bool()
    node = torch.arange(T, device=dev).expand(B, T)
    jump = torch.where(valid & (parents >= 0), parents.long().clamp(0, T - 1), node)
    key = torch.where(valid, rho.float(), torch.full_like(rho, -math.inf, dtype=torch.float32))
    for _ in range(max(1, math.ceil(math.log2(max(T, 2))))):
        key = torch.minimum(key, key.gather(1, jump))
        jump = jump.gather(1, jump)

    if floor not in BUDGET_FLOORS:
        raise ValueError(f"floor must be one of {BUDGET_FLOORS}, got {floor!r}")
    first = valid & (depth == 1)
    if floor == "best_child":  # the highest ρ among a request's depth-1 nodes (ties: the lowest index)
        first = first & (node == torch.where(first, key, torch.full_like(key, -math.inf)).argmax(1, keepdim=True))
    floor = first  # the kept floor nodes [B, T]
    cand = (valid & ~floor).flatten()
    # Lexicographic order (candidates first, ρ desc, depth asc, flat index asc): sort by a unique
    # integer key of (is-candidate, depth, index), then stably by ρ, which leaves ties in that order.
    idx = torch.arange(N, device=dev)
    secondary = (~cand).long() * (T + 1) * N + depth.flatten().long().clamp(0, T) * N + idx
    order = secondary.argsort()
    neg_key = torch.where(cand, -key.flatten(), torch.full_like(key.flatten(), math.inf))
    order = order[neg_key[order].sort(stable=True).indices]
    rank_in_req = None
    if max_per_request is not None or costs is not None:
        # rank of each node within its own request in the same order (a stable regroup by request)
        req_sorted = order // T
        regroup = req_sorted.sort(stable=True).indices
        grouped = req_sorted[regroup]
        within = idx - torch.searchsorted(grouped, grouped)
        rank_in_req = torch.empty_like(order).scatter_(0, order[regroup], within)
        rank_in_req = floor.sum(1).repeat_interleave(T) + rank_in_req   # the floor first: kept before any
    if max_per_request is not None:
        cand = cand & (rank_in_req < max_per_request)
    if costs is not None:
        kept, n = _goodput_kept(key.flatten(), floor, cand, order, rank_in_req, valid, b_ver, costs)
        if chosen is not None:
            chosen.copy_(n)
        return (floor.flatten() | kept).view(B, T)
    # global rank among the candidates, in the order above
    pos = torch.cumsum(cand[order].long(), 0) - 1
    rank = torch.empty_like(order).scatter_(0, order, pos)
    return (floor.flatten() | (cand & (rank < (b_ver - floor.sum()).clamp(min=0)))).view(B, T)


def _goodput_kept(key: torch.Tensor, floor: torch.Tensor, cand: torch.Tensor, order: torch.Tensor,
                 rank_in_req: torch.Tensor, valid: torch.Tensor, b_ver, costs: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates past the floor that the goodput rule keeps (``select_nodes``'s ``costs``), bool [B*T],
    and the capacity chosen (0-d int64).

    Ours rather than a library's: it is Algorithm 3's budget chosen per step from the bucket's measured
    T_ver(N) and the drafts' own ρ. Eq. 12 stops where T_ver leaves its plateau. On a MoE model T_ver
    climbs from the first nodes (each token reads more experts) and flattens again once every expert is
    read, so eq. 12 keeps the fewest nodes exactly where more would pay (docs/DESIGN.md §5). Every
    capacity k is scored as the calibration timed it: at most ``costs[2, k]`` nodes a request, so the
    widest tree, to which every tree is padded for the verify forward, is the width T_ver(N) was timed at
    (uncapped, a few deep trees would pad every request to their width at the price of a larger N)."""
    N, K = key.numel(), costs.shape[1]
    caps, t, width = costs[0].round().long(), costs[1].float(), costs[2].round().long()
    nf = floor.sum()
    # per capacity: the candidates within its per-request width, ranked in the selection order
    elig = cand[None] & (rank_in_req[None] < width[:, None])                       # [K, N]
    pos = torch.cumsum(elig[:, order].long(), 1) - 1
    rank = torch.empty_like(pos).scatter_(1, order.expand(K, N), pos)
    extra = (caps - nf).clamp(0, N)
    kept = elig & (rank < extra[:, None])                                           # [K, N]
    p, zero = key.exp(), torch.zeros_like(key)   # exp ρ: a node's chance of acceptance
    base = valid.any(1).sum().float() + torch.where(floor.flatten(), p, zero).sum()
    score = (base + torch.where(kept, p[None], zero[None]).sum(1)) / t.clamp(min=1e-9)
    # a capacity counts when real (> 0) and within b_ver; of those, the ones holding the floor (else the smallest)
    real = (caps > 0) & (caps <= b_ver)
    holds = real & (caps >= nf)
    smallest = caps == torch.where(real, caps, torch.full_like(caps, torch.iinfo(torch.long).max)).min()
    usable = torch.where(holds.any(), holds, real & smallest)
    best = torch.where(usable, score, torch.full_like(score, -math.inf)).argmax()
    # a gather, not kept[best]: indexing with a 0-d tensor reads it on the host (a CUDA graph capture fails)
    return kept.gather(0, best.view(1, 1).expand(1, N))[0], caps.gather(0, best.view(1))[0]
