"""Rolling recalibration: re-measure every replica's verification budget table, losing no request.

    python -m deployments.recalibrate --address ADDR --app bole [--deployment bole-a100 ...] [--full]
        [--strategy auto|surge|reroute] [--max-change F] [--table-dir DIR] [--report out.json] [--recover]

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
  3. install  with ``--table-dir`` first written as YAML with its provenance (ready to be named in the
              group's ``calibration_table``; a table that cannot be saved is not installed), then
              ``set_calibration``: no restart.
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

One job per application at a time (``deployments.recalibrate_lock.AppLock``: a second job is refused
at once, naming the holder), which journals what the job changed and has not yet put back (the drained
replica and its old table, the surge and the application's config before it), each noted before the
change is made. A job that finds a killed job's journal (its lock taken over) first puts back what it
lists, and resumes any running replica left drained.

SIGINT / SIGTERM stop the job: it puts back what it changed (the replica being recalibrated resumes
with its old table, the surge goes, the config is restored), says so, and exits with 130 / 143.
``--recover`` does only that put-back of a killed job's leftovers. Bad options, an unknown application
or deployment, a table directory that cannot be written, a held lock and a cluster that cannot be
reached are one ``error:`` line and exit status 2, before anything is changed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

from bole.recalibration import TableChecks
from deployments import surge
from deployments.checks import require_at_least
from deployments.engine_client import unwrap_remote_error
from deployments.recalibrate_lock import LOCK_NAMESPACE, AppLock, LockHeld
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
    lock_lease_s: float = 30.0         # a killed job's lock is taken over this long after its last renewal

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        require_at_least(self, 0, "drain_timeout_s", "sweep_timeout_s", "control_timeout_s", "surge_timeout_s",
                         "settle_s")
        require_at_least(self, 1, "lock_lease_s")


class UsageError(ValueError):
    """A name or path the user gave that cannot work (the CLI: one ``error:`` line, exit status 2)."""


def _handle(app: str, deployment: str):
    from ray import serve

    return serve.get_deployment_handle(deployment, app)


def _caller(handle, replica_id: str, timeout_s: float):
    """``call(method, timeout_s=..., **kw)``: a control call routed to exactly that replica."""
    async def call(method: str, timeout: float = timeout_s, **kw):
        ref = handle.options(method_name=method).remote(target_replica=replica_id, **kw)
        try:
            return await asyncio.wait_for(ref, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{method} on replica {replica_id}: no answer within {timeout:.0f}s") from None
    return call


async def _resume_replica(app: str, entry: dict, opts: RollingOptions, keep_new: bool) -> str:
    """Resume the journal's drained replica; with its old table back unless ``keep_new``."""
    dep, rid = entry["deployment"], entry["replica_id"]
    if rid not in surge.running_replicas(app, dep):
        return f"replica {rid} ({dep}) is no longer running"
    call = _caller(_handle(app, dep), rid, opts.control_timeout_s)
    what = f"resumed replica {rid} ({dep})"
    if not keep_new and (await call("calibration_info"))["table_id"] != entry["old_table_id"]:
        await call("set_calibration", table=entry["old_table"])
        what += f" with its old table {entry['old_table_id']}"
    await call("resume")
    return what


async def _remove_surge(app: str, entry: dict, opts: RollingOptions) -> str:
    """Back to the journal's replica count and the application's config before the surge, unless the
    config is no longer one the job deployed (someone redeployed the app meanwhile)."""
    dep, n, before = entry["deployment"], entry["n"], entry["before"]
    ours = [surge.with_replicas({app: before}, app, dep, k, entry["dep_cfg"])[app] for k in (n + 1, n)]
    current = surge.app_configs().get(app)
    if current == before:
        return f"the config of {app!r} was already restored (surge of {dep})"
    if current not in ours:
        return f"the config of {app!r} changed since the surge of {dep} (redeployed?): left as it is"
    await _surge_down(app, dep, n, before, entry["dep_cfg"], opts)
    return f"surge of {dep} removed, config of {app!r} restored"


