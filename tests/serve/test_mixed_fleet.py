"""The simulated mixed fleet (``make serve-mixed``'s code path) on a real local Ray cluster: the one
cluster_configs/mixed.yaml with cluster_configs/overlays/mixed-cpu.yaml, plus a test overlay for the
tiny model, started exactly as the Makefile starts it (``python -m deployments.launch`` with the fleet
nodes' resources) in its own session. Requests reach both groups (the A100 group is TP=2 over gloo),
the stale tables are flagged as mismatched, the rolling recalibration job (its CLI) re-measures both
classes under a steady 4-client load with zero failed requests, and Ctrl-C (SIGINT to the process
group, as a terminal sends it) drains and stops everything."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml
from conftest import ENGINE_OPTIONS
from fleet_helpers import STALE_T_DEC_MS, SteadyLoad, stale_table
from test_ray_serve import wait_for

from bole.llm import REPO_ROOT
from bole.parallel import free_port

pytestmark = pytest.mark.slow

# the Makefile's MIXED_RESOURCES has two GB10 nodes' worth; here one, so that class has no room for a
# surge replica and the job reroutes its traffic while the A100 class surges (its autoscaling headroom)
RESOURCES = '{"accelerator_type:A100": 1, "gb10": 1}'


def metrics_rows(url: str, name: str) -> list[dict]:
    """Label dicts (plus "value") of every sample of metric ``name`` on the ingress's /metrics."""
    rows = []
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            rows.append({**labels, "value": float(line.split()[-1])})
    return rows


def test_mixed_fleet_simulation_recalibration_and_ctrl_c(tiny_model, tmp_path):
    port = free_port()
    opts = {k: v for k, v in ENGINE_OPTIONS.items() if k != "calibration_table"}
    # stale tables that also say the wrong dtype / tp (as the issue found): flagged, then replaced
    a100 = stale_table(tmp_path / "a100.yaml", tiny_model, "a100", dtype="bfloat16", tp_size=1)
    gb10 = stale_table(tmp_path / "gb10.yaml", tiny_model, "gb10", dtype="bfloat16", tp_size=1)
    group = lambda name, table: {"name": name, "calibration_table": table, "engine_options": opts,  # noqa: E731
                                 "router": {"stats_period_s": 0.5}}
    overlay = {"http_options": {"port": port},
               "applications": [{"name": "bole", "args": {
                   "model": tiny_model, "served_model_name": "tiny", "default_max_tokens": 16,
                   "groups": [group("bole-a100", a100), group("bole-gb10", gb10)]}}]}
    overlay_path = tmp_path / "tiny-overlay.yaml"
    overlay_path.write_text(yaml.safe_dump(overlay))
    log_path = tmp_path / "launch.log"
    cmd = [sys.executable, "-m", "deployments.launch", "cluster_configs/mixed.yaml",
           "--overlay", "cluster_configs/overlays/mixed-cpu.yaml", "--overlay", str(overlay_path),
           "--num-cpus", "8", "--resources", RESOURCES, "--deploy-timeout-s", "300"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline, banner = time.time() + 330, None
        while banner is None and proc.poll() is None and time.time() < deadline:
            banner = re.search(r"recalibrate: (.*)python -m deployments.recalibrate --address (\S+)",
                               log_path.read_text())
            time.sleep(1)
        assert banner, f"make serve-mixed did not come up:\n{log_path.read_text()[-3000:]}"
        auth_env, address = banner.group(1), banner.group(2)

        # the stale tables' dtype / tp do not describe the replicas: logged loudly, labelled in /metrics
        tables = {r["hardware_class"]: r for r in metrics_rows(url, "bole_calibration_table_info")}
        assert {h: r["mismatch"] for h, r in tables.items()} == {"a100": "dtype,tp_size", "gb10": "dtype"}
        assert log_path.read_text().count("CALIBRATION TABLE MISMATCH") >= 2
        old_ids = {r["table_id"] for r in tables.values()}

        def job(*args) -> dict:
            """The job's CLI, as an operator runs it; its JSON report."""
            report_path = tmp_path / f"report-{len(reports)}.json"
            # CPU timings on a shared 2-core box are noisy (two sweeps here differed 4x): monotone / repeat relaxed
            run = subprocess.run(
                [sys.executable, "-m", "deployments.recalibrate", "--address", address, "--report", str(report_path),
                 "--settle-s", "1.0", "--monotone-tolerance", "0.9", "--repeat-tolerance", "9",
                 "--repeat-capacities", "3",
                 "--table-dir", str(tmp_path / "tables"), *args],
                cwd=REPO_ROOT, env={**env, **({"RAY_AUTH_MODE": "token"} if auth_env.strip() else {})},
                capture_output=True, text=True, timeout=600)
            print(run.stdout[run.stdout.find("rolling recalibration of"):])
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            reports.append(json.loads(report_path.read_text()))
            return reports[-1]

        reports: list[dict] = []
        with SteadyLoad(url, clients=4) as load:
            # concurrent clients keep loads apart, so the ingress uses both groups
            wait_for(lambda: {r["hardware_class"] for r in metrics_rows(url, "bole_generation_tokens_total")}
                     == {"a100", "gb10"}, timeout=120)
            job()
            time.sleep(1.0)
        assert not load.errors, load.errors[:5]
        assert [(c["deployment"], c["strategy"]) for c in reports[0]["classes"]] == [
            ("bole-a100", "surge"), ("bole-gb10", "reroute")]
        assert "gb10 needs 1, 0 free" in reports[0]["classes"][1]["why"]
        for r in reports:
            assert r["ok"]
            during = load.served_between(r["started_at"], r["finished_at"])
            assert during >= 4, "the clients were not served while the job ran"
            # the replicas' counters against what the clients saw meanwhile (in flight at either end)
            assert abs(r["requests_served"] - during) <= max(12, 0.05 * during), (r["requests_served"], during)
            windows = sorted((e["drained_at"], e["resumed_at"]) for e in r["events"])
            assert all(a[1] <= b[0] for a, b in zip(windows, windows[1:])), "two replicas were out at once"
            for e in r["events"]:
                assert e["ok"] and e["new_table_id"] != e["old_table_id"]
                assert e["buckets"] and all(b["old_t_dec_ms"] >= STALE_T_DEC_MS for b in e["buckets"])
                assert all(b["new_t_dec_ms"] * 3 <= b["old_t_dec_ms"] for b in e["buckets"]), e["buckets"]
        # every replica serving now has a new table, measured for how it runs (no mismatch left)
        after = wait_for(lambda: (rows := metrics_rows(url, "bole_calibration_table_info"))
                         and len(rows) == 2 and not {r["table_id"] for r in rows} & old_ids and rows, timeout=30)
        assert {r["hardware_class"]: r["mismatch"] for r in after} == {"a100": "", "gb10": ""}
        ids = {r["hardware_class"]: r["table_id"].split("@")[0].split("/") for r in after}
        assert [ids["a100"][i] for i in (0, 2, 3)] == ["a100", "float32", "tp2"]
        assert [ids["gb10"][i] for i in (0, 2, 3)] == ["gb10", "float32", "tp1"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)   # Ctrl-C: the whole foreground process group
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"Ctrl-C did not stop make serve-mixed:\n{log_path.read_text()[-3000:]}") from None
    assert code == 0, log_path.read_text()[-3000:]
    assert "shutting down" in log_path.read_text()
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=5)
    left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of make serve-mixed still running: {left}"
