"""The figures ``/metrics`` reads from the database tell the truth: the waits that end before
the first scrape are counted, and the reconciler's and the outbox's lag are what the tables say.

Against the real PostgreSQL of the test session, through ``ReservationService.counts`` and the
API's ``CachedCounts`` as the app wires them.
"""

from __future__ import annotations

from bettercompute.api.metrics import CachedCounts
from bettercompute.service.reservations import ReservationService
from bettercompute.store import outbox, stats
from bettercompute.store.database import Database
from tests.store.test_lifecycle import activate, advance, create, world


async def test_a_wait_that_ends_before_the_first_scrape_is_counted(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    counts = CachedCounts(service.counts, max_age_seconds=0)
    await counts.start()  # the app's start
    view = await create(service, "early")
    await activate(service, db, view["id"])
    first = await counts.read()  # the first scrape
    assert {w.phase for w in first.waits} == {"placed", "active"}
    assert (await counts.read()).waits == []  # and each only once


async def test_the_work_queue_lag_is_per_lane(db: Database, service: ReservationService) -> None:
    await world(db, nodes=1, gpus=8)
    big = await create(service, "big", count=8, duration="8h")
    waiting = await create(service, "waiting", count=4)
    assert waiting["state"] == "pending"
    quiet = await stats.read(db)
    # The big one's start is due now (lifecycle); the retry in 30 s.
    assert quiet.work_lag["retry"] == 0
    await advance(db, 90)
    late = await stats.read(db)
    assert 85 <= late.work_lag["lifecycle"] <= 100, late.work_lag  # its start, 90 s ago
    assert 55 <= late.work_lag["retry"] <= 70, late.work_lag  # the retry, due 60 s ago
    assert big["state"] == "placed"


async def test_the_outbox_lag_is_the_oldest_unhandled_event(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    await outbox.cursor(db, subscriber="watcher")
    await create(service, "one")
    await advance(db, 120)
    behind = await stats.read(db)
    assert 115 <= behind.outbox_lag["watcher"] <= 130, behind.outbox_lag
    await outbox.save_cursor(db, subscriber="watcher", last_id=await outbox.latest_id(db))
    assert (await stats.read(db)).outbox_lag["watcher"] == 0