async def _put_back(app: str, lock, key: str, opts: RollingOptions, keep_new: bool = False) -> str:
    """Put back the journal's ``key`` ("replica": resume it; "surge": remove it) and strike it off;
    what was done. An error leaves it in the journal (the next job, or --recover, tries again)."""
    entry = lock.journal[key]
    try:
        if key == "replica":
            what = await _resume_replica(app, entry, opts, keep_new)
        else:
            what = await _remove_surge(app, entry, opts)
    except Exception as e:
        cause = unwrap_remote_error(e)
        raise RuntimeError(f"could not put back the {key} of {entry['deployment']}: {type(cause).__name__}: "
                           f"{cause} (left in the lock's journal: the next job or --recover tries again)") from e
    await lock.note(key, None)
    return what


async def put_back(app: str, lock, opts: RollingOptions, scan: bool = False) -> list[str]:
    """Put back everything in ``lock.journal`` (a stopped job's, or a killed one's it took over); with
    ``scan`` also resume any running replica left drained that no journal names (only this job
    drains a running replica). What was done, failures included; raises nothing."""
    done = []
    for key in ("replica", "surge"):
        if key in lock.journal:
            try:
                done.append(await _put_back(app, lock, key, opts))
            except Exception as e:  # noqa: BLE001 - reported; the journal keeps it
                done.append(str(e))
    if scan:
        for dep in surge.replica_deployments(app):
            for rid in surge.running_replicas(app, dep):
                call = _caller(_handle(app, dep), rid, opts.control_timeout_s)
                try:
                    if not (await call("calibration_info"))["accepting"]:
                        await call("resume")
                        done.append(f"resumed replica {rid} ({dep}): found drained, in no job's journal")
                except Exception as e:  # noqa: BLE001 - reported
                    done.append(f"could not check replica {rid} ({dep}): {unwrap_remote_error(e)}")
    for what in done:
        logger.warning("put back: %s", what)
    return done


