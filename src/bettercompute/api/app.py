"""The aiohttp application: routes, the request pipeline and the answer envelopes.

Why it exists: the guide's HTTP examples must work as written::

    curl -X POST …/api/compute/reservations/create -H "Authorization: Bearer $TOKEN" \\
         -H "Content-Type: application/json" -H "X-Better-Compute: 1" -d '{…}'
    # → {"data": {"id": "rsv_…", "state": "placed", …}}

``make_app`` builds one application around a ``ReservationService`` the caller owns; the caller
runs it (``web.AppRunner``) and closes the database. Each operation handler is a few lines:
check the CSRF header, authenticate, read the JSON body, call the service, wrap the answer.

Routes:

* ``POST /api/compute/reservations/{create,get,list,release,cancel,extend,renew}`` and
  ``POST /api/compute/capacity/preview``: body = the guide's JSON input; ``200 {"data": …}``.
* ``GET /api/compute/openapi.json``, ``GET /healthz``, ``GET /readyz``, ``GET /metrics``: no
  credential needed.

Every operation call must carry ``X-Better-Compute: 1`` (a browser cannot add it to a
cross-site request without a CORS preflight, which this API never grants) and
``Authorization: Bearer <token>``. The body is read as JSON whatever its ``Content-Type``
says. Every answer carries ``X-Request-Id``: the caller's, when it
is 1-128 characters of ``[A-Za-z0-9._:-]``, else a new ``req_…`` id.

Status of each error answer, ``{"error": {"code", "message", "details"}}``:

=====================================================  ======  =========================
When                                                   Status  ``code``
=====================================================  ======  =========================
bad or unknown field, bad JSON, missing header         400     ``INVALID_INPUT``
``binding: 'instance'``                                400     ``UNSUPPORTED``
bearer token missing or not valid                      401     ``ACCESS_DENIED``
spent budget                                           402     ``SPEND_LIMIT_REACHED``
tenant pre-check, policy refusal, refused key          403     ``ACCESS_DENIED``
delegated session waiting for a person                 403     ``CONFIRMATION_REQUIRED``
reservation, draft or pool not found; unknown route    404     ``NOT_FOUND``
method other than the route's (e.g. GET on create)     405     ``INVALID_INPUT`` (field
                                                               ``method``)
key reused with another request, extend in flight      409     ``CONFLICT``
operation not allowed in the reservation's state       409     ``INVALID_STATE``
body over ``max_body_bytes``                           413     ``INVALID_INPUT`` (field
                                                               ``body``)
quota short                                            429     ``QUOTA_EXCEEDED``
unexpected server error (logged with the request id)   500     ``INTERNAL``
no capacity (reservation failed for it)                503     ``CAPACITY_UNAVAILABLE``
the database cannot be reached                         503     ``UNAVAILABLE``
=====================================================  ======  =========================

The mapping of the guide's codes lives in ``api.errors.STATUS``. What this module must never
do: speak SQL, decide policy, or answer bad input with a 500 or a traceback.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from bettercompute.api import errors, metrics, openapi, operations
from bettercompute.core import ids, ports
from bettercompute.core.errors import ComputeError
from bettercompute.iam.identities import CachingAuthenticator
from bettercompute.service.reservations import ReservationService
from bettercompute.store.database import StoreError

log = logging.getLogger(__name__)

CSRF_HEADER = "X-Better-Compute"
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Ready = Callable[[], Awaitable[bool]]

SERVICE = web.AppKey("service", ReservationService)
AUTHENTICATOR = web.AppKey("authenticator", CachingAuthenticator)
METRICS = web.AppKey("metrics", metrics.Metrics)
READY: web.AppKey[Ready] = web.AppKey("ready")
MAX_BODY = web.AppKey("max_body_bytes", int)
DOCUMENT = web.AppKey("openapi", bytes)

# Set by an operation handler for the pipeline's metrics: the outcome of a successful call.
_OUTCOME_KEY = web.RequestKey("outcome", str)


async def _always_ready() -> bool:
    return True


def make_app(
    *,
    service: ReservationService,
    authenticator: ports.Authenticator,
    ready: Ready | None = None,
    max_body_bytes: int = 1_048_576,
) -> web.Application:
    """The API for ``service``. Credentials are checked by ``authenticator`` and cached for
    30 seconds (the guide); ``ready`` is awaited by ``/readyz`` (default: always ready); a body
    over ``max_body_bytes`` is refused with 413 before it is read whole."""
    app = web.Application(middlewares=[_pipeline], client_max_size=max_body_bytes)
    app[SERVICE] = service
    app[AUTHENTICATOR] = CachingAuthenticator(authenticator, ttl_seconds=30)
    app[METRICS] = metrics.Metrics()
    service.add_observer(app[METRICS])
    app[READY] = ready or _always_ready
    app[MAX_BODY] = max_body_bytes
    app[DOCUMENT] = json.dumps(openapi.document()).encode()
    for op in operations.OPERATIONS:
        app.router.add_post(op.path, _handler(op), name=op.name)
    app.router.add_get(f"{operations.PREFIX}/openapi.json", _openapi)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    return app


# --- operations ------------------------------------------------------------------------------


def _handler(op: operations.Operation) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        _check_csrf_header(request)
        caller = await _authenticate(request)
        body = await _json_body(request)
        serve: Callable[[ports.Caller, Any], Awaitable[dict[str, Any]]]
        serve = getattr(request.app[SERVICE], op.method)
        data = await serve(caller, body)
        request[_OUTCOME_KEY] = operations.outcome(op, data)
        return web.json_response({"data": data}, dumps=json.dumps)

    return handle


def _check_csrf_header(request: web.Request) -> None:
    if request.headers.get(CSRF_HEADER) != "1":
        raise errors.invalid_input(
            CSRF_HEADER, f"every call must carry the header '{CSRF_HEADER}: 1'"
        )


async def _authenticate(request: web.Request) -> ports.Caller:
    header = request.headers.get("Authorization", "").strip()
    if not header:
        raise errors.unauthenticated(
            "the bearer token is missing: send 'Authorization: Bearer <token>'"
        )
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise errors.unauthenticated(
            "the Authorization header is not a bearer token: send 'Authorization: Bearer <token>'"
        )
    caller = await request.app[AUTHENTICATOR].authenticate(token)
    if caller is None:
        raise errors.unauthenticated("the bearer token is not valid")
    return caller


async def _json_body(request: web.Request) -> Any:
    limit = request.app[MAX_BODY]
    if request.content_length is not None and request.content_length > limit:
        raise errors.too_large(limit)
    raw = await request.read()  # aiohttp enforces the limit on bodies of unannounced length
    if not raw.strip():
        raise errors.invalid_input("body", "the body is empty: send a JSON object")
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise errors.invalid_input("body", "not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, too many digits, NaN
        raise errors.invalid_input("body", f"not valid JSON: {e}") from None


def _no_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity, which JSON itself does not have.
    raise ValueError(f"{name} is not a JSON value")


# --- plain routes ----------------------------------------------------------------------------


async def _openapi(request: web.Request) -> web.StreamResponse:
    return web.Response(body=request.app[DOCUMENT], content_type="application/json")


async def _healthz(request: web.Request) -> web.StreamResponse:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.StreamResponse:
    try:
        ready = await request.app[READY]()
    except Exception:
        # The check is the caller's code: whatever it raises means "not ready", never a 500.
        log.exception("the readiness check failed")
        ready = False
    if ready:
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "not ready"}, status=503)


async def _metrics(request: web.Request) -> web.StreamResponse:
    figures = request.app[METRICS]
    try:
        counts = await request.app[SERVICE].counts()
    except StoreError:
        log.warning("metrics: cannot read counts from the database", exc_info=True)
        figures.database_down()
    else:
        figures.update(
            reservations=counts.reservations, queued=counts.work_queued, due=counts.work_due
        )
    return web.Response(body=figures.render(), headers={"Content-Type": metrics.CONTENT_TYPE})


# --- the pipeline ----------------------------------------------------------------------------


@web.middleware
async def _pipeline(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request id, every error in our envelope, and the metrics of every request."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    request_id = given if _REQUEST_ID.fullmatch(given) else ids.new_id("req")
    started = time.perf_counter()
    outcome = "ok"
    try:
        response = await handler(request)
        outcome = request.get(_OUTCOME_KEY, "ok")
    except errors.Refusal as e:
        response, outcome = e.response(), e.code
    except ComputeError as e:
        response, outcome = errors.from_compute_error(e), e.code.value
    except web.HTTPException as e:
        response = errors.from_http_exception(e, max_body_bytes=request.app[MAX_BODY])
        outcome = "HTTP_" + str(e.status)
    except StoreError:
        log.warning("request %s: the database is unavailable", request_id, exc_info=True)
        response, outcome = _unavailable(request_id), errors.UNAVAILABLE
    except Exception:
        # Logged with the id the caller is given, so a report can be matched to its traceback.
        log.exception(
            "request %s: unexpected error in %s %s", request_id, request.method, request.path
        )
        response, outcome = _internal(request_id), errors.INTERNAL
    response.headers[REQUEST_ID_HEADER] = request_id
    route = request.match_info.route
    resource = route.resource
    request.app[METRICS].observe(
        route=resource.canonical if resource is not None else metrics.UNMATCHED,
        operation=route.name if route.name in operations.BY_NAME else None,
        outcome=outcome,
        seconds=time.perf_counter() - started,
    )
    return response


def _internal(request_id: str) -> web.Response:
    return errors.answer(
        status=500,
        code=errors.INTERNAL,
        message=f"internal error; quote request id {request_id} when reporting it",
        details={"requestId": request_id},
    )


def _unavailable(request_id: str) -> web.Response:
    return errors.answer(
        status=503,
        code=errors.UNAVAILABLE,
        message="the database is unavailable; retry shortly",
        details={"requestId": request_id, "retryAfterSeconds": 5},
        headers={"Retry-After": "5"},
    )
