"""OpenAI-compatible HTTP ingress: ``openai_app(engine_client, model_name, ...)`` -> FastAPI app.

The app only knows the ``EngineClient`` protocol (``deployments.engine_client``), so the same code
serves one in-process engine (tests, ``python -m deployments.ingress``) and a Ray Serve fleet
(``deployments.app`` wraps it in an ingress deployment whose client forwards to replicas).
``OpenAIServer`` has one method per route; ``deployments.choices`` turns a request into engine
requests, ``deployments.responses`` renders the response, ``deployments.http_errors`` maps errors.

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
Under Ray Serve (``deployments.app``) Serve's proxy answers some itself, before this app runs: 429 with
``Retry-After`` when its bounded queue for the ingress is full, and 408 for a request still open
``request_timeout_s`` + 2 s after it reached the proxy (one held in the proxy's queue, where this
app's deadline, counted from the ingress's receipt, had not started); its callback
(``deployments.proxy_errors``) makes them the same OpenAI-shaped errors.
With several replica groups, a group that refuses a request as full (before any output) passes it to
the next in the group choice's order at once; the 429 comes when every group refused it
(``deployments.serve_client``).
A failing request never disturbs the others: validation happens before anything reaches the
engine, and a request's stream ending (finished, error, deadline or client disconnect) aborts only
its own engine requests. ``n`` choices (and a batch of prompts) are independent engine requests,
sent together (``EngineClient.generate_many``); seeded choice i samples with ``seed + i``.
"""


from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from deployments.choices import Choice, check_ids, make_choices, usage
from deployments.engine_client import EngineClient, RequestTimeout, merge_streams
from deployments.http_errors import ERROR_HANDLERS, engine_error
from deployments.http_guards import APIError, ApiKeyGuard, BodySizeLimit, RequestClock, arrival_time
from deployments.logprobs import TokenText
from deployments.openai_protocol import ChatCompletionRequest, CompletionRequest, now
from deployments.responses import DONE, ResponseWriter, sse
from deployments.server_metrics import ServerMetrics

logger = logging.getLogger(__name__)

API_KEY_ENV = "BOLE_API_KEY"
PROTECT_METRICS_ENV = "BOLE_PROTECT_METRICS"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_REQUEST_TIMEOUT_S = 600.0

__all__ = ["APIError", "OpenAIServer", "main", "openai_app"]


