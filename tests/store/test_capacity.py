"""``pools.list``: each of the tenant's pools with its devices by class (total, healthy,
booked now, free now) and, when none is free, when the first frees. Real PostgreSQL."""

from __future__ import annotations

import pytest

from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.service.reservations import ReservationService
from bettercompute.store import inventory
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.store.test_lifecycle import create, world


async def test_a_pool_shows_what_is_booked_free_and_unhealthy_now(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=2, gpus=8, quota=64)
    await create(service, "now", count=4)
    future = await create(service, "later", count=8, start=4_000_000_000_000)
    assert future["state"] == "placed"
    await inventory.set_atom_health(
        db, node_id="node_pool_a-node-01", device_id="GPU-pool_a-node-01-7", healthy=False
    )
    [pool] = (await service.pools(caller(), {"tenantId": "acme"}))["items"]
    assert (pool["poolId"], pool["nodes"], pool["nodesReady"]) == ("pool_a", 2, 2)
    # The future booking is not booked now.
    assert pool["devices"] == {
        "gpu": {"total": 16, "healthy": 15, "booked": 4, "bound": 0, "free": 11}
    }
    assert "nextFreeAt" not in pool


async def test_a_full_pool_says_when_the_first_device_frees(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, gpus=8, quota=64)
    short = await create(service, "short", count=2, duration="1h")
    await create(service, "long", count=6, duration="3h")
    [pool] = (await service.pools(caller(), {"tenantId": "acme"}))["items"]
    assert pool["devices"]["gpu"]["free"] == 0
    assert pool["nextFreeAt"] == short["during"]["end"]


async def test_only_the_tenants_own_and_offered_pools(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1)
    await inventory.upsert_tenant(db, tenant_id="globex")
    assert (await service.pools(caller("bob", "globex"), {"tenantId": "globex"}))["items"] == []
    with pytest.raises(ComputeError) as refused:
        await service.pools(caller("bob", "globex"), {"tenantId": "acme"})
    assert refused.value.code is ErrorCode.ACCESS_DENIED
