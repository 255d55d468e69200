"""n > 1, best_of and batch prompts over one in-process engine, through a real uvicorn server and the
openai client; the server-side deadline on a really stuck engine (its step loop held)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from choices_check import check_best_of_and_batch, check_choices
from conftest import ENGINE_OPTIONS

from bole.engine.async_engine import AsyncEngine
from bole.llm import build_engine
from deployments.engine_client import LocalEngineClient
from deployments.ingress import openai_app

MODEL = "tiny"


def idle(client, timeout=10.0) -> bool:
    eng = client.async_engine
    deadline = time.time() + timeout
    while time.time() < deadline:
        stats = eng.stats()
        if not stats.held and not stats.running and not stats.waiting and not client.num_pending:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def server(tiny_model, serve_app):
    client = LocalEngineClient(AsyncEngine(build_engine(tiny_model, **ENGINE_OPTIONS)))
    app = openai_app(client, MODEL, api_key="", request_timeout_s=2.0)
    with serve_app(app) as srv:
        srv.engine_client = client
        srv.oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)
        yield srv


def test_n_choices_complete_and_match_single_requests(server):
    timings = check_choices(server.oai, MODEL, repeats=20)
    print({k: round(v, 3) for k, v in timings.items()})
    assert idle(server.engine_client)


def test_best_of_and_identical_batch_prompts(server):
    check_best_of_and_batch(server.oai, MODEL, [5, 6, 7, 8, 9])
    assert idle(server.engine_client)


def test_too_many_choices_is_a_400(server):
    limit = server.engine_client.max_choices
    with pytest.raises(openai.BadRequestError) as e:
        server.oai.completions.create(model=MODEL, prompt=[[5, 6]] * (limit // 2 + 1), n=2, max_tokens=1)
    assert e.value.body["param"] == "n"


class HeldEngine:
    """Really stick the engine: hold its step loop (``run_exclusive``) until ``release()``."""

    def __init__(self, client):
        self.released = threading.Event()
        self.thread = threading.Thread(target=client.async_engine.run_exclusive,
                                       args=(lambda e: self.released.wait(60),))
        self.thread.start()

    def release(self):
        self.released.set()
        self.thread.join()


def test_deadline_turns_a_stuck_request_into_a_504_and_aborts_it(server):
    held = HeldEngine(server.engine_client)
    try:
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "x", "n": 2, "max_tokens": 4})
        took = time.perf_counter() - t0
        assert r.status_code == 504, r.text
        err = r.json()["error"]
        assert err["type"] == "timeout_error" and err["code"] == "request_timeout" and "2" in err["message"]
        assert 1.9 < took < 5, took   # the deadline (2 s), not the engine, ended it
        # streamed: the status is sent with the first delta, so a request stuck before its first token
        # still gets a proper 504
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as s:
            s.read()
        assert s.status_code == 504 and s.json()["error"]["code"] == "request_timeout"
    finally:
        held.release()
    assert idle(server.engine_client), "the timed-out engine requests were not aborted"
    metrics = httpx.get(server.url + "/metrics").text
    assert 'bole_aborted_requests_total{model="tiny",reason="deadline"} 2.0' in metrics
    # and the server is fine afterwards
    assert server.oai.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_deadline_mid_stream_sends_an_error_event_then_done(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 300, "ignore_eos": True, "stream": True}
    held = None
    events = []
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if held is None:   # after the first delta: stick the engine past the deadline
                        held = HeldEngine(server.engine_client)
    finally:
        if held is not None:
            held.release()
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "request_timeout" and set(err) == {"message", "type", "param", "code"}
    assert idle(server.engine_client)


def test_merge_streams_deadline_and_errors():
    from deployments.engine_client import RequestTimeout, merge_streams

    closed = []

    async def gen(name, delay, n, fail=False):
        try:
            for i in range(n):
                await asyncio.sleep(delay)
                yield name, i
            if fail:
                raise ValueError(name)
        finally:
            closed.append(name)

    async def run(streams, deadline_in=None):
        loop = asyncio.get_running_loop()
        deadline = None if deadline_in is None else loop.time() + deadline_in
        return [item async for _, item in merge_streams(streams, deadline)]

    items = asyncio.run(run([gen("a", 0.01, 3), gen("b", 0.015, 2)]))
    assert sorted(items) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    assert sorted(closed) == ["a", "b"]
    closed.clear()
    with pytest.raises(ValueError, match="b"):
        asyncio.run(run([gen("a", 0.05, 100), gen("b", 0.01, 1, fail=True)]))
    assert sorted(closed) == ["a", "b"]          # the failing one, and the other cancelled
    closed.clear()
    with pytest.raises(RequestTimeout):
        asyncio.run(run([gen("a", 0.05, 100)], deadline_in=0.2))
    assert closed == ["a"]
