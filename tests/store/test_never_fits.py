"""A request that can never fit its pool as the pool is, told apart from one that waits for
devices to free: still admitted (``pending``, ``Unschedulable/NoFit``), but its message starts
``never fits this pool:`` and says why; ``capacity.preview`` answers ``never: true``; once the
pool changes, the next retry judges it again. On the real PostgreSQL of the test session.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bettercompute.core.placement import NEVER
from bettercompute.service.reservations import ReservationService
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.store.test_lifecycle import advance, create, get, run, world
from tests.support.world import World


def unschedulable(view: Mapping[str, Any]) -> str:
    [condition] = [c for c in view["conditions"] if c["type"] == "Unschedulable"]
    assert condition["reason"] == "NoFit"
    return str(condition["message"])


async def test_more_gpus_than_any_node_has_never_fits(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=2, gpus=8)
    view = await create(service, "nine", count=9)
    assert view["state"] == "pending"
    message = unschedulable(view)
    assert message.startswith(f"{NEVER}: even with every device free, 0 of 2 nodes fit")
    assert "too few free gpu" in message


async def test_a_busy_pool_is_not_a_never(db: Database, service: ReservationService) -> None:
    await world(db, nodes=1, gpus=8)
    first = await create(service, "all", count=8)
    assert first["state"] == "placed"
    second = await create(service, "next", count=8)
    assert second["state"] == "pending"
    assert not unschedulable(second).startswith(NEVER)


async def test_nvlink_all_larger_than_any_domain_never_fits_and_preview_says_so(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=2, gpus=8, domains=2)  # NVLink domains of 4
    body = {
        "tenantId": "acme",
        "poolId": "pool_a",
        "devices": [{"class": "gpu", "count": 8, "topology": "nvlink-all"}],
        "duration": "1h",
    }
    preview = await service.preview(caller(), body)
    assert (preview["fits"], preview["never"]) == (False, True)
    assert preview["message"].startswith(NEVER)
    assert "no NVLink domain with 8 free gpu" in preview["message"]
    view = await service.create(caller(), {**body, "idempotencyKey": "nvl8"})
    assert unschedulable(view).startswith(NEVER)


async def test_the_pool_changing_is_judged_at_the_next_retry(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, gpus=8)
    view = await create(service, "twelve", count=12)
    assert unschedulable(view).startswith(NEVER)
    # A bigger node joins the pool: the reservation is woken and placed.
    await World(db).nodes("pool_a", 1, gpus=16, prefix="big").build()
    await advance(db, 31)
    await run(db)
    assert (await get(service, view["id"]))["state"] in ("placed", "binding")
