"""The HTTP server's own defences (issue 10, finding 6), over raw sockets to the real server:
slow headers and bodies are cut off, idle connections closed, connections limited, aiohttp's
parser errors answered in our envelope without echoing the request, no versions in ``Server``,
client disconnects logged at INFO and counted as ``client_closed``, shutdown bounded, and a body
of too many members refused before it is parsed.

Short limits (fractions of a second) keep the tests fast; the defaults are checked once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from bettercompute.api import app as api_app
from bettercompute.api.app import make_app
from bettercompute.api.serving import HttpLimits, Runner
from bettercompute.core import requests
from bettercompute.iam import identities
from bettercompute.service.reservations import ReservationService
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database
from tests.api.conftest import TOKENS, Api, Serve, build_world, create_body
from tests.api.test_plain_routes import sample
from tests.support.policies import CountingPolicy

FAST = HttpLimits(header_timeout=0.4, body_timeout=0.4, keepalive_timeout=0.6)
GET = json.dumps({"tenantId": "acme", "reservationId": "rsv_x"}).encode()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict:
        assert self.headers["content-type"].startswith("application/json"), self.headers
        envelope = json.loads(self.body)
        assert set(envelope) == {"error"}
        assert set(envelope["error"]) == {"code", "message", "details"}
        return envelope["error"]


async def connect(api: Api) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    url = urlsplit(api.base)
    assert url.hostname is not None
    assert url.port is not None
    return await asyncio.open_connection(url.hostname, url.port)


def head(path: str = "/api/compute/reservations/get", *, length: int | None = None) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: test",
        "X-Better-Compute: 1",
        "Authorization: Bearer token-of-alice",
        "Content-Type: application/json",
    ]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def read_answer(reader: asyncio.StreamReader, *, within: float = 5.0) -> Answer:
    """One answer; the server must send it within ``within`` seconds."""
    async with asyncio.timeout(within):
        status_line = await reader.readline()
        assert status_line.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")), status_line
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Answer(int(status_line.split()[1]), headers, body)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the server closes the connection within ``seconds`` (all it sends is read)."""
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


async def operation_count(api: Api, operation: str, outcome: str) -> float:
    text = (await api.metrics.get("/metrics")).text
    return (
        sample(text, "bettercompute_api_operations_total", operation=operation, outcome=outcome)
        or 0
    )


# --- slow and idle clients ---------------------------------------------------------------------


async def test_headers_sent_byte_by_byte_are_cut_off(db: Database, serve: Serve):
    api = await serve(limits=FAST)
    reader, writer = await connect(api)
    started = time.monotonic()
    answer: Answer | None = None

    async def trickle() -> None:
        for byte in head(length=len(GET)):
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.05)

    sending = asyncio.create_task(trickle())
    try:
        answer = await read_answer(reader, within=3)
    finally:
        sending.cancel()
        writer.close()
    assert time.monotonic() - started < 2
    assert answer.status == 408
    assert answer.error()["details"]["field"] == "request"
    assert answer.headers["connection"] == "close"


async def test_a_body_sent_byte_by_byte_is_cut_off(db: Database, serve: Serve):
    await build_world(db)
    api = await serve(limits=FAST)
    reader, writer = await connect(api)
    writer.write(head(length=len(GET)))
    started = time.monotonic()

    async def trickle() -> None:
        for byte in GET:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.05)

    sending = asyncio.create_task(trickle())
    try:
        answer = await read_answer(reader, within=3)
        assert await closed_within(reader, 2)
    finally:
        sending.cancel()
        writer.close()
    assert time.monotonic() - started < 2
    assert answer.status == 408
    error = answer.error()
    assert (error["code"], error["details"]["field"]) == ("INVALID_INPUT", "body")
    assert await operation_count(api, "reservations.get", "HTTP_408") == 1


