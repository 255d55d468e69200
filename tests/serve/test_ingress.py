"""The OpenAI ingress over one in-process engine, through a real uvicorn server and real clients
(openai, httpx) on 127.0.0.1, with a tiny checkpoint and its BPE tokenizer."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from conftest import ENGINE_OPTIONS
from test_error_mapping import RaisingClient

from bole.engine.async_engine import AsyncEngine
from bole.llm import LLM, build_engine
from bole.sampling_params import SamplingParams
from deployments.engine_client import LocalEngineClient
from deployments.ingress import openai_app

MODEL = "tiny"
PROMPTS = ["def add(a, b):", "import os\n", "class Point:", "for i in range(10):", "Hello world", "print("]


def make_client(path, **kw):
    return LocalEngineClient(AsyncEngine(build_engine(path, **ENGINE_OPTIONS)), **kw)


@pytest.fixture(scope="module")
def server(tiny_model, serve_app):
    client = make_client(tiny_model)
    with serve_app(openai_app(client, MODEL, api_key="")) as srv:
        srv.engine_client = client
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(tiny_model, **ENGINE_OPTIONS)


def greedy(n, **extra):
    return dict(temperature=0, max_tokens=n, extra_body={"ignore_eos": True, **extra})


def wait_idle(client, timeout=10.0):
    eng = client.async_engine
    deadline = time.time() + timeout
    while time.time() < deadline:
        stats = eng.stats()
        if not stats.held and not stats.running and not stats.waiting and not client.num_pending:
            return True
        time.sleep(0.05)
    return False


def test_models(oai):
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL


def test_completion_matches_offline_engine_and_counts_usage(oai, offline):
    r = oai.completions.create(model=MODEL, prompt=PROMPTS[0], **greedy(8))
    ref = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length"
    prompt_ids = offline.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == len(prompt_ids) + 8


def test_completion_token_prompts_batch_and_n(oai, offline):
    ids = offline.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    r = oai.completions.create(model=MODEL, prompt=[ids, PROMPTS[2]], n=2, temperature=0, max_tokens=5,
                               extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by = {c.index: c.text for c in r.choices}
    assert by[0] == by[1] and by[2] == by[3]   # greedy: the n samples agree
    ref = offline.generate([ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert by[0] == ref.text
    n2 = len(offline.tokenizer.encode(PROMPTS[2], add_special_tokens=False))
    assert r.usage.prompt_tokens == len(ids) + n2 and r.usage.completion_tokens == 20


def test_chat_uses_the_chat_template(oai, offline):
    msgs = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "add two numbers"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, **greedy(6))
    text = offline.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = offline.tokenizer.encode(text, add_special_tokens=False)
    ref = offline.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 6


def test_streaming_completion_equals_non_streaming_and_reports_usage(oai):
    full = oai.completions.create(model=MODEL, prompt=PROMPTS[3], **greedy(10)).choices[0].text
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPTS[3], stream=True,
                                         stream_options={"include_usage": True}, **greedy(10)))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]


def test_streaming_chat_sse_wire_format(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "temperature": 0, "max_tokens": 5, "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert objs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(o["object"] == "chat.completion.chunk" for o in objs)
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 5
    assert objs[-2]["choices"][0]["finish_reason"] == "length"


def _error(r: httpx.Response, status: int, type_: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if type_:
        assert err["type"] == type_
    return err


def test_errors_are_openai_shaped(server, oai):
    url = server.url
    ok = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    _error(httpx.post(url + "/v1/completions", json={**ok, "model": "gpt-9"}), 404, "not_found_error")
    err = _error(httpx.post(url + "/v1/completions", json={**ok, "temperature": -1}), 400,
                 "invalid_request_error")
    assert err["param"] == "temperature"
    json_type = {"content-type": "application/json"}
    _error(httpx.post(url + "/v1/completions", content=b"{not json", headers=json_type), 400)
    _error(httpx.post(url + "/v1/completions", json={k: v for k, v in ok.items() if k != "prompt"}), 400)
    _error(httpx.post(url + "/v1/completions", json={**ok, "prompt": [1, 2, 10 ** 6]}), 400)
    _error(httpx.post(url + "/v1/completions", json={**ok, "prompt": ""}), 400)
    err = _error(httpx.post(url + "/v1/completions", json={**ok, "max_tokens": 10 ** 6}), 400)
    assert err["code"] == "context_length_exceeded"
    _error(httpx.post(url + "/v1/completions", json={**ok, "logprobs": 21}), 400)
    _error(httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": []}), 400)
    _error(httpx.post(url + "/v1/completions", content=b"x" * (5 * 1024 * 1024),
                      headers={"content-type": "application/json"}), 413)
    _error(httpx.get(url + "/v1/nope"), 404)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=10 ** 6)
    # the server is still fine afterwards
    assert oai.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_concurrent_requests_with_bad_ones_mixed_in(server, oai):
    refs = [oai.completions.create(model=MODEL, prompt=p, **greedy(12)).choices[0].text for p in PROMPTS]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            good = [c.post("/v1/completions", json={"model": MODEL, "prompt": p, "temperature": 0,
                                                    "max_tokens": 12, "ignore_eos": True}) for p in PROMPTS]
            bad = [c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -3}),
                   c.post("/v1/completions", json={"model": MODEL, "prompt": [99999]})]
            return await asyncio.gather(*good, *bad)

    rs = asyncio.run(main())
    assert [r.json()["choices"][0]["text"] for r in rs[: len(PROMPTS)]] == refs
    assert [r.status_code for r in rs[len(PROMPTS):]] == [400, 400]
    assert wait_idle(server.engine_client)


def test_client_disconnect_aborts_the_request(server):
    eng = server.engine_client.async_engine
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        stats = eng.stats()
        assert stats.running + stats.waiting == 1
    assert wait_idle(server.engine_client), "the abandoned stream kept running"
    # a non-streaming request abandoned by its client is aborted too (400 tokens take the CPU engine
    # longer than the client's 0.25 s; 1 s stopped being enough once decode became batched)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=0.25)
    assert wait_idle(server.engine_client)


class QueuedClient(RaisingClient):
    """An engine client whose requests never produce a token (queued behind a full batch); it records
    when the ingress closes a request's stream, which aborts its engine requests."""

    def __init__(self):
        super().__init__()
        self.closed: list[float] = []

    async def generate_many(self, subs):
        try:
            await asyncio.Event().wait()
            yield
        finally:
            self.closed.append(time.monotonic())


