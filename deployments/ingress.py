"""OpenAI-compatible HTTP ingress: ``build_app(engine_client, model_name, ...)`` -> FastAPI app.

The app only knows the ``EngineClient`` protocol (``deployments.engine_client``), so the same code
serves one in-process engine (tests, ``python -m deployments.ingress``) and a Ray Serve fleet
(``deployments.app`` wraps it in an ingress deployment whose client forwards to replicas).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat
template), server-sent-event streaming ending in ``data: [DONE]`` with ``stream_options.
include_usage``; GET /health (engine loop alive), GET /ready (accepting requests), GET /metrics
(Prometheus).

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``:
  400 invalid_request_error   bad JSON / fields / unsupported options, and a prompt + max_tokens
                              over the engine's capacity (code ``context_length_exceeded``, as
                              OpenAI and vLLM do: the client can fix it by asking for fewer tokens)
  401 authentication_error    missing / wrong ``Authorization: Bearer`` key (when a key is set)
  404 not_found_error         unknown model or route
  413 invalid_request_error   HTTP body over ``max_body_bytes`` (code ``request_too_large``)
  429 overloaded_error        too many requests in flight (``Retry-After`` set; clients retry)
  503 unavailable_error       draining / not ready
A failing request never disturbs the others: validation happens before anything reaches the
engine, and a request's stream ending (finished, error or client disconnect) aborts only it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from bole.sampling_params import SamplingParams
from deployments.engine_client import EngineClient, EngineOverloaded, EngineUnavailable
from deployments.openai_protocol import ChatCompletionRequest, CompletionRequest, UsageInfo, new_id, now

logger = logging.getLogger(__name__)

API_KEY_ENV = "BOLE_API_KEY"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _engine_error(e: BaseException) -> APIError:
    """Map what the engine (or a replica) raised to an HTTP error."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineOverloaded) or type(e).__name__ == "BackPressureError":
        return APIError(429, f"server overloaded: {e}", "overloaded_error", code="queue_full",
                        headers={"Retry-After": "1"})
    if isinstance(e, EngineUnavailable):
        return APIError(503, str(e), "unavailable_error", code="unavailable", headers={"Retry-After": "1"})
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    logger.exception("request failed", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}", "internal_error", code="internal_error")


@dataclass
class Choice:
    """One engine request behind one OpenAI choice."""

    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    first_token_time: float | None = None
    hardware_class: str = "unknown"
    num_steps: int = 0
    counts_prompt: bool = True     # False for the 2nd..nth sample of a prompt (usage counts it once)