async def test_idle_connections_are_closed(db: Database, serve: Serve):
    await build_world(db)
    api = await serve(limits=FAST)
    silent_reader, silent = await connect(api)  # never sends a byte
    reader, writer = await connect(api)
    writer.write(head(length=len(GET)) + GET)
    answer = await read_answer(reader)
    assert answer.status == 404  # served, then kept alive ...
    try:
        # ... until idle for keepalive_timeout.
        assert await closed_within(reader, 2)
        assert await closed_within(silent_reader, 2)
    finally:
        writer.close()
        silent.close()


async def test_connections_over_the_limit_are_answered_503_and_closed(db: Database, serve: Serve):
    api = await serve(limits=HttpLimits(max_connections=3))
    held = [await connect(api) for _ in range(3)]
    try:
        reader, writer = await connect(api)
        answer = await read_answer(reader)
        writer.close()
        assert answer.status == 503
        assert answer.headers["retry-after"] == "1"
        assert answer.error()["code"] == "UNAVAILABLE"
        # One goes away: a new connection is served again.
        held.pop()[1].close()
        for _ in range(50):
            reader, writer = await connect(api)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
            answer = await read_answer(reader)
            writer.close()
            if answer.status == 200:
                break
            await asyncio.sleep(0.02)
        assert answer.status == 200
    finally:
        for _, w in held:
            w.close()


# --- aiohttp's own answers ---------------------------------------------------------------------

SECRET = "s3cret-token-value"


@pytest.mark.parametrize(
    ("request_bytes", "words"),
    [
        (
            f"GET /healthz HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {SECRET}\x00x\r\n\r\n",
            "header",
        ),
        (f"GET /healthz?{SECRET} HTTP/9.9\r\nHost: t\r\n\r\n", "request line"),
        (f"G{SECRET}\x01T / HTTP/1.1\r\nHost: t\r\n\r\n", "method"),
        (f"GET / HTTP/1.1\r\nHost: t\r\nX-Long: {SECRET}{'a' * 9000}\r\n\r\n", "too long"),
        (f"GET / HTTP/1.1\r\nHost: t\r\nBad Name{SECRET}: v\r\n\r\n", "header"),
        (
            "POST /api/compute/reservations/get HTTP/1.1\r\nHost: t\r\n"
            f"Transfer-Encoding: chunked\r\n\r\nzz{SECRET}\r\n",
            "",
        ),
    ],
    ids=["nul-in-header", "bad-version", "bad-method", "long-header", "bad-name", "bad-chunk"],
)
async def test_protocol_errors_are_in_the_envelope_and_never_echo_the_request(
    api: Api, caplog: pytest.LogCaptureFixture, request_bytes: str, words: str
):
    reader, writer = await connect(api)
    with caplog.at_level(logging.DEBUG):
        writer.write(request_bytes.encode("latin-1"))
        answer = await read_answer(reader)
        writer.close()
    assert answer.status == 400
    error = answer.error()
    assert error["code"] == "INVALID_INPUT"
    assert words in error["message"]
    assert SECRET.encode() not in answer.body
    assert answer.headers["server"] == "better-compute"
    assert not [r for r in caplog.records if SECRET in r.getMessage() or r.exc_info]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_the_server_header_names_no_versions(api: Api):
    for response in (
        await api.client.get("/healthz"),
        await api.client.get("/no/such/route"),
        await api.client.get("/api/compute/reservations/create"),
        await api.call("reservations/get", {"tenantId": "acme", "reservationId": "rsv_x"}),
    ):
        assert response.headers["Server"] == "better-compute", response.headers


# --- client disconnects ------------------------------------------------------------------------


async def test_a_client_that_goes_away_mid_body_is_logged_at_info_and_counted_apart(
    api: Api, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.DEBUG):
        _reader, writer = await connect(api)
        writer.write(head(length=len(GET)) + GET[:5])
        await writer.drain()
        await asyncio.sleep(0.1)  # the handler is reading the body
        writer.close()
        for _ in range(100):
            if await operation_count(api, "reservations.get", "client_closed"):
                break
            await asyncio.sleep(0.02)
    assert await operation_count(api, "reservations.get", "client_closed") == 1
    assert await operation_count(api, "reservations.get", "INTERNAL") == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("closed the connection" in r.getMessage() for r in caplog.records)


