"""Overload through a real local Ray Serve: every request is answered within its deadline plus
slack, served, refused at once (429 with Retry-After) or timed out, including those Serve holds in
its own queues (which the ingress's deadline cannot see), and the fleet keeps serving afterwards.
What Serve's proxy answers itself (its 408, 429) is OpenAI-shaped JSON, as the ingress's errors are,
and a client's ``x-request-timeout-seconds`` does not change the proxy's timeout
(``deployments.proxy_errors``, installed as ``deployments.launch`` starts Serve); the middleware is
also checked on its own, over plain ASGI apps.

One CPU replica of the tiny checkpoint (max_num_seqs 4: it holds 16 calls), a 2 s deadline, and a
burst of 150 requests: far beyond what the fleet admits and queues (deployments.app)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from conftest import ENGINE_OPTIONS
from test_ray_serve import MODEL, deploy, start_serve, wait_for

from deployments.app import INGRESS_NAME, PROXY_TIMEOUT_SLACK_S, AppConfig
from deployments.launch import serve_controller_options, serve_http_options
from deployments.proxy_errors import CLIENT_OVERRIDE_HEADERS, PROXY_CALLBACK, PROXY_CALLBACK_ENV, ProxyErrors

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
    http = app_config(tiny_model, 0)["http_options"]
    assert http["request_timeout_s"] == TIMEOUT_S + PROXY_TIMEOUT_SLACK_S
    port = start_serve(controller_options=serve_controller_options(None), **http)  # as deployments.launch
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


@pytest.mark.slow
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
    # what the fleet cannot hold (16 running, 16 queued) is refused, most of it well before the deadline (with
    # other sessions' work on this 2-core box: as few as 36, their median at 1.8-2.0 s)
    assert len(refused) >= 150 // 5, summary(results)
    assert sorted(t for t, _ in refused)[len(refused) // 2] < 0.95 * TIMEOUT_S, summary(results)
    for _, r in refused:   # the ingress's, or Serve's proxy's (its queue for the ingress full): both JSON
        assert r.headers["retry-after"] == "1" and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["type"] == "overloaded_error", r.text
    for s, _, r in results:
        if s in (504, 408):
            assert r.json()["error"]["code"] == "request_timeout", r.text
    # and the fleet serves as before; a client's timeout header (Serve's proxy took 0.001 s from it: a
    # 408 at once) changes nothing
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=bodies[0], timeout=30, headers={"x-request-timeout-seconds": "0.001"})
    assert r.status_code == 200 and time.perf_counter() - t0 < TIMEOUT_S, r.text
    assert httpx.get(url + "/health", timeout=10).status_code == 200


async def openai_error(url: str, body: dict, stream: bool, delay_s: float) -> openai.APIStatusError | None:
    """What the official client raises for ``body`` sent after ``delay_s`` (None: it was answered)."""
    await asyncio.sleep(delay_s)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    fields = {k: v for k, v in body.items() if k not in ("model", "prompt", "max_tokens", "ignore_eos")}
    try:
        out = await client.completions.create(model=body["model"], prompt=body["prompt"], stream=stream,
                                              max_tokens=body["max_tokens"],
                                              extra_body={"ignore_eos": body["ignore_eos"]}, **fields)
        if stream:
            async for _ in out:
                pass
    except openai.APIStatusError as e:
        return e
    finally:
        await client.close()
    return None


@pytest.mark.slow
def test_a_request_held_in_serves_queue_is_still_answered_by_its_deadline(cluster, tiny_model):
    """One ingress slot, eight long requests: they pass through it one at a time (each served, or its 504
    at the deadline), the rest wait in the proxy's queue, where the ingress's own deadline has not
    started; Serve's timeout (deadline + slack from the proxy's receipt) answers those, as OpenAI-shaped
    JSON. Eight, so that some still wait at the proxy's timeout however fast this machine runs a request
    (at least 0.5 s); two more through the openai client, streamed and not, sent last, so that they wait
    behind all eight: the proxy's 408 is what the client raises, with its type and message."""
    from ray.serve.context import _get_global_client

    url, port = cluster
    deploy(app_config(tiny_model, port, ingress_max_ongoing_requests=1, ingress_max_queued_requests=12))

    def ingress():
        dep = _get_global_client().get_serve_details()["applications"]["bole"]["deployments"][INGRESS_NAME]
        running = [r for r in dep["replicas"] if r["state"] == "RUNNING"]
        return dep["deployment_config"]["max_ongoing_requests"] == 1 and len(running) == 1 \
            and dep["status"] == "HEALTHY"

    wait_for(ingress, timeout=120)
    wait_for(lambda: httpx.get(url + "/ready", timeout=10).status_code == 200, timeout=60)
    limit = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    long = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": limit - 3, "ignore_eos": True}

    async def run():
        return await asyncio.gather(burst(url, [long] * 8), openai_error(url, long, False, 0.2),
                                    openai_error(url, long, True, 0.2))

    results, *raised = asyncio.run(run())
    print("8 long, one ingress slot:", summary(results), f"(bound {BOUND_S:g} s); openai:",
          [e and e.status_code for e in raised])
    assert max(t for _, t, _ in results) <= BOUND_S, summary(results)
    assert {s for s, _, _ in results} <= {200, 504, 408}, summary(results)
    timed_out = [r for s, _, r in results if s == 408]
    assert timed_out, "no request waited in Serve's queue"
    for r in timed_out:   # Serve's proxy's own answer, as the ingress's errors are
        assert r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["type"] == "timeout_error" and "timed out" in r.json()["error"]["message"]
    for e in raised:
        assert isinstance(e, openai.APIStatusError) and e.status_code == 408, e
        assert e.type == "timeout_error" and e.code == "request_timeout", e.body
        assert "timed out" in e.body["message"], e.body


