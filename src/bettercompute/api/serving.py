"""How the API is served: the one runner both composition roots (``dev``, the operator) use
for the API and for the metrics port (``api.metrics_server``).

Why it exists: aiohttp alone lets a client hold a connection for as long as it likes. Its
keep-alive timer closes a connection that stays idle, but nothing bounds a request whose
headers or body arrive a byte at a time, nothing bounds the number of connections, graceful
shutdown waits 60 s per connection, its parser errors are plain text that quote the request,
and its ``Server`` header names the Python and aiohttp versions. ``Runner`` is an
``AppRunner`` whose connections are ``_GuardedConnection``s, which add what is missing:

==========================  ========  ==========================================================
``HttpLimits`` field        default   what happens when it is reached
==========================  ========  ==========================================================
``header_timeout``          5 s       from a request's first byte to its last header: answered
                                      408 ``INVALID_INPUT`` (field ``request``), then closed
``body_timeout``            10 s      from the last header to the last body byte: the handler's
                                      read fails, answered 408 (field ``body``), then closed
``keepalive_timeout``       15 s      a connection idle this long (none sent yet, or between
                                      requests) is closed (aiohttp's own timer)
``max_connections``         512       a connection beyond it is answered 503 ``UNAVAILABLE``
                                      with ``Retry-After: 1`` and closed at once
``max_connections_per_      128       one remote address's connection beyond it: answered 429
address``                             ``TOO_MANY_REQUESTS``, ``Retry-After: 1``, and closed
``max_requests_per_         64        requests in flight from one address (``api.fairness``);
address``                             one more is answered 429 with ``Retry-After: 1``
``max_requests_per_token``  32        the same, by bearer token
``max_streams_per_address`` 32        ``events/watch`` streams open from one address; 429
``max_streams_per_token``   8         the same, by bearer token
``max_stream_seconds``      900 s     a stream this old ends cleanly: the client reconnects
                                      with ``Last-Event-ID`` and resumes where it was
``shutdown_timeout``        1 s       on stop, requests in flight get this long to finish, then
                                      are cancelled (and get as long again to unwind)
==========================  ========  ==========================================================

Each limit can be set from the environment, ``BCD_HTTP_`` and the field's name in capitals
(``BCD_HTTP_MAX_STREAMS_PER_TOKEN=16``; ``HttpLimits.from_environ``); 0 turns a per-client
cap off.

Usage (a drop-in for ``web.AppRunner(app, access_log=None)``)::

    runner = serving.Runner(app)            # or Runner(app, limits=HttpLimits(...))
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    ...
    await runner.cleanup()                  # bounded by shutdown_timeout

What it must never do: decide anything about a request's content (that is ``api.app``), echo
request bytes in an answer or a log, or log a client that went away as an error.

The guard reads three attributes aiohttp's ``RequestHandler`` keeps for itself (``_messages``,
the parsed requests waiting; ``_kwargs`` of its ``Server``; ``_loop``); aiohttp is pinned below
4 and ``tests/api/test_serving.py`` fails if they change meaning.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web, web_protocol
from aiohttp.streams import StreamReader
from aiohttp.web_request import BaseRequest

from bettercompute.api import errors, fairness

log = logging.getLogger(__name__)

#: The environment variable the composition roots read the ``/metrics`` bearer token from
#: (asked on the metrics port, ``api.metrics_server``).
METRICS_TOKEN_ENV = "BETTER_COMPUTE_METRICS_TOKEN"


def metrics_token_from_env() -> str | None:
    """The ``/metrics`` token from ``BETTER_COMPUTE_METRICS_TOKEN``; unset or empty: none."""
    return os.environ.get(METRICS_TOKEN_ENV, "").strip() or None


@dataclass(frozen=True)
class HttpLimits:
    """Timeouts (seconds) and limits of the HTTP server; see the module's table."""

    header_timeout: float = 5.0
    body_timeout: float = 10.0
    keepalive_timeout: float = 15.0
    max_connections: int = 512
    shutdown_timeout: float = 1.0
    # Each client's share (``api.fairness``): well under the whole, so that no one client,
    # nor a few, can hold every connection; 0 is no cap.
    max_connections_per_address: int = 128
    max_requests_per_address: int = 64
    max_requests_per_token: int = 32
    max_streams_per_address: int = 32
    max_streams_per_token: int = 8
    max_stream_seconds: float = 900.0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> HttpLimits:
        """The defaults, with each ``BCD_HTTP_<FIELD>`` that is set; ``ValueError`` naming the
        variable when its value is not a number of the field's kind."""
        values: dict[str, Any] = {}
        for item in dataclasses.fields(cls):
            variable = f"{ENV_PREFIX}{item.name.upper()}"
            text = (environ.get(variable) or "").strip()
            if not text:
                continue
            integral = item.type in (int, "int")
            try:
                value: float = int(text) if integral else float(text)
            except ValueError:
                value = float("nan")
            per_client = item.name.endswith(("_per_address", "_per_token"))
            if not (value >= 0 if per_client else value > 0) or value == float("inf"):
                kind = "a whole number" if integral else "a number of seconds"
                floor = "0 or more" if per_client else "above 0"
                raise ValueError(f"{variable} must be {kind}, {floor}, not {text!r}")
            values[item.name] = value
        return cls(**values)

    def client_shares(self) -> fairness.ClientShares:
        return fairness.ClientShares(
            requests_per_address=self.max_requests_per_address,
            requests_per_token=self.max_requests_per_token,
            streams_per_address=self.max_streams_per_address,
            streams_per_token=self.max_streams_per_token,
        )


