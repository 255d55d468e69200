"""The rolling recalibration job on a real local Ray cluster, on the one-replica app of
cluster_configs/local.yaml's shape (the tiny model): its only replica is never drained before a surge
replica runs, so a steady 4-client load (openai client) sees no failure and /ready stays 200; the
re-measured table, far more than 3x from the stale one, is installed; the config is put back."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from fleet_helpers import STALE_T_DEC_MS, SteadyLoad, stale_table
from test_ray_serve import deploy, deploy_config, fleet, start_serve, wait_for

from bole.recalibration import TableChecks
from deployments import surge
from deployments.recalibrate import RollingOptions, format_report, rolling_recalibrate

pytestmark = pytest.mark.slow


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
