"""The Serve application on a real local Ray cluster: two CPU replicas of a tiny checkpoint behind
the OpenAI ingress and the Bole router, reached over HTTP with the openai client."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from conftest import ENGINE_OPTIONS

from bole.parallel import free_port

pytestmark = pytest.mark.slow

MODEL = "tiny"


def start_serve(attempts: int = 4) -> int:
    """serve.start on 127.0.0.1 and a free port (`bole.parallel.free_port`: outside the ranges Ray's own
    processes draw from), retried on another port if the proxy still cannot bind; returns the port."""
    from ray import serve

    for attempt in range(attempts):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except Exception as e:  # ray.exceptions.RayTaskError(RuntimeError) from the proxy actor
            if "Failed to bind" not in str(e) or attempt == attempts - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


def app_args(model_path, table="calibration_tables/default.yaml"):
    opts = {k: v for k, v in ENGINE_OPTIONS.items() if k != "calibration_table"}
    return {"model": model_path, "served_model_name": MODEL,
            "groups": [{"name": "bole-cpu", "hardware": "cpu", "num_replicas": 2, "engine_options": opts,
                        "calibration_table": table, "ray_actor_options": {"num_cpus": 1},
                        "router": {"stats_period_s": 0.5}}]}


def deploy_config(model_path, port, table="calibration_tables/default.yaml", override_table=None) -> dict:
    """A Serve config like cluster_configs/local.yaml, for the tiny model (what `serve run` deploys)."""
    app = {"name": "bole", "route_prefix": "/", "import_path": "deployments.app:build_app",
           "args": app_args(model_path, table)}
    if override_table:  # a lightweight update: only user_config changes -> reconfigure, no restart
        app["deployments"] = [{"name": "bole-cpu", "user_config": {"calibration_table": override_table}}]
    return {"http_options": {"host": "127.0.0.1", "port": port}, "applications": [app]}


def deploy(cfg: dict, timeout: float = 120.0) -> None:
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(cfg))
    deadline = time.time() + timeout
    while time.time() < deadline:
        app = serve.status().applications.get("bole")
        if app is not None and app.status == "RUNNING" and all(
                d.status == "HEALTHY" for d in app.deployments.values()):
            return
        if app is not None and app.status == "DEPLOY_FAILED":
            raise RuntimeError(app.message)
        time.sleep(0.5)
    raise TimeoutError("the application did not become RUNNING")


@pytest.fixture(scope="module")
def cluster(tiny_model):
    ray = pytest.importorskip("ray")
    from ray import serve

    ray.init(num_cpus=2, object_store_memory=80 * 1024 * 1024, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"TRITON_INTERPRET": "1"}})
    port = start_serve()
    deploy(deploy_config(tiny_model, port))
    yield f"http://127.0.0.1:{port}", port
    serve.shutdown()
    ray.shutdown()


def fleet(url) -> dict:
    """{replica: {metric: value}} from the ingress's /metrics."""
    out: dict = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("bole_") and 'replica="' in line:
            name = line.split("{")[0]
            replica = line.split('replica="')[1].split('"')[0]
            out.setdefault(replica, {})[name] = float(line.split()[-1])
            if name == "bole_calibration_table_info":
                out[replica]["table_id"] = line.split('table_id="')[1].split('"')[0]
    return out


def wait_for(pred, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError("condition not met in time")


def test_ray_serve_openai_prefix_affinity_and_reconfigure(cluster, tiny_model):
    url, port = cluster
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert [m.id for m in oai.models.list().data] == [MODEL]
    replicas = wait_for(lambda: (f := fleet(url)) and len(f) == 2 and f)
    assert all(r["bole_prefix_summary_blocks"] == 0 for r in replicas.values())

    # one shared prefix of 12 blocks (block_size 4), sent 5 times with different tails
    prefix = list(range(5, 53))
    for i in range(5):
        r = oai.completions.create(model=MODEL, prompt=prefix + [100 + i, 7], temperature=0, max_tokens=3,
                                   extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
    counts = wait_for(lambda: (c := sorted(v["bole_prefix_summary_blocks"] for v in fleet(url).values()))
                      and sum(c) >= 12 and c)
    assert counts[0] == 0 and counts[1] >= 12, f"the shared prefix was spread over replicas: {counts}"

    # streaming chat with usage, through the ingress and a replica
    chunks = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              stream=True, stream_options={"include_usage": True},
                                              temperature=0, max_tokens=4, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 4
    assert httpx.get(url + "/ready").status_code == 200
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=10 ** 6)

    # swap the calibration table through user_config: same replicas, new table
    before = set(fleet(url))
    deploy(deploy_config(tiny_model, port, override_table="calibration_tables/a100-qwen3.5-9b.yaml"))
    after = wait_for(lambda: (f := fleet(url)) and all(v.get("table_id", "").startswith("a100/")
                                                        for v in f.values()) and len(f) == 2 and f)
    assert set(after) == before, "reconfigure restarted the replicas"
    assert oai.completions.create(model=MODEL, prompt="def", max_tokens=2).usage.completion_tokens >= 1


def test_rolling_recalibration_one_replica_at_a_time(cluster, tiny_model, tmp_path):
    """Two replicas of one class: the job drains them in turn (the other serves: no surge), each gets
    its own re-measured table, and a client sending requests the whole time sees no failure."""
    import asyncio

    from fleet_helpers import SteadyLoad, stale_table

    from bole.recalibration import TableChecks
    from deployments.recalibrate import RollingOptions, rolling_recalibrate

    url, port = cluster
    stale = stale_table(tmp_path / "stale.yaml", tiny_model, "cpu")
    deploy(deploy_config(tiny_model, port, override_table=stale))        # reconfigure: no restart
    old = wait_for(lambda: (f := fleet(url)) and len(f) == 2 and all(
        v["table_id"].startswith("cpu/tiny/") for v in f.values()) and f)
    opts = RollingOptions(checks=TableChecks(monotone_tolerance=0.9, repeat_tolerance=9.0), settle_s=1.0)
    with SteadyLoad(url, clients=3, model=MODEL) as load:
        wait_for(lambda: len(load.results) >= 3, timeout=60)
        report = asyncio.run(rolling_recalibrate("bole", ["bole-cpu"], opts))
    assert not load.errors, load.errors[:3]
    assert report.ok and [(c.strategy, len(c.replicas)) for c in report.classes] == [("rolling", 2)]
    assert sorted(e.replica_id for e in report.events) == sorted(old)
    windows = sorted((e.drained_at, e.resumed_at) for e in report.events)
    assert windows[0][1] <= windows[1][0], windows
    assert load.served_between(report.started_at, report.finished_at) >= 3
    after = wait_for(lambda: (f := fleet(url)) and {v["table_id"] for v in f.values()}
                     == {e.new_table_id for e in report.events} and f)
    assert set(after) == set(old)