#: The prefix of the environment variables ``HttpLimits.from_environ`` reads.
ENV_PREFIX = "BCD_HTTP_"
#: Where ``Runner`` puts what the app's pipeline needs of its limits.
SHARES = web.AppKey("client_shares", fairness.ClientShares)
STREAM_SECONDS = web.AppKey("max_stream_seconds", float)


def install(app: web.Application, limits: HttpLimits) -> None:
    """Give ``app``'s pipeline the per-client shares and stream lifetime of ``limits``
    (``make_app`` installs the defaults, ``Runner`` its own)."""
    app[SHARES] = limits.client_shares()
    app[STREAM_SECONDS] = limits.max_stream_seconds


async def listen(
    stack: contextlib.AsyncExitStack, app: web.Application, limits: HttpLimits, host: str, port: int
) -> int:
    """Serve ``app`` on ``host:port`` (0: a free port) until ``stack`` closes; the port bound.
    ``OSError`` when the address cannot be bound (each composition root words it its way)."""
    runner = Runner(app, limits=limits)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    await web.TCPSite(runner, host, port).start()
    return int(runner.addresses[0][1])


class Runner(web.AppRunner):
    """An ``AppRunner`` with ``limits`` applied to every connection and no access log."""

    def __init__(self, app: web.Application, *, limits: HttpLimits | None = None) -> None:
        self.limits = limits or HttpLimits()
        install(app, self.limits)
        super().__init__(
            app,
            access_log=None,
            keepalive_timeout=self.limits.keepalive_timeout,
            shutdown_timeout=self.limits.shutdown_timeout,
        )

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return _GuardedServer(plain, self.limits)


class _GuardedServer(web.Server):
    """aiohttp's ``Server`` (the protocol factory) making ``_GuardedConnection``s and counting
    the connections it admitted."""

    def __init__(self, plain: web.Server, limits: HttpLimits) -> None:
        super().__init__(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=asyncio.get_running_loop(),
            **plain._kwargs,
        )
        self.limits = limits
        self.open_connections = 0
        self.by_address = fairness.Shares(limits.max_connections_per_address)

    def __call__(self) -> web_protocol.RequestHandler:
        return _GuardedConnection(self, loop=self._loop, **self._kwargs)


