"""Rolling recalibration: re-measure every replica's verification budget table, losing no request.

    python -m deployments.recalibrate --address ADDR --app bole [--deployment bole-a100 ...] [--full]
        [--strategy auto|surge|reroute] [--max-change F] [--table-dir DIR] [--report out.json]

Each replica deployment is one hardware class (``deployments.app``). The job goes through the whole
fleet one replica at a time (class after class, never two replicas out at once):

  1. drain    ``drain(target_replica=id)``: the replica reports ``accepting: False``, the routers route
              around it (``BoleRequestRouter``; the ingress skips a class none of whose replicas
              accepts), a request that reaches it before their next stats refresh is refused before
              any token and the ingress sends it elsewhere; the call returns when its in-flight
              requests have finished (or after ``--drain-timeout-s``: they then pause for the sweep).
  2. sweep    ``recalibrate(target_replica=id)``: two quick sweeps on the replica's engine between
              steps (``bole.recalibration``; on a TP replica on every rank at once), validated there:
              sane, monotone within noise, repeatable (the sweeps agree), measured for the replica's
              model / dtype / tp / hardware. Closeness to the old table is no criterion (recalibration
              exists to follow a changed clock or driver); ``--max-change`` adds that guard, off by
              default.
  3. install  ``set_calibration``: no restart; with ``--table-dir`` also written as YAML with its
              provenance, ready to be named in the group's ``calibration_table``.
  4. resume   the replica admits again; the job waits ``--settle-s`` so the routers see it back.

The last replica serving a class is never drained while its requests could go nowhere else. With
one running replica the class gets, first (``--strategy auto``):
  surge     one more replica through Serve's config (``deployments.surge``: a lightweight update of
            ``num_replicas`` / ``autoscaling_config.min_replicas``) when the app was deployed from a
            config and the cluster has room (autoscaling headroom, free resources); it is drained
            only once that replica runs, which then gets the new table too, and the config is put
            back afterwards (Serve stops the extra replica after its requests finish);
  reroute   otherwise, if another class has an accepting replica, that class takes the traffic while
            the replica is out (the ingress skips a class with no accepting replica);
  neither   the class is not recalibrated (reported as an error), nothing is drained.

The report (printed and ``--report`` JSON) lists per class the strategy used, per replica the old and
new B_ver per bucket and its drain, in-flight-done and resume times, and the requests served during
the run (the replicas' ``finished`` counters). A failure on one replica (timeout, refused table) is
recorded, the replica is resumed with its old table, and the job goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from dataclasses import asdict, dataclass

from bole.recalibration import TableChecks
from deployments import surge
from deployments.checks import require_at_least
from deployments.engine_client import unwrap_remote_error
from deployments.recalibrate_report import ClassReport, ReplicaEvent, RollingReport, bucket_rows, format_report

logger = logging.getLogger(__name__)
STRATEGIES = ("auto", "surge", "reroute")


@dataclass(frozen=True)
class RollingOptions:
    """How the job runs (the CLI flags mirror these)."""

    quick: bool = True                 # quick sweep plan (bole.calibrate_sweep.QUICK_PLAN layout)
    checks: TableChecks = TableChecks()
    strategy: str = "auto"             # for a class with one running replica: surge | reroute | auto
    drain_timeout_s: float = 120.0     # longest wait for a replica's in-flight requests
    sweep_timeout_s: float = 900.0     # longest wait for a replica's two sweeps
    control_timeout_s: float = 60.0    # longest wait for any other control call (beyond the drain's own)
    surge_timeout_s: float = 600.0     # longest wait for a surge replica to run
    settle_s: float = 2.0              # after resume / surge: let the routers' stats catch up
    table_dir: str | None = None       # write each new table here (YAML with provenance)

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        require_at_least(self, 0, "drain_timeout_s", "sweep_timeout_s", "control_timeout_s", "surge_timeout_s",
                         "settle_s")


def _write_table(table: dict, table_dir: str, deployment: str, replica_id: str) -> str:
    from bole.calibrate_table import write_table
    from bole.spec.budget import CalibrationTable

    os.makedirs(table_dir, exist_ok=True)
    path = os.path.join(table_dir, f"{deployment}-{replica_id}.yaml")
    write_table(CalibrationTable.from_dict(table), path)
    return path


def _caller(handle, replica_id: str, timeout_s: float):
    """``call(method, timeout_s=..., **kw)``: a control call routed to exactly that replica."""
    async def call(method: str, timeout: float = timeout_s, **kw):
        ref = handle.options(method_name=method).remote(target_replica=replica_id, **kw)
        try:
            return await asyncio.wait_for(ref, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{method} on replica {replica_id}: no answer within {timeout:.0f}s") from None
    return call


async def recalibrate_replica(handle, app: str, deployment: str, replica_id: str,
                              opts: RollingOptions) -> ReplicaEvent:
    """Drain -> sweep (validated) -> install -> resume one replica (see the module docstring)."""
    ev = ReplicaEvent(deployment, replica_id)
    if replica_id not in surge.running_replicas(app, deployment):  # the router would wait for it forever
        ev.error = f"replica {replica_id} is no longer running"
        return ev
    call = _caller(handle, replica_id, opts.control_timeout_s)
    info = await call("calibration_info")
    ev.hardware_class, ev.old_table_id = info["hardware_class"], info["table_id"]
    ev.drained_at = time.time()
    try:
        ev.drained_clean = await call("drain", timeout=opts.drain_timeout_s + opts.control_timeout_s,
                                      timeout_s=opts.drain_timeout_s)
        ev.drain_done_at = time.time()
        if not ev.drained_clean:  # requests still running pause during the sweep; none is dropped
            logger.warning("%s: in-flight requests outlived the drain timeout", replica_id)
        res = await call("recalibrate", timeout=opts.sweep_timeout_s, quick=opts.quick, checks=opts.checks)
        ev.recalibrated_at = time.time()
        ev.times["sweep_s"] = round(ev.recalibrated_at - ev.drain_done_at, 2)
        ev.buckets = bucket_rows(res["old_table"], res["table"])
        ev.new_table_id = await call("set_calibration", table=res["table"])
        if opts.table_dir:
            ev.table_path = _write_table(res["table"], opts.table_dir, deployment, replica_id)
        ev.ok = True
    except Exception as e:  # noqa: BLE001 - recorded; the replica is resumed (old table) and the job goes on
        cause = unwrap_remote_error(e)   # a RayTaskError carries the replica's exception
        ev.error = f"{type(cause).__name__}: {cause}"
        logger.error("recalibration of %s failed: %s", replica_id, ev.error)
    finally:
        await call("resume")
        ev.resumed_at = time.time()
        ev.times["out_of_service_s"] = round(ev.resumed_at - ev.drained_at, 2)
    logger.info("%s/%s: %s -> %s (%s)", deployment, replica_id, ev.old_table_id, ev.new_table_id or "-",
                "ok" if ev.ok else ev.error)
    return ev


def choose_strategy(app: str, deployment: str, requested: str, details: dict) -> tuple[str, str]:
    """(strategy, why) for a class; "rolling" with two or more replicas, "none" when neither fits."""
    running = surge.running_replicas(app, deployment, details)
    if len(running) >= 2:
        return "rolling", f"{len(running)} replicas: the others serve while one is out"
    can_surge, surge_why = surge.headroom(app, deployment, details)
    others = [d for d in surge.replica_deployments(app, details) if d != deployment
              and surge.running_replicas(app, d, details)]
    can_reroute = bool(others)
    reroute_why = f"classes {others} take the traffic" if others else "no other class serves this app"
    if requested in ("auto", "surge") and can_surge:
        return "surge", surge_why
    if requested in ("auto", "reroute") and can_reroute:
        return "reroute", reroute_why + (f" (no surge: {surge_why})" if requested == "auto" else "")
    return "none", f"cannot take the last replica of {deployment} out without losing requests: surge: " \
                   f"{surge_why}; reroute: {reroute_why}"


async def _resize(app: str, deployment: str, n: int, configs: dict, dep_cfg: dict, opts: RollingOptions) -> list[str]:
    """Hold ``deployment`` at ``n`` replicas (``surge.with_replicas`` on ``configs``; ``dep_cfg``: its
    deployment config before the surge, which says whether the code autoscales it); their ids."""
    surge.deploy(surge.with_replicas(configs, app, deployment, n, dep_cfg))
    return await asyncio.to_thread(surge.wait_for_replicas, app, deployment, n, opts.surge_timeout_s)


async def _surge_up(app: str, deployment: str, running: list[str], opts: RollingOptions, rep: ClassReport):
    """Start one more replica; returns what ``_surge_down`` needs to go back."""
    details = surge.serve_details()
    before = (surge.app_configs(details), details["applications"][app]["deployments"][deployment]["deployment_config"])
    t0 = time.time()
    try:
        ids = await _resize(app, deployment, len(running) + 1, *before, opts)
    except Exception:
        await _surge_down(app, deployment, len(running), before, opts)
        raise
    rep.surge_replica = next(r for r in ids if r not in running)
    rep.surge_ready_s = round(time.time() - t0, 2)
    await asyncio.sleep(opts.settle_s)   # the routers' stats include the new replica
    return before


async def _surge_down(app: str, deployment: str, n: int, before: tuple, opts: RollingOptions) -> None:
    """Back to ``n`` replicas, then the configs as they were (an autoscaled deployment keeps the ``n``
    it then has instead of waiting out its downscale delay)."""
    try:
        await _resize(app, deployment, n, *before, opts)
    finally:
        surge.deploy(before[0])


async def recalibrate_class(app: str, deployment: str, opts: RollingOptions, report: RollingReport) -> None:
    """One replica at a time through one deployment (hardware class)."""
    from ray import serve

    details = surge.serve_details()
    running = surge.running_replicas(app, deployment, details)
    rep = ClassReport(deployment, running)
    report.classes.append(rep)
    rep.strategy, rep.why = choose_strategy(app, deployment, opts.strategy, details)
    logger.info("%s: %s (%s)", deployment, rep.strategy, rep.why)
    if rep.strategy == "none":
        rep.error = rep.why
        return
    handle = serve.get_deployment_handle(deployment, app)
    restore = None
    try:
        if rep.strategy == "surge":
            restore = await _surge_up(app, deployment, running, opts, rep)
        for replica_id in running:
            report.events.append(await recalibrate_replica(handle, app, deployment, replica_id, opts))
            await asyncio.sleep(opts.settle_s)
        done = [e for e in report.events if e.deployment == deployment and e.ok]
        if rep.surge_replica and done:  # whichever replica Serve keeps, it has a new table
            src = await _caller(handle, done[-1].replica_id, opts.control_timeout_s)("calibration_info")
            await _caller(handle, rep.surge_replica, opts.control_timeout_s)("set_calibration", table=src["table"])
    except Exception as e:  # noqa: BLE001 - recorded, the next class goes on
        rep.error = f"{type(e).__name__}: {e}"
        logger.error("%s: %s", deployment, rep.error)
    finally:
        if restore is not None:
            try:  # its count as late as possible: it may still serve until Serve stops it
                info = await _caller(handle, rep.surge_replica, opts.control_timeout_s)("calibration_info")
                report.served[rep.surge_replica] = info["finished"]
            finally:
                await _surge_down(app, deployment, len(running), restore, opts)


async def _finished_counts(app: str, deployments: list[str], timeout_s: float) -> dict[str, int]:
    from ray import serve

    out = {}
    for dep in deployments:
        handle = serve.get_deployment_handle(dep, app)
        for rid in surge.running_replicas(app, dep):
            info = await _caller(handle, rid, timeout_s)("calibration_info")
            out[rid] = info["finished"]
    return out


async def rolling_recalibrate(app: str = "bole", deployments: list[str] | None = None,
                              opts: RollingOptions | None = None) -> RollingReport:
    """Recalibrate every replica of ``deployments`` (default: all replica deployments of ``app``)."""
    opts = opts or RollingOptions()
    deployments = deployments or surge.replica_deployments(app)
    report = RollingReport(app)
    fleet = surge.replica_deployments(app)   # requests served are counted over the whole fleet
    start = await _finished_counts(app, fleet, opts.control_timeout_s)
    report.started_at = time.time()          # the counters' window: from here to finished_at
    for dep in deployments:
        await recalibrate_class(app, dep, opts, report)
    end = await _finished_counts(app, fleet, opts.control_timeout_s)
    for rid in set(start) | set(end) | set(report.served):
        last = end.get(rid, report.served.get(rid, start.get(rid, 0)))
        report.served[rid] = last - start.get(rid, 0)
    report.requests_served = sum(report.served.values())
    report.finished_at = time.time()
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.recalibrate", description=__doc__.split("\n")[0])
    d, c = RollingOptions(), TableChecks()
    p.add_argument("--address", default="auto", help="Ray cluster address (what `make serve` prints)")
    p.add_argument("--app", default="bole", help="Serve application name")
    p.add_argument("--deployment", action="append", help="replica deployment(s) (hardware classes); default all")
    p.add_argument("--full", action="store_true", help="full sweep plan instead of the quick one")
    p.add_argument("--strategy", choices=STRATEGIES, default=d.strategy,
                   help="a class with one replica: surge (one more replica first), reroute (other classes "
                        "serve it meanwhile), auto (surge if there is room, else reroute)")
    p.add_argument("--max-change", type=float, default=c.max_change,
                   help="refuse a table whose B_ver or T_dec moved by more than this factor (default: off)")
    p.add_argument("--monotone-tolerance", type=float, default=c.monotone_tolerance)
    p.add_argument("--repeat-tolerance", type=float, default=c.repeat_tolerance,
                   help="the two sweeps must agree within a factor 1 + this")
    p.add_argument("--repeat-capacities", type=int, default=c.repeat_capacities,
                   help="and their B_ver at most this many capacities of G apart")
    p.add_argument("--drain-timeout-s", type=float, default=d.drain_timeout_s)
    p.add_argument("--surge-timeout-s", type=float, default=d.surge_timeout_s)
    p.add_argument("--settle-s", type=float, default=d.settle_s)
    p.add_argument("--table-dir", default=None, help="write the new tables here (YAML)")
    p.add_argument("--report", default=None, help="write the JSON report here")
    a = p.parse_args(argv)
    import ray

    logging.basicConfig(level=logging.INFO)
    checks = TableChecks(a.monotone_tolerance, a.repeat_tolerance, a.repeat_capacities, a.max_change)
    opts = RollingOptions(quick=not a.full, checks=checks, strategy=a.strategy, drain_timeout_s=a.drain_timeout_s,
                          surge_timeout_s=a.surge_timeout_s, settle_s=a.settle_s, table_dir=a.table_dir)
    ray.init(address=a.address, namespace="serve", log_to_driver=False)
    report = asyncio.run(rolling_recalibrate(a.app, a.deployment, opts))
    data = json.dumps(asdict(report) | {"ok": report.ok}, indent=1)
    if a.report:
        with open(a.report, "w") as f:
            f.write(data)
    print(data)
    print(format_report(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
