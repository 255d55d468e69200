"""logprobs / top_logprobs, echo and the penalties through the OpenAI endpoint (real uvicorn, the official
openai client, no Ray), checked against transformers on the served checkpoint."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from conftest import ENGINE_OPTIONS

from bole.engine.async_engine import AsyncEngine
from bole.llm import LLM, build_engine
from bole.sampling_params import SamplingParams
from deployments.engine_client import LocalEngineClient
from deployments.ingress import openai_app

MODEL = "tiny"
PROMPT = "def add(a, b):"
TOL = 1e-4


def serve(tiny_model, serve_app, **options):
    client = LocalEngineClient(AsyncEngine(build_engine(tiny_model, **{**ENGINE_OPTIONS, **options})))
    srv = serve_app(openai_app(client, MODEL, api_key=""))
    srv.engine_client = client
    return srv


@pytest.fixture(scope="module")
def server(tiny_model, serve_app):
    with serve(tiny_model, serve_app) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(tiny_model, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def hf(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model).eval(), AutoTokenizer.from_pretrained(tiny_model)


@torch.no_grad()
def hf_logprobs(model, ids):
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def greedy(n, **extra):
    return dict(temperature=0, max_tokens=n, extra_body={"ignore_eos": True, **extra})


def test_completion_logprobs_equal_transformers(oai, hf, offline):
    model, tok = hf
    r = oai.completions.create(model=MODEL, prompt=PROMPT, logprobs=3, **greedy(6))
    lp, text = r.choices[0].logprobs, r.choices[0].text
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    ids = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids
    assert lp.tokens == [tok.decode([i]) for i in ids] and "".join(lp.tokens) == text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(6)]
    ref = hf_logprobs(model, prompt + ids)
    for j, t in enumerate(ids):
        assert abs(lp.token_logprobs[j] - float(ref[len(prompt) - 1 + j, t])) <= TOL
    for j, top in enumerate(lp.top_logprobs):
        assert lp.tokens[j] in top and len(top) <= 4    # 3 most likely plus the chosen one
        assert max(top.values()) == pytest.approx(lp.token_logprobs[j], abs=1e-6)   # greedy: the chosen is best
    # the first token's alternatives against transformers' top 3
    row = ref[len(prompt) - 1]
    want = {tok.decode([i]): float(v) for i, v in zip(row.topk(3).indices.tolist(), row.topk(3).values)}
    for t, v in want.items():
        assert lp.top_logprobs[0][t] == pytest.approx(v, abs=TOL)


def test_streamed_completion_logprobs_equal_non_streamed(oai):
    full = oai.completions.create(model=MODEL, prompt=PROMPT, logprobs=2, echo=True, **greedy(7))
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPT, logprobs=2, echo=True, stream=True,
                                         **greedy(7)))
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in parts) == full.choices[0].text and parts[0].text.startswith(PROMPT)
    ref = full.choices[0].logprobs
    for field in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
        assert [x for p in parts if p.logprobs for x in getattr(p.logprobs, field)] == getattr(ref, field), field


def test_echo_scores_the_prompt_like_lm_eval(oai, hf):
    """lm-evaluation-harness's loglikelihood request: echo, max_tokens 0, logprobs k."""
    model, tok = hf
    text = "for i in range(10):\n    print(i)"
    r = oai.completions.create(model=MODEL, prompt=text, echo=True, max_tokens=0, logprobs=1)
    c = r.choices[0]
    ids = tok.encode(text, add_special_tokens=False)
    assert c.text == text and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert c.logprobs.tokens == [tok.decode([i]) for i in ids] and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.top_logprobs[0] is None
    ref = hf_logprobs(model, ids)
    for j in range(1, len(ids)):
        assert abs(c.logprobs.token_logprobs[j] - float(ref[j - 1, ids[j]])) <= TOL, j
    # echo without logprobs, with a completion: the prompt's text, then the completion's
    r = oai.completions.create(model=MODEL, prompt=[ids, ids[:5]], echo=True, **greedy(3))
    assert [c.text[:len(text)] for c in r.choices][0] == text and r.choices[0].logprobs is None
    assert r.choices[1].text.startswith(tok.decode(ids[:5]))


def test_chat_logprobs_streamed_and_not(oai, hf):
    model, tok = hf
    msgs = [{"role": "user", "content": "add two numbers"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, top_logprobs=2, **greedy(5))
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 2 for e in content)
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == r.choices[0].message.content
    prompt = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    ref = hf_logprobs(model, prompt)[-1]
    assert content[0].logprob == pytest.approx(float(ref.max()), abs=TOL)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob, abs=1e-6)
    assert content[0].top_logprobs[1].logprob == pytest.approx(float(ref.topk(2).values[1]), abs=TOL)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, top_logprobs=2,
                                              stream=True, **greedy(5)))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # the streamed request restores the first one's prefix-cache checkpoint and runs only the prompt's rest,
    # the first ran it whole: the same tokens, logprobs equal to rounding (other GEMM shapes)
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    plain = oai.chat.completions.create(model=MODEL, messages=msgs, **greedy(2))
    assert plain.choices[0].logprobs is None


def test_penalties_through_the_endpoint_equal_the_library(oai, offline):
    llm = offline
    pen = dict(presence_penalty=1.2, frequency_penalty=0.8)
    r = oai.completions.create(model=MODEL, prompt=PROMPT, **pen, **greedy(12, repetition_penalty=1.5))
    ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5,
                                              **pen))[0]
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert r.choices[0].text == ref.text and ref.token_ids != plain.token_ids


@pytest.mark.parametrize("path, extra, param", [
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"presence_penalty": -2.01}, "presence_penalty"),
])
def test_out_of_range_values_get_400_naming_the_param(server, path, extra, param):
    body = {"model": MODEL, "max_tokens": 2, **extra}
    body.update({"prompt": "x"} if path == "completions" else {"messages": [{"role": "user", "content": "x"}]})
    r = httpx.post(f"{server.url}/v1/{path}", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"


def test_bole_mode_serves_the_same_logprobs_and_penalised_text(oai, tiny_model, serve_app):
    """Tree speculation behind the endpoint: penalised greedy text and its logprobs equal ar's."""
    kw = dict(model=MODEL, prompt=PROMPT, logprobs=2, presence_penalty=1.0, **greedy(8, repetition_penalty=1.4))
    ref = oai.completions.create(**kw).choices[0]
    with serve(tiny_model, serve_app, mode="bole") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        chunks = list(client.completions.create(stream=True, **kw))
        stats = srv.engine_client.stats().engine
    assert stats.mean_b_ver > 0 and stats.mat >= 1.0   # verify steps ran
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in parts) == ref.text
    got = [x for p in parts if p.logprobs for x in p.logprobs.token_logprobs]
    assert max(abs(a - b) for a, b in zip(got, ref.logprobs.token_logprobs, strict=True)) <= TOL


def test_token_bytes_of_a_byte_level_tokenizer(hf):
    """A character split over byte tokens: each token's bytes are its own, so they join to the UTF-8."""
    from deployments.logprobs import TokenText

    _, tok = hf
    text_of = TokenText(tok)
    assert text_of.byte_level
    for s in ("é", "naïve → ok", "def f(x):"):
        ids = tok.encode(s, add_special_tokens=False)
        assert b"".join(bytes(text_of.bytes(i)) for i in ids) == s.encode("utf-8")
    assert any(text_of(i) == "\ufffd" for i in tok.encode("é", add_special_tokens=False))  # a partial character