class _GuardedConnection(web_protocol.RequestHandler):
    """One connection: aiohttp's handler plus the header and body timers, the connection limit,
    and parser errors in the error envelope."""

    def __init__(self, server: _GuardedServer, **kwargs: Any) -> None:
        super().__init__(server, **kwargs)
        self._server = server
        self._limits = server.limits
        self._admitted = False
        self._address = ""
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        # The body of the last request whose headers arrived: bytes that come while it is not
        # complete are body bytes, any others start the next request's head.
        self._body: StreamReader | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._server.open_connections >= self._limits.max_connections:
            log.info("over %d connections: refused one", self._limits.max_connections)
            assert isinstance(transport, asyncio.Transport)
            transport.write(
                errors.raw_answer(
                    status=503,
                    code=errors.UNAVAILABLE,
                    message="too many connections; retry shortly",
                    details={"retryAfterSeconds": 1},
                    headers={"Retry-After": "1"},
                )
            )
            transport.close()
            return
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not self._server.by_address.has_room(address):
            # This client's share, not the server, is full: it alone is told to wait.
            log.info(
                "over %d connections from one address: refused one",
                self._limits.max_connections_per_address,
            )
            assert isinstance(transport, asyncio.Transport)
            transport.write(
                errors.raw_answer(
                    status=429,
                    code=errors.TOO_MANY_REQUESTS,
                    message=(
                        f"too many connections from this address (at most "
                        f"{self._limits.max_connections_per_address}); retry shortly"
                    ),
                    details={
                        "limit": self._limits.max_connections_per_address,
                        "retryAfterSeconds": 1,
                    },
                    headers={"Retry-After": "1"},
                )
            )
            transport.close()
            return
        self._admitted = True
        self._address = address
        self._server.by_address.take(address)
        self._server.open_connections += 1
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._server.open_connections -= 1
        self._server.by_address.give_back(self._address)
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if data and self._header_timer is None and not self._in_body():
            self._header_timer = self._loop.call_later(
                self._limits.header_timeout, self._header_timed_out
            )
        waiting = len(self._messages)
        super().data_received(data)
        if len(self._messages) > waiting:
            # A whole head arrived: its body, if any, now has its own deadline.
            self._cancel_header_timer()
            self._body = self._messages[-1][1]
            if not self._body.is_eof():
                if self._body_timer is not None:
                    self._body_timer.cancel()
                self._body_timer = self._loop.call_later(
                    self._limits.body_timeout, self._body_timed_out, self._body
                )

    def _in_body(self) -> bool:
        return self._body is not None and not self._body.is_eof()

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport is None:
            return
        log.info("a request's headers did not arrive in %gs: closed", self._limits.header_timeout)
        self.transport.write(
            errors.raw_answer(
                status=408,
                code="INVALID_INPUT",
                message=(
                    f"request: the headers did not arrive within "
                    f"{self._limits.header_timeout:g} seconds"
                ),
                details={"field": "request", "timeoutSeconds": self._limits.header_timeout},
            )
        )
        self.force_close()

    def _body_timed_out(self, body: StreamReader) -> None:
        self._body_timer = None
        if body.is_eof() or self.transport is None:
            return
        log.info("a request's body did not arrive in %gs", self._limits.body_timeout)
        # The handler's read raises it (answered 408 by ``api.app``); nothing more is read.
        body.set_exception(errors.BodyTimeout(self._limits.body_timeout))
        self.close()

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_header_timer()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's parser errors (and anything escaping the app) in our envelope, logged
        without the exception's text: it quotes the request's bytes."""
        if status >= 500:
            log.error("unhandled error answering a request", exc_info=exc)
        else:
            log.info("refused a malformed request: %s", errors.protocol_reason(exc))
        if request.writer.output_size > 0:
            # Part of an answer is already out: the connection cannot carry another.
            raise ConnectionError("an answer was already started")
        return errors.protocol_error(exc, status=status)
