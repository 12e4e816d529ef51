"""The CLI's HTTP calls to the reservations API, and the one way a command fails.

Why one module: every command sends ``POST /api/compute/<operation>`` with the same headers
(``Authorization: Bearer``, ``X-Better-Compute: 1``) and reads the same envelope (``{"data"}`` or
``{"error": {code, message, details}}``), and every way that can go wrong becomes a ``Failure``
with an exit code the user can script against.

Hierarchy::

    Failure                 message (+ code, details, hint from the server or from us)
      exit_code             from the one table both CLIs share (``core.exits``): the server's
                            code picks it (NOT_FOUND 4, QUOTA_EXCEEDED 5, CONFLICT 6, ...);
                            2 when the command line or config file is wrong (nothing was
                            sent), 3 when the server could not be reached or did not speak it

What this module must never do: retry a request on its own (a create is idempotent only with the
same key, which the command owns), print anything, or let an ``httpx`` exception escape.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
from httpx_sse import connect_sse

from bettercompute.core.exits import Exit, for_error_code

EXIT_USAGE = Exit.USAGE
EXIT_UNREACHABLE = Exit.UNREACHABLE

API_PREFIX = "/api/compute/"
USER_AGENT = "better-compute-cli/0.1"


class Failure(Exception):
    """A command that could not do what was asked, with the exit code that says why."""

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        details: dict[str, Any] | None = None,
        exit_code: int | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.details: dict[str, Any] = dict(details or {})
        # Unless the failure says otherwise, its code picks the exit (a code the table does not
        # know, or none, is 1: failed).
        self.exit_code = int(for_error_code(code)) if exit_code is None else exit_code
        self.hint = hint


class ApiClient:
    """One server, one credential; ``call`` answers the ``data`` of the envelope."""

    def __init__(self, *, url: str, token: str | None, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.has_token = bool(token)
        try:
            parsed = httpx.URL(self.url)
        except httpx.InvalidURL as e:
            raise _bad_url(url, str(e)) from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise _bad_url(url, "give an http:// or https:// address such as http://127.0.0.1:8080")
        headers = {"X-Better-Compute": "1", "User-Agent": USER_AGENT}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._timeout_s = timeout_s
        self._http = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(5.0, timeout_s)),
            follow_redirects=False,
        )

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def call(self, operation: str, body: dict[str, Any], *, timeout_s: float | None = None) -> Any:
        """POST ``body`` to ``operation`` (``reservations/create``) and answer its ``data``."""
        target = self.url + API_PREFIX + operation
        timeout = timeout_s or self._timeout_s
        try:
            response = self._http.post(
                target, json=body, timeout=httpx.Timeout(timeout, connect=5.0)
            )
        except httpx.TimeoutException as e:
            if isinstance(e, httpx.ConnectTimeout):
                raise self._unreachable("the connection timed out") from None
            raise Failure(
                f"the server at {self.url} did not answer within {timeout:g} s",
                exit_code=EXIT_UNREACHABLE,
                hint="retry the same command; a create with the same --key is safe to repeat",
            ) from None
        except httpx.ConnectError as e:
            raise self._unreachable(str(e) or "connection failed") from None
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as e:
            raise _bad_url(self.url, str(e)) from None
        except httpx.TransportError as e:
            raise Failure(
                f"lost the connection to the server at {self.url}: {e or type(e).__name__}",
                exit_code=EXIT_UNREACHABLE,
            ) from None
        return self._read(response)

    def server_version(self) -> str:
        """The server's version: ``info.version`` of its OpenAPI document, which every server
        serves without a credential and stamps with its installed version (no operation of
        the guide answers it)."""
        try:
            response = self._http.get(self.url + API_PREFIX + "openapi.json")
            document = response.json()
        except httpx.HTTPError as e:
            raise self._unreachable(str(e) or type(e).__name__) from None
        except ValueError:
            document = None
        info = document.get("info") if isinstance(document, dict) else None
        version = info.get("version") if isinstance(info, dict) else None
        if response.status_code != 200 or not isinstance(version, str):
            raise Failure(
                f"the server at {self.url} answered no OpenAPI document with a version",
                exit_code=EXIT_UNREACHABLE,
            )
        return version

    def events(self, tenant_id: str, *, after: int | None = None) -> Iterator[dict[str, Any]]:
        """The tenant's events as the server streams them (``GET events/watch``), forever;
        resumed after event ``after`` when given. A refusal is a ``Failure``, as for ``call``.

        The server ends a stream when it reaches its lifetime, after a message of no data whose
        id is where the stream stood: this reconnects at once with that ``Last-Event-ID``, so
        nothing is missed and nothing comes twice."""
        target = self.url + API_PREFIX + "events/watch"
        # No read timeout: a quiet stream is kept open by the server's comment pings.
        timeout = httpx.Timeout(None, connect=5.0)
        last = after
        try:
            while True:
                headers = {"Last-Event-ID": str(last)} if last is not None else {}
                pause_ms = 0
                with connect_sse(
                    self._http,
                    "GET",
                    target,
                    params={"tenantId": tenant_id},
                    headers=headers,
                    timeout=timeout,
                ) as source:
                    if source.response.status_code != 200:
                        source.response.read()
                        self._read(source.response)  # raises the refusal
                    for message in source.iter_sse():
                        if message.id and message.id.isascii() and message.id.isdigit():
                            last = int(message.id)
                        if message.retry is not None:
                            pause_ms = message.retry
                        if message.data:
                            yield json.loads(message.data)
                if last is None:
                    # Ended before it said where it stood: resuming "from now" could miss
                    # events, so say so instead.
                    raise httpx.RemoteProtocolError("the stream ended")
                time.sleep(min(pause_ms, 5000) / 1000)
        except httpx.ConnectError as e:
            raise self._unreachable(str(e) or "connection failed") from None
        except httpx.TransportError as e:
            raise Failure(
                f"lost the connection to the server at {self.url}: {e or type(e).__name__}",
                exit_code=EXIT_UNREACHABLE,
                hint="run it again with --after <the last id shown> to miss nothing",
            ) from None

    def _read(self, response: httpx.Response) -> Any:
        try:
            envelope = response.json()
        except ValueError:
            envelope = None
        if isinstance(envelope, dict):
            error = envelope.get("error")
            if isinstance(error, dict):
                raise self._refusal(error)
            if "data" in envelope:
                return envelope["data"]
        kind = response.headers.get("content-type", "no content type").split(";")[0]
        raise Failure(
            f"the server at {self.url} answered HTTP {response.status_code} ({kind}),"
            " which is not an answer of the Better Compute API",
            exit_code=EXIT_UNREACHABLE,
            hint="check --url (or $BETTER_COMPUTE_URL): it should be the server's base address",
        )

    def _refusal(self, error: dict[str, Any]) -> Failure:
        code = str(error.get("code") or "ERROR")
        details = error.get("details")
        hint = None
        if code == "ACCESS_DENIED" and not self.has_token:
            hint = (
                "no token was sent: pass --token, set $BETTER_COMPUTE_TOKEN,"
                " or put 'token:' in the config file"
            )
        return Failure(
            str(error.get("message") or "the server refused the request"),
            code=code,
            details=details if isinstance(details, dict) else {},
            hint=hint,
        )

    def _unreachable(self, reason: str) -> Failure:
        return Failure(
            f"cannot reach the Better Compute server at {self.url}: {reason}",
            exit_code=EXIT_UNREACHABLE,
            hint=(
                "is it running? Start one with `better-compute dev`,"
                " or point --url (or $BETTER_COMPUTE_URL) at it"
            ),
        )


def _bad_url(url: str, reason: str) -> Failure:
    return Failure(f"--url {url!r} is not a server address: {reason}", exit_code=EXIT_USAGE)