def test_a_stream_abandoned_before_its_first_token_is_aborted(serve_app):
    """A streaming client that leaves while its request waits for its first token (no response started)
    aborts it then, not once a token comes (or the deadline passes) and finds the client gone."""
    client = QueuedClient()
    with serve_app(openai_app(client, MODEL, api_key="")) as srv:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=body, timeout=0.5)
        left = time.monotonic()
        while not client.closed and time.monotonic() < left + 3:
            time.sleep(0.05)
        assert client.closed and client.closed[0] - left < 2.0
        metrics = httpx.get(srv.url + "/metrics").text
    assert 'bole_aborted_requests_total{model="tiny",reason="client_disconnected"} 1.0' in metrics


def test_metrics_health_ready(server, oai):
    oai.completions.create(model=MODEL, prompt=PROMPTS[4], **greedy(6))
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in ("bole_time_to_first_token_seconds_count", "bole_time_per_output_token_seconds_count",
                 "bole_request_mean_accepted_tokens_count", "bole_engine_mat",
                 "bole_verify_budget_used_ratio",
                 "bole_verify_budget_b_ver", "bole_prefix_cache_hit_rate", "bole_requests_total"):
        assert name in text, name
    assert 'hardware_class="cpu"' in text
    mat = [line for line in text.splitlines() if line.startswith("bole_engine_mat{")]
    assert mat and float(mat[0].split()[-1]) >= 1.0
    # the engine's memory plan, one gauge per category, the bytes the engine reports
    plan = server.engine_client.memory_plan
    assert plan and plan["kv"] > 0
    for category, n in plan.items():
        line = [x for x in text.splitlines() if x.startswith("bole_memory_plan_bytes{") and
                f'category="{category}"' in x]
        assert len(line) == 1 and float(line[0].split()[-1]) == float(n), category


def _counter(text: str, name: str, hardware: str) -> float:
    line = f'{name}{{hardware_class="{hardware}",model="{MODEL}"}} '
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))


def test_prompt_scoring_is_counted_under_the_serving_replicas_class(server, offline):
    """echo with max_tokens 0 (lm-eval's loglikelihood) yields no token, only the prompt's logprobs: its
    prompt tokens count under the class of the replica that scored it (they were labelled "unknown",
    as the ingress took the class from an output's first token), as a generating request's do."""
    ids = offline.tokenizer.encode(PROMPTS[3], add_special_tokens=False)
    before = httpx.get(server.url + "/metrics").text
    for stream in (False, True):
        body = {"model": MODEL, "prompt": PROMPTS[3], "echo": True, "max_tokens": 0, "logprobs": 1, "stream": stream}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    after = httpx.get(server.url + "/metrics").text
    assert 'hardware_class="unknown"' not in after
    assert _counter(after, "bole_prompt_tokens_total", "cpu") - _counter(before, "bole_prompt_tokens_total", "cpu") \
        == 2 * len(ids)
    assert _counter(after, "bole_generation_tokens_total", "cpu") == _counter(before, "bole_generation_tokens_total",
                                                                              "cpu")


