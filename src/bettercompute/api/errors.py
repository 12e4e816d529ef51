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
from typing import Any

from aiohttp import web

from bettercompute.core.errors import ComputeError, ErrorCode

INTERNAL = "INTERNAL"
UNAVAILABLE = "UNAVAILABLE"

#: The HTTP status of each code of the guide.
STATUS: Mapping[ErrorCode, int] = {
    ErrorCode.INVALID_INPUT: 400,
    ErrorCode.UNSUPPORTED: 400,
    ErrorCode.SPEND_LIMIT_REACHED: 402,
    ErrorCode.ACCESS_DENIED: 403,
    ErrorCode.CONFIRMATION_REQUIRED: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.CONFLICT: 409,
    ErrorCode.INVALID_STATE: 409,
    ErrorCode.QUOTA_EXCEEDED: 429,
    ErrorCode.CAPACITY_UNAVAILABLE: 503,
}

#: Every code an error answer may carry.
CODES: tuple[str, ...] = (*(c.value for c in ErrorCode), INTERNAL, UNAVAILABLE)


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
