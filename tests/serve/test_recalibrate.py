"""The rolling recalibration job. On a real local Ray cluster, on the one-replica app of
cluster_configs/local.yaml's shape (the tiny model): its only replica is never drained before a surge
replica runs, so a steady 4-client load (openai client) sees no failure and /ready stays 200; the
re-measured table, far more than 3x from the stale one, is installed; the config is put back (slow).
On a fake fleet (``FakeFleet``: Serve's details, deploys and handles as the job sees them): a stopped
job puts back what it changed, a killed job's leftovers are put back by the next, a table that cannot
be written is not installed, unknown names are refused; the lock's rules (its actor on a real Ray
cluster: test_recalibrate_cli.py)."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from fleet_helpers import STALE_T_DEC_MS, SteadyLoad, stale_table
from test_ray_serve import deploy, deploy_config, fleet, start_serve, wait_for

from bole.recalibration import TableChecks
from bole.spec.budget import CalibrationTable
from deployments import recalibrate, recalibrate_lock, surge
from deployments.app import INGRESS_NAME
from deployments.recalibrate import (
    RollingOptions,
    UsageError,
    format_report,
    rolling_recalibrate,
)
from deployments.recalibrate_report import RollingReport

REPO = Path(__file__).resolve().parents[2]
TABLE = yaml.safe_load((REPO / "calibration_tables/cpu-bole-tiny-coder.yaml").read_text())
OLD, NEW = {**TABLE, "date": "2026-01-01"}, {**TABLE, "date": "2026-02-02"}


def table_id(table: dict) -> str:
    return CalibrationTable.from_dict(table).table_id


class FakeReplica:
    """A BoleReplica's control methods; ``hooks[method]`` (async, optional) runs inside that call."""

    def __init__(self, rid: str, hooks: dict):
        self.rid, self.hooks, self.table, self.accepting, self.calls = rid, hooks, OLD, True, []

    async def _hook(self, method: str) -> None:
        self.calls.append(method)
        if method in self.hooks:
            await self.hooks[method](self)

    async def calibration_info(self):
        return {"replica_id": self.rid, "table_id": table_id(self.table), "accepting": self.accepting,
                "finished": 0, "hardware_class": "cpu", "table": self.table, "pending": 0, "mismatch": ""}

    async def drain(self, timeout_s):
        self.accepting = False
        await self._hook("drain")
        return True

    async def recalibrate(self, quick, checks):
        await self._hook("recalibrate")
        return {"table": NEW, "old_table": self.table, "table_id": table_id(NEW)}

    async def set_calibration(self, table):
        self.table = table
        await self._hook("set_calibration")
        return table_id(table)

    async def resume(self):
        self.accepting = True
        await self._hook("resume")


class FakeFleet:
    """Serve as the job sees it (``surge.serve_details`` / ``deploy`` / ``headroom``, the handles) for
    one application "bole" deployed from a config: a ``deployments:`` entry's ``num_replicas`` starts
    or stops replicas (newest last), as Serve does."""

    def __init__(self, monkeypatch, hooks: dict | None = None, **counts: int):
        self.hooks = hooks if hooks is not None else {}
        self.base = {dep.replace("_", "-"): n for dep, n in counts.items()}
        self.config = {"name": "bole", "route_prefix": "/", "import_path": "deployments.app:build_app",
                       "args": {"model": "tiny"}}
        self.replicas = {dep: [FakeReplica(f"{dep}-{i}", self.hooks) for i in range(n)] for dep, n in self.base.items()}
        self.deploys = 0
        monkeypatch.setattr(surge, "serve_details", self.details)
        monkeypatch.setattr(surge, "deploy", self.deploy)
        monkeypatch.setattr(surge, "headroom", lambda app, dep, details=None: (True, "room for one more"))
        monkeypatch.setattr(recalibrate, "_handle", lambda app, dep: FakeHandle(self, dep))

    def details(self) -> dict:
        deps = {dep: {"deployment_config": {"ray_actor_options": {"num_cpus": 1}},
                      "replicas": [{"replica_id": r.rid, "state": "RUNNING", "start_time_s": i}
                                   for i, r in enumerate(rs)]} for dep, rs in self.replicas.items()}
        deps[INGRESS_NAME] = {"deployment_config": {}, "replicas": []}
        return {"applications": {"bole": {"status": "RUNNING", "deployed_app_config": copy.deepcopy(self.config),
                                          "deployments": deps}}}

    def deploy(self, configs: dict) -> None:
        self.deploys += 1
        self.config = copy.deepcopy(configs["bole"])
        for dep, rs in self.replicas.items():
            entry = next((e for e in self.config.get("deployments", []) if e["name"] == dep), {})
            n = entry.get("num_replicas", self.base[dep])
            rs.extend(FakeReplica(f"{dep}-surge{k}", self.hooks) for k in range(len(rs), n))
            del rs[n:]

    def replica(self, rid: str) -> FakeReplica:
        return next(r for rs in self.replicas.values() for r in rs if r.rid == rid)


