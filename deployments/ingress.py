"""OpenAI-compatible HTTP ingress: ``build_app(engine_client, model_name, ...)`` -> FastAPI app.

The app only knows the ``EngineClient`` protocol (``deployments.engine_client``), so the same code
serves one in-process engine (tests, ``python -m deployments.ingress``) and a Ray Serve fleet
(``deployments.app`` wraps it in an ingress deployment whose client forwards to replicas).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat
template), server-sent-event streaming ending in ``data: [DONE]`` with ``stream_options.
include_usage``; GET /health (engine loop alive), GET /ready (accepting requests), GET /metrics
(Prometheus). Sampling parameters map onto ``SamplingParams`` (penalties, ``logprobs`` /
``top_logprobs``, ``echo`` with prompt logprobs); ``deployments.logprobs`` renders the logprobs.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``:
  400 invalid_request_error   bad JSON / fields / unsupported options (``param`` names the field),
                              a prompt + max_tokens over ``max_model_len`` (code
                              ``context_length_exceeded``, as OpenAI and vLLM do), and whatever the
                              library refuses as ``bole.errors.InvalidRequest``
  401 authentication_error    missing / wrong ``Authorization: Bearer`` key (when a key is set),
                              checked before the body is read
  404 not_found_error         unknown model or route
  413 invalid_request_error   HTTP body over ``max_body_bytes`` (code ``request_too_large``)
  429 overloaded_error        too many requests in flight (``Retry-After`` set; clients retry)
  503 unavailable_error       draining / not ready (``Retry-After`` set)
  504 timeout_error           the request passed its deadline (``request_timeout_s``)
  500 internal_error          anything else: logged with its traceback under a request id, which
                              the message carries (never a 400: the client did nothing wrong)
A failing request never disturbs the others: validation happens before anything reaches the
engine, and a request's stream ending (finished, error, deadline or client disconnect) aborts only
its own engine requests. ``n`` choices (and a batch of prompts) are independent engine requests,
sent together (``EngineClient.generate_many``); seeded choice i samples with ``seed + i``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from bole.errors import InvalidRequest
from bole.sampling_params import SamplingParams
from deployments.engine_client import (
    EngineClient,
    EngineOverloaded,
    EngineUnavailable,
    RequestTimeout,
    SubRequest,
    merge_streams,
    unwrap_remote_error,
)
from deployments.http_guards import APIError, ApiKeyGuard, BodySizeLimit, RequestClock, arrival_time
from deployments.logprobs import TokenText, openai_logprobs
from deployments.openai_protocol import ChatCompletionRequest, CompletionRequest, UsageInfo, new_id, now
from deployments.retry import REPLICA_GONE_ERRORS
from deployments.server_metrics import ServerMetrics

logger = logging.getLogger(__name__)

API_KEY_ENV = "BOLE_API_KEY"
PROTECT_METRICS_ENV = "BOLE_PROTECT_METRICS"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_REQUEST_TIMEOUT_S = 600.0

__all__ = ["APIError", "build_app", "main"]


def _engine_error(e: BaseException, request_id: str) -> APIError:
    """Map what the engine (or a replica) raised to an HTTP error. A replica's exception arrives
    wrapped by Ray, whose text is a remote traceback: only the original message reaches a client.
    Only a client's mistake is a 400; an unknown exception is the server's fault: a logged 500."""
    e = unwrap_remote_error(e)
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineOverloaded) or type(e).__name__ in ("BackPressureError", "DeploymentUnavailableError"):
        return APIError(429, f"server overloaded: {e}", "overloaded_error", code="queue_full",
                        headers={"Retry-After": "1"})
    if isinstance(e, EngineUnavailable):
        retry = str(max(1, math.ceil(e.retry_after_s)))
        return APIError(503, str(e), "unavailable_error", code="unavailable", headers={"Retry-After": retry})
    if type(e).__name__ in REPLICA_GONE_ERRORS:  # after its first output: not retried (tokens were sent)
        return APIError(503, "the replica serving this request stopped before it finished; send it again",
                        "unavailable_error", code="replica_unavailable", headers={"Retry-After": "1"})
    if isinstance(e, RequestTimeout):
        return APIError(504, str(e), "timeout_error", code="request_timeout")
    if isinstance(e, (InvalidRequest, ValidationError)):
        return APIError(400, str(e))
    return internal_error(e, request_id)


def internal_error(e: BaseException, request_id: str) -> APIError:
    """The 500 of a server fault, logged with its traceback under ``request_id``, which the client
    sees (to quote in a report) with the exception's type and nothing else of it."""
    logger.error("request %s failed", request_id, exc_info=(type(e), e, e.__traceback__))
    return APIError(500, f"internal error ({type(e).__name__}); request id {request_id}", "internal_error",
                    code="internal_error")


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
    logprobs: list = field(default_factory=list)   # ``TokenLogprob`` of every token so far (when asked)
    prompt_logprobs: list | None = None            # echo: the prompt's, from the first output
    echo: str | None = None                        # echo: the prompt's text, sent before the completion
    text_offset: int = 0                           # completions logprobs: where the next token starts

    @property
    def sub(self) -> SubRequest:
        return SubRequest(self.prompt_token_ids, self.params, self.request_id)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def build_app(engine_client: EngineClient, model_name: str, *, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, default_max_tokens: int | None = None,
              drain_timeout_s: float = 30.0, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
              protect_metrics: bool | None = None) -> FastAPI:
    """The OpenAI-compatible app over ``engine_client``.

    api_key: required ``Authorization: Bearer`` key for /v1 routes; None reads ``$BOLE_API_KEY``;
        "" (or an unset / empty variable) turns authentication off.
    max_body_bytes: larger HTTP bodies get 413.
    default_max_tokens: chat requests without max_tokens generate up to this many tokens (None:
        the rest of the context, as vLLM does); completions default to 16 as in the OpenAI API.
    drain_timeout_s: on shutdown, how long to wait for in-flight requests.
    request_timeout_s: every request's server-side deadline from its arrival; past it the request's
        engine requests are aborted and the client gets a 504 (``request_timeout``; streaming: an
        error event, then ``[DONE]``).
    protect_metrics: with a key set, also require it on /metrics, /docs and /openapi.json; None
        reads ``$BOLE_PROTECT_METRICS`` (1 / true / yes).
    """
    if not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s!r}")
    client = engine_client
    api_key = (api_key if api_key is not None else os.environ.get(API_KEY_ENV)) or None
    if protect_metrics is None:
        protect_metrics = os.environ.get(PROTECT_METRICS_ENV, "").strip().lower() in ("1", "true", "yes")
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
    # the last added runs first: the clock, then auth (before the body is read), then the size limit
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(ApiKeyGuard, api_key=api_key, protect_docs=protect_metrics)
    app.add_middleware(RequestClock, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        msg = err.get("msg", "invalid request")
        if err.get("type") == "json_invalid":  # loc is ("body", byte offset): no field to name
            pos = next((x for x in err.get("loc", ()) if isinstance(x, int)), None)
            where = f" at character {pos}" if pos is not None else ""
            return APIError(400, f"the body is not valid JSON{where}: {msg}", code="json_invalid").response()
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        return APIError(400, f"{'.'.join(loc) + ': ' if loc else ''}{msg}", param=".".join(loc) or None,
                        code=err.get("type")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, str(e.detail), kind).response()

    @app.exception_handler(InvalidRequest)
    async def _invalid_request(request, e: InvalidRequest):
        return APIError(400, str(e)).response()

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):  # a bug: never a 400
        return internal_error(e, new_id("req")).response()

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

    def make_choices(req, prompts: list[list[int]], max_tokens: int | None, kind: str,
                     logprobs: int | None = None, prompt_logprobs: int | None = None) -> list[Choice]:
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4:
            raise APIError(400, "at most 4 stop sequences", param="stop")
        if len(prompts) * req.n > client.max_choices:
            raise APIError(400, f"{len(prompts)} prompt(s) x n={req.n} is more than the {client.max_choices} "
                           "sequences one request may ask for", param="n")
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
                # choice j of a seeded request samples with seed + j: distinct, reproducible samples
                try:
                    params = SamplingParams(
                        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, max_tokens=want,
                        min_tokens=req.min_tokens, stop=tuple(stop),
                        stop_token_ids=tuple(req.stop_token_ids or ()),
                        seed=None if req.seed is None else req.seed + j, ignore_eos=req.ignore_eos,
                        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                        repetition_penalty=req.repetition_penalty, logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs)
                except InvalidRequest as e:
                    raise APIError(400, str(e)) from None
                choices.append(Choice(p_index * req.n + j, ids, params, new_id(kind), counts_prompt=j == 0))
        return choices

    # -- running ----------------------------------------------------------------------------------
    async def run(choices: list[Choice], arrival: float) -> AsyncIterator[tuple[Choice, object]]:
        """The choices' deltas as they come, all from one ``generate_many`` call (one admission, one
        replica), until the request's deadline; leaving early aborts the engine requests."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + request_timeout_s - (time.monotonic() - arrival)
        first = True
        try:
            async for _, (i, out) in merge_streams([client.generate_many([c.sub for c in choices])], deadline):
                c = choices[i]
                if out.new_token_ids and c.first_token_time is None:
                    c.first_token_time = time.monotonic()
                    c.hardware_class = getattr(out, "hardware_class", "unknown")
                    if first:
                        metrics.observe_first_token(c.hardware_class, c.first_token_time - arrival,
                                                    getattr(out, "prefill_s", None))
                        first = False
                c.num_tokens += len(out.new_token_ids)
                c.text += out.new_text
                c.logprobs += getattr(out, "logprobs", None) or []
                if getattr(out, "prompt_logprobs", None) is not None:
                    c.prompt_logprobs = out.prompt_logprobs
                c.num_steps = getattr(out, "num_steps", 0)
                if out.finished:
                    c.finish_reason = out.finish_reason
                    metrics.observe_choice(c.hardware_class, len(c.prompt_token_ids) if c.counts_prompt else 0,
                                           c.num_tokens, c.first_token_time, c.num_steps, time.monotonic())
                yield c, out
        except RequestTimeout:
            metrics.aborted.labels(model_name, "deadline").inc()
            raise RequestTimeout(f"the request did not finish within its deadline (request_timeout_s="
                                 f"{request_timeout_s:g}); its engine requests were aborted") from None

    def usage(choices: list[Choice]) -> dict:
        prompt = sum(len(c.prompt_token_ids) for c in choices if c.counts_prompt)
        completion = sum(c.num_tokens for c in choices)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion).model_dump()

    async def until_disconnected(request: Request, work):
        """Run ``work`` (a coroutine); cancel it if the client goes away (aborting its requests), and
        when this handler itself is cancelled (Serve cancels it when its client disconnects)."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    metrics.aborted.labels(model_name, "client_disconnected").inc()
                    raise APIError(499, "client disconnected", code="client_closed_request")
        except asyncio.CancelledError:
            metrics.aborted.labels(model_name, "client_disconnected").inc()
            raise
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    text_of = TokenText(client.tokenizer)

    def render_logprobs(c: Choice, entries: list, with_prompt: bool, kind: str) -> dict | None:
        """The OpenAI logprobs object of these tokens of ``c`` (``deployments.logprobs``); with_prompt:
        the echoed prompt's tokens first. None when the request did not ask."""
        if c.params.logprobs is None:
            return None
        obj, c.text_offset = openai_logprobs(text_of, kind, entries, c.text_offset,
                                             c.prompt_token_ids if with_prompt else None, c.prompt_logprobs)
        return obj

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
                raise _engine_error(e, rid) from None
            if kind == "chat":
                body = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": render_logprobs(c, c.logprobs, False, kind), "finish_reason": c.finish_reason}
                        for c in choices]
            else:
                body = [{"index": c.index, "text": (c.echo or "") + c.text,
                         "logprobs": render_logprobs(c, c.logprobs, c.echo is not None, kind),
                         "finish_reason": c.finish_reason} for c in choices]
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
            await stream.aclose()
            raise _engine_error(e, rid) from None

        def chunk(c: Choice, text: str, finish: str | None, role: bool = False, logprobs: dict | None = None) -> str:
            if kind == "chat":
                delta = {"content": text} if text else {}
                if role:
                    delta = {"role": "assistant", "content": text}
                ch = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                ch = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
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
                    entries, echo, c.echo = getattr(out, "logprobs", None) or [], c.echo, None  # echo: once
                    if out.new_text or out.finished or entries or echo is not None:
                        yield chunk(c, (echo or "") + out.new_text, c.finish_reason if out.finished else None,
                                    logprobs=render_logprobs(c, entries, echo is not None, kind))
                    try:
                        item = await stream.__anext__()
                    except StopAsyncIteration:
                        item = None
                if include_usage:
                    yield _sse({"id": rid, "object": chunk_obj, "created": created, "model": model_name,
                                "choices": [], "usage": usage(choices)})
            except (asyncio.CancelledError, GeneratorExit):  # the client went away mid-stream
                metrics.aborted.labels(model_name, "stream_closed").inc()
                raise
            except Exception as e:  # mid-stream failure or deadline: an error event, then the stream ends
                yield _sse(_engine_error(e, rid).body())
            finally:
                await stream.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- routes -----------------------------------------------------------------------------------
    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": now(), "owned_by": "bole",
                "max_model_len": client.max_model_len}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str):
        check_model(name)
        return model_card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        arrival = arrival_time(request.scope)
        check_model(req.model)
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo)", param="max_tokens")
        if req.best_of is not None and req.best_of < req.n:
            raise APIError(400, f"best_of ({req.best_of}) must be at least n ({req.n})", param="best_of")
        if req.best_of is not None and req.best_of > req.n:
            # ranking the candidates by cumulative logprob is not implemented; best_of == n is the same as n
            raise APIError(400, "best_of > n is not supported; best_of == n is", param="best_of",
                           code="unsupported")
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
        # echo with logprobs scores the prompt; echo with max_tokens 0 and no logprobs still runs it
        prompt_lp = (req.logprobs if req.logprobs is not None else 0 if req.max_tokens == 0 else None) \
            if req.echo else None
        choices = make_choices(req, prompts, req.max_tokens, "cmpl", req.logprobs, prompt_lp)
        if req.echo:
            for c in choices:
                c.echo = client.tokenizer.decode(c.prompt_token_ids) if client.tokenizer is not None else ""
        return await respond(request, req, choices, "completion", arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        arrival = arrival_time(request.scope)
        check_model(req.model)
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools", code="unsupported")
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
        choices = make_choices(req, [ids], req.max_completion_tokens or req.max_tokens, "chat",
                               (req.top_logprobs or 0) if req.logprobs else None)
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
    p.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                   help="server-side deadline of every request, seconds (then 504, engine request aborted)")
    a = p.parse_args(argv)
    engine = build_engine(a.model, mode=a.mode, device=a.device, dtype=a.dtype, num_blocks=a.num_blocks,
                          max_num_seqs=a.max_num_seqs, calibration_table=a.calibration_table)
    client = LocalEngineClient(AsyncEngine(engine))
    name = a.served_model_name or os.path.basename(os.path.normpath(a.model))
    app = build_app(client, name, api_key=a.api_key, default_max_tokens=a.default_max_tokens,
                    request_timeout_s=a.request_timeout)
    uvicorn.run(app, host=a.host, port=a.port, log_level="info", timeout_graceful_shutdown=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
