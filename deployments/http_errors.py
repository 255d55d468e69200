"""Which exception is which HTTP error: the ingress's one mapping of what a request raised.

Only a client's mistake (``bole.errors.InvalidRequest``, a pydantic ``ValidationError``) is a 400;
overload is a 429, unavailability a 503, the deadline a 504. Anything else is the server's fault: a
500 logged with its traceback under a request id, which the client sees and nothing else of it.
"""

from __future__ import annotations

import logging
import math

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from bole.errors import InvalidRequest
from deployments.engine_client import EngineOverloaded, EngineUnavailable, RequestTimeout, unwrap_remote_error
from deployments.http_guards import APIError
from deployments.openai_protocol import new_id
from deployments.retry import REPLICA_GONE_ERRORS, group_refused

logger = logging.getLogger(__name__)


def engine_error(e: BaseException, request_id: str) -> APIError:
    """Map what the engine (or a replica) raised to an HTTP error. A replica's exception arrives
    wrapped by Ray, whose text is a remote traceback: only the original message reaches a client.
    Only a client's mistake is a 400; an unknown exception is the server's fault: a logged 500."""
    e = unwrap_remote_error(e)
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineOverloaded) or group_refused(e):
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
    if isinstance(e, InvalidRequest):
        return APIError(400, str(e), param=e.param)
    if isinstance(e, ValidationError):
        return APIError(400, str(e))
    return internal_error(e, request_id)


def internal_error(e: BaseException, request_id: str) -> APIError:
    """The 500 of a server fault, logged with its traceback under ``request_id``, which the client
    sees (to quote in a report) with the exception's type and nothing else of it."""
    logger.error("request %s failed", request_id, exc_info=(type(e), e, e.__traceback__))
    return APIError(500, f"internal error ({type(e).__name__}); request id {request_id}", "internal_error",
                    code="internal_error")


async def _api_error(request, e: APIError):
    return e.response()


async def _validation_error(request, e: RequestValidationError):
    err = e.errors()[0] if e.errors() else {}
    msg = err.get("msg", "invalid request")
    if err.get("type") == "json_invalid":  # loc is ("body", byte offset): no field to name
        pos = next((x for x in err.get("loc", ()) if isinstance(x, int)), None)
        where = f" at character {pos}" if pos is not None else ""
        return APIError(400, f"the body is not valid JSON{where}: {msg}", code="json_invalid").response()
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if not loc and err.get("type") == "missing":  # no body at all: name the fields it needs
        needs = ", ".join(_required_fields(request)) or "the request's fields"
        return APIError(400, f"the body is empty: send a JSON object with {needs}", code="missing").response()
    return APIError(400, f"{'.'.join(loc) + ': ' if loc else ''}{msg}", param=".".join(loc) or None,
                    code=err.get("type")).response()


def _required_fields(request) -> list[str]:
    """The required fields of the body model of the route that ``request`` matched."""
    body = getattr(request.scope.get("route"), "body_field", None)
    model = getattr(getattr(body, "field_info", None), "annotation", None)
    return [name for name, f in getattr(model, "model_fields", {}).items() if f.is_required()]


async def _http_error(request, e: StarletteHTTPException):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return APIError(e.status_code, str(e.detail), kind, headers=e.headers).response()   # a 405's Allow


async def _invalid_request(request, e: InvalidRequest):
    return APIError(400, str(e), param=e.param).response()


async def _internal_error(request, e: Exception):  # a bug: never a 400
    return internal_error(e, new_id("req")).response()


ERROR_HANDLERS = {  # the app's exception handlers, by what they catch
    APIError: _api_error, RequestValidationError: _validation_error, StarletteHTTPException: _http_error,
    InvalidRequest: _invalid_request, Exception: _internal_error}