class FakeHandle:
    def __init__(self, fleet: FakeFleet, dep: str, method: str = ""):
        self.fleet, self.dep, self.method = fleet, dep, method

    def options(self, method_name: str):
        return FakeHandle(self.fleet, self.dep, method_name)

    def remote(self, target_replica: str, **kw):
        return getattr(self.fleet.replica(target_replica), self.method)(**kw)


class FakeLock:
    """``AppLock`` without Ray: a journal, always free."""

    def __init__(self, journal: dict | None = None):
        self.journal, self.notes, self.held = copy.deepcopy(journal or {}), [], False

    def acquire(self):
        self.held = True
        return self

    def release(self) -> None:
        self.held = False

    def check(self) -> None:
        pass

    async def note(self, key, value) -> None:
        self.notes.append((key, value))
        if value is None:
            self.journal.pop(key, None)
        else:
            self.journal[key] = value


FAST = RollingOptions(settle_s=0.0, control_timeout_s=5.0, surge_timeout_s=5.0)


async def _forever(replica) -> None:
    await asyncio.Event().wait()


@pytest.mark.parametrize("stop_in", ["recalibrate", "set_calibration"])
def test_stopped_job_puts_back_what_it_changed(monkeypatch, stop_in):
    """Cancelled (as SIGINT / SIGTERM do) mid-sweep or right after the install: the surge is removed, the
    config is as deployed, the replica admits again with its old table, and the journal is empty."""
    fleet = FakeFleet(monkeypatch, bole_cpu=1)
    deployed, lock, report = copy.deepcopy(fleet.config), FakeLock(), RollingReport("bole")
    reached = asyncio.Event()

    async def stop_here(replica):   # the first time: the put-back installs the old table the same way
        if not reached.is_set():
            reached.set()
            await _forever(replica)

    fleet.hooks[stop_in] = stop_here

    async def run():
        task = asyncio.create_task(rolling_recalibrate("bole", None, FAST, report=report, lock=lock))
        await asyncio.wait_for(reached.wait(), 10)
        assert len(fleet.replicas["bole-cpu"]) == 2 and lock.journal.keys() == {"replica", "surge"}
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    (replica,) = fleet.replicas["bole-cpu"]
    assert replica.rid == "bole-cpu-0" and replica.accepting and replica.table == OLD
    assert fleet.config == deployed and lock.journal == {}
    assert report.interrupted == "cancelled" and not report.ok
    assert report.put_back == ["resumed replica bole-cpu-0 (bole-cpu)"
                               + (f" with its old table {table_id(OLD)}" if stop_in == "set_calibration" else ""),
                               "surge of bole-cpu removed, config of 'bole' restored"], report.put_back
    assert "INTERRUPTED (cancelled)" in format_report(report)


