"""No client starves the rest: with an abusive client running, a normal client is served.

The attacks (issue 26): an unauthenticated client holding and re-opening connections left 3 of
159 normal requests served; one tenant's token holding 512 event streams left none. Here both
run against the real server (``api.serving.Runner`` on 127.0.0.1) from their own source
addresses on loopback (127.0.0.2 for the connection holder, 127.0.0.3-6 for the token's
streams, so the token's cap is what bounds them), while a normal client (127.0.0.1, another
token) opens a new connection for each request, as the CLI does. At least 95 % of its requests
must succeed within its usual latency, measured first without the abuse. The limits are
scaled down (a 128-connection server) so the test stays light; the shares are the same kind.

Also: a client over its share gets 429 with ``Retry-After`` while others do not, and a stream
reaching its lifetime ends with its position, from which the CLI's ``watch --events``
reconnects without missing an event.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from bettercompute.api import fairness
from bettercompute.api.serving import HttpLimits
from bettercompute.store.database import Database
from tests.api.conftest import Api, Serve, build_world, create_body

LIMITS = HttpLimits(
    max_connections=128,
    max_connections_per_address=16,
    max_requests_per_address=16,
    max_requests_per_token=8,
    max_streams_per_address=8,
    max_streams_per_token=4,
    # Short, so the connections the abuser holds end (408) and are counted while it runs.
    header_timeout=0.5,
)
WATCH = "/api/compute/events/watch"
ROOT = str(Path(__file__).resolve().parents[2])


@dataclass
class Abuse:
    held_connections: int = 0
    spans: list[tuple[float, float]] = field(default_factory=list)
    open_streams: int = 0
    refused: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


async def _hold_connection(host: str, port: int, source: str, abuse: Abuse) -> None:
    """Open a connection, send half a request head, keep it; when closed, open another.

    What the server did with it is read from its answer, not from how long it took: a refused
    connection is answered 429 (its share) or 503 (the server's) at once, if late on a loaded
    machine; a held one 408 when its header timer runs out. Each held one's span goes to
    ``abuse.spans``; the peak of them open at once is what the server held."""
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            await asyncio.sleep(0.05)
            continue
        opened = time.monotonic()
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        try:
            answer = await reader.read()
        except OSError:
            answer = b""
        finally:
            writer.close()
        if answer.startswith(b"HTTP/1.1 408"):  # held until its header timer ran out
            abuse.spans.append((opened, time.monotonic()))
        elif answer.startswith((b"HTTP/1.1 429", b"HTTP/1.1 503")):  # its share, or the server's
            abuse.refused += 1
        await asyncio.sleep(0.1)


def peak(spans: list[tuple[float, float]]) -> int:
    """The most spans open at one moment."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


async def _hold_stream(client: httpx.AsyncClient, token: str, abuse: Abuse) -> None:
    """Open an event stream with ``token`` and keep reading it; when refused or ended, again."""
    while True:
        try:
            async with client.stream(
                "GET",
                WATCH,
                params={"tenantId": "acme"},
                headers={"Authorization": f"Bearer {token}"},
            ) as response:
                if response.status_code != 200:
                    abuse.refused += 1
                    await response.aread()
                else:
                    abuse.open_streams += 1
                    try:
                        async for _ in response.aiter_bytes():
                            pass
                    finally:
                        abuse.open_streams -= 1
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def abusing(api: Api, *, connections: int, streams: int) -> AsyncIterator[Abuse]:
    """The abuse, in a process of its own (as an abuser is: its CPU is not the server's)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys, asyncio; from tests.api.test_fairness import _abuse; "
        "asyncio.run(_abuse(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))",
        api.base,
        str(connections),
        str(streams),
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    abuse = Abuse()
    assert process.stdout is not None
    async with asyncio.timeout(30):
        assert await process.stdout.readline() == b"started\n"
    await asyncio.sleep(1.5)  # the abuse takes hold before the normal client comes
    try:
        yield abuse
    finally:
        process.terminate()
        out, _ = await process.communicate()
        held, streams_open, refused = (int(x) for x in out.split()[-3:])
        abuse.held_connections, abuse.open_streams, abuse.refused = held, streams_open, refused


async def _abuse(base: str, connections: int, streams: int) -> None:
    """Runs in the abuser's process until SIGTERM; prints what it held and how often it was
    refused."""
    host, port = base.removeprefix("http://").split(":")
    abuse = Abuse()
    for _ in range(connections):
        abuse.tasks.append(
            asyncio.create_task(_hold_connection(host, int(port), "127.0.0.2", abuse))
        )
    # One client per source address (making a client reads the CA bundle: ~50 ms of CPU).
    clients = [
        httpx.AsyncClient(
            base_url=base,
            transport=httpx.AsyncHTTPTransport(
                local_address=f"127.0.0.{3 + i}", limits=httpx.Limits(max_connections=None)
            ),
            timeout=None,
        )
        for i in range(4)
    ]
    for i in range(streams):
        client = clients[i % len(clients)]
        abuse.tasks.append(asyncio.create_task(_hold_stream(client, "token-of-bob", abuse)))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("started", flush=True)
    peak_streams = 0
    while not stop.is_set():
        peak_streams = max(peak_streams, abuse.open_streams)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)
    print(peak(abuse.spans), peak_streams, abuse.refused, flush=True)
    os._exit(0)


async def normal_client(api: Api, *, requests: int, workers: int = 4) -> list[float | None]:
    """Latency of each request (``None`` when it failed), a new connection for each."""
    results: list[float | None] = []
    body = {"tenantId": "acme", "limit": 10}
    headers = {"X-Better-Compute": "1", "Authorization": "Bearer token-of-alice"}
    no_reuse = httpx.Limits(max_keepalive_connections=0)

    async def work(n: int) -> None:
        async with httpx.AsyncClient(base_url=api.base, limits=no_reuse, timeout=10) as client:
            for _ in range(n):
                started = time.perf_counter()
                try:
                    answer = await client.post(
                        "/api/compute/reservations/list", json=body, headers=headers
                    )
                    ok = answer.status_code == 200
                except httpx.HTTPError:
                    ok = False
                results.append(time.perf_counter() - started if ok else None)

    await asyncio.gather(*(work(requests // workers) for _ in range(workers)))
    return results


def _summary(latencies: list[float | None]) -> str:
    done = sorted(x for x in latencies if x is not None)
    if not done:
        return f"0/{len(latencies)} succeeded"
    p95 = done[min(len(done) - 1, int(len(done) * 0.95))]
    return (
        f"{len(done)}/{len(latencies)} succeeded, median {statistics.median(done) * 1000:.1f} ms,"
        f" p95 {p95 * 1000:.1f} ms"
    )


async def test_a_normal_client_is_served_while_another_holds_connections_and_streams(
    db: Database, serve: Serve
):
    await build_world(db)
    api = await serve(limits=LIMITS)
    baseline = await normal_client(api, requests=80)
    assert all(x is not None for x in baseline), _summary(baseline)
    usual = sorted(x for x in baseline if x is not None)
    # "Within its usual latency": five times its own p95 without the abuse, at least 250 ms (a
    # shared machine's noise), far below the seconds a starved request waits or fails in.
    bound = max(5 * usual[int(len(usual) * 0.95)], 0.25)
    async with abusing(api, connections=300, streams=100) as abuse:
        during = await normal_client(api, requests=80)
    # The abuser's peaks, as it reported them when it was stopped.
    held, streams = abuse.held_connections, abuse.open_streams
    within = [x for x in during if x is not None and x <= bound]
    print(
        f"\nwithout abuse: {_summary(baseline)}; with abuse: {_summary(during)}, "
        f"{len(within)}/{len(during)} within {bound * 1000:.0f} ms; the abuser held {held} "
        f"connections and {streams} streams, {abuse.refused} refused"
    )
    assert len(within) >= 0.95 * len(during), _summary(during)
    # The abuse was real, and bounded by its shares.
    assert abuse.refused > 0
    assert 0 < streams <= LIMITS.max_streams_per_token
    # The spans are the abuser's view: each begins before the server admitted it and ends
    # after the server closed it, so under load a few more than the share may overlap.
    assert 0 < held <= 2 * LIMITS.max_connections_per_address


async def test_a_client_over_its_share_gets_429_and_others_do_not(db: Database, serve: Serve):
    await build_world(db)
    api = await serve(limits=HttpLimits(max_streams_per_token=2, max_streams_per_address=0))
    bob = {"Authorization": "Bearer token-of-bob"}
    async with contextlib.AsyncExitStack() as held:
        for _ in range(2):
            response = await held.enter_async_context(
                api.client.stream("GET", WATCH, params={"tenantId": "acme"}, headers=bob)
            )
            assert response.status_code == 200
        refused = await api.client.get(WATCH, params={"tenantId": "acme"}, headers=bob)
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "TOO_MANY_REQUESTS"
        assert error["details"] == {"limit": 2, "by": "token", "retryAfterSeconds": 1}
        # Another token on the same address is not affected, nor are bob's plain requests.
        async with api.client.stream(
            "GET",
            WATCH,
            params={"tenantId": "acme"},
            headers={"Authorization": "Bearer token-of-alice"},
        ) as alice:
            assert alice.status_code == 200
        await api.ok("reservations/list", {"tenantId": "acme"}, who="bob")
    # Streams closed give their share back, once the server noticed (its next poll, < 1 s).
    async with asyncio.timeout(5):
        while True:
            async with api.client.stream(
                "GET", WATCH, params={"tenantId": "acme"}, headers=bob
            ) as again:
                if again.status_code == 200:
                    break
            await asyncio.sleep(0.1)


def test_shares_are_given_back_whatever_happens() -> None:
    shares = fairness.ClientShares(
        requests_per_address=1, requests_per_token=0, streams_per_address=0, streams_per_token=0
    )
    with shares.hold(address="a", token="t", stream=False):
        with pytest.raises(fairness.OverShare), shares.hold(address="a", token="u", stream=False):
            pass
        assert shares.requests[0].held == {"a": 1}
    assert shares.requests[0].held == {}
    assert shares.requests[1].held == {}
    with contextlib.suppress(RuntimeError), shares.hold(address="a", token="t", stream=True):
        raise RuntimeError
    assert shares.streams[0].held == {}


async def test_a_stream_ends_at_its_lifetime_and_the_cli_resumes_without_a_gap(
    db: Database, serve: Serve
):
    from bettercompute.cli.client import ApiClient

    await build_world(db)
    api = await serve(limits=HttpLimits(max_stream_seconds=1.0))
    seen: list[int] = []

    def watch() -> None:
        with ApiClient(url=api.base, token="token-of-alice") as client:
            for event in client.events("acme"):
                seen.append(int(event["id"]))
                if len(seen) == 3:
                    return

    # A stream ends by itself at its lifetime, saying where it stood.
    async with asyncio.timeout(5):
        ended = await api.client.get(
            WATCH, params={"tenantId": "acme"}, headers={"Authorization": "Bearer token-of-alice"}
        )
    assert ended.status_code == 200
    assert ended.text.endswith(f"id: {await api.service.latest_event_id()}\nretry: 500\n\n")

    watcher = asyncio.create_task(asyncio.to_thread(watch))
    await asyncio.sleep(0.5)
    # Three events, each in another stream's lifetime: between them the stream ends and the
    # client reconnects from the position the server gave it.
    made = await api.ok("reservations/create", create_body(idempotencyKey="life-1"))
    await asyncio.sleep(1.6)
    await api.ok("reservations/release", {"tenantId": "acme", "reservationId": made["id"]})
    await asyncio.sleep(1.6)
    await api.ok("reservations/create", create_body(idempotencyKey="life-2"))
    async with asyncio.timeout(10):
        await watcher
    assert seen == sorted(set(seen))
    assert len(seen) == 3
