"""A create's ``wait`` ends when its client goes away, and then reads nothing more.

The guide: the server re-reads the reservation "until the operation is no longer running,
``timeoutMs`` passes, or the request is aborted". aiohttp keeps a handler running after its
client disconnects, so without this an abandoned wait goes on reading the database for up to
30 s. The reads are counted with the connection pool's own statistics (each read takes a pooled
connection); the test's own look at the database goes through a connection of its own.
"""

from __future__ import annotations

import asyncio
import json
import time

import psycopg

from bettercompute.store.database import Database
from tests.api.conftest import POOL, Serve, create_body
from tests.support.world import World


async def lease_world(db: Database) -> None:
    await (
        World(db)
        .tenant("acme")
        .tenant("root", root=True)
        .pool(POOL, owner="acme", policy={"placer": "pool-lease"})
        .nodes(POOL, 2)
        .quota("acme", "gpu:H100", 16)
        .build()
    )


def reads(db: Database) -> int:
    return int(db.pool.get_stats().get("requests_num", 0))


async def committed(dsn: str, *, within_s: float = 10.0) -> None:
    """Until the create's transaction 2 committed (its reservation is pending, queued)."""
    give_up = time.monotonic() + within_s
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < give_up:
            row = await (
                await conn.execute("SELECT count(*) FROM reservations WHERE state = 'pending'")
            ).fetchone()
            if row is not None and row[0] == 1:
                return
            await asyncio.sleep(0.01)
    raise AssertionError("the create did not commit")


async def test_a_waiting_create_stops_reading_when_its_client_goes_away(
    db: Database, serve: Serve
) -> None:
    await lease_world(db)
    api = await serve()
    host, port = api.base.removeprefix("http://").split(":")
    body = json.dumps(create_body(wait={"timeoutMs": 20_000})).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /api/compute/reservations/create HTTP/1.1\r\n"
        + f"Host: {host}\r\n".encode()
        + b"Authorization: Bearer token-of-alice\r\nX-Better-Compute: 1\r\n"
        + b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    await committed(db.dsn)
    # Nothing places it (no placer runs): the wait backs off and reads, 50 ms, 100 ms, …
    before = reads(db)
    await asyncio.sleep(0.8)
    assert reads(db) > before, "the wait should be reading while its client is there"

    writer.close()
    await writer.wait_closed()
    await asyncio.sleep(0.3)  # noticed within CLIENT_CHECK_S; a read in flight may finish
    after_abort = reads(db)
    # Left alone, the wait would read at about 1.55 s and 2.55 s after its start, and on.
    await asyncio.sleep(2.5)
    assert reads(db) == after_abort
    assert not await reader.read()  # nothing was answered to a client that is gone