# ProxyErrors on its own, around plain ASGI apps (what Serve's proxy sends, without Ray)

def plain_text(status: int, text: str, *more: tuple[bytes, bytes], chunks: int = 1):
    """An ASGI app answering ``text`` as text/plain with ``status``, its body in ``chunks`` messages."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"), *more]})
        data, step = text.encode(), -(-len(text) // chunks)
        for i in range(chunks):
            await send({"type": "http.response.body", "body": data[i * step:(i + 1) * step],
                        "more_body": i < chunks - 1})
    return app


def call(app, headers=()) -> tuple[list[dict], dict]:
    """(messages sent, the scope the wrapped app saw) of one GET through ``ProxyErrors(app)``."""
    sent, seen = [], {}

    async def inner(scope, receive, send):
        seen.update(scope)
        await app(scope, receive, send)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/v1/completions", "headers": list(headers)}
    asyncio.run(ProxyErrors(inner)(scope, receive, send))
    return sent, seen


def answer(sent: list[dict]) -> tuple[int, dict, bytes]:
    assert sent[0]["type"] == "http.response.start" and not sent[-1].get("more_body", False), sent
    return sent[0]["status"], dict(sent[0]["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize("status, text, extra, kind, code", [
    (408, "Request abc timed out after 4.0s.", (), "timeout_error", "request_timeout"),
    (429, "Request dropped due to backpressure (num_queued_requests=9, max_queued_requests=8).",
     ((b"retry-after", b"1"),), "overloaded_error", "queue_full"),
    (503, "ingress is unavailable because it failed to deploy.", (), "unavailable_error", "unavailable"),
    (404, "Path '/v2' not found.", (), "not_found_error", None),
])
@pytest.mark.parametrize("chunks", [1, 3])
def test_the_proxys_plain_text_errors_become_openai_errors(status, text, extra, kind, code, chunks):
    sent, _ = call(plain_text(status, text, (b"x-request-id", b"r1"), *extra, chunks=chunks))
    got, headers, body = answer(sent)
    assert got == status and headers[b"content-type"] == b"application/json"
    assert int(headers[b"content-length"]) == len(body) and headers[b"x-request-id"] == b"r1"
    assert {k: v for k, v in extra} == {k: v for k, v in headers.items() if k == b"retry-after"}
    error = json.loads(body)["error"]
    assert error["type"] == kind and error["code"] == code and error["param"] is None
    assert text in error["message"]


def test_answers_that_are_not_plain_text_errors_pass_untouched():
    sse = [{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]},
           {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True},
           {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}]
    json_type = [(b"content-type", b"application/json")]
    ingress_error = [{"type": "http.response.start", "status": 504, "headers": json_type},
                     {"type": "http.response.body", "body": b'{"error": {"message": "deadline"}}'}]
    for messages in (sse, ingress_error):
        async def app(scope, receive, send, messages=messages):
            for m in messages:
                await send(m)
        assert call(app)[0] == messages
    assert answer(call(plain_text(200, "success"))[0])[2] == b"success"   # /-/healthz when healthy


def test_a_request_the_proxy_left_unanswered_gets_a_json_500():
    async def silent(scope, receive, send):   # Serve's proxy on an unexpected error: nothing sent
        scope["headers"].append((b"x-request-id", b"r2"))   # as Serve's RequestIdMiddleware, inside
    status, headers, body = answer(call(silent)[0])
    assert status == 500 and headers[b"x-request-id"] == b"r2"
    assert json.loads(body)["error"]["type"] == "internal_error" and "r2" in json.loads(body)["error"]["message"]

    async def failing(scope, receive, send):
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError):   # still raised, for uvicorn's log; the client has its JSON 500
        call(failing)


def test_a_clients_overrides_of_the_proxys_policy_are_dropped():
    from ray.serve._private import constants

    # the headers Serve's proxy reads a per-request timeout and disconnect policy from
    assert CLIENT_OVERRIDE_HEADERS == (constants.SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER.encode(),
                                       constants.SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER.encode())
    _, seen = call(plain_text(200, "ok"), [(b"x-request-timeout-seconds", b"0"), (b"authorization", b"Bearer k"),
                                           (b"x-request-disconnect-disabled", b"?1")])
    assert seen["headers"] == [(b"authorization", b"Bearer k")]


def test_launch_installs_the_proxy_callback():
    from ray.serve._private.http_util import validate_http_proxy_callback_return
    from ray.serve._private.utils import call_function_from_import_path

    env = serve_controller_options(None)["runtime_env"]["env_vars"]
    assert env == {PROXY_CALLBACK_ENV: PROXY_CALLBACK}
    # what Serve's proxy does with the variable: call it, check it returns Starlette middlewares
    middlewares = validate_http_proxy_callback_return(call_function_from_import_path(PROXY_CALLBACK))
    assert [m.cls for m in middlewares] == [ProxyErrors]
    # a config's own controller options and env vars are kept
    given = {"runtime_env": {"env_vars": {"A": "1"}}}
    assert serve_controller_options(given)["runtime_env"]["env_vars"] == {"A": "1", PROXY_CALLBACK_ENV: PROXY_CALLBACK}
    assert given == {"runtime_env": {"env_vars": {"A": "1"}}}
