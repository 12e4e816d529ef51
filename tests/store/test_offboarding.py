"""Owner offboarding: an offboarded owner's live reservations go to the successor, each with
``reservation.reassigned`` (``reservationId``, ``from``, ``to``, ``reason``), a type webhooks and
EventSubscriptions can name. Against the real PostgreSQL of the test session."""

from __future__ import annotations

import pytest

from bettercompute.core import requests
from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.service.offboarding import Offboarding
from bettercompute.service.reservations import ReservationService
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.store.test_lifecycle import create, events, world


async def test_an_offboarded_owners_live_reservations_go_to_the_successor(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    live = await create(service, "live", count=2)
    ended = await create(service, "ended", count=2)
    await service.release(caller(), {"tenantId": "acme", "reservationId": ended["id"]})
    bobs = await service.create(
        caller("bob"),
        {
            "tenantId": "acme",
            "poolId": "pool_a",
            "devices": [{"class": "gpu", "count": 1}],
            "duration": "1h",
            "idempotencyKey": "bobs",
        },
    )

    moved = await Offboarding(db).offboard(
        tenant_id="acme", identity_id="alice", successor_id="carol", reason="left the team"
    )
    assert moved == [live["id"]]
    view = await service.get(caller("carol"), {"tenantId": "acme", "reservationId": live["id"]})
    assert view["ownerIdentityId"] == "carol"
    assert view["version"] == live["version"] + 1
    mine = await service.list(caller("carol"), {"tenantId": "acme"})
    assert [r["id"] for r in mine["items"]] == [live["id"]]
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT owner_identity_id FROM authz_resources WHERE id = %s", (live["id"],)
            )
        ).fetchone()
    assert row == {"owner_identity_id": "carol"}
    [(_kind, data)] = [e for e in await events(db, live["id"]) if e[0] == "reservation.reassigned"]
    assert data == {
        "state": "placed",
        "poolId": "pool_a",
        "reservationId": live["id"],
        "from": "alice",
        "to": "carol",
        "reason": "left the team",
    }
    # An ended reservation keeps its owner, and another person's is not touched.
    kept = await service.get(caller(), {"tenantId": "acme", "reservationId": ended["id"]})
    assert kept["ownerIdentityId"] == "alice"
    assert not [e for e in await events(db, ended["id"]) if e[0] == "reservation.reassigned"]
    assert (await service.get(caller("bob"), {"tenantId": "acme", "reservationId": bobs["id"]}))[
        "ownerIdentityId"
    ] == "bob"
    # Safe to repeat: nothing is left to move.
    assert (
        await Offboarding(db).offboard(tenant_id="acme", identity_id="alice", successor_id="carol")
        == []
    )


async def test_offboarding_stays_within_the_tenant(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    live = await create(service, "live", count=2)
    assert (
        await Offboarding(db).offboard(
            tenant_id="globex", identity_id="alice", successor_id="carol"
        )
        == []
    )
    view = await service.get(caller(), {"tenantId": "acme", "reservationId": live["id"]})
    assert view["ownerIdentityId"] == "alice"
    with pytest.raises(ComputeError) as refused:
        await Offboarding(db).offboard(tenant_id="acme", identity_id="alice", successor_id="alice")
    assert refused.value.code == ErrorCode.INVALID_INPUT


def test_webhooks_and_event_subscriptions_can_name_reservation_reassigned() -> None:
    assert "reservation.reassigned" in requests.EVENT_TYPES
    parsed = requests.parse(
        requests.SubscriptionCreateInput,
        {
            "tenantId": "acme",
            "url": "https://hooks.example.com/compute",
            "eventTypes": ["reservation.reassigned"],
        },
    )
    assert parsed.eventTypes == ["reservation.reassigned"]
