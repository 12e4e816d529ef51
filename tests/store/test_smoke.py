"""The first path through the whole sequence: a create placed on real devices."""

from __future__ import annotations

from bettercompute.service.reservations import ReservationService
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.support.world import World


async def test_create_places_on_one_nvlink_domain(db: Database, service: ReservationService):
    await (
        World(db)
        .tenant("acme")
        .pool("pool_a", owner="acme")
        .nodes("pool_a", 2)
        .quota("acme", "gpu:H100", 16)
        .build()
    )
    view = await service.create(
        caller(),
        {
            "tenantId": "acme",
            "poolId": "pool_a",
            "devices": [{"class": "gpu", "count": 4, "topology": "nvlink-all"}],
            "duration": "8h",
            "idempotencyKey": "train-1",
        },
    )
    assert view["state"] == "placed", view
    assert view["request"]["duration"] == "28800000ms"
    assert view["operation"] == {"id": view["id"], "state": "succeeded"}
    assert view["during"]["end"] - view["during"]["start"] == 8 * 3600 * 1000
