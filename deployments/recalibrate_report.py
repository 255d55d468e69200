"""The rolling recalibration job's report (``deployments.recalibrate``): what happened to each
class and replica, old and new B_ver per bucket, and the requests served during the run; as
dataclasses (``asdict`` gives the JSON) and as text (``format_report``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class ReplicaEvent:
    """What happened to one replica (timestamps are time.time())."""

    deployment: str
    replica_id: str
    hardware_class: str = "unknown"
    old_table_id: str = ""
    new_table_id: str = ""
    buckets: list = field(default_factory=list)   # [{batch, kv, depth, old_b_ver, new_b_ver, ...}]
    drained_at: float = 0.0
    drain_done_at: float = 0.0         # in-flight requests finished (or the drain timed out)
    drained_clean: bool = False
    recalibrated_at: float = 0.0
    resumed_at: float = 0.0
    ok: bool = False
    error: str = ""
    table_path: str = ""
    times: dict = field(default_factory=dict)


@dataclass
class ClassReport:
    deployment: str
    replicas: list[str]
    strategy: str = ""                 # rolling (>= 2 replicas) | surge | reroute | none
    why: str = ""
    surge_replica: str = ""
    surge_ready_s: float = 0.0
    error: str = ""


@dataclass
class RollingReport:
    app: str
    started_at: float = 0.0
    finished_at: float = 0.0
    classes: list[ClassReport] = field(default_factory=list)
    events: list[ReplicaEvent] = field(default_factory=list)
    served: dict = field(default_factory=dict)   # replica -> requests finished during the run
    requests_served: int = 0
    recovered: list[str] = field(default_factory=list)  # an earlier, killed job's leftovers put back first
    put_back: list[str] = field(default_factory=list)   # what this job put back on its way out (a signal)
    interrupted: str = ""              # the signal that stopped the job (SIGINT / SIGTERM)
    error: str = ""                    # why the job stopped before the end

    @property
    def ok(self) -> bool:
        return (all(e.ok for e in self.events) and not any(c.error for c in self.classes)
                and not self.interrupted and not self.error)


def bucket_rows(old: dict, new: dict) -> list[dict]:
    """Old and new B_ver (and T_dec) at every new bucket, the old one looked up at its upper edges."""
    from bole.spec.budget import CalibrationTable

    o, n = CalibrationTable.from_dict(old), CalibrationTable.from_dict(new)
    rows = []
    for b in n.buckets:
        j, old_b_ver = o.lookup(b.batch[1], b.kv[1], b.depth[1])
        rows.append({"batch": list(b.batch), "kv": list(b.kv), "depth": list(b.depth), "old_b_ver": old_b_ver,
                     "new_b_ver": b.b_ver, "old_t_dec_ms": o.buckets[j].t_dec_ms, "new_t_dec_ms": b.t_dec_ms})
    return rows


def format_report(report: RollingReport) -> str:
    """The report as text: classes and strategies, replicas' windows, B_ver per bucket, requests served."""
    t = lambda ts: time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts * 10) % 10}" if ts else "-"  # noqa: E731
    state = f"INTERRUPTED ({report.interrupted})" if report.interrupted else "ok" if report.ok else "FAILED"
    lines = [f"rolling recalibration of {report.app!r}: {max(report.finished_at - report.started_at, 0):.1f} s, "
             f"{report.requests_served} requests served during the run, {state}"]
    lines += [f"put back first (an earlier job's leftovers): {r}" for r in report.recovered]
    lines += [f"ERROR {report.error}"] if report.error else []
    for c in report.classes:
        extra = f", surge replica {c.surge_replica} running after {c.surge_ready_s} s" if c.surge_replica else ""
        lines.append(f"class {c.deployment} ({len(c.replicas)} replica(s)): {c.strategy} ({c.why}){extra}"
                     + (f"  ERROR {c.error}" if c.error else ""))
        for e in (e for e in report.events if e.deployment == c.deployment):
            lines.append(f"  replica {e.replica_id}: drained {t(e.drained_at)}, in-flight done {t(e.drain_done_at)}, "
                         f"resumed {t(e.resumed_at)} (out {e.times.get('out_of_service_s', 0)} s, sweep "
                         f"{e.times.get('sweep_s', '-')} s): {e.old_table_id} -> {e.new_table_id or '-'}"
                         + (f"  ERROR {e.error}" if e.error else ""))
            for b in e.buckets:
                lines.append(f"    batch {b['batch']} kv {b['kv']} depth {b['depth']}: B_ver {b['old_b_ver']} -> "
                             f"{b['new_b_ver']}  (T_dec {b['old_t_dec_ms']} -> {b['new_t_dec_ms']} ms)")
    lines.append("requests served per replica: " + ", ".join(f"{r} {n}" for r, n in sorted(report.served.items())))
    lines += [f"put back: {r}" for r in report.put_back]
    return "\n".join(lines)
