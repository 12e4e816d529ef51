"""The work queue under a backlog: a placed reservation is bound within a few reconciler steps,
not after every pending retry that was due before it (issue 26).

Against the real PostgreSQL of the test session. A pool of one node keeps one GPU booked, so
requests for all eight GPUs stay pending; a release wakes them all at once (capacity freed).
The reconciler is driven one step at a time (``reconciling.reconcile_due(limit=1)``): each step
takes one wake-up, so "bound within N steps" is exact, however fast the machine.
"""

from __future__ import annotations

from bettercompute.service.reservations import ReservationService
from bettercompute.store import reconciling
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.store.test_lifecycle import advance, create, get, report_bound, run, world

PENDING = 40


async def backlog(db: Database, service: ReservationService) -> str:
    """One GPU kept, ``PENDING`` whole-node requests pending, every one of their retries due;
    returns the kept reservation's id."""
    await world(db, nodes=1, quota=10_000)
    kept = await create(service, "kept", count=1, duration="8h")
    assert kept["state"] == "placed"
    for i in range(PENDING):
        assert (await create(service, f"whole-{i}", count=8))["state"] == "pending"
    freed = await create(service, "freed", count=1)
    await run(db)  # the kept and the freed one binding; no retry due yet
    # A release frees capacity and wakes every pending reservation at once.
    await service.release(caller(), {"tenantId": "acme", "reservationId": freed["id"]})
    return str(kept["id"])


async def due(db: Database, rid: str) -> int:
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT count(*) AS n FROM work_queue"
                " WHERE reservation_id = %s AND due_at <= compute_now()",
                (rid,),
            )
        ).fetchone()
    return int(row["n"]) if row else 0


async def test_a_placed_reservation_binds_within_two_steps_of_a_backlog(
    db: Database, service: ReservationService
) -> None:
    await backlog(db, service)
    await advance(db, 1)  # the retries are older than the bind's wake-ups
    view = await create(service, "bind-me", count=1)
    assert view["state"] == "placed"
    # One step: its start, ahead of the 40 retries due before it.
    assert await reconciling.reconcile_due(db, limit=1) == 1
    assert (await get(service, view["id"]))["state"] == "binding"
    await report_bound(service, db, view["id"])
    # One more: the node's report.
    assert await reconciling.reconcile_due(db, limit=1) == 1
    assert (await get(service, view["id"]))["state"] == "active"
    # The retries were only put off: the next steps take them, and they stay pending.
    assert await run(db) >= PENDING


async def test_a_release_does_not_wake_a_pending_reservation_twice(
    db: Database, service: ReservationService
) -> None:
    await backlog(db, service)
    whole = await create(service, "whole-0", count=8)
    assert await due(db, whole["id"]) == 1
    # A second release while the first one's wake-ups are still due adds none.
    again = await create(service, "freed-again", count=1)
    await service.release(caller(), {"tenantId": "acme", "reservationId": again["id"]})
    assert await due(db, whole["id"]) == 1
    await run(db)
    assert await due(db, whole["id"]) == 0
    # Once taken, the next release wakes it again.
    third = await create(service, "freed-third", count=1)
    await service.release(caller(), {"tenantId": "acme", "reservationId": third["id"]})
    assert await due(db, whole["id"]) == 1