class ServerMetrics:
    """Prometheus metrics of one app (its own registry, so several apps can live in one process)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        hw = ["model", "hardware_class"]
        self.requests = Counter("bole_requests", "Finished HTTP requests", ["model", "endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("bole_prompt_tokens", "Prompt tokens", hw, registry=r)
        self.generation_tokens = Counter("bole_generation_tokens", "Generated tokens", hw, registry=r)
        self.ttft = Histogram("bole_time_to_first_token_seconds", "TTFT seen by the ingress", hw,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("bole_time_per_output_token_seconds", "TPOT after the first token", hw,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.mat = Histogram("bole_request_mean_accepted_tokens", "Tokens per decode step of a request (MAT)",
                             hw, buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16), registry=r)
        rep = ["model", "replica", "hardware_class"]
        self.gauges = {
            "mat": Gauge("bole_engine_mat", "Mean accepted tokens per request-step", rep, registry=r),
            "budget_used": Gauge("bole_verify_budget_used_ratio", "Draft nodes verified / B_ver", rep,
                                 registry=r),
            "b_ver": Gauge("bole_verify_budget_b_ver", "B_ver of the current calibration bucket", rep,
                           registry=r),
            "bucket": Gauge("bole_calibration_bucket", "Current calibration bucket index", rep, registry=r),
            "prefix_hit_rate": Gauge("bole_prefix_cache_hit_rate", "Share of prompt tokens served from "
                                     "the prefix cache", rep, registry=r),
            "running": Gauge("bole_running_requests", "Requests in the running batch", rep, registry=r),
            "waiting": Gauge("bole_waiting_requests", "Requests queued in the engine", rep, registry=r),
            "num_prefix_blocks": Gauge("bole_prefix_summary_blocks", "Block hashes in the replica's prefix "
                                       "summary", rep, registry=r),
        }
        self.table = Gauge("bole_calibration_table_info", "Calibration table in use (value 1); mismatch: the "
                           "fields (model, dtype, tp_size, hardware) it was not measured for, '' if none",
                           rep + ["table_id", "mismatch"], registry=r)

    def observe_choice(self, c: Choice, end: float) -> None:
        labels = (self.model_name, c.hardware_class)
        self.generation_tokens.labels(*labels).inc(c.num_tokens)
        if c.counts_prompt:
            self.prompt_tokens.labels(*labels).inc(len(c.prompt_token_ids))
        if c.first_token_time is not None and c.num_tokens > 1:
            self.tpot.labels(*labels).observe((end - c.first_token_time) / (c.num_tokens - 1))
        if c.num_steps:
            self.mat.labels(*labels).observe((c.num_tokens - 1) / c.num_steps)

    def export(self, fleet: list[dict]) -> bytes:
        for g in (*self.gauges.values(), self.table):
            g.clear()
        for s in fleet:
            labels = (self.model_name, str(s.get("replica", "?")), str(s.get("hardware_class", "unknown")))
            for key, g in self.gauges.items():
                if key in s:
                    g.labels(*labels).set(float(s[key]))
            if "table_id" in s:
                self.table.labels(*labels, str(s["table_id"]), str(s.get("calibration_mismatch", ""))).set(1)
        return generate_latest(self.registry)


class BodySizeLimit:
    """ASGI middleware: 413 once a request body exceeds ``max_bytes`` (declared or streamed)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await too_large.response()(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise APIError(413, too_large.message, code="request_too_large")
            return message

        return await self.app(scope, limited_receive, send)


class RequestCounter:
    """ASGI middleware counting /v1 responses by status (pure ASGI: streaming and disconnects pass
    through untouched, unlike ``BaseHTTPMiddleware``)."""

    def __init__(self, app, metrics: "ServerMetrics"):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(self.metrics.model_name, path, str(message["status"])).inc()
            await send(message)

        return await self.app(scope, receive, counting_send)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave several async iterators as (stream index, item); closing this closes them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i, it):
        try:
            async for item in it:
                await queue.put((i, item))
            await queue.put((i, end))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def build_app(engine_client: EngineClient, model_name: str, *, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, default_max_tokens: int | None = None,
              drain_timeout_s: float = 30.0) -> FastAPI:
    """The OpenAI-compatible app over ``engine_client``.

    api_key: required ``Authorization: Bearer`` key for /v1 routes; None reads ``$BOLE_API_KEY``;
        "" (or an unset / empty variable) turns authentication off.
    max_body_bytes: larger HTTP bodies get 413.
    default_max_tokens: chat requests without max_tokens generate up to this many tokens (None:
        the rest of the context, as vLLM does); completions default to 16 as in the OpenAI API.
    drain_timeout_s: on shutdown, how long to wait for in-flight requests.
    """
    client = engine_client
    api_key = (api_key if api_key is not None else os.environ.get(API_KEY_ENV)) or None
    metrics = ServerMetrics(model_name)

    @asynccontextmanager
    async def lifespan(app):
        if hasattr(client, "start"):  # e.g. learn the replicas' limits before taking requests
            await client.start()
        yield
        if hasattr(client, "drain"):  # graceful: finish what is in flight before the engine stops
            await client.drain(drain_timeout_s)
        if hasattr(client, "close"):
            await client.close()

    app = FastAPI(title="Bole OpenAI-compatible server", lifespan=lifespan)
    app.state.engine_client, app.state.metrics = client, metrics
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(RequestCounter, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        msg = err.get("msg", "invalid request")
        return APIError(400, f"{'.'.join(loc) + ': ' if loc else ''}{msg}", param=".".join(loc) or None,
                        code=err.get("type")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, str(e.detail), kind).response()

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "authentication_error", code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", param="model", code="model_not_found")

    # -- request -> engine requests ---------------------------------------------------------------
    def encode(text: str) -> list[int]:
        if client.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
        return client.tokenizer.encode(text, add_special_tokens=False)

    def check_ids(ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        bad = [t for t in ids if not 0 <= t < client.vocab_size]
        if bad:
            raise APIError(400, f"token ids out of range [0, {client.vocab_size}): {bad[:5]}", param=param)
        return ids

    def make_choices(req, prompts: list[list[int]], max_tokens: int | None, kind: str) -> list[Choice]:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise APIError(400, f"{name} is not supported", param=name, code="unsupported")
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4:
            raise APIError(400, "at most 4 stop sequences", param="stop")
        choices = []
        for p_index, ids in enumerate(prompts):
            room = client.max_model_len - len(ids)
            want = max_tokens if max_tokens is not None else (default_max_tokens or room)
            if kind == "chat" and max_tokens is None:
                want = min(want, room)
            if len(ids) + want > client.max_model_len or room < 1:
                raise APIError(400, f"this model's maximum context length is {client.max_model_len} tokens; "
                               f"the request has {len(ids)} prompt tokens and asks for {want} more",
                               param="max_tokens" if room >= 1 else "prompt", code="context_length_exceeded")
            for j in range(req.n):
                try:
                    params = SamplingParams(
                        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, max_tokens=want,
                        min_tokens=req.min_tokens, stop=tuple(stop),
                        stop_token_ids=tuple(req.stop_token_ids or ()),
                        seed=None if req.seed is None else req.seed + j, ignore_eos=req.ignore_eos)
                except ValueError as e:
                    raise APIError(400, str(e)) from None
                choices.append(Choice(p_index * req.n + j, ids, params, new_id(kind), counts_prompt=j == 0))
        return choices

    # -- running ----------------------------------------------------------------------------------
    async def run(choices: list[Choice], arrival: float) -> AsyncIterator[tuple[Choice, object]]:
        streams = [client.generate(c.prompt_token_ids, c.params, c.request_id) for c in choices]
        first = True
        async for i, out in _merge(streams):
            c = choices[i]
            if out.new_token_ids and c.first_token_time is None:
                c.first_token_time = time.monotonic()
                c.hardware_class = getattr(out, "hardware_class", "unknown")
                if first:
                    metrics.ttft.labels(model_name, c.hardware_class).observe(c.first_token_time - arrival)
                    first = False
            c.num_tokens += len(out.new_token_ids)
            c.text += out.new_text
            c.num_steps = getattr(out, "num_steps", 0)
            if out.finished:
                c.finish_reason = out.finish_reason
                metrics.observe_choice(c, time.monotonic())
            yield c, out

    def usage(choices: list[Choice]) -> dict:
        prompt = sum(len(c.prompt_token_ids) for c in choices if c.counts_prompt)
        completion = sum(c.num_tokens for c in choices)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion).model_dump()

    async def until_disconnected(request: Request, work):
        """Run ``work`` (a coroutine); cancel it if the client goes away (aborting its requests)."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise APIError(499, "client disconnected", code="client_closed_request")

    async def respond(request: Request, req, choices: list[Choice], kind: str, arrival: float):
        rid, created = new_id("chatcmpl" if kind == "chat" else "cmpl"), now()
        obj = "chat.completion" if kind == "chat" else "text_completion"
        if not req.stream:
            async def collect():
                async for _ in run(choices, arrival):
                    pass

            try:
                await until_disconnected(request, collect())
            except APIError:
                raise
            except Exception as e:
                raise _engine_error(e) from None
            if kind == "chat":
                body = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": None, "finish_reason": c.finish_reason} for c in choices]
            else:
                body = [{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                        for c in choices]
            return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": body,
                    "usage": usage(choices)}

        chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        stream = run(choices, arrival)
        try:  # the first delta decides the HTTP status: admission errors are still proper responses
            first = await stream.__anext__()
        except StopAsyncIteration:
            first = None
        except Exception as e:
            raise _engine_error(e) from None

        def chunk(c: Choice, text: str, finish: str | None, role: bool = False) -> str:
            if kind == "chat":
                delta = {"content": text} if text else {}
                if role:
                    delta = {"role": "assistant", "content": text}
                ch = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                ch = {"index": c.index, "text": text, "logprobs": None, "finish_reason": finish}
            out = {"id": rid, "object": chunk_obj, "created": created, "model": model_name, "choices": [ch]}
            if include_usage:
                out["usage"] = None
            return _sse(out)

        async def events():
            try:
                if kind == "chat":
                    for c in choices:
                        yield chunk(c, "", None, role=True)
                item = first
                while item is not None:
                    c, out = item
                    if out.new_text or out.finished:
                        yield chunk(c, out.new_text, c.finish_reason if out.finished else None)
                    try:
                        item = await stream.__anext__()
                    except StopAsyncIteration:
                        item = None
                if include_usage:
                    yield _sse({"id": rid, "object": chunk_obj, "created": created, "model": model_name,
                                "choices": [], "usage": usage(choices)})
            except Exception as e:  # mid-stream failure: an error event, then the stream ends
                yield _sse(_engine_error(e).body())
            finally:
                await stream.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- routes -----------------------------------------------------------------------------------
    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": now(), "owned_by": "bole",
                "max_model_len": client.max_model_len}

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(check_auth)])
    async def get_model(name: str):
        check_model(name)
        return model_card()

    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(req: CompletionRequest, request: Request):
        arrival = time.monotonic()
        check_model(req.model)
        if req.echo or req.logprobs is not None or req.suffix is not None:
            raise APIError(400, "echo, logprobs and suffix are not supported", code="unsupported")
        if req.best_of not in (None, req.n):
            raise APIError(400, "best_of is not supported", param="best_of", code="unsupported")
        p = req.prompt
        if isinstance(p, str):
            prompts = [encode(p)]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif p and all(isinstance(x, (str, list)) for x in p):
            prompts = [encode(x) if isinstance(x, str) else list(x) for x in p]
        else:
            raise APIError(400, "prompt must be a string, a list of strings or token ids", param="prompt")
        prompts = [check_ids(ids, "prompt") for ids in prompts]
        choices = make_choices(req, prompts, req.max_tokens, "cmpl")
        return await respond(request, req, choices, "completion", arrival)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        arrival = time.monotonic()
        check_model(req.model)
        if req.logprobs or req.tools:
            raise APIError(400, "logprobs and tools are not supported", code="unsupported")
        if req.response_format and req.response_format.get("type") != "text":
            raise APIError(400, "only response_format {'type': 'text'} is supported", param="response_format")
        tok = client.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                if any(part.get("type") != "text" for part in content):
                    raise APIError(400, "only text content parts are supported",
                                   param=f"messages.{i}.content")
                content = "".join(str(part.get("text", "")) for part in content)
            messages.append({"role": m.role, "content": content or ""})
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:
            raise APIError(400, f"the chat template failed on these messages: {e}",
                           param="messages") from None
        ids = check_ids(encode(text), "messages")
        choices = make_choices(req, [ids], req.max_completion_tokens or req.max_tokens, "chat")
        return await respond(request, req, choices, "chat", arrival)

    @app.get("/health")
    async def health():
        if await client.is_alive():
            return {"status": "ok"}
        raise APIError(503, "the engine loop is not running", "unavailable_error", code="engine_dead")

    @app.get("/ready")
    async def ready():
        if await client.is_ready():
            return {"status": "ready"}
        raise APIError(503, "not accepting requests (starting or draining)", "unavailable_error",
                       code="not_ready")

    @app.get("/metrics")
    async def prometheus():
        try:
            fleet = await client.fleet_stats()
        except Exception:
            logger.exception("fleet stats failed")
            fleet = []
        return Response(metrics.export(fleet), media_type=CONTENT_TYPE_LATEST)

    return app


def main(argv=None) -> int:
    """Single-process server (no Ray): ``python -m deployments.ingress --model PATH``."""
    import argparse

    import uvicorn

    from bole.config import ENGINE_MODES, CacheConfig, EngineConfig
    from bole.engine.async_engine import AsyncEngine
    from bole.llm import build_engine
    from deployments.engine_client import LocalEngineClient

    p = argparse.ArgumentParser(prog="python -m deployments.ingress")
    p.add_argument("--model", required=True, help="checkpoint folder (config.json, weights, tokenizer)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: folder name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--mode", choices=ENGINE_MODES, default=EngineConfig.mode)
    p.add_argument("--device", default=EngineConfig.device)
    p.add_argument("--dtype", default=EngineConfig.dtype)
    p.add_argument("--num-blocks", type=int, default=CacheConfig.num_blocks)
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    p.add_argument("--calibration-table", default=EngineConfig.calibration_table)
    p.add_argument("--api-key", default=None, help=f"require this bearer key (default: ${API_KEY_ENV})")
    p.add_argument("--default-max-tokens", type=int, default=None)
    a = p.parse_args(argv)
    engine = build_engine(a.model, mode=a.mode, device=a.device, dtype=a.dtype, num_blocks=a.num_blocks,
                          max_num_seqs=a.max_num_seqs, calibration_table=a.calibration_table)
    client = LocalEngineClient(AsyncEngine(engine))
    name = a.served_model_name or os.path.basename(os.path.normpath(a.model))
    app = build_app(client, name, api_key=a.api_key, default_max_tokens=a.default_max_tokens)
    uvicorn.run(app, host=a.host, port=a.port, log_level="info", timeout_graceful_shutdown=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
