"""What the endpoint refuses before any engine work, through the real app on a real uvicorn server
over a stub engine client: each refusal an OpenAI-shaped 400 (413 for a body over the limit) whose
``param`` names the field; and ``bole_requests_total`` labelled by route template, so clients can't
mint series with made-up paths."""

import json
import uuid

import httpx
import pytest
from test_error_mapping import RaisingClient

from bole.errors import InvalidRequest
from bole.sampling_params import SamplingParams
from deployments.ingress import openai_app

MODEL = "stub"
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def server(serve_app):
    with serve_app(openai_app(RaisingClient(), MODEL, api_key="", max_body_bytes=MAX_BODY)) as srv:
        yield srv


def error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def completion(server, **body):
    return httpx.post(server.url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, **body})


def chat(server, **body):
    return httpx.post(server.url + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body})


def requests_series(server) -> list[str]:
    return [line for line in httpx.get(server.url + "/metrics").text.splitlines()
            if line.startswith("bole_requests_total{")]


def test_request_counter_is_labelled_by_route_template(server):
    for _ in range(20):
        assert httpx.get(f"{server.url}/v1/{uuid.uuid4().hex}").status_code == 404
        assert httpx.get(f"{server.url}/v1/models/{uuid.uuid4().hex}").status_code == 404
    # answered before routing (the declared size is over the limit): still the route's template
    error(httpx.post(server.url + "/v1/completions", content=b"x" * (MAX_BODY + 1)), 413)
    series = requests_series(server)
    endpoints = {line.split('endpoint="')[1].split('"')[0] for line in series}
    assert endpoints <= {"other", "/v1/models/{name:path}", "/v1/completions", "/v1/chat/completions"}
    assert {"other", "/v1/models/{name:path}"} <= endpoints
    assert any('endpoint="/v1/completions"' in line and 'status="413"' in line for line in series)


def test_a_chunked_body_over_the_limit_is_the_same_413_as_a_declared_one(server):
    def chunks():
        yield b'{"model": "stub", "prompt": "'
        for _ in range(4):
            yield b"a" * (MAX_BODY // 2)
        yield b'", "max_tokens": 1}'

    chunked = httpx.post(server.url + "/v1/completions", content=chunks(),
                         headers={"content-type": "application/json"}, timeout=30)
    assert "content-length" not in chunked.request.headers
    declared = httpx.post(server.url + "/v1/completions", content=b"".join(chunks()),
                          headers={"content-type": "application/json"}, timeout=30)
    assert error(chunked, 413) == error(declared, 413)
    assert error(chunked, 413)["code"] == "request_too_large"


@pytest.mark.parametrize("body, param", [
    ({"seed": 2**63 - 1, "n": 2}, "seed"),    # choice 1 would sample with seed 2**63, past int64
    ({"seed": 2**70}, "seed"),
    ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
    ({"stop_token_ids": [10**12, 2**63]}, "stop_token_ids.1"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids.0"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": [1.0, 2.0]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [[1, 2], [3.5]]}, "prompt"),
    ({"prompt": 5}, "prompt"),
])
def test_completion_fields_are_refused_by_name(server, body, param):
    assert error(completion(server, **body))["param"] == param


def test_the_seed_range_leaves_room_for_n_choices(server):
    # within range: validation passes and the request reaches the engine (the stub's 500)
    assert completion(server, seed=2**63 - 2, n=2).status_code == 500
    assert "n=2" in error(completion(server, seed=2**63 - 1, n=2))["message"]


def test_a_non_finite_temperature_is_reported_as_such(server):
    r = httpx.post(server.url + "/v1/completions", headers={"content-type": "application/json"},
                   content=b'{"model": "stub", "prompt": [1], "temperature": NaN}')
    err = error(r)
    assert err["param"] == "temperature" and "finite number" in err["message"]


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "f"}}])
def test_tool_choice_is_refused_as_tools_are(server, tool_choice):
    tools = error(chat(server, tools=[{"type": "function", "function": {"name": "f"}}]))
    err = error(chat(server, tool_choice=tool_choice))
    assert err["param"] == "tool_choice" and err["code"] == tools["code"] == "unsupported"
    # "none" (what sending no tools means) passes: on to the stub's missing chat template
    assert error(chat(server, tool_choice="none"))["param"] == "messages"


@pytest.mark.parametrize("path, fields", [("/v1/completions", "model, prompt"),
                                          ("/v1/chat/completions", "model, messages")])
def test_an_empty_body_names_the_required_fields(server, path, fields):
    err = error(httpx.post(server.url + path, content=b"", headers={"content-type": "application/json"}))
    assert fields in err["message"] and err["code"] == "missing"


@pytest.mark.parametrize("kwargs, param", [
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"), (dict(seed=2**63), "seed"),
    (dict(temperature=float("nan")), "temperature"), (dict(logprobs=21), "logprobs"),
])
def test_sampling_params_errors_name_their_field(kwargs, param):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and isinstance(e.value, ValueError)


@pytest.mark.parametrize("body, param", [({"stop": ""}, "stop"), ({"stop": ["x", ""]}, "stop"),
                                         ({"min_tokens": 20}, "min_tokens")])
def test_sampling_params_refusals_name_the_field_at_the_endpoint(server, body, param):
    assert error(completion(server, **body))["param"] == param


def test_valid_token_id_prompts_still_pass_validation(server):
    for prompt in ([1, 2], [[1, 2], [3]], ["ab", [1]]):
        r = completion(server, prompt=prompt)
        assert r.status_code == 500, json.dumps(prompt)   # validated, then the stub engine raises