# --- shutdown ----------------------------------------------------------------------------------


@pytest.fixture
async def own_runner(db: Database) -> AsyncIterator[tuple[Runner, str]]:
    """A server this test stops itself (the ``serve`` fixture stops its own at teardown)."""
    service = ReservationService(
        db=db, policy=CountingPolicy(), budget=DatabaseBudget(db), root_tenant_id="root"
    )
    app = make_app(service=service, authenticator=identities.StaticTokenAuthenticator(TOKENS))
    runner = Runner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield runner, f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_shutdown_is_bounded_while_a_client_holds_a_half_sent_body(
    own_runner: tuple[Runner, str],
):
    runner, base = own_runner
    url = urlsplit(base)
    assert url.hostname is not None
    assert url.port is not None
    _reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(head(length=len(GET)) + GET[:5])
    await writer.drain()
    await asyncio.sleep(0.1)
    started = time.monotonic()
    try:
        async with asyncio.timeout(5):
            await runner.cleanup()
    finally:
        writer.close()
    # shutdown_timeout (2 s) for the handler to finish, then it is cancelled.
    assert time.monotonic() - started < 3


def test_the_default_limits_are_the_documented_ones():
    assert HttpLimits() == HttpLimits(
        header_timeout=5.0,
        body_timeout=10.0,
        keepalive_timeout=15.0,
        max_connections=512,
        shutdown_timeout=1.0,
        max_connections_per_address=128,
        max_requests_per_address=64,
        max_requests_per_token=32,
        max_streams_per_address=32,
        max_streams_per_token=8,
        max_stream_seconds=900.0,
    )


def test_the_limits_are_read_from_the_environment():
    limits = HttpLimits.from_environ(
        {"BCD_HTTP_MAX_STREAMS_PER_TOKEN": "16", "BCD_HTTP_MAX_STREAM_SECONDS": "60"}
    )
    assert (limits.max_streams_per_token, limits.max_stream_seconds) == (16, 60.0)
    assert (
        HttpLimits.from_environ({"BCD_HTTP_MAX_REQUESTS_PER_ADDRESS": "0"}).max_requests_per_address
        == 0
    )
    for variable, text in (
        ("BCD_HTTP_MAX_STREAMS_PER_TOKEN", "lots"),
        ("BCD_HTTP_HEADER_TIMEOUT", "0"),
    ):
        with pytest.raises(ValueError, match=variable):
            HttpLimits.from_environ({variable: text})


# --- JSON parsed on the event loop -------------------------------------------------------------


async def test_a_body_of_too_many_members_is_refused_before_it_is_parsed(api: Api):
    body = create_body()
    body.update({f"k{i:05d}": i for i in range(60_000)})
    raw = json.dumps(body).encode()
    assert len(raw) < 1_048_576  # under the size limit: only the member bound refuses it

    # What parsing and validating it costs on the loop (what the server did before).
    started = time.perf_counter()
    with pytest.raises(Exception, match="unknown field"):
        requests.parse(requests.CreateInput, json.loads(raw))
    parse_ms = (time.perf_counter() - started) * 1000

    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            lags.append(now - last)
            last = now

    ticking = asyncio.create_task(ticker())
    response = await api.call("reservations/create", content=raw)
    stop.set()
    await ticking
    print(
        f"\n1 MB body of 60,000 keys: parse+validate {parse_ms:.0f} ms on the loop before; "
        f"now refused, worst loop lag during the request {max(lags) * 1000:.1f} ms"
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["details"]["field"] == "body"
    assert "too many members" in error["message"]
    assert error["details"]["limit"] == api_app.MAX_MEMBERS
    assert await api.rows("reservations") == 0


async def test_a_valid_create_is_far_under_the_member_bound(api: Api):
    body = create_body(devices=[{"class": "gpu", "count": 1}] * 16)
    assert json.dumps(body).count(",") < api_app.MAX_MEMBERS / 10
