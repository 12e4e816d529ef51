"""The metrics port: a small aiohttp application that serves ``GET /metrics`` and nothing else.

Why it exists: the figures on ``/metrics`` name every tenant (``bettercompute_quota_used`` and
``_limit{tenant}``, ``bettercompute_billed_gpu_seconds_total{pool, tenant}``), and the HTTP API's
port is the one every tenant can reach. Served there, any tenant could read every other
tenant's quota use and spending. So the composition roots (the operator, ``better-compute
dev``) serve the API app (``api.app``) on one port and this app on another (9464 by default),
and the Helm chart exposes the second only through a metrics Service for Prometheus, which a
NetworkPolicy (``networkPolicy.metricsFrom``) can open to the monitoring namespace alone.

``make_metrics_app(api)`` renders the registry of the API app ``api`` (its request counters and
latencies, the service's decision and placement timings, the webhook certificate's expiry the
operator tells it) together with the database's figures, read through ``metrics.CachedCounts``
(at most once every ``max_age_seconds``, however often it is scraped). With ``token`` every
scrape must carry ``Authorization: Bearer <token>`` (``BETTER_COMPUTE_METRICS_TOKEN``,
``serving.metrics_token_from_env``); otherwise it answers ``401 ACCESS_DENIED``. It is served
with ``serving.Runner``, as the API is, so a slow or greedy client is bounded the same way.

What it must never do: serve an API route (operations, events, the OpenAPI document) or be
mounted on the API's port; accept a tenant's bearer token in place of the metrics token; read
the database itself, or more often than ``CachedCounts`` allows; or answer an error as anything
but the API's JSON envelope.
"""

from __future__ import annotations

import hmac
import logging

from aiohttp import web

from bettercompute.api import app as api_app
from bettercompute.api import errors, metrics
from bettercompute.core.errors import StoreError

log = logging.getLogger(__name__)

#: The port the operator and ``better-compute dev`` serve metrics on unless told otherwise.
DEFAULT_PORT = 9464
#: The path Prometheus scrapes.
PATH = "/metrics"
#: A scrape is a GET: a body is refused once it passes this many bytes.
MAX_BODY_BYTES = 1024

FIGURES = web.AppKey("figures", metrics.Metrics)
COUNTS = web.AppKey("counts", metrics.CachedCounts)
TOKEN: web.AppKey[str | None] = web.AppKey("metrics_token")


def make_metrics_app(
    api: web.Application, *, token: str | None = None, max_age_seconds: float = 5.0
) -> web.Application:
    """The metrics of the API application ``api`` (made by ``api.app.make_app``), on an app of
    their own. ``token``: the bearer token every scrape must carry (``None`` or empty: none).
    The database's figures are read at most once every ``max_age_seconds``."""
    app = web.Application(middlewares=[_envelope], client_max_size=MAX_BODY_BYTES)
    app[FIGURES] = api[api_app.METRICS]
    app[COUNTS] = metrics.CachedCounts(api[api_app.SERVICE].counts, max_age_seconds=max_age_seconds)
    app[TOKEN] = token or None
    app.on_startup.append(_start_counts)
    app.router.add_get(PATH, _metrics)
    return app


async def _start_counts(app: web.Application) -> None:
    # Where the events stand at start: the waits that end before the first scrape are counted.
    try:
        await app[COUNTS].start()
    except StoreError as e:
        log.warning("metrics: cannot read counts at start (the first scrape will): %s", e)


async def _metrics(request: web.Request) -> web.StreamResponse:
    _check_token(request)
    figures = request.app[FIGURES]
    try:
        counts = await request.app[COUNTS].read()
    except StoreError as e:
        log.warning("metrics: cannot read counts from the database: %s", e)
        figures.database_down()
    else:
        figures.update(counts)
    return web.Response(body=figures.render(), headers={"Content-Type": metrics.CONTENT_TYPE})


def _check_token(request: web.Request) -> None:
    expected = request.app[TOKEN]
    if expected is None:
        return
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    # Compared in constant time, as bytes: a str compare_digest refuses non-ASCII input.
    given = token.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given, expected.encode()):
        raise errors.unauthenticated(
            "/metrics needs 'Authorization: Bearer <token>' with the metrics token"
        )


@web.middleware
async def _envelope(request: web.Request, handler: api_app.Handler) -> web.StreamResponse:
    """Every refusal (bad token, unknown path, wrong method) in the API's error envelope."""
    try:
        response = await handler(request)
    except errors.Refusal as e:
        response = e.response()
    except web.HTTPException as e:
        response = errors.from_http_exception(e, max_body_bytes=MAX_BODY_BYTES)
    response.headers["Server"] = errors.SERVER
    return response