def test_killed_jobs_leftovers_are_put_back_by_the_next(monkeypatch):
    """A journal left by a killed job (drained replica with a new table, surge running) and a drained
    replica no journal names: the next job puts them back before anything else (here --recover)."""
    fleet = FakeFleet(monkeypatch, bole_a100=1, bole_gb10=1)
    deployed = copy.deepcopy(fleet.config)
    dep_cfg = fleet.details()["applications"]["bole"]["deployments"]["bole-a100"]["deployment_config"]
    fleet.deploy({"bole": surge.with_replicas({"bole": deployed}, "bole", "bole-a100", 2, dep_cfg)["bole"]})
    a100, gb10 = fleet.replica("bole-a100-0"), fleet.replica("bole-gb10-0")
    a100.accepting, a100.table, gb10.accepting = False, NEW, False
    lock = FakeLock({"replica": {"deployment": "bole-a100", "replica_id": "bole-a100-0",
                                 "old_table_id": table_id(OLD), "old_table": OLD},
                     "surge": {"deployment": "bole-a100", "n": 1, "before": deployed, "dep_cfg": dep_cfg}})
    report = asyncio.run(rolling_recalibrate("bole", None, FAST, lock=lock, recover_only=True))
    assert report.recovered == [
        f"resumed replica bole-a100-0 (bole-a100) with its old table {table_id(OLD)}",
        "surge of bole-a100 removed, config of 'bole' restored",
        "resumed replica bole-gb10-0 (bole-gb10): found drained, in no job's journal"]
    assert lock.journal == {} and fleet.config == deployed and len(fleet.replicas["bole-a100"]) == 1
    assert a100.accepting and a100.table == OLD and gb10.accepting and not report.events

    # a surge whose config someone redeployed since is left alone (and said so)
    fleet.deploy({"bole": {**deployed, "args": {"model": "other"}}})
    lock = FakeLock({"surge": {"deployment": "bole-a100", "n": 1, "before": deployed, "dep_cfg": dep_cfg}})
    report = asyncio.run(rolling_recalibrate("bole", None, FAST, lock=lock, recover_only=True))
    assert report.recovered == ["the config of 'bole' changed since the surge of bole-a100 (redeployed?): "
                                "left as it is"] and fleet.config["args"] == {"model": "other"}