def _gauge(text: str, name: str) -> float:
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{")]
    assert len(values) == 1, (name, values)
    return values[0]


def test_metrics_count_preemptions_and_prefix_hits(tiny_model, serve_app):
    """The totals a load run differences (benchmarks/run_gpu_agent.sh): KV blocks for about two of
    four concurrent requests force preemptions, and a repeated prompt is served from the prefix cache."""
    from concurrent.futures import ThreadPoolExecutor

    client = LocalEngineClient(AsyncEngine(build_engine(tiny_model, **{**ENGINE_OPTIONS, "num_blocks": 12})))
    with serve_app(openai_app(client, MODEL, api_key="")) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda p: oai.completions.create(model=MODEL, prompt=p, **greedy(12)), PROMPTS[:4]))
        repeated = "def add(a, b):\n    return a + b\n\ndef sub(a, b):"
        for _ in range(2):
            oai.completions.create(model=MODEL, prompt=repeated, **greedy(2))
        assert wait_idle(client)
        text = httpx.get(srv.url + "/metrics").text
        stats = client.async_engine.stats()
        assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0
        assert _gauge(text, "bole_engine_preemptions") == stats.preemptions
        assert _gauge(text, "bole_prefix_cache_hit_tokens") == stats.prefix_hit_tokens
        assert _gauge(text, "bole_engine_prompt_tokens") == stats.prompt_tokens > stats.prefix_hit_tokens
        assert _gauge(text, "bole_engine_steps") == stats.steps > 0
        assert _gauge(text, "bole_engine_step_seconds") == stats.step_time_s > 0
        assert _gauge(text, "bole_engine_eager_forwards") == stats.eager_forwards == stats.decode_steps > 0
        assert _gauge(text, "bole_engine_graph_captures") == stats.graph_captures == 0   # no graphs on the CPU


def test_auth_overload_and_drain(tiny_model, serve_app):
    client = make_client(tiny_model, max_pending=1)
    with serve_app(openai_app(client, MODEL, api_key="sekret")) as srv:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
        _error(httpx.post(srv.url + "/v1/completions", json=body), 401, "authentication_error")
        wrong = {"Authorization": "Bearer nope"}
        _error(httpx.post(srv.url + "/v1/completions", json=body, headers=wrong), 401)
        assert httpx.get(srv.url + "/health").status_code == 200          # probes need no key
        auth = {"Authorization": "Bearer sekret"}
        assert httpx.post(srv.url + "/v1/completions", json=body, headers=auth).status_code == 200
        long = {**body, "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=long, headers=auth, timeout=60) as r:
            lines = r.iter_lines()  # keep a reference: closing the iterator closes the stream
            next(line for line in lines if line.startswith("data: "))
            busy = httpx.post(srv.url + "/v1/completions", json=body, headers=auth)
            _error(busy, 429, "overloaded_error")
            assert busy.headers["retry-after"] == "1"
        assert wait_idle(client)
        asyncio.run(client.drain(1.0))
        assert httpx.get(srv.url + "/ready").status_code == 503
        _error(httpx.post(srv.url + "/v1/completions", json=body, headers=auth), 503, "unavailable_error")


def test_bole_mode_is_served_token_identically(tiny_model, serve_app, offline):
    """Tree speculative decoding behind the server: greedy text equals autoregressive decoding; with a
    stop string, streamed and whole, the text ends where the stop string starts (no part of it sent) and
    the tokens, logprobs and usage are autoregressive decoding's."""
    client = LocalEngineClient(AsyncEngine(build_engine(tiny_model, **{**ENGINE_OPTIONS, "mode": "bole"})))
    free = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].text
    stop = free[5:9]
    ref = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))[0]
    assert ref.finish_reason == "stop" and ref.text == free[:free.find(stop)]
    with serve_app(openai_app(client, MODEL, api_key="")) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        chunks = oai.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, **greedy(6))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        whole = oai.completions.create(model=MODEL, prompt=PROMPTS[0], stop=[stop], logprobs=0, **greedy(16))
        chunks = list(oai.completions.create(model=MODEL, prompt=PROMPTS[0], stop=[stop], stream=True,
                                             stream_options={"include_usage": True}, **greedy(16)))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        stats = client.stats().engine
    assert text == free[:len(text)] and len(text) < len(free)
    assert whole.choices[0].text == streamed == ref.text and whole.choices[0].finish_reason == "stop"
    n = len(ref.token_ids)
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == n
    assert len(whole.choices[0].logprobs.tokens) == n
    assert stats.mean_b_ver > 0 and stats.table_id.startswith("any/any")
