"""How the API is served: the one runner both composition roots (``dev``, the operator) use.

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
``shutdown_timeout``        1 s       on stop, requests in flight get this long to finish, then
                                      are cancelled (and get as long again to unwind)
==========================  ========  ==========================================================

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
import logging
import os
from dataclasses import dataclass
from typing import Any

from aiohttp import web, web_protocol
from aiohttp.streams import StreamReader
from aiohttp.web_request import BaseRequest

from bettercompute.api import errors

log = logging.getLogger(__name__)

#: The environment variable the composition roots read the ``/metrics`` bearer token from.
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


class Runner(web.AppRunner):
    """An ``AppRunner`` with ``limits`` applied to every connection and no access log."""

    def __init__(self, app: web.Application, *, limits: HttpLimits | None = None) -> None:
        self.limits = limits or HttpLimits()
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
        self._admitted = True
        self._server.open_connections += 1
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._server.open_connections -= 1
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