def check_table_dir(path: str) -> None:
    """UsageError unless ``path`` is (or can be made) a writable directory: checked before anything is
    drained, rather than finding out with a replica's new table in hand."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".bole-write-check-"):
            pass
    except OSError as e:
        raise UsageError(f"table directory {path!r} is not writable: {e.strerror or e}") from None


def _write_table(table: dict, table_dir: str, deployment: str, replica_id: str) -> str:
    from bole.calibrate_table import write_table
    from bole.spec.budget import CalibrationTable

    os.makedirs(table_dir, exist_ok=True)
    path = os.path.join(table_dir, f"{deployment}-{replica_id}.yaml")
    write_table(CalibrationTable.from_dict(table), path)
    return path


async def recalibrate_replica(handle, app: str, deployment: str, replica_id: str, opts: RollingOptions,
                              lock) -> ReplicaEvent:
    """Drain -> sweep (validated) -> install -> resume one replica (see the module docstring). Stopped
    midway (cancelled), the replica stays in ``lock.journal`` for ``put_back``."""
    ev = ReplicaEvent(deployment, replica_id)
    if replica_id not in surge.running_replicas(app, deployment):  # the router would wait for it forever
        ev.error = f"replica {replica_id} is no longer running"
        return ev
    call = _caller(handle, replica_id, opts.control_timeout_s)
    info = await call("calibration_info")
    ev.hardware_class, ev.old_table_id = info["hardware_class"], info["table_id"]
    await lock.note("replica", {"deployment": deployment, "replica_id": replica_id,
                                "old_table_id": info["table_id"], "old_table": info["table"]})
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
        # saved before it is installed: a table that cannot be written leaves the replica's old one
        path = _write_table(res["table"], opts.table_dir, deployment, replica_id) if opts.table_dir else ""
        try:
            ev.new_table_id = await call("set_calibration", table=res["table"])
        except BaseException:
            if path:
                os.remove(path)
            raise
        ev.table_path, ev.ok = path, True
    except Exception as e:  # noqa: BLE001 - recorded; the replica is resumed (old table) and the job goes on
        cause = unwrap_remote_error(e)   # a RayTaskError carries the replica's exception
        ev.error = f"{type(cause).__name__}: {cause}"
        logger.error("recalibration of %s failed: %s", replica_id, ev.error)
    try:
        await _put_back(app, lock, "replica", opts, keep_new=ev.ok)
    except RuntimeError as e:   # still drained, still in the journal: the class stops here
        ev.ok, ev.error = False, ev.error or str(e)
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


async def _resize(app: str, deployment: str, n: int, before: dict, dep_cfg: dict, opts: RollingOptions) -> list[str]:
    """Hold ``deployment`` at ``n`` replicas (``surge.with_replicas`` on ``before``, the app's config
    before the surge; ``dep_cfg``: its deployment config then, which says whether the code autoscales
    it); their ids."""
    surge.deploy_app(app, surge.with_replicas({app: before}, app, deployment, n, dep_cfg)[app])
    return await surge.wait_for_replicas(app, deployment, n, opts.surge_timeout_s)


async def _surge_up(app: str, deployment: str, running: list[str], opts: RollingOptions, rep: ClassReport,
                    lock) -> None:
    """Start one more replica, journaled first (``_remove_surge`` goes back)."""
    details = surge.serve_details()
    before = surge.app_configs(details)[app]
    dep_cfg = details["applications"][app]["deployments"][deployment]["deployment_config"]
    await lock.note("surge", {"deployment": deployment, "n": len(running), "before": before, "dep_cfg": dep_cfg})
    t0 = time.time()
    ids = await _resize(app, deployment, len(running) + 1, before, dep_cfg, opts)
    rep.surge_replica = next(r for r in ids if r not in running)
    rep.surge_ready_s = round(time.time() - t0, 2)
    await asyncio.sleep(opts.settle_s)   # the routers' stats include the new replica


async def _surge_down(app: str, deployment: str, n: int, before: dict, dep_cfg: dict, opts: RollingOptions) -> None:
    """Back to ``n`` replicas, then the app's config as it was (an autoscaled deployment keeps the ``n``
    it then has instead of waiting out its downscale delay)."""
    try:
        await _resize(app, deployment, n, before, dep_cfg, opts)
    finally:
        surge.deploy_app(app, before)


async def recalibrate_class(app: str, deployment: str, opts: RollingOptions, report: RollingReport, lock) -> None:
    """One replica at a time through one deployment (hardware class)."""
    details = surge.serve_details()
    running = surge.running_replicas(app, deployment, details)
    rep = ClassReport(deployment, running)
    report.classes.append(rep)
    rep.strategy, rep.why = choose_strategy(app, deployment, opts.strategy, details)
    logger.info("%s: %s (%s)", deployment, rep.strategy, rep.why)
    if rep.strategy == "none":
        rep.error = rep.why
        return
    handle = _handle(app, deployment)
    try:
        if rep.strategy == "surge":
            await _surge_up(app, deployment, running, opts, rep, lock)
        for replica_id in running:
            lock.check()
            report.events.append(await recalibrate_replica(handle, app, deployment, replica_id, opts, lock))
            if "replica" in lock.journal:   # it could not be resumed: drain no other
                raise RuntimeError(report.events[-1].error)
            await asyncio.sleep(opts.settle_s)
        done = [e for e in report.events if e.deployment == deployment and e.ok]
        if rep.surge_replica and done:  # whichever replica Serve keeps, it has a new table
            src = await _caller(handle, done[-1].replica_id, opts.control_timeout_s)("calibration_info")
            await _caller(handle, rep.surge_replica, opts.control_timeout_s)("set_calibration", table=src["table"])
    except Exception as e:  # noqa: BLE001 - recorded, the next class goes on
        rep.error = f"{type(e).__name__}: {e}"
        logger.error("%s: %s", deployment, rep.error)
    if "surge" not in lock.journal:   # (a stopped job's surge is put back by rolling_recalibrate)
        return
    try:
        if rep.surge_replica:   # its count as late as possible: it may still serve until Serve stops it
            info = await _caller(handle, rep.surge_replica, opts.control_timeout_s)("calibration_info")
            report.served[rep.surge_replica] = info["finished"]
    finally:
        try:
            await _put_back(app, lock, "surge", opts)
        except RuntimeError as e:
            rep.error = rep.error or str(e)
            logger.error("%s: %s", deployment, e)


async def _finished_counts(app: str, deployments: list[str], timeout_s: float) -> dict[str, int]:
    out = {}
    for dep in deployments:
        handle = _handle(app, dep)
        for rid in surge.running_replicas(app, dep):
            info = await _caller(handle, rid, timeout_s)("calibration_info")
            out[rid] = info["finished"]
    return out


def check_names(app: str, deployments: list[str] | None, details: dict) -> list[str]:
    """The app's replica deployments; UsageError, naming the known ones, for an unknown app or deployment."""
    apps = details["applications"]
    if app not in apps:
        raise UsageError(f"unknown application {app!r} (applications: {', '.join(sorted(apps)) or 'none'})")
    fleet = surge.replica_deployments(app, details)
    for dep in deployments or []:
        if dep not in fleet:
            raise UsageError(f"unknown deployment {dep!r} (deployments: {', '.join(fleet) or 'none'})")
    return fleet


