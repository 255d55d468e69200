"""The OpenAI app's error type and the pure-ASGI middlewares that run before any route.

Pure ASGI (not ``BaseHTTPMiddleware``), so streaming responses and disconnects pass through untouched.
Outermost first, as ``deployments.ingress.openai_app`` stacks them:

  RequestClock   stamps the request's arrival (``scope["state"][ARRIVAL_KEY]``, ``time.monotonic()``)
                 before anything else runs, and counts /v1 responses by route template and status
                 (``endpoint_label``: a path no route matches is "other", so clients can't mint series)
  ApiKeyGuard    401 for a missing / wrong bearer key, before the body is read or validated (a
                 request without a key learns nothing about its body); /v1 routes always, and with
                 ``protect_docs`` also /metrics, /docs, /redoc and /openapi.json. /health and
                 /ready stay open for probes.
  BodySizeLimit  413 once a body exceeds ``max_bytes`` (declared, or streamed: then whatever the app
                 answers, FastAPI's 400 for a body it could not read, is replaced by the 413)
"""

from __future__ import annotations

import hmac
import time

from fastapi.responses import JSONResponse
from starlette.routing import Match

ARRIVAL_KEY = "bole_arrival"
PROTECTED_DOCS = ("/metrics", "/docs", "/redoc", "/openapi.json")


class APIError(Exception):
    """An OpenAI-shaped error: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def arrival_time(scope) -> float:
    """When ``RequestClock`` saw the request (now, for an app run without it)."""
    return (scope.get("state") or {}).get(ARRIVAL_KEY) or time.monotonic()


def endpoint_label(scope) -> str:
    """The template of the route ``scope`` matched (``/v1/models/{name:path}``), else "other". A request
    answered before routing (401, a declared 413) is matched here against the app's routes."""
    route = scope.get("route")
    if route is None:
        routes = getattr(scope.get("app"), "routes", ())
        route = next((r for r in routes if r.matches(scope)[0] != Match.NONE), None)
    return getattr(route, "path", None) or "other"


class RequestClock:
    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})[ARRIVAL_KEY] = time.monotonic()
        path = scope.get("path", "")
        if not path.startswith("/v1/"):
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(self.metrics.model_name, endpoint_label(scope),
                                             str(message["status"])).inc()
            await send(message)

        return await self.app(scope, receive, counting_send)


class ApiKeyGuard:
    def __init__(self, app, api_key: str | None, protect_docs: bool = False):
        self.app, self.api_key, self.protect_docs = app, api_key, protect_docs

    def _guarded(self, path: str) -> bool:
        return path.startswith("/v1/") or path == "/v1" or (self.protect_docs and (
            path in PROTECTED_DOCS or path.startswith("/docs/")))

    def _authorized(self, scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.api_key and self._guarded(scope.get("path", "")) \
                and not self._authorized(scope):
            err = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "authentication_error", code="invalid_api_key")
            return await err.response()(scope, receive, send)
        return await self.app(scope, receive, send)


class BodySizeLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await too_large.response()(scope, receive, send)
        seen, over, started, replaced = 0, False, False, False

        async def limited_receive():
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    over = True
                    raise APIError(413, too_large.message, code="request_too_large")
            return message

        async def limited_send(message):
            # FastAPI catches what the body read raised and answers 400: once over, the app's answer
            # (unless it began before) is dropped and the 413 sent in its place
            nonlocal started, replaced
            if over and not started:
                if not replaced:
                    replaced = True
                    await too_large.response()(scope, receive, send)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        return await self.app(scope, limited_receive, limited_send)
