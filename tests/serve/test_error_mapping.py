"""What the ingress answers when the engine raises: a client's mistake (``InvalidRequest``, pydantic
validation) is an OpenAI-shaped 400; anything else a logged 500 carrying a request id, never a 400.
Through the real app on a real uvicorn server, over an engine client that raises on demand."""

import logging

import httpx
import pytest

from bole.errors import InvalidRequest
from deployments.ingress import openai_app

MODEL = "stub"


class BrokenTokenizer:
    def encode(self, text, add_special_tokens=False):
        raise RuntimeError("tokenizer bug")


class RaisingClient:
    """An ``EngineClient`` whose every request raises ``error``."""

    max_model_len, vocab_size, max_choices = 64, 100, 4

    def __init__(self):
        self.error: BaseException = RuntimeError("unset")
        self.tokenizer = BrokenTokenizer()

    async def generate_many(self, subs):
        raise self.error
        yield  # an async generator, as the real clients are

    async def is_ready(self):
        return True

    async def is_alive(self):
        return True

    async def fleet_stats(self):
        return []

    async def start(self):
        pass

    async def drain(self, timeout=None):
        return True

    async def close(self):
        pass


@pytest.fixture(scope="module")
def server(serve_app):
    client = RaisingClient()
    with serve_app(openai_app(client, MODEL, api_key="")) as srv:
        srv.client = client
        yield srv


def post(server, error, stream=False, **body):
    server.client.error = error
    return httpx.post(server.url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "stream": stream, **body})


def test_invalid_request_is_a_400(server):
    r = post(server, InvalidRequest("request id 'x' is already in use"))
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "request id 'x' is already in use", "type": "invalid_request_error",
                                 "param": None, "code": None}


def test_an_invalid_request_naming_its_field_gives_param(server):
    r = post(server, InvalidRequest("seed must be an int in [-2**63, 2**63) or None, got 2**63", param="seed"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


def test_pydantic_validation_is_a_400(server):
    r = post(server, RuntimeError("not reached"), temperature="hot")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["param"] == "temperature"


@pytest.mark.parametrize("error", [RuntimeError("CUDA error: an illegal memory access"),
                                   ValueError("a bug, not the client's"), KeyError("slot")])
def test_any_other_error_is_a_logged_500_with_a_request_id(server, error, caplog):
    with caplog.at_level(logging.ERROR, logger="deployments.http_errors"):
        r = post(server, error)
    assert r.status_code == 500
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == err["code"] == "internal_error"
    rid = err["message"].rsplit("request id ", 1)[1]
    assert rid.startswith("cmpl-") and type(error).__name__ in err["message"]
    assert str(error) not in err["message"]   # the server's internals stay in its log
    logged = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert logged and logged[0].exc_info is not None


def test_a_streamed_request_gets_the_same_statuses(server):
    assert post(server, InvalidRequest("bad"), stream=True).status_code == 400
    r = post(server, RuntimeError("boom"), stream=True)
    assert r.status_code == 500 and "request id cmpl-" in r.json()["error"]["message"]


def test_an_error_outside_the_engine_call_is_a_500_too(server, caplog):
    with caplog.at_level(logging.ERROR, logger="deployments.http_errors"):
        r = post(server, RuntimeError("not reached"), prompt="text goes through the broken tokenizer")
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "internal_error" and "RuntimeError" in err["message"]
    assert any(err["message"].rsplit("request id ", 1)[1] in rec.getMessage() for rec in caplog.records)