async def rolling_recalibrate(app: str = "bole", deployments: list[str] | None = None,
                              opts: RollingOptions | None = None, *, report: RollingReport | None = None,
                              lock=None, recover_only: bool = False) -> RollingReport:
    """Recalibrate every replica of ``deployments`` (default: all replica deployments of ``app``),
    holding the app's lock (``lock``: one already held). First the leftovers of a killed job are put
    back (with ``recover_only``, nothing else). Cancelled (SIGINT), it puts back what it changed, sets
    ``report.interrupted`` ("cancelled" unless the caller names the signal) and re-raises."""
    from ray.serve.exceptions import RayServeException

    opts = opts or RollingOptions()
    report = report if report is not None else RollingReport(app)
    try:
        details = surge.serve_details()
    except RayServeException as e:
        raise UsageError(f"no Serve instance on this Ray cluster ({e})") from None
    fleet = check_names(app, deployments, details)
    if opts.table_dir:
        check_table_dir(opts.table_dir)
    owned = lock is None
    lock = lock or AppLock(app, opts.lock_lease_s).acquire()
    try:
        report.recovered = await put_back(app, lock, opts, scan=True)
        if lock.journal:   # never overwrite what a replica still needs put back
            report.error = f"an earlier job's {sorted(lock.journal)} could not be put back: not starting"
        if recover_only or report.error:
            return report
        start = await _finished_counts(app, fleet, opts.control_timeout_s)  # served over the whole fleet
        report.started_at = time.time()          # the counters' window: from here to finished_at
        for dep in deployments or fleet:
            await recalibrate_class(app, dep, opts, report, lock)
            if lock.journal:   # the class could not put it back: once more, else stop
                report.put_back += await put_back(app, lock, opts)
                if lock.journal:
                    report.error = f"stopped after {dep}: {sorted(lock.journal)} could not be put back"
                    break
        end = await _finished_counts(app, fleet, opts.control_timeout_s)
        for rid in set(start) | set(end) | set(report.served):
            last = end.get(rid, report.served.get(rid, start.get(rid, 0)))
            report.served[rid] = last - start.get(rid, 0)
        report.requests_served = sum(report.served.values())
        report.finished_at = time.time()
        return report
    except asyncio.CancelledError:
        asyncio.current_task().uncancel()   # the put-back below must not be cancelled too
        report.interrupted = report.interrupted or "cancelled"
        report.finished_at = time.time()
        raise
    finally:
        if lock.journal:
            report.put_back += await put_back(app, lock, opts)
        if owned:
            lock.release()


def _probe(address: str, wait_s: float = 60.0) -> str:
    """What a bare GCS client finds at ``address``: "token" (the cluster wants Ray's auth token),
    "unreachable" (no GCS answers: ~40 s), else "" (fine, or unsure: ``ray.init`` finds out). It answers
    those at once or within a minute, where ``ray.init`` retries ~20 s and then only says it failed
    to connect, or for many minutes. Private Ray API: any surprise counts as unsure."""
    result = [""]

    def probe():
        try:
            from ray._private.services import canonicalize_bootstrap_address
            from ray._raylet import GcsClient
            from ray.exceptions import AuthenticationError, RpcError

            gcs = canonicalize_bootstrap_address(address)
            if gcs:
                try:
                    GcsClient(address=gcs)
                except AuthenticationError:
                    result[0] = "token"
                except RpcError:
                    result[0] = "unreachable"
        except Exception:  # noqa: BLE001 - unsure: let ray.init find out
            pass

    t = threading.Thread(target=probe, name="bole-gcs-probe", daemon=True)
    t.start()
    t.join(wait_s)
    return result[0]


