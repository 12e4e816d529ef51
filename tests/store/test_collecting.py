"""Garbage collection: old refused drafts, denied reservations past retention, extend holds and
claims of ended holders go; admitted reservations, live drafts, keys and audit rows stay; the
loop outlives database errors."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from bettercompute.core import ids, ports
from bettercompute.iam import policies
from bettercompute.service.collecting import Collector
from bettercompute.service.reservations import ReservationService
from bettercompute.store import collecting, inventory
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database
from bettercompute.store.holding import Holder
from tests.conftest import ROOT, caller
from tests.store.test_admission import acme, create_input, expect
from tests.store.test_extend import extend_input, staged
from tests.store.test_holders import GatedPolicy, crash

HOUR = 3600
EIGHT_GPUS = [{"class": "gpu", "count": 8}]


class DenyKeys:
    """Cedar decides, except that creates of the listed draft ids are denied."""

    def __init__(self) -> None:
        self.inner = policies.CedarPolicyEngine.from_text(policies.DEFAULT_POLICIES)
        self.denied: set[str] = set()

    async def decide(self, request: ports.DecisionRequest) -> ports.Decision:
        if request.action == ports.CREATE and request.resource_id in self.denied:
            return ports.Decision(allowed=False, reasons=("test-deny",))
        return await self.inner.decide(request)


async def eventually(check: Callable[[], Awaitable[bool]], *, seconds: float = 10.0) -> bool:
    """Whether ``check`` comes true within ``seconds``."""
    for _ in range(int(seconds / 0.05)):
        if await check():
            return True
        await asyncio.sleep(0.05)
    return await check()


def rid(key: str) -> str:
    return ids.draft_id("acme", caller().identity_id, key)


async def count(db: Database, sql: str, *params: Any) -> int:
    async with db.connection() as conn:
        row = await (await conn.execute(f"SELECT count(*) AS n FROM {sql}", params)).fetchone()
    assert row is not None
    return int(row["n"])


async def state_of(db: Database, reservation_id: str) -> str | None:
    async with db.connection() as conn:
        row = await (
            await conn.execute("SELECT state FROM reservations WHERE id = %s", (reservation_id,))
        ).fetchone()
    return None if row is None else str(row["state"])


async def test_old_refused_drafts_go_and_their_keys_are_remembered(
    db: Database, make_service: Any
) -> None:
    await acme(db, gpus=8)
    service = make_service()
    placed = await service.create(caller(), create_input(idempotencyKey="kept"))
    too_big = create_input(idempotencyKey="too-big", devices=EIGHT_GPUS)
    await expect("QUOTA_EXCEEDED", service.create(caller(), too_big))
    assert (await collecting.collect(db)).drafts == 0  # younger than an hour

    await inventory.advance_clock(db, seconds=2 * HOUR)
    young = create_input(idempotencyKey="young", devices=EIGHT_GPUS)
    await expect("QUOTA_EXCEEDED", service.create(caller(), young))
    # The old draft is being decided again right now, by a live holder: it stays.
    gated = GatedPolicy(ports.CREATE)
    retried = asyncio.ensure_future(make_service(gated).create(caller(), too_big))
    try:
        await asyncio.wait_for(gated.reached.wait(), 5)
        assert (await collecting.collect(db)).drafts == 0
    finally:
        gated.gate.set()
    await expect("QUOTA_EXCEEDED", retried)

    await inventory.advance_clock(db, seconds=2 * HOUR)
    assert (await collecting.collect(db)).drafts == 2
    assert await state_of(db, rid("too-big")) is None
    assert await state_of(db, rid("young")) is None
    assert await count(db, "authz_resources WHERE id = %s", rid("too-big")) == 0
    assert await state_of(db, placed["id"]) == "placed"
    # The audit rows of the collected drafts stay (one per refusal).
    assert await count(db, "audit_log WHERE resource_id = %s", rid("too-big")) == 2
    # The key is remembered: another request under it is CONFLICT; the same one is decided
    # again, as if the draft had never gone.
    await expect(
        "CONFLICT",
        service.create(caller(), {**too_big, "devices": [{"class": "gpu", "count": 2}]}),
    )
    await expect("QUOTA_EXCEEDED", service.create(caller(), too_big))
    assert await state_of(db, rid("too-big")) == "draft"


async def test_a_denied_key_stays_refused_after_its_reservation_goes(
    db: Database, make_service: Any
) -> None:
    await acme(db)
    policy = DenyKeys()
    service = make_service(policy)
    policy.denied.add(rid("denied"))
    await expect("ACCESS_DENIED", service.create(caller(), create_input(idempotencyKey="denied")))
    await inventory.advance_clock(db, seconds=6 * 24 * HOUR)
    assert (await collecting.collect(db)).denied == 0
    assert await state_of(db, rid("denied")) == "denied"

    await inventory.advance_clock(db, seconds=2 * 24 * HOUR)
    assert (await collecting.collect(db)).denied == 1
    assert await state_of(db, rid("denied")) is None
    assert await count(db, "authz_resources WHERE id = %s", rid("denied")) == 0
    assert await count(db, "audit_log WHERE resource_id = %s", rid("denied")) >= 1
    # Even a policy that would allow it now is never asked: the key stays refused.
    policy.denied.clear()
    await expect("ACCESS_DENIED", service.create(caller(), create_input(idempotencyKey="denied")))
    assert await state_of(db, rid("denied")) is None


def replica(db: Database, policy: Any) -> ReservationService:
    """A service with a holder session of its own: another replica."""
    return ReservationService(
        db=db, policy=policy, budget=DatabaseBudget(db), root_tenant_id=ROOT, holder=Holder(db)
    )


async def test_holds_and_claims_of_a_crashed_holder_are_collected(
    db: Database, make_service: Any
) -> None:
    await acme(db)
    view = await make_service().create(caller(), create_input(duration="2h"))
    # Replicas crash mid-extend and mid-create, and their clients never come back.
    extend_gate, create_gate = GatedPolicy(ports.EXTEND), GatedPolicy(ports.CREATE)
    extender, creator = replica(db, extend_gate), replica(db, create_gate)
    stuck = [
        asyncio.ensure_future(extender.extend(caller(), extend_input(view["id"], "e", by="1h"))),
        asyncio.ensure_future(creator.create(caller(), create_input(idempotencyKey="crashed"))),
    ]
    try:
        await asyncio.wait_for(extend_gate.reached.wait(), 5)
        await asyncio.wait_for(create_gate.reached.wait(), 5)
        pending, holds = await staged(db, view["id"])
        assert (pending is not None, holds) == (True, 1)
        # While their holders live, the hold and the claim stay.
        done = await collecting.collect(db)
        assert (done.holds, done.claims) == (0, 0)
        await crash(db, extender.holder)
        await crash(db, creator.holder)
        done = await collecting.collect(db)
        assert (done.holds, done.claims) == (1, 1)
        assert await staged(db, view["id"]) == (None, 0)
        assert await count(db, "idempotency WHERE claim IS NOT NULL") == 0
    finally:
        extend_gate.gate.set()
        create_gate.gate.set()
        await asyncio.gather(*stuck, return_exceptions=True)
        await extender.close()
        await creator.close()


async def test_the_loop_outlives_database_errors(
    db: Database, pg_dsn: str, make_service: Any, caplog: pytest.LogCaptureFixture
) -> None:
    await acme(db, gpus=8)
    # The collector's own pool gives up on a lock after 200 ms, as a frozen database would.
    impatient = await Database.open(
        psycopg.conninfo.make_conninfo(pg_dsn, options="-c lock_timeout=200"),
        min_size=1,
        max_size=2,
        migrate=False,
    )
    collector = Collector(impatient, interval_s=0.05, retry_s=0.05)
    loop = asyncio.ensure_future(collector.run())
    try:
        async with db.transaction() as conn:
            await conn.execute("LOCK TABLE reservations IN ACCESS EXCLUSIVE MODE")

            async def failed_twice() -> bool:
                return collector.failures >= 2

            with caplog.at_level(logging.WARNING, logger="bettercompute.service.collecting"):
                assert await eventually(failed_twice)
        assert not loop.done()
        assert "garbage collection failed" in caplog.text
        # The database is back: the next passes collect again.
        await expect(
            "QUOTA_EXCEEDED",
            make_service().create(
                caller(), create_input(idempotencyKey="big", devices=[{"class": "gpu", "count": 9}])
            ),
        )
        await inventory.advance_clock(db, seconds=2 * HOUR)

        async def collected() -> bool:
            return await state_of(db, rid("big")) is None

        assert await eventually(collected)
        assert not loop.done()
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await impatient.close()
