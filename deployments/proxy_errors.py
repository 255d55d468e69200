"""Ray Serve's HTTP proxy's own answers as OpenAI-shaped errors, and no client say over its timeout.

Serve's proxy answers some requests itself, before the ingress (and its error handlers) runs, in
plain text (Ray 2.60, ``ray/serve/_private/proxy.py``):

  404  no application's route matches (no app deployed yet, or it was deleted)
  408  ``http_options.request_timeout_s`` passed, typically while the request waited in the proxy's
       queue for an ingress slot (the ingress's deadline, counted from its receipt, had not started)
  429  backpressure: the proxy's queue for the ingress is full (``backpressure_config``; Retry-After)
  503  the ingress deployment is unavailable (failed to deploy), a backpressure refusal without a
       ``backpressure_config``, and ``/-/healthz`` / ``/-/routes`` while not ready or draining
  500  any other failure: the proxy sends nothing and uvicorn answers "Internal Server Error"

``ProxyErrors``, a pure-ASGI middleware outermost in the proxy, gives clients (the ``openai``
client parses ``{"error": {...}}``) one error shape: any plain-text answer of status >= 400 becomes
``deployments.http_guards.APIError``'s body with the same status and headers (``Retry-After``,
``X-Request-ID``), the types those of ``deployments.http_errors``, and a request the proxy left
unanswered gets a JSON 500 in place of uvicorn's text. Successes and the ingress's own JSON errors
and event streams pass through untouched.

It also drops the request headers by which the proxy lets a caller (meant: a load balancer in front
of it) change its policy per request: ``x-request-timeout-seconds`` lengthens the end-to-end timeout
(0 turns it off), which must stay the app's deadline plus slack (``deployments.app``), and
``x-request-disconnect-disabled: ?1`` keeps a request running after its client went away.

Installed through Serve's proxy callback: ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` =
``PROXY_CALLBACK`` in the proxy actor's environment, which the Serve configs set through
``controller_options.runtime_env.env_vars`` (the proxies are the controller's children and inherit
its environment variables; Serve reads both when it first starts on a cluster).
"""

from __future__ import annotations

from http import HTTPStatus

from deployments.http_guards import APIError

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "deployments.proxy_errors:proxy_middlewares"
# Serve's per-request override headers (ray.serve._private.constants names them), as uvicorn passes
# header names: lowercase bytes
CLIENT_OVERRIDE_HEADERS = (b"x-request-timeout-seconds", b"x-request-disconnect-disabled")
REQUEST_ID_HEADER = b"x-request-id"   # what Serve's RequestIdMiddleware adds to the scope and answer

# status -> (type, code, what the message says before the proxy's text), as deployments.http_errors
# names them; another status: invalid_request_error (4xx) or internal_error (5xx)
PROXY_ERRORS = {
    404: ("not_found_error", None, None),
    408: ("timeout_error", "request_timeout", "request timed out in Ray Serve's proxy"),
    429: ("overloaded_error", "queue_full", "server overloaded"),
    500: ("internal_error", "internal_error", "internal error in Ray Serve's proxy"),
    503: ("unavailable_error", "unavailable", "service unavailable"),
}


def proxy_error(status: int, text: str, headers: dict | None = None) -> APIError:
    """The OpenAI-shaped error of one of the proxy's plain-text answers (``text``: its body), with
    ``headers`` (the proxy's, its content type aside)."""
    kind, code, what = PROXY_ERRORS.get(status, ("invalid_request_error" if status < 500 else "internal_error",
                                                 None, None))
    if not text:
        try:
            text = HTTPStatus(status).phrase.lower()
        except ValueError:   # a status http.HTTPStatus does not know
            text = "error"
    return APIError(status, f"{what}: {text}" if what else text, kind, code=code, headers=headers)


def _is_plain_error(message) -> bool:
    if message["status"] < 400:
        return False
    for name, value in message.get("headers") or ():
        if name.lower() == b"content-type":
            return value.split(b";")[0].strip().lower() == b"text/plain"
    return True   # no content type: nothing a client could parse either


class ProxyErrors:
    """Plain-text error answers as OpenAI-shaped JSON; Serve's per-request override headers dropped."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers") or ()
                                      if k.lower() not in CLIENT_OVERRIDE_HEADERS]}
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held: dict | None = None   # the start of a plain-text error, until its body is complete
        body: list[bytes] = []
        answered = replaced = False

        async def json_send(message):
            nonlocal held, answered, replaced
            if held is not None and message["type"] == "http.response.body":
                body.append(message.get("body", b""))
                if not message.get("more_body", False) and not replaced:
                    replaced = True
                    await self._send_error(scope, receive, send, held, b"".join(body))
                return
            if message["type"] == "http.response.start":
                answered = True
                if _is_plain_error(message):
                    held = message
                    return
            await send(message)

        try:
            await self.app(scope, receive, json_send)
        except Exception:
            if not answered:   # uvicorn would answer a plain-text 500
                await self._send_unanswered(scope, receive, send)
            raise
        if not answered:   # e.g. the proxy's 500, or a client that went away (then uvicorn drops it)
            await self._send_unanswered(scope, receive, send)
        elif held is not None and not replaced:   # its body was cut short
            await self._send_error(scope, receive, send, held, b"".join(body))

    @staticmethod
    async def _send_error(scope, receive, send, start, text: bytes) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.get("headers") or ()
                   if k.lower() not in (b"content-type", b"content-length")}
        err = proxy_error(start["status"], text.decode("utf-8", "replace").strip(), headers)
        await err.response()(scope, receive, send)

    async def _send_unanswered(self, scope, receive, send) -> None:
        request_id = dict(scope["headers"]).get(REQUEST_ID_HEADER, b"").decode("latin-1")
        headers = [(REQUEST_ID_HEADER, request_id.encode("latin-1"))] if request_id else []
        text = "the request failed before an answer" + (f" (request id {request_id})" if request_id else "")
        await self._send_error(scope, receive, send, {"status": 500, "headers": headers}, text.encode())


def proxy_middlewares() -> list:
    """The proxy callback (``PROXY_CALLBACK``): Serve wraps its HTTP proxy in these middlewares."""
    from starlette.middleware import Middleware

    return [Middleware(ProxyErrors)]