def _connect(address: str) -> None:
    """``ray.init`` on the cluster, or UsageError saying what to do (token auth, the address)."""
    import ray
    from ray.exceptions import AuthenticationError

    without_token = os.environ.get("RAY_AUTH_MODE") != "token"
    running = "is it running? `make serve` prints its address"
    found = _probe(address)
    if found == "token" and without_token:
        raise UsageError(f"cannot connect to the Ray cluster at {address}: it uses Ray's token authentication: "
                         "run the job with RAY_AUTH_MODE=token (the cluster's token in ~/.ray/auth_token, or "
                         "RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH)")
    if found:
        raise UsageError(f"cannot connect to the Ray cluster at {address}: "
                         + ("its token is refused (RAY_AUTH_TOKEN / ~/.ray/auth_token)" if found == "token"
                            else f"no Ray cluster answers there ({running})"))
    try:
        ray.init(address=address, namespace=LOCK_NAMESPACE, log_to_driver=False)
    except (ConnectionError, AuthenticationError) as e:
        hint = running + ("; if it uses Ray's token authentication, run the job with RAY_AUTH_MODE=token"
                          if without_token else "")
        raise UsageError(f"cannot connect to the Ray cluster at {address}: {str(e).splitlines()[0]} ({hint})") from None


async def _run_stoppable(app: str, deployments: list[str] | None, opts: RollingOptions, report: RollingReport,
                         recover_only: bool) -> None:
    """``rolling_recalibrate``, which SIGINT / SIGTERM cancel: it then puts back what it changed (a
    second signal meanwhile is only reported) and ``report.interrupted`` names the signal."""
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(rolling_recalibrate(app, deployments, opts, report=report, recover_only=recover_only))

    def on_signal(sig: signal.Signals) -> None:
        if report.interrupted:
            print(f"{sig.name}: still putting back what the job changed; kill -9 abandons that (then the next "
                  "job, or --recover, puts it back)", file=sys.stderr, flush=True)
            return
        report.interrupted = sig.name
        print(f"{sig.name}: stopping; putting back what the job changed...", file=sys.stderr, flush=True)
        task.cancel()

    sigs = (signal.SIGINT, signal.SIGTERM)
    for sig in sigs:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await task
    except asyncio.CancelledError:
        if not report.interrupted:
            raise
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)


# options whose range the dataclasses check: their errors name the flag
_FLAG_FIELDS = ("monotone_tolerance", "repeat_tolerance", "repeat_capacities", "max_change", "drain_timeout_s",
                "surge_timeout_s", "settle_s")


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
    p.add_argument("--recover", action="store_true",
                   help="only put back what a killed job left (drained replica, surge, config), then exit")
    a = p.parse_args(argv)
    try:  # option ranges, before connecting to anything
        checks = TableChecks(a.monotone_tolerance, a.repeat_tolerance, a.repeat_capacities, a.max_change)
        opts = RollingOptions(quick=not a.full, checks=checks, strategy=a.strategy,
                              drain_timeout_s=a.drain_timeout_s, surge_timeout_s=a.surge_timeout_s,
                              settle_s=a.settle_s, table_dir=a.table_dir)
        if a.table_dir:
            check_table_dir(a.table_dir)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        p.error(f"--{name.replace('_', '-')}{str(e)[len(name):]}" if name in _FLAG_FIELDS else str(e))

    logging.basicConfig(level=logging.INFO)
    report = RollingReport(a.app)
    try:
        _connect(a.address)
        asyncio.run(_run_stoppable(a.app, a.deployment, opts, report, a.recover))
    except (UsageError, LockHeld) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # Ctrl-C while connecting: nothing was changed yet
        print("SIGINT: stopped before anything was changed", file=sys.stderr)
        return 130
    data = json.dumps(asdict(report) | {"ok": report.ok}, indent=1)
    if a.report:
        with open(a.report, "w") as f:
            f.write(data)
    print(data)
    print(format_report(report))
    if report.interrupted:
        print(f"{report.interrupted}: stopped; put back: " + ("; ".join(report.put_back) or "nothing was changed"),
              file=sys.stderr)
        return 128 + signal.Signals[report.interrupted].value
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
