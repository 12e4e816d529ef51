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
* ``GET /api/compute/openapi.json``, ``GET /healthz``, ``GET /readyz``: no credential needed.
* ``GET /`` and ``/console/…``: the web console's files (``bettercompute.console``);
  ``POST /console/session`` and ``/console/session/delete``: its sign-in (``api.sessions``).

No ``/metrics`` here: this is the port tenants reach, and the metrics name every tenant.
``api.metrics_server`` serves this app's registry (``METRICS``) on a port of its own.

Every operation call must carry ``X-Better-Compute: 1`` (a browser cannot add it to a
cross-site request without a CORS preflight, which this API never grants) and
``Authorization: Bearer <token>``, or the web console's session cookie (``api.sessions``).
The body is read as JSON whatever its ``Content-Type`` says. Every answer carries
``X-Request-Id``: the caller's, when it is 1-128 characters of ``[A-Za-z0-9._:-]``, else a new
``req_…`` id.

Status of each error answer, ``{"error": {"code", "message", "details"}}``:

=====================================================  ======  =========================
When                                                   Status  ``code``
=====================================================  ======  =========================
bad or unknown field, bad JSON, missing header         400     ``INVALID_INPUT``
not valid HTTP (``api.serving``), too many members     400     ``INVALID_INPUT`` (field
                                                               ``request``/``body``)
``binding: 'instance'``                                400     ``UNSUPPORTED``
bearer token missing or not valid                      401     ``ACCESS_DENIED``
spent budget                                           402     ``SPEND_LIMIT_REACHED``
tenant pre-check, policy refusal, refused key          403     ``ACCESS_DENIED``
delegated session waiting for a person                 403     ``CONFIRMATION_REQUIRED``
quota short (Kubernetes' answer over a ResourceQuota)  403     ``QUOTA_EXCEEDED``
reservation, draft or pool not found; unknown route    404     ``NOT_FOUND``
method other than the route's (e.g. GET on create)     405     ``INVALID_INPUT`` (field
                                                               ``method``)
