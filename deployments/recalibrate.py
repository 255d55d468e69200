"""Rolling recalibration: re-measure every replica's verification budget table without dropping requests.

    python -m deployments.recalibrate --app bole [--deployment bole-a100 ...] [--full] [--table-dir DIR]

Each replica deployment is one hardware class (``deployments.app``). Classes are processed
concurrently; within a class, one replica at a time:

  1. drain    ``drain(target_replica=id)``: the replica reports ``accepting: False`` and the routers
              route around it (``BoleRequestRouter``); a request that reaches it before the routers'
              next stats refresh is refused before any token and the ingress sends it elsewhere
              (``ServeEngineClient``); the call returns when its in-flight requests have finished.
  2. sweep    ``recalibrate(target_replica=id)``: ``bole.calibrate.recalibrate`` (quick mode by default)
              on the replica's engine between steps (``AsyncEngine.run_exclusive``; on a TP replica on
              every rank at once). Its own checks (monotone, sane bounds, agreement with the old table)
              refuse a bad table, and the old one stays.
  3. validate here: the new table is for the same hardware class, is a new measurement, and every
              bucket keeps a positive budget; otherwise the old table is put back.
  4. push     the table is installed on the replica (``set_calibration``: no restart) and, with
              ``--table-dir``, written as YAML with its provenance, ready to be named in the group's
              ``calibration_table`` (``user_config`` -> ``reconfigure``) so new replicas start with it.
  5. resume   the replica admits again; the job waits one routing-stats period (``--settle-s``) so the
              routers see it back before the next replica of the class is drained.

So at most one replica of a class is out at a time, and a class never loses more than one replica's
capacity. Control calls name their replica with ``target_replica``; the replica checks the id. A
failure on one replica (timeout, refused table) is recorded, the replica is resumed, and the job
goes on with the next one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RollingOptions:
    """How the job runs (CLI flags mirror these)."""

    quick: bool = True                 # quick sweep plan (bole.calibrate.QUICK_PLAN layout)
    monotone_tolerance: float = 0.25   # passed to bole.calibrate.check_table
    drain_timeout_s: float = 120.0     # longest wait for a replica's in-flight requests
    call_timeout_s: float = 900.0      # longest wait for any one control call (the sweep included)
    settle_s: float = 2.0              # after resume: let the routers' stats show the replica back
    table_dir: str | None = None       # write each new table here (YAML with provenance)

    def __post_init__(self):
        for name in ("drain_timeout_s", "call_timeout_s", "settle_s", "monotone_tolerance"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class ReplicaEvent:
    """What happened to one replica (timestamps are time.time())."""

    deployment: str
    replica_id: str
    hardware_class: str = "unknown"
    old_table_id: str = ""
    new_table_id: str = ""
    drained_at: float = 0.0
    drained_clean: bool = False        # in-flight requests finished within drain_timeout_s
    recalibrated_at: float = 0.0
    resumed_at: float = 0.0
    ok: bool = False
    error: str = ""
    table_path: str = ""
    times: dict = field(default_factory=dict)


def running_replicas(app: str, deployment: str) -> list[str]:
    """Unique ids of a deployment's RUNNING replicas (Serve's instance details)."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    dep = details["applications"][app]["deployments"][deployment]
    return sorted(r["replica_id"] for r in dep["replicas"] if r["state"] == "RUNNING")


def replica_deployments(app: str) -> list[str]:
    """The app's replica deployments (every deployment but the ingress)."""
    from ray.serve.context import _get_global_client

    from deployments.app import INGRESS_NAME

    details = _get_global_client().get_serve_details()
    return sorted(d for d in details["applications"][app]["deployments"] if d != INGRESS_NAME)


def validate(new: dict, old: dict) -> list[str]:
    """The job's own checks on a recalibrated table (mappings, ``CalibrationTable.to_dict``)."""
    from bole.spec.budget import CalibrationTable

    problems = []
    n, o = CalibrationTable.from_dict(new), CalibrationTable.from_dict(old)
    if o.hardware != "any" and n.hardware != o.hardware:
        problems.append(f"hardware class {n.hardware!r} differs from the replica's {o.hardware!r}")
    if n.table_id == o.table_id:
        problems.append("the table id did not change (no new measurement)")
    if n.source != "measured":
        problems.append(f"source is {n.source!r}, not 'measured'")
    if any(b.b_ver < 1 for b in n.buckets):
        problems.append("a bucket has no verification budget")
    return problems