class OpenAIServer:
    """The routes over one ``EngineClient``: each public coroutine below is one endpoint."""

    def __init__(self, client: EngineClient, model_name: str, metrics: ServerMetrics,
                 default_max_tokens: int | None = None, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 drain_timeout_s: float = 30.0):
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s!r}")
        self.client, self.model_name, self.metrics = client, model_name, metrics
        self.default_max_tokens, self.request_timeout_s = default_max_tokens, request_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.text_of = TokenText(client.tokenizer)

    @asynccontextmanager
    async def lifespan(self, app):
        await self.client.start()   # e.g. learn the replicas' limits before taking requests
        yield
        await self.client.drain(self.drain_timeout_s)   # graceful: finish what is in flight
        await self.client.close()

    # -- request -> engine requests ---------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            shown = repr(name) if len(name) <= 200 else f"{name[:200]!r}... ({len(name)} characters)"
            raise APIError(404, f"the model {shown} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", param="model", code="model_not_found")

    def encode(self, text: str) -> list[int]:
        if self.client.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
        return self.client.tokenizer.encode(text, add_special_tokens=False)

    def choices(self, req, prompts: list[list[int]], max_tokens: int | None, kind: str,
                logprobs: int | None = None, prompt_logprobs: int | None = None) -> list[Choice]:
        return make_choices(self.client, req, prompts, max_tokens, kind, self.default_max_tokens, logprobs,
                            prompt_logprobs)

    # -- running ----------------------------------------------------------------------------------
    async def run(self, choices: list[Choice], arrival: float) -> AsyncIterator[tuple[Choice, object]]:
        """The choices' deltas as they come, all from one ``generate_many`` call (one admission, one
        replica), until the request's deadline; leaving early aborts the engine requests."""
        metrics, loop = self.metrics, asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s - (time.monotonic() - arrival)
        first = True
        try:
            async for _, (i, out) in merge_streams([self.client.generate_many([c.sub for c in choices])],
                                                   deadline):
                c = choices[i]
                # from any output, not only one with tokens: prompt scoring (echo, max_tokens 0) has none
                c.hardware_class = out.hardware_class
                if out.new_token_ids and c.first_token_time is None:
                    c.first_token_time = time.monotonic()
                    if first:
                        metrics.observe_first_token(c.hardware_class, c.first_token_time - arrival,
                                                    out.prefill_s, out.engine_queue_s)
                        first = False
                c.num_tokens += len(out.new_token_ids)
                c.text += out.new_text
                c.logprobs += out.logprobs or []
                if out.prompt_logprobs is not None:
                    c.prompt_logprobs = out.prompt_logprobs
                c.num_steps = out.num_steps
                if out.finished:
                    c.finish_reason = out.finish_reason
                    metrics.observe_choice(c.hardware_class, len(c.prompt_token_ids) if c.counts_prompt else 0,
                                           c.num_tokens, c.first_token_time, c.num_steps, time.monotonic())
                yield c, out
        except RequestTimeout:
            metrics.aborted.labels(self.model_name, "deadline").inc()
            raise RequestTimeout(f"the request did not finish within its deadline (request_timeout_s="
                                 f"{self.request_timeout_s:g}); its engine requests were aborted") from None

    async def until_disconnected(self, request: Request, work):
        """Run ``work`` (a coroutine); cancel it if the client goes away (aborting its requests), and
        when this handler itself is cancelled (Serve cancels it when its client disconnects)."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    self.metrics.aborted.labels(self.model_name, "client_disconnected").inc()
                    raise APIError(499, "client disconnected", code="client_closed_request")
        except asyncio.CancelledError:
            self.metrics.aborted.labels(self.model_name, "client_disconnected").inc()
            raise
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def respond(self, request: Request, req, choices: list[Choice], kind: str, arrival: float):
        writer = ResponseWriter(kind, self.model_name, self.text_of,
                                bool(req.stream and req.stream_options and req.stream_options.include_usage))
        if not req.stream:
            async def collect():
                async for _ in self.run(choices, arrival):
                    pass

            try:
                await self.until_disconnected(request, collect())
            except APIError:
                raise
            except Exception as e:
                raise engine_error(e, writer.id) from None
            return writer.body(choices, usage(choices))

        stream = self.run(choices, arrival)
        try:  # the first delta decides the HTTP status: admission errors are still proper responses;
            # a client that leaves before it (its request still queued, say) aborts the request now
            first = await self.until_disconnected(request, stream.__anext__())
        except StopAsyncIteration:
            first = None
        except APIError:
            await stream.aclose()
            raise
        except Exception as e:
            await stream.aclose()
            raise engine_error(e, writer.id) from None
        return StreamingResponse(self.events(writer, choices, stream, first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def events(self, writer: ResponseWriter, choices: list[Choice], stream, first):
        """The SSE body: (chat) the role, every delta, (asked) the usage, then ``[DONE]``; a failure
        mid-stream (or the deadline) is an error event before ``[DONE]``."""
        try:
            if writer.kind == "chat":
                for c in choices:
                    yield writer.chunk(c, "", None, role=True)
            item = first
            while item is not None:
                event = writer.delta(*item)
                if event is not None:
                    yield event
                try:
                    item = await stream.__anext__()
                except StopAsyncIteration:
                    item = None
            if writer.include_usage:
                yield writer.usage_chunk(usage(choices))
        except (asyncio.CancelledError, GeneratorExit):  # the client went away mid-stream
            self.metrics.aborted.labels(self.model_name, "stream_closed").inc()
            raise
        except Exception as e:  # mid-stream failure or deadline: an error event, then the stream ends
            yield sse(engine_error(e, writer.id).body())
        finally:
            await stream.aclose()
        yield DONE

    # -- routes -----------------------------------------------------------------------------------
    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": now(), "owned_by": "bole",
                "max_model_len": self.client.max_model_len}

    async def list_models(self):
        return {"object": "list", "data": [self.model_card()]}

    async def get_model(self, name: str):
        self.check_model(name)
        return self.model_card()

    async def completions(self, req: CompletionRequest, request: Request):
        arrival = arrival_time(request.scope)
        self.check_model(req.model)
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
            prompts = [self.encode(p)]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif p and all(isinstance(x, (str, list)) for x in p):
            prompts = [self.encode(x) if isinstance(x, str) else list(x) for x in p]
        else:
            raise APIError(400, "prompt must be a string, a list of strings or token ids", param="prompt")
        prompts = [check_ids(ids, "prompt", self.client.vocab_size) for ids in prompts]
        # echo with logprobs scores the prompt; echo with max_tokens 0 and no logprobs still runs it
        prompt_lp = (req.logprobs if req.logprobs is not None else 0 if req.max_tokens == 0 else None) \
            if req.echo else None
        choices = self.choices(req, prompts, req.max_tokens, "cmpl", req.logprobs, prompt_lp)
        if req.echo:
            tok = self.client.tokenizer
            for c in choices:
                c.echo = tok.decode(c.prompt_token_ids) if tok is not None else ""
        return await self.respond(request, req, choices, "completion", arrival)

    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        arrival = arrival_time(request.scope)
        self.check_model(req.model)
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools", code="unsupported")
        if req.response_format and req.response_format.get("type") != "text":
            raise APIError(400, "only response_format {'type': 'text'} is supported", param="response_format")
        tok = self.client.tokenizer
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
        ids = check_ids(self.encode(text), "messages", self.client.vocab_size)
        choices = self.choices(req, [ids], req.max_completion_tokens or req.max_tokens, "chat",
                               (req.top_logprobs or 0) if req.logprobs else None)
        return await self.respond(request, req, choices, "chat", arrival)

    async def health(self):
        if await self.client.is_alive():
            return {"status": "ok"}
        raise APIError(503, "the engine loop is not running", "unavailable_error", code="engine_dead")

    async def ready(self):
        if await self.client.is_ready():
            return {"status": "ready"}
        raise APIError(503, "not accepting requests (starting or draining)", "unavailable_error",
                       code="not_ready")

    async def prometheus(self):
        try:
            fleet = await self.client.fleet_stats()
        except Exception:
            logger.exception("fleet stats failed")
            fleet = []
        return Response(self.metrics.export(fleet), media_type=CONTENT_TYPE_LATEST)


def openai_app(engine_client: EngineClient, model_name: str, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, default_max_tokens: int | None = None,
               drain_timeout_s: float = 30.0, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
               protect_metrics: bool | None = None) -> FastAPI:
    """The OpenAI-compatible FastAPI app over ``engine_client`` (an ``OpenAIServer``'s routes).

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
    api_key = (api_key if api_key is not None else os.environ.get(API_KEY_ENV)) or None
    if protect_metrics is None:
        protect_metrics = os.environ.get(PROTECT_METRICS_ENV, "").strip().lower() in ("1", "true", "yes")
    metrics = ServerMetrics(model_name)
    server = OpenAIServer(engine_client, model_name, metrics, default_max_tokens, request_timeout_s,
                          drain_timeout_s)
    app = FastAPI(title="Bole OpenAI-compatible server", lifespan=server.lifespan)
    app.state.engine_client, app.state.metrics = engine_client, metrics
    # the last added runs first: the clock, then auth (before the body is read), then the size limit
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(ApiKeyGuard, api_key=api_key, protect_docs=protect_metrics)
    app.add_middleware(RequestClock, metrics=metrics)
    for exc, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(exc, handler)
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])
    for path, handler in (("/v1/models", server.list_models), ("/v1/models/{name:path}", server.get_model),
                          ("/health", server.health), ("/ready", server.ready)):
        app.add_api_route(path, handler, methods=["GET"])
        # HEAD too, as probes and load balancers ask (the GET's status and headers); one schema entry
        app.add_api_route(path, handler, methods=["HEAD"], include_in_schema=False)
    return app