headers or body too slow (``api.serving``)             408     ``INVALID_INPUT``
key reused with another request, extend in flight      409     ``CONFLICT``
operation not allowed in the reservation's state       409     ``INVALID_STATE``
no capacity (the pool's state conflicts with it)       409     ``CAPACITY_UNAVAILABLE``
body over ``max_body_bytes``                           413     ``INVALID_INPUT`` (field
                                                               ``body``)
a client over its share (``api.fairness``)             429     ``TOO_MANY_REQUESTS``
unexpected server error (logged with the request id)   500     ``INTERNAL``
the database cannot be reached; too many connections   503     ``UNAVAILABLE``
=====================================================  ======  =========================

Only 429 and 503 ask a client to retry the same request, and both carry ``Retry-After``.

The mapping of the guide's codes lives in ``api.errors.STATUS``. What this module must never
do: speak SQL, decide policy, or answer bad input with a 500 or a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import http_exceptions, web
from aiohttp_sse import EventSourceResponse, sse_response

from bettercompute import console
from bettercompute.api import errors, fairness, metrics, openapi, operations, serving, sessions
from bettercompute.core import ids, ports
from bettercompute.core.errors import ComputeError, StoreError
from bettercompute.iam.identities import CachingAuthenticator
from bettercompute.service.reservations import ReservationService

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

#: A body with more commas than this is refused before it is parsed. Every member of an
#: object or array after the first needs one, so this bounds the keys and items the parser
#: and the validator handle on the event loop (a 1 MB body of 60,000 keys held the loop
#: ~100 ms); the largest valid input (a create with 16 devices) has about a hundred.
MAX_MEMBERS = 1000
#: ``/readyz`` and ``/healthz`` answer within a second, whatever the readiness check does.
READY_TIMEOUT_SECONDS = 0.9
#: The outcome metrics count a request under when its client went away before the answer.
CLIENT_CLOSED = "client_closed"

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
    30 seconds (the guide); ``ready`` is awaited by ``/readyz`` (default: always ready, and
    "not ready" when it takes longer than 0.9 s); a body over ``max_body_bytes`` is refused
    with 413 before it is read whole. Its requests are counted in ``app[METRICS]``, which
    ``api.metrics_server.make_metrics_app(app)`` serves on the metrics port."""
    app = web.Application(middlewares=[_pipeline], client_max_size=max_body_bytes)
    app[SERVICE] = service
    app[AUTHENTICATOR] = CachingAuthenticator(authenticator, ttl_seconds=30)
    app[METRICS] = metrics.Metrics()
    service.add_observer(app[METRICS])
    app[READY] = ready or _always_ready
    app[MAX_BODY] = max_body_bytes
    app[DOCUMENT] = json.dumps(openapi.document()).encode()
    # Each client's share of the server; ``serving.Runner`` puts its own limits in their place.
    serving.install(app, serving.HttpLimits())
    for op in operations.OPERATIONS:
        app.router.add_post(op.path, _handler(op), name=op.name)
    app.router.add_get(f"{operations.PREFIX}/openapi.json", _openapi)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get(f"{operations.PREFIX}/events/watch", _watch_events, name=WATCH)
    # The web console on the same origin: its pages at / and its sign-in cookie.
    console.install(app)
    sessions.install(app, authenticator=app[AUTHENTICATOR], whoami=lambda c: service.whoami(c, {}))
    return app


# --- operations ------------------------------------------------------------------------------


def _handler(op: operations.Operation) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        _check_csrf_header(request)
        caller = await _authenticate(request)
        body = await _json_body(request)
        if op.method == "create" and isinstance(body, dict) and body.get("wait") is not None:
            data: operations.Answer = await _create_waiting(request, caller, body)
        else:
            serve: Callable[[ports.Caller, Any], Awaitable[operations.Answer]]
            serve = getattr(request.app[SERVICE], op.method)
            data = await serve(caller, body)
        request[_OUTCOME_KEY] = operations.outcome(op, data)
        return web.json_response({"data": data}, dumps=json.dumps)

    return handle


#: How often a waiting create looks whether its client is still connected.
CLIENT_CHECK_S = 0.05


async def _create_waiting(
    request: web.Request, caller: ports.Caller, body: dict[str, Any]
) -> operations.Answer:
    """A create with ``wait``: the wait ends when the client goes away.

    Why: aiohttp keeps a handler running after its client disconnects (no handler
    cancellation), and an abandoned wait would go on reading the database for up to 30 s. The
    transport gives no callback on close, so it is looked at every ``CLIENT_CHECK_S``; the
    service then stops waiting and reads nothing more. Admission itself is not cut short: a
    create that reached the database completes, as a retry with the same key would find it.
    """
    aborted = asyncio.Event()

    async def watch() -> None:
        # Polled: the transport has no close callback to wait on.
        while True:
            if _gone(request):
                aborted.set()
                return
            await asyncio.sleep(CLIENT_CHECK_S)

    watcher = asyncio.create_task(watch(), name="create-wait-client")
    try:
        return await request.app[SERVICE].create(caller, body, aborted=aborted)
    finally:
        watcher.cancel()


def _check_csrf_header(request: web.Request) -> None:
    if request.headers.get(CSRF_HEADER) != "1":
        raise errors.invalid_input(
            CSRF_HEADER, f"every call must carry the header '{CSRF_HEADER}: 1'"
        )


async def _authenticate(request: web.Request) -> ports.Caller:
    return await sessions.authenticate(request, request.app[AUTHENTICATOR])


async def _json_body(request: web.Request) -> Any:
    limit = request.app[MAX_BODY]
    if request.content_length is not None and request.content_length > limit:
        raise errors.too_large(limit)
    raw = await request.read()  # aiohttp enforces the limit on bodies of unannounced length
    if not raw.strip():
        raise errors.invalid_input("body", "the body is empty: send a JSON object")
    # Counting is a memchr over the bytes (a fraction of a millisecond per MB); parsing in a
    # thread would not help, since the JSON parser holds the GIL all along.
    if raw.count(b",") >= MAX_MEMBERS:
        raise errors.invalid_input(
            "body", f"too many members: at most {MAX_MEMBERS} keys and items", limit=MAX_MEMBERS
        )
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise errors.invalid_input("body", "not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, too many digits, NaN
        raise errors.invalid_input("body", f"not valid JSON: {e}") from None


def _no_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity, which JSON itself does not have.
    raise ValueError(f"{name} is not a JSON value")


# --- events, as Server-Sent Events ------------------------------------------------------------

#: A comment line this often keeps proxies and our own idle timeout from closing a quiet stream.
EVENTS_PING_S = 15.0
#: The route name of the stream: counted as a stream, not a request (``api.fairness``).
WATCH = "events.watch"
#: How soon a client whose stream reached its lifetime should come back (SSE ``retry``).
RECONNECT_MS = 500


async def _watch_events(request: web.Request) -> web.StreamResponse:
    """``GET /api/compute/events/watch?tenantId=acme``: the tenant's events as they commit,
    one SSE message each (``id`` the event's id, ``event`` its type, ``data`` the JSON event),
    from ``Last-Event-ID`` (or ``?after=``) on, else from now. Refusals come before the stream,
    as the usual JSON error."""
    caller = await _authenticate(request)
    tenant_id = request.query.get("tenantId", "")
    if not tenant_id:
        raise errors.invalid_input("tenantId", "required: the tenant whose events to watch")
    after_text = request.headers.get("Last-Event-ID") or request.query.get("after")
    after: int | None = None
    if after_text is not None:
        field = "Last-Event-ID" if request.headers.get("Last-Event-ID") else "after"
        if not after_text.isascii() or not after_text.isdigit() or len(after_text) > 18:
            raise errors.invalid_input(field, "must be an event id (digits)")
        after = int(after_text)
    service = request.app[SERVICE]
    # The stream's position is always known (from now: the newest event's id), so that a
    # stream ended for its age can tell the client where to resume.
    position = after if after is not None else await service.latest_event_id()
    batches = service.watch_events(caller, tenant_id=tenant_id, after=position)
    lifetime = request.app[serving.STREAM_SECONDS]
    try:
        first = await anext(batches)  # the pre-check runs here, before anything is streamed
        ends = asyncio.get_running_loop().time() + lifetime
        stream: EventSourceResponse
        async with sse_response(request, ping_interval=EVENTS_PING_S) as stream:
            batch: list[dict[str, Any]] = first
            # A client gone is noticed at the next poll (the transport closes), not only when
            # a ping fails to write: a closed watch must stop reading the database at once.
            while stream.is_connected() and not _gone(request):
                for event in batch:
                    await stream.send(json.dumps(event), id=str(event["id"]), event=event["type"])
                    position = int(event["id"])
                if asyncio.get_running_loop().time() >= ends:
                    # No stream lives for ever (a client could hold its share for good): this
                    # one ends cleanly, with a message of no data that sets the client's last
                    # event id to where it stands, so its reconnect misses nothing.
                    await stream.write(f"id: {position}\nretry: {RECONNECT_MS}\n\n".encode())
                    break
                batch = await anext(batches)
    finally:
        await batches.aclose()
    return stream


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


# --- plain routes ----------------------------------------------------------------------------


async def _openapi(request: web.Request) -> web.StreamResponse:
    return web.Response(body=request.app[DOCUMENT], content_type="application/json")


async def _healthz(request: web.Request) -> web.StreamResponse:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.StreamResponse:
    try:
        async with asyncio.timeout(READY_TIMEOUT_SECONDS):
            ready = await request.app[READY]()
    except TimeoutError:
        log.warning("the readiness check took over %gs: not ready", READY_TIMEOUT_SECONDS)
        ready = False
    except Exception:
        # The check is the caller's code: whatever it raises means "not ready", never a 500.
        log.exception("the readiness check failed")
        ready = False
    if ready:
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "not ready"}, status=503)


# --- the pipeline ----------------------------------------------------------------------------


@web.middleware
async def _pipeline(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request id, every error in our envelope, and the metrics of every request."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    request_id = given if _REQUEST_ID.fullmatch(given) else ids.new_id("req")
    started = time.perf_counter()
    outcome = "ok"
    try:
        # This client's share (``api.fairness``): over it, this request alone is refused.
        with request.app[serving.SHARES].hold(
            address=request.remote or "",
            token=fairness.token_key(sessions.authorization(request)),
            stream=request.match_info.route.name == WATCH,
        ):
            response = await handler(request)
        outcome = request.get(_OUTCOME_KEY, "ok")
    except fairness.OverShare as e:
        log.info("request %s refused: %s", request_id, e)
        response, outcome = _over_share(e), errors.TOO_MANY_REQUESTS
    except errors.Refusal as e:
        response, outcome = e.response(), e.code
    except ComputeError as e:
        response, outcome = errors.from_compute_error(e), e.code.value
    except web.HTTPException as e:
        response = errors.from_http_exception(e, max_body_bytes=request.app[MAX_BODY])
        outcome = "HTTP_" + str(e.status)
    except errors.BodyTimeout as e:
        response, outcome = errors.body_timeout(e.seconds).response(), "HTTP_408"
        response.force_close()
    except http_exceptions.HttpProcessingError as e:
        # The body's framing broke while it was read (Content-Length, chunked encoding).
        response, outcome = errors.protocol_error(e), "HTTP_400"
    except ConnectionResetError:
        # aiohttp's ClientConnectionResetError too: the client went away mid-request. Nobody
        # is left to answer; the response below is never sent.
        log.info("request %s: the client closed the connection", request_id)
        response = errors.invalid_input("body", "the client closed the connection").response()
        outcome = CLIENT_CLOSED
    except asyncio.CancelledError:
        # aiohttp cancels a handler when the client goes away (handler_cancellation) or the
        # server stops; counted, never a 500, and the cancellation goes on.
        log.info("request %s: cancelled (client gone or server stopping)", request_id)
        _observe(request, started, CLIENT_CLOSED)
        raise
    except StoreError as e:
        # One line, no traceback: during an outage every request lands here, and the cause
        # is the database's, not this code's.
        log.warning("request %s: the database is unavailable: %s", request_id, e)
        response, outcome = _unavailable(request_id), errors.UNAVAILABLE
    except Exception:
        # Logged with the id the caller is given, so a report can be matched to its traceback.
        log.exception(
            "request %s: unexpected error in %s %s", request_id, request.method, request.path
        )
        response, outcome = _internal(request_id), errors.INTERNAL
    response.headers[REQUEST_ID_HEADER] = request_id
    response.headers["Server"] = errors.SERVER
    _observe(request, started, outcome)
    return response


def _observe(request: web.Request, started: float, outcome: str) -> None:
    route = request.match_info.route
    resource = route.resource
    request.app[METRICS].observe(
        route=resource.canonical if resource is not None else metrics.UNMATCHED,
        operation=route.name if route.name in operations.BY_NAME else None,
        outcome=outcome,
        seconds=time.perf_counter() - started,
    )


def _internal(request_id: str) -> web.Response:
    return errors.answer(
        status=500,
        code=errors.INTERNAL,
        message=f"internal error; quote request id {request_id} when reporting it",
        details={"requestId": request_id},
    )


def _over_share(over: fairness.OverShare) -> web.Response:
    return errors.answer(
        status=429,
        code=errors.TOO_MANY_REQUESTS,
        message=f"{over}; retry shortly",
        details={"limit": over.limit, "by": over.by, "retryAfterSeconds": 1},
        headers={"Retry-After": "1"},
    )


def _unavailable(request_id: str) -> web.Response:
    return errors.answer(
        status=503,
        code=errors.UNAVAILABLE,
        message="the database is unavailable; retry shortly",
        details={"requestId": request_id, "retryAfterSeconds": 5},
        headers={"Retry-After": "5"},
    )
