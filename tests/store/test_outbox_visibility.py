"""The outbox's readers never move past an event whose transaction may still commit.

Two real connections besides the pool: transaction A inserts an outbox event and stays open,
transaction B inserts a later one and commits. While A is open no reader sees either (B's id is
past A's); once A commits each reader gets both, in id order, and nothing is skipped. Checked
for the webhook fan-out's cursor (``store.subscriptions.fan_out``), the event stream's reader
(``ReservationService.watch_events``, what ``GET /api/compute/events/watch`` sends) and the
in-process subscribers' reader (``store.outbox.events_after``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from bettercompute.service.reservations import ReservationService
from bettercompute.store import outbox, subscriptions
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.support.world import World

SUBSCRIBER = "visibility-test"


@pytest.fixture
async def rid(db: Database, service: ReservationService) -> str:
    """A placed reservation of acme's (its own events already written and committed)."""
    await (
        World(db)
        .tenant("acme")
        .tenant("root", root=True)
        .pool("pool_a", owner="acme")
        .nodes("pool_a", 1)
        .quota("acme", "gpu:H100", 8)
        .build()
    )
    view = await service.create(
        caller(),
        {
            "tenantId": "acme",
            "poolId": "pool_a",
            "devices": [{"class": "gpu", "count": 1}],
            "duration": "1h",
            "idempotencyKey": "k1",
        },
    )
    return str(view["id"])


@contextlib.asynccontextmanager
async def connection(pg_dsn: str) -> AsyncIterator[psycopg.AsyncConnection[dict[str, Any]]]:
    conn = await psycopg.AsyncConnection.connect(pg_dsn, row_factory=dict_row)
    try:
        yield conn
    finally:
        await conn.close()


async def emit(conn: psycopg.AsyncConnection[dict[str, Any]], rid: str, n: int) -> int:
    """Insert an outbox event about ``rid`` in ``conn``'s open transaction; its id."""
    row = await (
        await conn.execute(
            "INSERT INTO outbox (type, subject, data) VALUES (%s, %s, %s) RETURNING id",
            ("reservation.extended", f"reservation/{rid}", json.dumps({"n": n})),
        )
    ).fetchone()
    assert row is not None
    return int(row["id"])


@contextlib.asynccontextmanager
async def a_open_b_committed(pg_dsn: str, rid: str) -> AsyncIterator[tuple[int, int, Any]]:
    """A's event inserted and A open, B's (later id) committed; yields (a, b, commit A)."""
    async with connection(pg_dsn) as a, connection(pg_dsn) as b:
        a_id = await emit(a, rid, 1)
        b_id = await emit(b, rid, 2)
        await b.commit()
        assert a_id < b_id
        yield a_id, b_id, a.commit
        await a.rollback()  # a no-op once committed; ends A if the test failed before


async def test_the_fan_out_waits_for_an_open_earlier_event_and_then_skips_nothing(
    db: Database, service: ReservationService, rid: str, pg_dsn: str
):
    made = await service.subscriptions_create(
        caller(), {"tenantId": "acme", "url": "http://127.0.0.1:9/hook"}
    )
    while await subscriptions.fan_out(db, subscriber=SUBSCRIBER):
        pass  # past what was committed before the test's events

    async def fanned() -> list[int]:
        log = await subscriptions.deliveries(db, subscription_id=made["id"], state=None, limit=100)
        return sorted(d["eventId"] for d in log)

    async with a_open_b_committed(pg_dsn, rid) as (a_id, b_id, commit_a):
        assert await subscriptions.fan_out(db, subscriber=SUBSCRIBER) == 0
        assert await fanned() == []
        assert await outbox.cursor(db, subscriber=SUBSCRIBER) < a_id
        await commit_a()
        assert await subscriptions.fan_out(db, subscriber=SUBSCRIBER) == 2
        assert await fanned() == [a_id, b_id]
        assert await outbox.cursor(db, subscriber=SUBSCRIBER) == b_id


async def test_the_event_stream_waits_for_an_open_earlier_event_and_then_skips_nothing(
    service: ReservationService, rid: str, pg_dsn: str
):
    stream = service.watch_events(caller(), tenant_id="acme", after=None, poll_s=0.01)
    try:
        assert await anext(stream) == []  # from now: nothing new
        async with a_open_b_committed(pg_dsn, rid) as (a_id, b_id, commit_a):
            for _ in range(5):  # several reads, each finding nothing past A
                assert await anext(stream) == []
            await commit_a()
            batch = await anext(stream)
            assert [e["id"] for e in batch] == [a_id, b_id]
            assert [e["data"]["n"] for e in batch] == [1, 2]
    finally:
        await stream.aclose()


async def test_a_watch_from_now_starts_below_an_open_event(
    service: ReservationService, rid: str, pg_dsn: str
):
    async with a_open_b_committed(pg_dsn, rid) as (a_id, b_id, commit_a):
        stream = service.watch_events(caller(), tenant_id="acme", after=None, poll_s=0.01)
        try:
            assert await anext(stream) == []
            await commit_a()
            batch = await anext(stream)
            assert [e["id"] for e in batch] == [a_id, b_id]
        finally:
            await stream.aclose()


async def test_the_in_process_reader_waits_for_an_open_earlier_event(
    db: Database, rid: str, pg_dsn: str
):
    start = await outbox.latest_id(db)
    async with a_open_b_committed(pg_dsn, rid) as (a_id, b_id, commit_a):
        assert await outbox.events_after(db, after_id=start) == []
        await commit_a()
        got = await outbox.events_after(db, after_id=start)
        assert [int(e["id"]) for e in got] == [a_id, b_id]


async def test_events_written_before_the_migration_are_settled(db: Database, rid: str):
    """Rows that predate migration 0012 carry xid 0: below every snapshot, so readable."""
    async with db.connection() as conn:
        await conn.execute("UPDATE outbox SET xid = '0'")
    got = await outbox.events_after(db, after_id=0)
    assert got
    assert [e["id"] for e in got] == sorted(e["id"] for e in got)
