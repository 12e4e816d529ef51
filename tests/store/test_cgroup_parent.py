"""A bound report's ``cgroupParent``: the control plane keeps only the allocation's own slice.

A node reports the cgroup slice it made for a hold with limits; ``reservations.get`` shows it as
``binding.cgroupParent``. A node (or whoever relays its reports) must not be able to point a
reservation at another allocation's slice, a path out of the cgroup root, or give a
``kubernetes`` binding a slice: each attempt below is dropped, the binding still counts.

Runs against the real PostgreSQL of the test session, reports through
``ReservationService.report`` exactly as the operator sends them.
"""

from __future__ import annotations

from typing import Any

import pytest

from bettercompute.core.ids import cgroup_slice
from bettercompute.service.reservations import ReservationService
from bettercompute.store.database import Database
from tests.store.test_lifecycle import (
    K8S_LABEL,
    allocations,
    cdi,
    create,
    get,
    report,
    run,
    world,
)


async def _bind(
    service: ReservationService,
    db: Database,
    rid: str,
    *,
    slice_of: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Report every allocation of ``rid`` bound, claiming the slice of allocation ``slice_of``
    (its own when None), and return the reservation once reconciled."""
    for alloc in await allocations(db, rid):
        parent = cgroup_slice(slice_of or alloc["id"])
        assert await report(
            service,
            alloc,
            "bound",
            cdiDevices=cdi(alloc["device_ids"]),
            envFile=f"/run/bcd/allocations/{alloc['id']}.env",
            cgroupParent=extra.get("cgroupParent", parent),
        )
    await run(db)
    return await get(service, rid)


async def test_the_allocations_own_slice_is_kept_and_shown(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    rid = (await create(service, "own"))["id"]
    await run(db)
    [alloc] = await allocations(db, rid)
    view = await _bind(service, db, rid)
    assert view["state"] == "active"
    assert view["binding"]["cgroupParent"] == f"bcd-alloc-{alloc['id']}.slice"
    [stored] = await allocations(db, rid)
    assert stored["report"]["cgroupParent"] == view["binding"]["cgroupParent"]


async def test_a_node_cannot_point_a_reservation_at_another_allocations_slice(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    victim = (await create(service, "victim"))["id"]
    attacker = (await create(service, "attacker"))["id"]
    await run(db)
    [victim_alloc] = await allocations(db, victim)
    view = await _bind(service, db, attacker, slice_of=victim_alloc["id"])
    assert view["state"] == "active"  # the binding counts; only the false slice is dropped
    assert "cgroupParent" not in view["binding"]
    [stored] = await allocations(db, attacker)
    assert "cgroupParent" not in stored["report"]


@pytest.mark.parametrize(
    "claimed",
    [
        "../bcd-alloc-x.slice",
        "/sys/fs/cgroup/system.slice",
        "system.slice",
        "bcd-alloc-.slice",
        "",
        42,
    ],
)
async def test_a_slice_that_is_not_the_allocations_name_is_dropped(
    db: Database, service: ReservationService, claimed: Any
) -> None:
    await world(db)
    rid = (await create(service, "odd"))["id"]
    await run(db)
    view = await _bind(service, db, rid, cgroupParent=claimed)
    assert view["state"] == "active"
    assert "cgroupParent" not in view["binding"]


async def test_a_kubernetes_binding_keeps_no_slice(
    db: Database, service: ReservationService
) -> None:
    await world(db, policy={"kubernetes": True}, labels={K8S_LABEL: ("true", "system")})
    rid = (await create(service, "k8s", binding="kubernetes"))["id"]
    await run(db)
    view = await _bind(service, db, rid)  # even its own allocation's slice name
    assert view["state"] == "active"
    assert "cgroupParent" not in view["binding"]
