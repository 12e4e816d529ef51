"""Extend's admission: decided on the total duration, one at a time, refusals clear the staged
change, and a stale hold is taken over after 60 seconds."""

from __future__ import annotations

from typing import Any

import pytest

from bettercompute.core.errors import ComputeError
from bettercompute.iam import policies
from bettercompute.service.reservations import ReservationService
from bettercompute.store import inventory
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.store.test_admission import acme, create_input
from tests.support.policies import CountingPolicy

BOUNDED_EXTEND = policies.DEFAULT_POLICIES.replace(
    "when { principal.tenant == resource.tenant }",
    'when { principal.tenant == resource.tenant && (action != Compute::Action::"compute:'
    'reservations:extend" || resource.durationHours.lessThanOrEqual(decimal("24.0"))) }',
)


def extend_input(rid: str, key: str, **how: Any) -> dict[str, Any]:
    return {"tenantId": "acme", "reservationId": rid, "idempotencyKey": key, **how}


async def staged(db: Database, rid: str) -> Any:
    async with db.connection() as conn:
        row = await (
            await conn.execute("SELECT pending FROM authz_resources WHERE id = %s", (rid,))
        ).fetchone()
        holds = await (
            await conn.execute(
                "SELECT count(*) AS n FROM extend_holds WHERE reservation_id = %s", (rid,)
            )
        ).fetchone()
    assert row is not None
    assert holds is not None
    return row["pending"], holds["n"]


async def test_a_cap_on_duration_also_bounds_extensions(db: Database, make_service: Any):
    await acme(db)
    service: ReservationService = make_service(CountingPolicy(BOUNDED_EXTEND))
    view = await service.create(caller(), create_input(duration="20h"))
    ok = await service.extend(caller(), extend_input(view["id"], "e1", by="4h"))
    assert ok["extended"] is True
    with pytest.raises(ComputeError) as info:
        await service.extend(caller(), extend_input(view["id"], "e2", by="1h"))
    assert info.value.code == "ACCESS_DENIED"
    # The refused lifetime never reaches later decisions: nothing stays staged.
    assert await staged(db, view["id"]) == (None, 0)
    after = await service.get(caller(), {"tenantId": "acme", "reservationId": view["id"]})
    assert after["during"]["end"] - after["during"]["start"] == 24 * 3_600_000
    # The same key is decided again (and refused again).
    with pytest.raises(ComputeError):
        await service.extend(caller(), extend_input(view["id"], "e2", by="1h"))


async def test_an_until_already_reached_is_not_decided(db: Database, make_service: Any):
    await acme(db)
    policy = CountingPolicy(BOUNDED_EXTEND)
    service: ReservationService = make_service(policy)
    view = await service.create(caller(), create_input(duration="2h"))
    creates = policy.creates
    answer = await service.extend(
        caller(), extend_input(view["id"], "u1", until=view["during"]["end"] - 1000)
    )
    assert answer == {"reservation": answer["reservation"], "extended": False}
    assert policy.creates == creates
    assert await staged(db, view["id"]) == (None, 0)


async def test_a_key_reused_for_another_extend_conflicts(db: Database, service: ReservationService):
    await acme(db)
    view = await service.create(caller(), create_input(duration="2h"))
    await service.extend(caller(), extend_input(view["id"], "k", by="1h"))
    with pytest.raises(ComputeError) as info:
        await service.extend(caller(), extend_input(view["id"], "k", by="2h"))
    assert info.value.code == "CONFLICT"


async def test_a_hold_in_flight_refuses_then_is_taken_over_after_a_minute(
    db: Database, service: ReservationService
):
    await acme(db)
    view = await service.create(caller(), create_input(duration="2h"))
    # Another replica's extend holds the slot (and then died).
    async with db.transaction() as conn:
        await conn.execute(
            "INSERT INTO extend_holds (reservation_id, hold, taken_at)"
            " VALUES (%s, 'hold_other', compute_now())",
            (view["id"],),
        )
    with pytest.raises(ComputeError) as info:
        await service.extend(caller(), extend_input(view["id"], "t1", by="1h"))
    assert info.value.code == "CONFLICT"
    assert info.value.details["reason"] == "extend-in-flight"
    assert info.value.details["retryAfterSeconds"] == 60
    await inventory.advance_clock(db, seconds=61)
    answer = await service.extend(caller(), extend_input(view["id"], "t1", by="1h"))
    assert answer["extended"] is True
    assert await staged(db, view["id"]) == (None, 0)


async def test_extend_of_a_pending_or_foreign_reservation(
    db: Database, service: ReservationService
):
    await acme(db, gpus=64, nodes=1)
    pending = await service.create(
        caller(), create_input(devices=[{"class": "gpu", "count": 16}], idempotencyKey="big")
    )
    assert pending["state"] == "pending"
    with pytest.raises(ComputeError) as info:
        await service.extend(caller(), extend_input(pending["id"], "p", by="1h"))
    assert info.value.code == "INVALID_STATE"
    with pytest.raises(ComputeError) as info:
        await service.extend(caller(), extend_input("rsv_unknown", "p2", by="1h"))
    assert info.value.code == "NOT_FOUND"
