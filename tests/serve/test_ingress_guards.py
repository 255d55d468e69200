"""The endpoint's guards and limits through a real uvicorn server: auth before the body is looked
at, the optional protection of /metrics and the docs, error ``param`` naming the field,
``max_model_len`` = min(the model's positions, the KV capacity), TTFT / queue wait measured from the
request's arrival, the aborted-request counter."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time

import httpx
import openai
import pytest
from conftest import ENGINE_OPTIONS

from bole.engine.async_engine import AsyncEngine
from bole.llm import build_engine
from deployments.engine_client import LocalEngineClient
from deployments.ingress import openai_app

MODEL = "tiny"
KEY = {"Authorization": "Bearer sekret"}


def client_for(path, **options):
    return LocalEngineClient(AsyncEngine(build_engine(path, **{**ENGINE_OPTIONS, **options})))


@pytest.fixture(scope="module")
def short_model(tiny_model, tmp_path_factory):
    """The tiny model with 48 positions: fewer than its KV capacity (128 blocks x 4 tokens)."""
    path = tmp_path_factory.mktemp("short_positions_model")
    shutil.copytree(tiny_model, path, dirs_exist_ok=True)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = 48
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_auth_comes_first_and_can_protect_metrics_and_docs(tiny_model, serve_app, monkeypatch):
    monkeypatch.setenv("BOLE_PROTECT_METRICS", "1")
    with serve_app(openai_app(client_for(tiny_model), MODEL, api_key="sekret")) as srv:
        url = srv.url + "/v1/completions"
        # a bad body without a key: 401, not 400 / 422 (nothing about the body is revealed)
        for content in (b"{not json", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -1}).encode()):
            err = error(httpx.post(url, content=content, headers={"content-type": "application/json"}), 401)
            assert err["type"] == "authentication_error"
        error(httpx.post(url, content=b"{not json", headers={**KEY, "content-type": "application/json"}), 400)
        for path in ("/metrics", "/docs", "/openapi.json"):
            error(httpx.get(srv.url + path), 401)
            assert httpx.get(srv.url + path, headers=KEY).status_code == 200, path
        for path in ("/health", "/ready"):   # probes stay open, HEAD too (load balancers')
            assert httpx.get(srv.url + path).status_code == 200
            assert httpx.head(srv.url + path).status_code == 200
        assert httpx.head(srv.url + "/v1/models", headers=KEY).status_code == 200
        r = httpx.get(srv.url + "/v1/completions", headers=KEY)   # a 405 says what the route takes
        assert error(r, 405) and r.headers["allow"] == "POST"
        err = error(httpx.get(srv.url + "/v1/models/" + "m" * 30_000, headers=KEY), 404)
        assert err["code"] == "model_not_found" and len(err["message"]) < 400   # the name not echoed whole
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0, timeout=60)
        assert oai.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_metrics_and_docs_stay_open_without_the_setting(tiny_model, short_model, serve_app, monkeypatch):
    monkeypatch.delenv("BOLE_PROTECT_METRICS", raising=False)
    client = client_for(short_model)
    with serve_app(openai_app(client, MODEL, api_key="sekret")) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 200
        assert httpx.get(srv.url + "/openapi.json").status_code == 200
        error(httpx.get(srv.url + "/v1/models"), 401)

        # max_model_len: the model's 48 positions, not the KV capacity
        assert client.async_engine.limits().kv_tokens > 48
        card = httpx.get(srv.url + "/v1/models", headers=KEY).json()["data"][0]
        assert card["max_model_len"] == client.max_model_len == 48
        body = {"model": MODEL, "prompt": list(range(5, 45)), "max_tokens": 9}
        err = error(httpx.post(srv.url + "/v1/completions", json=body, headers=KEY), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
        err = error(httpx.post(srv.url + "/v1/completions", json={**body, "prompt": list(range(5, 60))},
                               headers=KEY), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        assert httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 8},
                          headers=KEY).status_code == 200
        # max_tokens null: the room left; none left is refused by name; scoring a full prompt needs none
        r = httpx.post(srv.url + "/v1/completions", headers=KEY,
                       json={**body, "max_tokens": None, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        full = {**body, "prompt": list(range(5, 53))}
        err = error(httpx.post(srv.url + "/v1/completions", json={**full, "max_tokens": None}, headers=KEY), 400)
        assert err["code"] == "context_length_exceeded" and "no room" in err["message"] and err["param"] == "prompt"
        r = httpx.post(srv.url + "/v1/completions", headers=KEY,
                       json={**full, "max_tokens": 0, "echo": True, "logprobs": 0})
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 48, r.text

        # param names the field, never a byte offset
        bad_json = httpx.post(srv.url + "/v1/completions", content=b'{"model": "tiny", "prompt": }',
                              headers={**KEY, "content-type": "application/json"})
        err = error(bad_json, 400)
        assert err["param"] is None and err["code"] == "json_invalid" and "character" in err["message"]
        err = error(httpx.post(srv.url + "/v1/chat/completions", headers=KEY,
                               json={"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}), 400)
        assert err["param"] == "messages.0.role"
        err = error(httpx.post(srv.url + "/v1/completions", headers=KEY,
                               json={"model": MODEL, "prompt": "x", "temperature": "hot"}), 400)
        assert err["param"] == "temperature"


def metric(text: str, name: str, **labels) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            return float(line.split()[-1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_ttft_counts_the_wait_behind_a_full_batch_and_aborts_are_counted(tiny_model, serve_app):
    client = client_for(tiny_model)   # max_num_seqs 4
    with serve_app(openai_app(client, MODEL, api_key="")) as srv:
        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                # 240 tokens: about 1 s on a 2-core CPU (60 took 0.25 s, so the held request's
                # wait could fall under the 0.25 s bucket below)
                long = {"model": MODEL, "prompt": "x", "max_tokens": 240, "ignore_eos": True}
                batch = [asyncio.ensure_future(c.post("/v1/completions", json=long)) for _ in range(4)]
                while client.async_engine.stats().running < 4:   # the batch is full
                    await asyncio.sleep(0.01)
                held = await c.post("/v1/completions", json={**long, "max_tokens": 1})
                return [r.status_code for r in await asyncio.gather(*batch)], held

        codes, held = asyncio.run(main())
        assert codes == [200] * 4 and held.status_code == 200
        text = httpx.get(srv.url + "/metrics").text
        labels = dict(model=MODEL, hardware_class="cpu")
        assert metric(text, "bole_queue_wait_seconds_count", **labels) == 5
        # the held request waited for a batch slot (most of a 240-token request): one queue wait over
        # 0.25 s, inside its TTFT; the TTFT histogram holds it too
        assert metric(text, "bole_queue_wait_seconds_bucket", le="0.25", **labels) <= 4
        assert metric(text, "bole_time_to_first_token_seconds_bucket", le="0.25", **labels) <= 4
        assert metric(text, "bole_time_to_first_token_seconds_sum", **labels) >= \
            metric(text, "bole_queue_wait_seconds_sum", **labels)
        # that wait was in the engine's own queue (its receipt to its scheduling), which is counted apart
        assert metric(text, "bole_engine_queue_seconds_count", **labels) == 5
        assert metric(text, "bole_engine_queue_seconds_bucket", le="0.25", **labels) <= 4
        assert metric(text, "bole_queue_wait_seconds_sum", **labels) >= \
            metric(text, "bole_engine_queue_seconds_sum", **labels)

        # aborted requests: a streaming client going away, a non-streaming one timing out; 500 tokens
        # each (what the 512-token KV cache admits: ~2 s alone, longer together) so that neither can
        # finish before the server sees its client go (it polls every 0.25 s)
        body = {"model": MODEL, "prompt": "x", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
        # the server sees each disconnect on its own clock (on a loaded machine the timed-out request
        # may not even be queued yet when the client gives up): wait for both aborts to be counted
        # and both engine requests to be gone
        def aborted():
            text = httpx.get(srv.url + "/metrics").text
            done = sum(metric(text, "bole_aborted_requests_total", reason=r)
                       for r in ("stream_closed", "client_disconnected")) >= 2
            return text if done and not client.num_pending else None

        deadline = time.time() + 60
        while (text := aborted()) is None and time.time() < deadline:
            time.sleep(0.1)
        aborts = [line for line in httpx.get(srv.url + "/metrics").text.splitlines()
                  if line.startswith("bole_aborted_requests_total")]
        assert text is not None and not client.num_pending, (client.num_pending, aborts)
        assert metric(text, "bole_aborted_requests_total", reason="stream_closed") == 1
        assert metric(text, "bole_aborted_requests_total", reason="client_disconnected") == 1
        assert metric(text, "bole_aborted_requests_total", reason="deadline") == 0