def _write_table(table: dict, table_dir: str, deployment: str, replica_id: str) -> str:
    import yaml

    os.makedirs(table_dir, exist_ok=True)
    path = os.path.join(table_dir, f"{deployment}-{replica_id}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(table, f, sort_keys=False)
    return path


async def recalibrate_replica(handle, deployment: str, replica_id: str, opts: RollingOptions) -> ReplicaEvent:
    """Drain -> sweep -> validate -> push -> resume one replica (see the module docstring)."""
    ev = ReplicaEvent(deployment, replica_id)
    call = lambda method, **kw: asyncio.wait_for(  # noqa: E731
        handle.options(method_name=method).remote(target_replica=replica_id, **kw), opts.call_timeout_s)
    info = await call("calibration_info")
    ev.hardware_class, ev.old_table_id = info["hardware_class"], info["table_id"]
    ev.drained_at = time.time()
    try:
        ev.drained_clean = await call("drain", timeout_s=opts.drain_timeout_s)
        if not ev.drained_clean:  # requests still running pause during the sweep; none is dropped
            logger.warning("%s: in-flight requests outlived the drain timeout", replica_id)
        t0 = time.time()
        res = await call("recalibrate", quick=opts.quick, monotone_tolerance=opts.monotone_tolerance)
        ev.recalibrated_at = time.time()
        ev.times["sweep_s"] = round(ev.recalibrated_at - t0, 2)
        problems = validate(res["table"], res["old_table"])
        if problems:
            await call("set_calibration", table=res["old_table"])
            raise RuntimeError("new table rejected: " + "; ".join(problems))
        ev.new_table_id = await call("set_calibration", table=res["table"])
        if opts.table_dir:
            ev.table_path = _write_table(res["table"], opts.table_dir, deployment, replica_id)
        ev.ok = True
    except Exception as e:  # noqa: BLE001 - recorded; the replica is resumed and the job goes on
        ev.error = f"{type(e).__name__}: {e}"
        logger.error("recalibration of %s failed: %s", replica_id, ev.error)
    finally:
        await call("resume")
        ev.resumed_at = time.time()
    logger.info("%s/%s: %s -> %s (%s)", deployment, replica_id, ev.old_table_id, ev.new_table_id or "-",
                "ok" if ev.ok else ev.error)
    return ev


async def recalibrate_class(app: str, deployment: str, opts: RollingOptions) -> list[ReplicaEvent]:
    """One replica at a time through one deployment (hardware class)."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app)
    events = []
    for replica_id in running_replicas(app, deployment):
        events.append(await recalibrate_replica(handle, deployment, replica_id, opts))
        await asyncio.sleep(opts.settle_s)
    return events


async def rolling_recalibrate(app: str = "bole", deployments: list[str] | None = None,
                              opts: RollingOptions | None = None) -> list[ReplicaEvent]:
    """Recalibrate every replica of ``deployments`` (default: all replica deployments of ``app``)."""
    opts = opts or RollingOptions()
    deployments = deployments or replica_deployments(app)
    per_class = await asyncio.gather(*(recalibrate_class(app, d, opts) for d in deployments))
    return [ev for events in per_class for ev in events]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.recalibrate", description=__doc__.split("\n")[0])
    p.add_argument("--address", default="auto", help="Ray cluster address")
    p.add_argument("--app", default="bole", help="Serve application name")
    p.add_argument("--deployment", action="append", help="replica deployment(s); default: all")
    p.add_argument("--full", action="store_true", help="full sweep plan instead of the quick one")
    p.add_argument("--table-dir", default=None, help="write the new tables here")
    p.add_argument("--settle-s", type=float, default=RollingOptions.settle_s)
    a = p.parse_args(argv)
    import ray

    logging.basicConfig(level=logging.INFO)
    ray.init(address=a.address, namespace="serve", log_to_driver=False)
    opts = RollingOptions(quick=not a.full, table_dir=a.table_dir, settle_s=a.settle_s)
    events = asyncio.run(rolling_recalibrate(a.app, a.deployment, opts))
    print(json.dumps([asdict(e) for e in events], indent=1))
    return 0 if all(e.ok for e in events) else 1


if __name__ == "__main__":
    raise SystemExit(main())
