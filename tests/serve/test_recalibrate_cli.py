"""``python -m deployments.recalibrate``: bad options, unknown names, an unwritable table directory and a
cluster that wants Ray's auth token are one ``error:`` line and exit status 2 (options before connecting);
SIGINT / SIGTERM put back what the job changed (on test_recalibrate.py's fake fleet). The application's
lock on a local Ray cluster: a second holder refused, released on an exception, taken over at once
from a driver killed with -9."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_ray_serve import wait_for
from test_recalibrate import OLD, REPO, FakeFleet, FakeLock

from deployments import recalibrate
from deployments.recalibrate import main
from deployments.recalibrate_lock import AppLock, LockHeld


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deployments.recalibrate", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_bad_option_is_a_usage_error_before_connecting():
    """A subprocess, as an operator runs it: the address goes nowhere, so only an early check is fast."""
    t0 = time.monotonic()
    run = run_cli("--address", "127.0.0.1:9", "--max-change", "-1")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.splitlines()[-1] == ("python -m deployments.recalibrate: error: --max-change must be None "
                                           "(off) or a factor > 1, got -1.0")
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("args, message", [
    (["--repeat-tolerance", "-5"], "error: --repeat-tolerance must be a finite number >= 0, got -5.0"),
    (["--settle-s", "-1"], "error: --settle-s must be >= 0, got -1.0"),
    (["--strategy", "nope"], "error: argument --strategy: invalid choice: 'nope'"),
    (["--table-dir", "{file}/tables"], "error: table directory '{file}/tables' is not writable: Not a directory"),
])
def test_option_errors_through_argparse(monkeypatch, capsys, tmp_path, args, message):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(recalibrate, "_connect", lambda address: pytest.fail("connected"))
    with pytest.raises(SystemExit) as exit_:
        main([a.format(file=tmp_path / "file") for a in args])
    assert exit_.value.code == 2 and message.format(file=tmp_path / "file") in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--deployment", "nope"], "error: unknown deployment 'nope' (deployments: bole-a100, bole-gb10)"),
    (["--app", "nope"], "error: unknown application 'nope' (applications: bole)"),
])
def test_unknown_names_are_one_error_line(monkeypatch, capsys, args, message):
    FakeFleet(monkeypatch, bole_a100=1, bole_gb10=1)
    monkeypatch.setattr(recalibrate, "_connect", lambda address: None)
    monkeypatch.setattr(recalibrate, "AppLock", lambda app, lease_s: pytest.fail("locked"))
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == message


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_puts_back_what_the_job_changed(monkeypatch, capsys, sig):
    """The signal comes mid-sweep of the one replica (a surge running): the job resumes the replica with
    its old table, removes the surge, restores the config, says so, and exits with 128 + the signal."""
    fleet = FakeFleet(monkeypatch, bole_cpu=1)
    deployed, lock = copy.deepcopy(fleet.config), FakeLock()
    monkeypatch.setattr(recalibrate, "_connect", lambda address: None)
    monkeypatch.setattr(recalibrate, "AppLock", lambda app, lease_s: lock)

    async def signal_mid_sweep(replica):
        os.kill(os.getpid(), sig)
        await asyncio.Event().wait()

    fleet.hooks["recalibrate"] = signal_mid_sweep
    assert main(["--settle-s", "0", "--surge-timeout-s", "5"]) == 128 + sig
    out = capsys.readouterr()
    (replica,) = fleet.replicas["bole-cpu"]
    assert replica.rid == "bole-cpu-0" and replica.accepting and replica.table == OLD
    assert fleet.config == deployed and lock.journal == {} and not lock.held
    assert f"{sig.name}: stopping; putting back what the job changed..." in out.err
    assert (f"{sig.name}: stopped; put back: resumed replica bole-cpu-0 (bole-cpu); surge of bole-cpu removed, "
            "config of 'bole' restored") in out.err
    report = json.loads(out.out[:out.out.index("\nrolling recalibration of")])
    assert report["interrupted"] == sig.name and not report["ok"]


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster (token authentication on: the default of a new one)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, object_store_memory=80 * 1024 * 1024, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_cluster_wanting_a_token_is_told_at_once(local_ray):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    t0 = time.monotonic()
    run = run_cli("--address", local_ray.get_runtime_context().gcs_address, env=env)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "uses Ray's token authentication: run the job with RAY_AUTH_MODE=token" in run.stderr.splitlines()[-1]
    assert time.monotonic() - t0 < 15


HOLD_AND_WAIT = """
import asyncio, sys, time
import ray
from deployments.recalibrate_lock import AppLock
ray.init(address=sys.argv[1], log_to_driver=False)
lock = AppLock("locktest", lease_s=600).acquire()
asyncio.run(lock.note("surge", {"deployment": "bole-cpu", "n": 1}))
print("held", flush=True)
time.sleep(600)
"""


def test_app_lock_one_holder_released_on_error_taken_from_a_killed_driver(local_ray):
    """Cluster-wide, per application: a second holder is refused (naming pid, host, start); an exception
    releases it; a driver killed with -9 (lease 600 s) gives it up at once, with its journal."""
    ray = local_ray
    with AppLock("locktest"):
        with pytest.raises(LockHeld, match=rf"pid {os.getpid()} on host .+, started 20\d\d-"):
            AppLock("locktest").acquire()
        AppLock("other-app").acquire().release()          # one lock per application
    with pytest.raises(RuntimeError, match="a bug"), AppLock("locktest"):
        raise RuntimeError("a bug")
    AppLock("locktest").acquire().release()
    wait_for(lambda: not _lock_actor_alive(ray, "locktest"), timeout=10)   # nothing idle left behind

    child = subprocess.Popen([sys.executable, "-c", HOLD_AND_WAIT, ray.get_runtime_context().gcs_address],
                             cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(LockHeld, match=f"pid {child.pid} "):
            AppLock("locktest").acquire()
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    lock = wait_for(lambda: _try_acquire("locktest"), timeout=15)
    assert lock.previous["pid"] == child.pid and lock.journal == {"surge": {"deployment": "bole-cpu", "n": 1}}
    asyncio.run(lock.note("surge", None))
    lock.release()


def _lock_actor_alive(ray, app: str) -> bool:
    try:
        ray.get_actor(f"bole-recalibrate:{app}", namespace=recalibrate.LOCK_NAMESPACE)
        return True
    except ValueError:
        return False


def _try_acquire(app: str):
    try:
        return AppLock(app).acquire()
    except LockHeld:
        return None