def test_table_that_cannot_be_written_is_not_installed(monkeypatch, tmp_path):
    """The table is written before it is installed: a write failure leaves the old table (ok=False);
    a table directory that cannot be written is refused before anything is drained."""
    fleet = FakeFleet(monkeypatch, bole_cpu=2)

    def fail(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(recalibrate, "_write_table", fail)
    report = asyncio.run(rolling_recalibrate("bole", None, RollingOptions(settle_s=0, table_dir=str(tmp_path)),
                                             lock=FakeLock()))
    assert [e.ok for e in report.events] == [False, False] and "No space left" in report.events[0].error
    for r in fleet.replicas["bole-cpu"]:
        assert r.table == OLD and r.accepting and "set_calibration" not in r.calls, r.calls

    (tmp_path / "file").write_text("")
    lock, opts = FakeLock(), RollingOptions(table_dir=str(tmp_path / "file" / "t"))
    for r in fleet.replicas["bole-cpu"]:
        r.calls.clear()
    with pytest.raises(UsageError, match="table directory .* is not writable"):
        asyncio.run(rolling_recalibrate("bole", None, opts, lock=lock))
    assert lock.notes == [] and all(r.calls == [] for r in fleet.replicas["bole-cpu"])


def test_replica_that_cannot_be_resumed_stops_its_class(monkeypatch):
    """A resume that fails leaves the replica in the journal: no other replica of the class is drained
    (never two out at once); the job puts it back (old table) before the next class."""
    fleet = FakeFleet(monkeypatch, bole_cpu=2)
    failures = []

    async def fail_once(replica):
        if not failures:
            failures.append(replica.rid)
            raise ConnectionError("replica unreachable")

    fleet.hooks["resume"] = fail_once
    report = asyncio.run(rolling_recalibrate("bole", None, FAST, lock=(lock := FakeLock())))
    (ev,) = report.events
    assert ev.replica_id == "bole-cpu-0" and not ev.ok and "could not put back the replica" in ev.error
    assert "drain" not in fleet.replica("bole-cpu-1").calls and report.classes[0].error
    # a failed replica keeps its old table, whatever step failed
    assert report.put_back == [f"resumed replica bole-cpu-0 (bole-cpu) with its old table {table_id(OLD)}"]
    assert fleet.replica("bole-cpu-0").table == OLD and lock.journal == {} and not report.ok


def test_unknown_application_or_deployment_is_named(monkeypatch):
    FakeFleet(monkeypatch, bole_a100=1, bole_gb10=1)
    with pytest.raises(UsageError, match=r"unknown application 'nope' \(applications: bole\)"):
        asyncio.run(rolling_recalibrate("nope", None, FAST, lock=FakeLock()))
    with pytest.raises(UsageError, match=r"unknown deployment 'nope' \(deployments: bole-a100, bole-gb10\)"):
        asyncio.run(rolling_recalibrate("bole", ["bole-a100", "nope"], FAST, lock=FakeLock()))


def test_lock_lease_and_take_over_rules():
    """The lock actor's rules, as a plain object: a live holder keeps it, a lapsed lease or a named
    dead holder's token gives it up (with the journal), a stale token can neither renew nor note."""
    state = recalibrate_lock._lock_actor_class()()
    a, b = {"token": "a", "lease_s": 0.2}, {"token": "b", "lease_s": 0.2}
    assert state.acquire(a)["ok"] and state.note("a", "surge", {"n": 1})
    refused = state.acquire(b)
    assert not refused["ok"] and refused["holder"] is a
    assert state.renew("a") and not state.renew("b")
    taken = state.acquire(b, take_over="a")           # its driver is gone
    assert taken["ok"] and taken["previous"] is a and taken["journal"] == {"surge": {"n": 1}}
    assert not state.note("a", "surge", None) and not state.renew("a")
    time.sleep(0.3)                                   # b's lease lapses
    assert state.acquire(a)["ok"] and state.note("a", "surge", None) and state.journal == {}


@pytest.mark.slow
def test_one_replica_app_surges_and_drops_nothing(tiny_model, tmp_path):
    ray = pytest.importorskip("ray")
    from ray import serve

    # 2 CPUs: the replica and room for one surge replica (the ingress takes none)
    ray.init(num_cpus=2, object_store_memory=80 * 1024 * 1024, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"TRITON_INTERPRET": "1"}})
    try:
        port = start_serve()
        table = stale_table(tmp_path / "stale.yaml", tiny_model, "cpu")
        cfg = deploy_config(tiny_model, port, table=table)
        cfg["applications"][0]["args"]["groups"][0]["num_replicas"] = 1     # as local.yaml
        deploy(cfg)
        url = f"http://127.0.0.1:{port}"
        before = wait_for(lambda: (f := fleet(url)) and len(f) == 1 and f)
        (rid, old), = before.items()
        assert old["table_id"].startswith("cpu/tiny/float32/tp1@2026-01-02")

        ready, stop_ready = [], threading.Event()

        def watch_ready():
            while not stop_ready.is_set():
                ready.append(httpx.get(url + "/ready", timeout=30).status_code)
                time.sleep(0.5)

        watcher = threading.Thread(target=watch_ready, daemon=True)
        # CPU timings on a shared 2-core box are noisy (two sweeps here differed 4x): monotone / repeat relaxed
        opts = RollingOptions(checks=TableChecks(monotone_tolerance=0.9, repeat_tolerance=9.0,
                                                 repeat_capacities=3), settle_s=1.0,
                              table_dir=str(tmp_path / "tables"))
        with SteadyLoad(url, clients=4) as load:
            wait_for(lambda: len(load.results) >= 4, timeout=60)
            watcher.start()
            report = asyncio.run(rolling_recalibrate("bole", None, opts))
            time.sleep(1.0)
            stop_ready.set()
        watcher.join(30)
        print(format_report(report))

        assert not load.errors, load.errors[:3]
        assert ready and set(ready) == {200}, ready          # the class never went dark
        assert report.ok and [c.strategy for c in report.classes] == ["surge"]
        cls = report.classes[0]
        assert cls.replicas == [rid] and cls.surge_replica and cls.surge_replica != rid
        (ev,) = report.events
        assert ev.ok and ev.replica_id == rid and ev.new_table_id != ev.old_table_id and ev.table_path
        assert ev.drained_at <= ev.drain_done_at <= ev.recalibrated_at <= ev.resumed_at
        assert all(b["old_t_dec_ms"] >= STALE_T_DEC_MS and b["new_t_dec_ms"] * 3 <= b["old_t_dec_ms"]
                   for b in ev.buckets), ev.buckets
        during = load.served_between(report.started_at, report.finished_at)
        assert during >= 4 and abs(report.requests_served - during) <= max(12, 0.05 * during)
        # the surge replica is gone again, the config is as deployed, the replica keeps its new table
        assert surge.running_replicas("bole", "bole-cpu") == [rid]
        assert not surge.app_configs()["bole"].get("deployments")      # no override left behind
        after = wait_for(lambda: (f := fleet(url)) and f[rid]["table_id"] == ev.new_table_id and f)
        assert set(after) == {rid}
    finally:
        serve.shutdown()
        ray.shutdown()
