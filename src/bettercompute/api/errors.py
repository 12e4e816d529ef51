"""The error envelope of the HTTP API and the status each error code answers with.

Why one module: every refusal, whether the service raised it or the HTTP layer did (a missing
header, a bad token, a body too large, an unknown route), leaves as the same
``{"error": {"code", "message", "details"}}`` with a status from one table, so a client needs
one error handler. The table is documented in ``bettercompute.api.app``.

Hierarchy::

    core.errors.ComputeError    the service's refusals; status from ``STATUS`` by code
    Refusal                     the HTTP layer's own refusals, status given explicitly
                                (401 for a missing or invalid bearer token, 413, 404, 405)

Codes beyond the guide's: ``INTERNAL`` (500: an unexpected server error, with ``requestId``)
and ``UNAVAILABLE`` (503: the database cannot be reached, or the server is not ready).

What it must never do: put a traceback, a token or a request body into an answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from aiohttp import http_exceptions, web

from bettercompute.core.errors import ComputeError, ErrorCode

INTERNAL = "INTERNAL"
UNAVAILABLE = "UNAVAILABLE"
#: A client over its share of the server (``api.fairness``): 429 with ``Retry-After``.
TOO_MANY_REQUESTS = "TOO_MANY_REQUESTS"

#: The ``Server`` header of every answer: a name, never a version of Python or aiohttp.
SERVER = "better-compute"

#: The HTTP status of each code of the guide. Chosen so a generic client (an HTTP library's
#: retry policy, a proxy, a dashboard counting 5xx) does the right thing: only 429 and 503 mean
#: "retry later", and both always come with ``Retry-After`` (``TOO_MANY_REQUESTS``,
#: ``UNAVAILABLE``). A quota refusal is 403, as Kubernetes answers a request over a
#: ResourceQuota: retrying it unchanged fails again until something is released. No capacity is
#: 409, the pool's state conflicting with the request, and not the 503 of a database outage: it
#: is no fault of the server, and retrying the same request at once does not help.
STATUS: Mapping[ErrorCode, int] = {
    ErrorCode.INVALID_INPUT: 400,
    ErrorCode.UNSUPPORTED: 400,
    ErrorCode.SPEND_LIMIT_REACHED: 402,
    ErrorCode.ACCESS_DENIED: 403,
    ErrorCode.CONFIRMATION_REQUIRED: 403,
    ErrorCode.QUOTA_EXCEEDED: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.CONFLICT: 409,
    ErrorCode.INVALID_STATE: 409,
    ErrorCode.CAPACITY_UNAVAILABLE: 409,
}

#: Every code an error answer may carry.
CODES: tuple[str, ...] = (
    *(c.value for c in ErrorCode),
    INTERNAL,
    UNAVAILABLE,
    TOO_MANY_REQUESTS,
)


class Refusal(Exception):
    """A refusal made by the HTTP layer itself, with its status and optional headers."""

    def __init__(
        self,
        *,
        status: int,
        code: str,
        message: str,
        details: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = dict(details or {})
        self.headers = dict(headers or {})

    def response(self) -> web.Response:
        return answer(
            status=self.status,
            code=self.code,
            message=self.message,
            details=self.details,
            headers=self.headers,
        )


def answer(
    *,
    status: int,
    code: str,
    message: str,
    details: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """The error envelope as a JSON response."""
    body = {"error": {"code": code, "message": message, "details": dict(details or {})}}
    # ensure_ascii (the default): a lone surrogate from a caller's input cannot break encoding.
    return web.json_response(body, status=status, headers=headers, dumps=json.dumps)


def from_compute_error(error: ComputeError) -> web.Response:
    return answer(
        status=STATUS.get(error.code, 400),
        code=error.code.value,
        message=error.message,
        details=error.details,
    )


def invalid_input(field: str, reason: str, *, status: int = 400, **details: Any) -> Refusal:
    """``INVALID_INPUT`` naming ``field``, in the same shape as ``core.errors.invalid_input``."""
    return Refusal(
        status=status,
        code=ErrorCode.INVALID_INPUT.value,
        message=f"{field}: {reason}",
        details={"field": field, "reason": reason, **details},
    )


def unauthenticated(message: str) -> Refusal:
    """401: the bearer token is missing or not valid (the code stays the guide's)."""
    return Refusal(
        status=401,
        code=ErrorCode.ACCESS_DENIED.value,
        message=message,
        details={"header": "Authorization"},
        headers={"WWW-Authenticate": 'Bearer realm="better-compute"'},
    )


def from_http_exception(error: web.HTTPException, *, max_body_bytes: int) -> web.Response:
    """aiohttp's own refusals (no route, wrong method, body too large) in our envelope."""
    if isinstance(error, web.HTTPNotFound):
        return answer(status=404, code=ErrorCode.NOT_FOUND.value, message="no such route")
    if isinstance(error, web.HTTPMethodNotAllowed):
        allowed = sorted(error.allowed_methods)
        refusal = invalid_input(
            "method",
            f"{error.method} is not allowed here; use {', '.join(allowed)}",
            status=405,
            allowed=allowed,
        )
        refusal.headers["Allow"] = ", ".join(allowed)
        return refusal.response()
    if isinstance(error, web.HTTPRequestEntityTooLarge):
        return too_large(max_body_bytes).response()
    if error.status >= 500:
        return answer(status=500, code=INTERNAL, message="internal error")
    status = error.status if 400 <= error.status < 500 else 400
    return invalid_input("request", error.reason or "bad request", status=status).response()


def too_large(max_body_bytes: int) -> Refusal:
    return invalid_input(
        "body", f"the body is larger than {max_body_bytes} bytes", status=413, limit=max_body_bytes
    )


class BodyTimeout(TimeoutError):
    """The body did not arrive in time (set on the request's payload by ``api.serving``).

    A ``TimeoutError``, so aiohttp's own lingering read after an answer treats it as the end of
    waiting rather than an unhandled error."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the body did not arrive within {seconds:g} seconds")
        self.seconds = seconds


def body_timeout(seconds: float) -> Refusal:
    return invalid_input(
        "body",
        f"the body did not arrive within {seconds:g} seconds",
        status=408,
        timeoutSeconds=seconds,
    )


# aiohttp's parser errors, in the order they are matched (subclasses first). Fixed words only:
# the parser's own messages quote the offending bytes, and a header may hold a credential.
_PROTOCOL_ERRORS: tuple[tuple[type[Exception], str], ...] = (
    (http_exceptions.LineTooLong, "the request line or a header is too long"),
    (http_exceptions.InvalidHeader, "a request header is not valid"),
    (http_exceptions.BadHttpMethod, "the request method is not valid"),
    (http_exceptions.BadStatusLine, "the request line is not valid"),
    (http_exceptions.InvalidURLError, "the request target is not valid"),
    (http_exceptions.PayloadEncodingError, "the body's framing or encoding is not valid"),
)


def protocol_reason(error: BaseException | None) -> str:
    """A fixed description of an HTTP protocol error, never quoting the request."""
    for kind, reason in _PROTOCOL_ERRORS:
        if isinstance(error, kind):
            return reason
    return "the request line or a header is not valid HTTP/1.1"


def protocol_error(error: BaseException | None, *, status: int = 400) -> web.Response:
    """The envelope for a request aiohttp could not parse; the connection is closed after it."""
    if status >= 500:
        response = answer(status=500, code=INTERNAL, message="internal error")
    else:
        response = invalid_input("request", protocol_reason(error), status=status).response()
    response.headers["Server"] = SERVER
    response.force_close()
    return response


def raw_answer(
    *,
    status: int,
    code: str,
    message: str,
    details: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
) -> bytes:
    """A whole HTTP/1.1 answer in the envelope, as bytes for a connection that has no parsed
    request to answer (over the connection limit, headers that never completed)."""
    body = json.dumps(
        {"error": {"code": code, "message": message, "details": dict(details or {})}}
    ).encode()
    lines = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        f"Server: {SERVER}",
        "Content-Type: application/json; charset=utf-8",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body
