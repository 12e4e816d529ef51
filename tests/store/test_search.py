"""``capacity.search``: the earliest windows a create would fit in, read from the pool's
bookings once and judged by the create's own placer; books and decides nothing. On the real
PostgreSQL of the test session, through ``ReservationService`` as the API calls it.
"""

from __future__ import annotations

from typing import Any

import pytest

from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.service.reservations import ReservationService
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.store.test_lifecycle import create, world

HOUR_MS = 3_600_000


def body(**extra: Any) -> dict[str, Any]:
    return {
        "tenantId": "acme",
        "poolId": "pool_a",
        "devices": [{"class": "gpu", "count": 8}],
        "duration": "2h",
        **extra,
    }


async def test_an_idle_pool_answers_now_and_the_following_boundaries(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, gpus=8, quota=64)
    found = await service.search(caller(), body(limit=3))
    assert found["never"] is False
    [window] = found["windows"]  # no booking: no other boundary than now
    assert window["start"] == found["from"]
    assert window["end"] - window["start"] == 2 * HOUR_MS
    assert window["nodeIds"] == ["node_pool_a-node-00"]


async def test_the_first_window_opens_when_the_bookings_in_the_way_end(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, gpus=8, quota=64)
    now = (await create(service, "now", count=8, duration="3h"))["during"]
    later = await create(service, "later", count=4, duration="1h", start=now["end"] + 2 * HOUR_MS)
    found = await service.search(caller(), body(limit=3))
    starts = [w["start"] for w in found["windows"]]
    # Full until the first ends; then exactly 2 h free before the second's hour (4 of 8 GPUs),
    # so 8 GPUs for 2 h fit from the first's end, and again from the second's end.
    assert starts == [now["end"], later["during"]["end"]]
    # Each window is what a create at its start gets.
    placed = await create(service, "fits", count=8, duration="2h", start=starts[0])
    assert placed["state"] == "placed"
    assert placed["during"]["start"] == starts[0]


async def test_nothing_is_booked_or_decided(db: Database, service: ReservationService) -> None:
    await world(db, nodes=1, gpus=8, quota=64)
    await service.search(caller(), body())
    async with db.connection() as conn:
        row = await (await conn.execute("SELECT count(*) AS n FROM reservations")).fetchone()
    assert row == {"n": 0}


async def test_a_request_that_can_never_fit_says_so_at_once(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=2, gpus=8, quota=64)
    found = await service.search(caller(), body(devices=[{"class": "gpu", "count": 9}]))
    assert (found["windows"], found["never"]) == ([], True)
    assert found["message"].startswith("never fits this pool")


async def test_from_horizon_and_limit_bound_the_answer(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, gpus=8, quota=64)
    first = await create(service, "a", count=8, duration="1h")
    await create(service, "b", count=8, duration="1h", start=first["during"]["end"])
    start = first["during"]["start"]
    # Looking from a moment inside the first booking, at most 30 minutes ahead: nothing.
    none = await service.search(
        caller(), body(duration="1h", **{"from": start + 60_000}, horizon="30m")
    )
    assert none["windows"] == []
    assert none["message"] == "no window within the horizon"
    two_hours_later = first["during"]["end"] + HOUR_MS
    one = await service.search(caller(), body(duration="1h", limit=1))
    assert [w["start"] for w in one["windows"]] == [two_hours_later]
    with pytest.raises(ComputeError) as refused:
        await service.search(caller(), body(start=start))
    assert refused.value.code is ErrorCode.INVALID_INPUT
    assert "from" in refused.value.message
