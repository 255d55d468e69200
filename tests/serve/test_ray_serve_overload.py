"""Overload through a real local Ray Serve: every request is answered within its deadline plus
slack, served, refused at once (429 with Retry-After) or timed out, including those Serve holds in
its own queues (which the ingress's deadline cannot see), and the fleet keeps serving afterwards.

One CPU replica of the tiny checkpoint (max_num_seqs 4: it holds 16 calls), a 2 s deadline, and a
burst of 150 requests: far beyond what the fleet admits and queues (deployments.app)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from conftest import ENGINE_OPTIONS
from test_ray_serve import MODEL, deploy, start_serve, wait_for

from deployments.app import INGRESS_NAME, PROXY_TIMEOUT_SLACK_S, AppConfig
from deployments.launch import serve_http_options

pytestmark = pytest.mark.slow

TIMEOUT_S = 2.0
# past the proxy's own timeout: the client's connection and this loaded 2-core box's scheduling
CLIENT_SLACK_S = 1.0
BOUND_S = TIMEOUT_S + PROXY_TIMEOUT_SLACK_S + CLIENT_SLACK_S


def app_config(model_path, port: int, **extra) -> dict:
    opts = {k: v for k, v in ENGINE_OPTIONS.items() if k != "calibration_table"}
    args = {"model": model_path, "served_model_name": MODEL, "request_timeout_s": TIMEOUT_S, "retry_budget_s": 1.0,
            "groups": [{"name": "bole-cpu", "hardware": "cpu", "num_replicas": 1, "engine_options": opts,
                        "calibration_table": "calibration_tables/default.yaml",
                        "ray_actor_options": {"num_cpus": 1}}], **extra}
    http = serve_http_options({"host": "127.0.0.1", "port": port}, AppConfig(**args))
    return {"http_options": http, "applications": [{"name": "bole", "route_prefix": "/",
                                                    "import_path": "deployments.app:build_app", "args": args}]}


@pytest.fixture(scope="module")
def cluster(tiny_model):
    ray = pytest.importorskip("ray")
    from ray import serve

    ray.init(num_cpus=2, object_store_memory=80 * 1024 * 1024, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"TRITON_INTERPRET": "1"}})
    proxy_timeout = app_config(tiny_model, 0)["http_options"]["request_timeout_s"]
    assert proxy_timeout == TIMEOUT_S + PROXY_TIMEOUT_SLACK_S
    port = start_serve(request_timeout_s=proxy_timeout)
    deploy(app_config(tiny_model, port))
    yield f"http://127.0.0.1:{port}", port
    serve.shutdown()
    ray.shutdown()


async def burst(url: str, bodies: list[dict]) -> list[tuple[int, float, httpx.Response]]:
    """Send every body at once; (status, seconds, response) of each."""
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=len(bodies))) as c:
        async def one(body):
            t0 = time.perf_counter()
            r = await c.post("/v1/completions", json=body)
            return r.status_code, time.perf_counter() - t0, r

        return await asyncio.gather(*(one(b) for b in bodies))


def summary(results) -> dict:
    return {s: (sum(1 for x in results if x[0] == s), round(max(x[1] for x in results if x[0] == s), 2))
            for s in sorted({x[0] for x in results})}


def test_overload_is_refused_at_once_and_nothing_outlives_its_deadline(cluster):
    url, _ = cluster
    bodies = [{"model": MODEL, "prompt": [5 + i % 7, 6, 7, 8 + i], "max_tokens": 8, "temperature": 0,
               "ignore_eos": True} for i in range(150)]
    results = asyncio.run(burst(url, bodies))
    print("150 at once:", summary(results), f"(status: (count, max s); bound {BOUND_S:g} s)")
    assert {s for s, _, _ in results} <= {200, 429, 504, 408}, summary(results)
    assert max(t for _, t, _ in results) <= BOUND_S, summary(results)
    served = [r for s, _, r in results if s == 200]
    refused = [(t, r) for s, t, r in results if s == 429]
    assert served and all(r.json()["usage"]["completion_tokens"] == 8 for r in served)
    # what the fleet cannot hold (16 running, 16 queued) is refused, most of it long before the deadline
    assert len(refused) >= 150 // 3, summary(results)
    assert sorted(t for t, _ in refused)[len(refused) // 2] < TIMEOUT_S / 2, summary(results)
    for _, r in refused:
        assert r.headers["retry-after"] == "1"
        if r.headers["content-type"].startswith("application/json"):   # the ingress's: OpenAI-shaped
            assert r.json()["error"]["type"] == "overloaded_error", r.text
        else:   # Serve's proxy, its queue for the ingress full
            assert "backpressure" in r.text, r.text
    for s, _, r in results:
        if s == 504:
            assert r.json()["error"]["code"] == "request_timeout", r.text
    # and the fleet serves as before
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=bodies[0], timeout=30)
    assert r.status_code == 200 and time.perf_counter() - t0 < TIMEOUT_S, r.text
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_a_request_held_in_serves_queue_is_still_answered_by_its_deadline(cluster, tiny_model):
    """One ingress slot, eight long requests: they pass through it one at a time (each served, or its 504
    at the deadline), the rest wait in the proxy's queue, where the ingress's own deadline has not
    started; Serve's timeout (deadline + slack from the proxy's receipt) answers those. Eight, so that
    some still wait at the proxy's timeout however fast this machine runs a request (at least 0.5 s)."""
    from ray.serve.context import _get_global_client

    url, port = cluster
    deploy(app_config(tiny_model, port, ingress_max_ongoing_requests=1, ingress_max_queued_requests=8))

    def ingress():
        dep = _get_global_client().get_serve_details()["applications"]["bole"]["deployments"][INGRESS_NAME]
        running = [r for r in dep["replicas"] if r["state"] == "RUNNING"]
        return dep["deployment_config"]["max_ongoing_requests"] == 1 and len(running) == 1 \
            and dep["status"] == "HEALTHY"

    wait_for(ingress, timeout=120)
    wait_for(lambda: httpx.get(url + "/ready", timeout=10).status_code == 200, timeout=60)
    limit = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    long = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": limit - 3, "ignore_eos": True}
    results = asyncio.run(burst(url, [long] * 8))
    print("8 long, one ingress slot:", summary(results), f"(bound {BOUND_S:g} s)")
    assert max(t for _, t, _ in results) <= BOUND_S, summary(results)
    assert {s for s, _, _ in results} <= {200, 504, 408}, summary(results)
    assert any(s == 408 for s, _, _ in results), "no request waited in Serve's queue"
