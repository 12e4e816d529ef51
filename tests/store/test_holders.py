"""Claims and extend holds belong to their holder's session: a crashed holder frees them at
once, a live one keeps concurrent requests waiting, and a holder that lost its session can never
commit a claim another replica took over."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from bettercompute.core import ports
from bettercompute.core.errors import ComputeError
from bettercompute.iam import policies
from bettercompute.service.reservations import ReservationService
from bettercompute.store import inventory
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database
from bettercompute.store.holding import Holder
from tests.conftest import ROOT, caller
from tests.store.test_admission import acme, create_input
from tests.store.test_extend import extend_input, staged

#: What "at once" means here: the old claim timeout made a retry wait ~30 s.
AT_ONCE_S = 1.5


class GatedPolicy:
    """Cedar decides; the first decision of ``action`` waits for the test to open the gate,
    so the request stands still holding its claim or hold."""

    def __init__(self, action: str) -> None:
        self.inner = policies.CedarPolicyEngine.from_text(policies.DEFAULT_POLICIES)
        self.action = action
        self.reached = asyncio.Event()
        self.gate = asyncio.Event()
        self.decisions = 0

    async def decide(self, request: ports.DecisionRequest) -> ports.Decision:
        if request.action == self.action:
            self.decisions += 1
            if self.decisions == 1:
                self.reached.set()
                await self.gate.wait()
        return await self.inner.decide(request)


@pytest.fixture
async def spawn() -> AsyncIterator[Callable[[Any], asyncio.Task[Any]]]:
    """Start a request in the background; one a failed test left behind is cancelled."""
    tasks: list[asyncio.Task[Any]] = []

    def start(coro: Any) -> asyncio.Task[Any]:
        tasks.append(asyncio.ensure_future(coro))
        return tasks[-1]

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
async def replica(db: Database, spawn: Any) -> AsyncIterator[Callable[[Any], ReservationService]]:
    """A service with a holder session of its own: one replica of the service."""
    made: list[ReservationService] = []

    def make(policy: Any) -> ReservationService:
        service = ReservationService(
            db=db, policy=policy, budget=DatabaseBudget(db), root_tenant_id=ROOT, holder=Holder(db)
        )
        made.append(service)
        return service

    yield make
    for service in made:
        await service.close()


async def crash(db: Database, holder: Holder) -> None:
    """End the holder's session the way a dead process does: PostgreSQL terminates it."""
    pid = holder.backend_pid
    assert pid is not None
    async with db.connection() as conn:
        await conn.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))


async def counts(db: Database) -> dict[str, Any]:
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT (SELECT count(*) FROM reservations) AS reservations,"
                " (SELECT count(*) FROM bookings) AS bookings,"
                " (SELECT count(*) FROM outbox WHERE type = 'reservation.placed') AS placed"
            )
        ).fetchone()
    assert row is not None
    return row


async def test_a_crashed_holder_frees_its_create_claim_at_once(
    db: Database, replica: Any, spawn: Any
):
    await acme(db)
    gated = GatedPolicy(ports.CREATE)
    first, second = replica(gated), replica(gated)
    stuck = spawn(first.create(caller(), create_input()))
    await asyncio.wait_for(gated.reached.wait(), 5)
    await crash(db, first.holder)
    loop = asyncio.get_running_loop()
    started = loop.time()
    view = await asyncio.wait_for(second.create(caller(), create_input()), 10)
    assert loop.time() - started < AT_ONCE_S
    assert view["state"] == "placed"
    gated.gate.set()
    with pytest.raises(ComputeError):
        await stuck
    again = await second.create(caller(), create_input())
    assert again["id"] == view["id"]
    assert await counts(db) == {"reservations": 1, "bookings": 4, "placed": 1}
    assert (await inventory.quota(db, tenant_id="acme", resource="gpu:H100")) == (16, 4)