def main(argv=None) -> int:
    """Single-process server (no Ray): ``python -m deployments.ingress --model PATH``."""
    import argparse

    import uvicorn

    from bole.config import ENGINE_MODES, CacheConfig, EngineConfig
    from bole.engine.async_engine import AsyncEngine, freeze_startup_heap
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
    p.add_argument("--gpu-memory-utilization", type=float, default=CacheConfig.gpu_memory_utilization)
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    p.add_argument("--calibration-table", default=EngineConfig.calibration_table)
    p.add_argument("--api-key", default=None, help=f"require this bearer key (default: ${API_KEY_ENV})")
    p.add_argument("--default-max-tokens", type=int, default=None)
    p.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                   help="server-side deadline of every request, seconds (then 504, engine request aborted)")
    a = p.parse_args(argv)
    engine = build_engine(a.model, mode=a.mode, device=a.device, dtype=a.dtype, num_blocks=a.num_blocks,
                          max_num_seqs=a.max_num_seqs, calibration_table=a.calibration_table,
                          gpu_memory_utilization=a.gpu_memory_utilization)
    client = LocalEngineClient(AsyncEngine(engine))
    name = a.served_model_name or os.path.basename(os.path.normpath(a.model))
    app = openai_app(client, name, api_key=a.api_key, default_max_tokens=a.default_max_tokens,
                    request_timeout_s=a.request_timeout)
    freeze_startup_heap()
    uvicorn.run(app, host=a.host, port=a.port, log_level="info", timeout_graceful_shutdown=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
