"""Group commit of inline creates: concurrent transaction 2s of one pool share one database
transaction, and each create still meets exactly its own outcome — placed on devices no other
create of the group holds, pending when the pool is full, refused for quota without undoing
anyone else's admission, and a preemption that sees the group's bookings before it; and on a
pool-lease pool, the queueing of concurrent creates shares one commit the same way. Real
PostgreSQL, through ReservationService.

Whether creates really shared a transaction is read from the database itself: rows one
transaction wrote carry the same ``xmin``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bettercompute.core.errors import ComputeError
from bettercompute.service.reservations import ReservationService
from bettercompute.store.database import Database
from tests.store.test_lifecycle import create, get, quota_used, world
from tests.support.placers import placer_policy, placers

LATER = 4_000_000_000_000  # one future window for every create: they all compete for it


async def create_many(
    service: ReservationService, count: int, **extra: Any
) -> list[dict[str, Any] | ComputeError]:
    async def one(n: int) -> dict[str, Any] | ComputeError:
        try:
            return await create(service, f"group-{n}", count=1, start=LATER, **extra)
        except ComputeError as e:
            return e

    return await asyncio.gather(*(one(n) for n in range(count)))


async def booked(db: Database) -> list[dict[str, Any]]:
    async with db.connection() as conn:
        return await (
            await conn.execute(
                "SELECT reservation_id, atom_id, xmin::text AS tx FROM bookings"
                " WHERE during && tstzrange(to_timestamp(%s / 1000.0),"
                "                           to_timestamp(%s / 1000.0 + 3600))",
                (LATER, LATER),
            )
        ).fetchall()


async def test_concurrent_creates_share_transactions_and_never_share_a_device(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=2, gpus=8, quota=100)
    views = await create_many(service, 24)
    assert not [v for v in views if isinstance(v, ComputeError)]
    states = sorted(v["state"] for v in views if isinstance(v, dict))
    # 16 GPUs: the first 16 are placed, the rest wait pending with their quota charged.
    assert states == ["pending"] * 8 + ["placed"] * 16
    rows = await booked(db)
    assert len(rows) == 16
    assert len({r["atom_id"] for r in rows}) == 16  # no device twice
    placed = {v["id"] for v in views if isinstance(v, dict) and v["state"] == "placed"}
    assert {r["reservation_id"] for r in rows} == placed
    # Fewer transactions than creates: the group commit did commit creates together.
    assert len({r["tx"] for r in rows}) < 16
    assert await quota_used(db) == 24
    for v in views:
        assert isinstance(v, dict)
        again = await get(service, v["id"])
        assert again["state"] == v["state"]
        assert again["version"] == v["version"]


async def test_a_quota_refusal_in_a_group_undoes_no_other_admission(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=2, gpus=8, quota=5)
    views = await create_many(service, 12)
    refused = [v for v in views if isinstance(v, ComputeError)]
    placed = [v for v in views if isinstance(v, dict)]
    assert {e.code for e in refused} == {"QUOTA_EXCEEDED"}
    assert len(refused) == 7
    assert {v["state"] for v in placed} == {"placed"}
    assert len(placed) == 5
    rows = await booked(db)
    assert sorted(r["reservation_id"] for r in rows) == sorted(v["id"] for v in placed)
    assert await quota_used(db) == 5  # charged exactly for the admitted ones


async def test_a_preemption_in_a_group_sees_the_bookings_of_the_creates_before_it(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, gpus=8, quota=64)
    # Spot work holds half the node; then 8 regular one-GPU creates at once: 4 fit the free
    # half, and the other 4 must take the spot work's GPUs, never a GPU of the group.
    spot = await create(service, "spot", count=4, start=LATER, spot=True)
    assert spot["state"] == "placed"
    views = await create_many(service, 8)
    assert {v["state"] for v in views if isinstance(v, dict)} == {"placed"}
    assert len([v for v in views if isinstance(v, dict)]) == 8
    rows = await booked(db)
    assert len(rows) == 8
    assert len({r["atom_id"] for r in rows}) == 8
    assert spot["id"] not in {r["reservation_id"] for r in rows}
    # Still together: the creates after the preemption read the bookings again rather than
    # fail the group on a device the preemption's snapshot did not know was taken.
    assert len({r["tx"] for r in rows}) < 8
    assert (await get(service, spot["id"]))["state"] == "pending"


# --- pool-lease: the queueing transactions of concurrent creates share one commit ----------


async def queued_events(db: Database) -> list[dict[str, Any]]:
    async with db.connection() as conn:
        return await (
            await conn.execute(
                "SELECT subject, xmin::text AS tx FROM outbox WHERE type = 'reservation.queued'"
            )
        ).fetchall()


async def test_pool_lease_creates_queue_together_and_each_is_placed_once(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=2, gpus=8, quota=100, policy=placer_policy("pool-lease"))
    async with placers(db, [service]):
        views = await create_many(service, 24, wait={"timeoutMs": 20_000})
    assert not [v for v in views if isinstance(v, ComputeError)]
    states = sorted(v["state"] for v in views if isinstance(v, dict))
    assert states == ["pending"] * 8 + ["placed"] * 16
    rows = await booked(db)
    assert len({r["atom_id"] for r in rows}) == len(rows) == 16
    events = await queued_events(db)
    assert len(events) == 24  # one reservation.queued each, never twice
    assert len({e["tx"] for e in events}) < 24  # committed together
    assert await quota_used(db) == 24


async def test_a_quota_refusal_in_a_pool_lease_group_undoes_no_other_admission(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=2, gpus=8, quota=5, policy=placer_policy("pool-lease"))
    async with placers(db, [service]):
        views = await create_many(service, 12, wait={"timeoutMs": 20_000})
    refused = [v for v in views if isinstance(v, ComputeError)]
    assert {e.code for e in refused} == {"QUOTA_EXCEEDED"}
    assert len(refused) == 7
    placed = [v for v in views if isinstance(v, dict)]
    assert {v["state"] for v in placed} == {"placed"}
    assert len(await queued_events(db)) == 5
    assert await quota_used(db) == 5
