"""Spot preemption: a regular request that does not fit takes the capacity of spot work, the
fewest reservations, not-started ones first, never a regular one; a spot reservation that has
not started waits pending (SpotPreempted), a running one keeps its devices until the notice
deadline and is then released as preempted. Real PostgreSQL, through ReservationService."""

from __future__ import annotations

import asyncio
from typing import Any

from bettercompute.core import moments
from bettercompute.service.reservations import ReservationService
from bettercompute.store import desired
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.store.test_lifecycle import (
    activate,
    advance,
    allocations,
    bookings,
    create,
    get,
    quota_used,
    run,
    world,
)

HOUR_MS = 3_600_000


async def events(db: Database, rid: str) -> list[str]:
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT type FROM outbox WHERE subject = %s ORDER BY id", (f"reservation/{rid}",)
            )
        ).fetchall()
    return [r["type"] for r in rows]


def condition(view: dict[str, Any], kind: str) -> dict[str, Any]:
    [found] = [c for c in view["conditions"] if c["type"] == kind]
    return found


async def test_a_regular_request_requeues_spot_work_that_has_not_started(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, gpus=8, quota=64)
    later = 4_000_000_000_000  # both in the same future window: neither has started
    spot = await create(service, "spot", count=8, start=later, spot=True)
    assert spot["state"] == "placed"
    regular = await create(service, "regular", count=4, start=later)
    assert regular["state"] == "placed"
    assert regular["during"]["start"] == later
    requeued = await get(service, spot["id"])
    assert requeued["state"] == "pending"
    cond = condition(requeued, "Unschedulable")
    assert cond["reason"] == "SpotPreempted"
    assert regular["id"] in cond["message"]
    assert await bookings(db, spot["id"]) == []
    assert "reservation.preempted" in await events(db, spot["id"])
    assert await quota_used(db) == 12  # a pending reservation keeps its quota
    # Capacity freed wakes it: placed again.
    await service.release(caller(), {"tenantId": "acme", "reservationId": regular["id"]})
    await run(db)
    assert (await get(service, spot["id"]))["state"] == "placed"


async def test_running_spot_work_gets_notice_then_is_released_as_preempted(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, gpus=8, quota=64, policy={"spot": {"noticeSeconds": 60}})
    spot = await create(service, "spot", count=8, duration="8h", spot=True)
    await activate(service, db, spot["id"])
    regular = await create(service, "regular", count=8, duration="1h")
    assert regular["state"] == "placed"
    noticed = await get(service, spot["id"])
    preempted = condition(noticed, "Preempted")
    deadline = preempted["deadline"]
    assert preempted["reason"] == "SpotPreempted"
    # People read the message: its time is RFC 3339 (the deadline field stays epoch ms).
    assert preempted["message"].endswith(f"released at {moments.rfc3339(deadline)}")
    assert noticed["state"] == "active"  # it keeps its devices until the deadline
    assert noticed["during"]["end"] == deadline
    assert regular["during"]["start"] == deadline  # placed for the window from the deadline
    assert "reservation.preempting" in await events(db, spot["id"])
    # Its node is told, to warn the pods holding the devices.
    [alloc] = await allocations(db, spot["id"])
    [wanted] = await desired.for_node(db, node_id=alloc["node_id"])
    assert (wanted["preemptAt"], wanted["until"]) == (deadline, deadline)
    await advance(db, 61)
    await run(db)
    released = await get(service, spot["id"])
    assert (released["state"], released["releaseReason"]) == ("released", "preempted")


async def test_regular_work_is_never_preempted_and_the_fewest_spot_go(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, gpus=8, quota=64)
    later = 4_000_000_000_000
    regular = await create(service, "regular", count=4, start=later)
    small = await create(service, "spot-small", count=2, start=later, spot=True)
    big = await create(service, "spot-big", count=2, start=later, spot=True)
    # 2 GPUs asked: one spot reservation is enough; the latest created goes first.
    asked = await create(service, "asked", count=2, start=later)
    assert asked["state"] == "placed"
    assert (await get(service, big["id"]))["state"] == "pending"
    assert (await get(service, small["id"]))["state"] == "placed"
    # Asking more than spot work holds: nothing is preempted, the request waits.
    too_much = await create(service, "too-much", count=6, start=later)
    assert too_much["state"] == "pending"
    assert (await get(service, small["id"]))["state"] == "placed"
    assert (await get(service, regular["id"]))["state"] == "placed"


async def test_two_preemptors_never_take_the_same_victims(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, gpus=8, quota=64)
    later = 4_000_000_000_000
    spots = [await create(service, f"spot-{i}", count=4, start=later, spot=True) for i in (0, 1)]
    first, second, third = await asyncio.gather(
        *(create(service, f"regular-{i}", count=4, start=later) for i in range(3))
    )
    placed = [v for v in (first, second, third) if v["state"] == "placed"]
    assert len(placed) == 2  # 8 GPUs: two regular requests of 4, whatever the order
    for spot in spots:
        assert (await get(service, spot["id"]))["state"] == "pending"
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT count(*) AS n FROM outbox WHERE type = 'reservation.preempted'"
            )
        ).fetchone()
    assert row == {"n": 2}  # each victim preempted once