async def test_a_holder_that_lost_its_session_cannot_commit_a_claim_taken_over(
    db: Database, replica: Any, spawn: Any
):
    await acme(db)
    gated = GatedPolicy(ports.CREATE)
    first, second = replica(gated), replica(gated)
    old_id = await first.holder.current()
    stuck = spawn(first.create(caller(), create_input()))
    await asyncio.wait_for(gated.reached.wait(), 5)
    # A blip: the session is gone while the request decides, and another replica takes over.
    await crash(db, first.holder)
    taken = await asyncio.wait_for(second.create(caller(), create_input()), 10)
    gated.gate.set()
    with pytest.raises(ComputeError) as info:
        await stuck
    assert info.value.code == "CONFLICT"
    assert info.value.details["reservationId"] == taken["id"]
    assert await counts(db) == {"reservations": 1, "bookings": 4, "placed": 1}
    # The holder reconnects with a new id, and the replica serves again.
    assert await first.holder.current() != old_id
    other = await first.create(caller(), create_input(idempotencyKey="after-blip"))
    assert other["state"] == "placed"


async def test_a_live_holder_keeps_a_same_key_retry_waiting(db: Database, replica: Any, spawn: Any):
    await acme(db)
    gated = GatedPolicy(ports.CREATE)
    first, second = replica(gated), replica(gated)
    deciding = spawn(first.create(caller(), create_input()))
    await asyncio.wait_for(gated.reached.wait(), 5)
    retry = spawn(second.create(caller(), create_input()))
    await asyncio.sleep(1.0)
    assert not retry.done()  # Busy: it polls, it does not decide
    assert gated.decisions == 1
    gated.gate.set()
    view, replayed = await asyncio.wait_for(asyncio.gather(deciding, retry), 10)
    assert replayed["id"] == view["id"]
    assert gated.decisions == 1
    assert await counts(db) == {"reservations": 1, "bookings": 4, "placed": 1}


async def test_a_hung_holder_claim_is_taken_over_after_thirty_seconds(
    db: Database, replica: Any, spawn: Any
):
    await acme(db)
    gated = GatedPolicy(ports.CREATE)
    first, second = replica(gated), replica(gated)
    hung = spawn(first.create(caller(), create_input()))
    await asyncio.wait_for(gated.reached.wait(), 5)
    await inventory.advance_clock(db, seconds=31)
    view = await asyncio.wait_for(second.create(caller(), create_input()), 10)
    assert view["state"] == "placed"
    gated.gate.set()
    with pytest.raises(ComputeError) as info:
        await hung
    assert info.value.code == "CONFLICT"
    assert await counts(db) == {"reservations": 1, "bookings": 4, "placed": 1}


async def test_a_crashed_holder_frees_its_extend_hold_at_once(
    db: Database, replica: Any, spawn: Any
):
    await acme(db)
    gated = GatedPolicy(ports.EXTEND)
    first, second = replica(gated), replica(gated)
    view = await second.create(caller(), create_input(duration="2h"))
    stuck = spawn(first.extend(caller(), extend_input(view["id"], "e1", by="1h")))
    await asyncio.wait_for(gated.reached.wait(), 5)
    # While the holder lives, its hold refuses another extend.
    with pytest.raises(ComputeError) as info:
        await second.extend(caller(), extend_input(view["id"], "e2", by="2h"))
    assert info.value.details["reason"] == "extend-in-flight"
    await crash(db, first.holder)
    loop = asyncio.get_running_loop()
    started = loop.time()
    answer = await asyncio.wait_for(
        second.extend(caller(), extend_input(view["id"], "e2", by="2h")), 10
    )
    assert loop.time() - started < AT_ONCE_S
    assert answer["extended"] is True
    gated.gate.set()
    with pytest.raises(ComputeError) as info:
        await stuck
    assert info.value.code == "CONFLICT"
    final = answer["reservation"]
    assert final["during"]["end"] - final["during"]["start"] == 4 * 3_600_000
    assert await staged(db, view["id"]) == (None, 0)
