"""The confirmation deadline kept by the reconciler (``store.confirmations`` woken through the
work queue): a reservation awaiting a person's confirmation expires at its deadline, never
before, its confirmation with it, with the event and the audit row, and nothing was ever
charged. Business time is moved with ``inventory.advance_clock``."""

from __future__ import annotations

from typing import Any

import pytest

from bettercompute.core import ports
from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.iam import policies
from bettercompute.service.reconciling import Reconciler
from bettercompute.service.reservations import ReservationService
from bettercompute.store import inventory
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database
from tests.support.world import World

HELD = """
@id("agents-confirm") @confirm
forbid (principal, action == Compute::Action::"compute:reservations:create", resource)
when { principal has actingFor && resource.gpuCount > 4 };
"""
AGENT = ports.Caller(identity_id="agent", tenant_id="acme", kind="agent", on_behalf_of="alice")
ALICE = ports.Caller(identity_id="alice", tenant_id="acme")


@pytest.fixture
async def service(db: Database) -> ReservationService:
    await (
        World(db)
        .tenant("acme")
        .tenant("root", root=True)
        .pool("pool_a", owner="acme")
        .nodes("pool_a", 1)
        .quota("acme", "gpu:H100", 8)
        .build()
    )
    engine = policies.CedarPolicyEngine.from_texts([policies.DEFAULT_POLICIES, HELD])
    return ReservationService(
        db=db, policy=engine, budget=DatabaseBudget(db), root_tenant_id="root"
    )


def body(key: str = "k1") -> dict[str, Any]:
    return {
        "tenantId": "acme",
        "poolId": "pool_a",
        "devices": [{"class": "gpu", "count": 6}],
        "duration": "1h",
        "idempotencyKey": key,
    }


async def ask(service: ReservationService, key: str = "k1") -> dict[str, Any]:
    with pytest.raises(ComputeError) as raised:
        await service.create(AGENT, body(key))
    assert raised.value.code == ErrorCode.CONFIRMATION_REQUIRED
    return dict(raised.value.details)


async def state_of(db: Database, rid: str) -> tuple[str, str]:
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT r.state, c.state AS asked FROM reservations r"
                " JOIN confirmations c ON c.reservation_id = r.id WHERE r.id = %s",
                (rid,),
            )
        ).fetchone()
    assert row is not None
    return row["state"], row["asked"]


async def types(db: Database, rid: str) -> list[str]:
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT type FROM outbox WHERE subject = %s ORDER BY id", (f"reservation/{rid}",)
            )
        ).fetchall()
    return [r["type"] for r in rows]


async def test_the_reconciler_expires_it_at_the_deadline_and_not_before(
    db: Database, service: ReservationService
):
    rid = (await ask(service))["reservationId"]
    reconciler = Reconciler(db)
    await inventory.advance_clock(db, seconds=29 * 60)
    await reconciler.run_once()
    assert await state_of(db, rid) == ("awaiting-confirmation", "pending")

    await inventory.advance_clock(db, seconds=61)
    assert await reconciler.run_once() >= 1
    assert await state_of(db, rid) == ("expired", "expired")
    assert await types(db, rid) == ["reservation.awaiting-confirmation", "reservation.expired"]
    shown = await service.get(AGENT, {"tenantId": "acme", "reservationId": rid})
    assert shown["operation"]["error"]["code"] == "INVALID_STATE"
    async with db.connection() as conn:
        audited = await (
            await conn.execute(
                "SELECT outcome FROM audit_log WHERE resource_id = %s"
                " AND action = 'compute:reservations:create' ORDER BY id",
                (rid,),
            )
        ).fetchall()
    assert [a["outcome"] for a in audited] == ["CONFIRMATION_REQUIRED", "expired"]

    # A late retry: INVALID_STATE, and the reconciler running again changes nothing.
    with pytest.raises(ComputeError) as raised:
        await service.create(AGENT, body())
    assert raised.value.code == ErrorCode.INVALID_STATE
    await reconciler.run_once()
    assert await types(db, rid) == ["reservation.awaiting-confirmation", "reservation.expired"]


async def test_an_approval_unused_by_the_deadline_expires_too(
    db: Database, service: ReservationService
):
    details = await ask(service)
    rid, cid = details["reservationId"], details["confirmationId"]
    await service.confirmations_approve(ALICE, {"tenantId": "acme", "confirmationId": cid})
    await inventory.advance_clock(db, seconds=30 * 60)
    await Reconciler(db).run_once()
    assert await state_of(db, rid) == ("expired", "expired")


async def test_awaiting_charges_nothing_so_another_request_fits(
    db: Database, service: ReservationService
):
    """Quota 8: a held request for 6 leaves all 8 to alice's own."""
    await ask(service)
    mine = await service.create(
        ALICE, {**body("alice-1"), "devices": [{"class": "gpu", "count": 8}]}
    )
    assert mine["state"] == "placed"
    # The approved request now finds the quota spent: QUOTA_EXCEEDED, and it stays awaiting.
    [item] = (await service.confirmations_list(ALICE, {"tenantId": "acme"}))["items"]
    await service.confirmations_approve(ALICE, {"tenantId": "acme", "confirmationId": item["id"]})
    with pytest.raises(ComputeError) as raised:
        await service.create(AGENT, body())
    assert raised.value.code == ErrorCode.QUOTA_EXCEEDED
    assert await state_of(db, item["reservationId"]) == ("awaiting-confirmation", "approved")
