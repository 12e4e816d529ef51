"""A pool's ``policy.kubernetes.api`` against a real PostgreSQL: a ``dra`` pool's allocations
say so to their node (``kubernetesApi``, no extended resource), and the api of a pool switches
only while no live reservation uses it, refused in the pool write's own transaction."""

from __future__ import annotations

import time
from typing import Any

import pytest

from bettercompute.core.errors import ComputeError
from bettercompute.kube import allocations
from bettercompute.service.reconciling import Reconciler
from bettercompute.service.reservations import ReservationService
from bettercompute.store import desired, inventory
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.support.world import World

DRA = {"kubernetes": {"api": "dra"}}
#: The system label a node needs to take ``binding: kubernetes`` (its agent serves pods).
K8S_LABEL = "bc.dev/cap.binding.kubernetes"


def kube_input(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "tenantId": "acme",
        "poolId": "pool_k",
        "devices": [{"class": "gpu", "count": 2}],
        "duration": "8h",
        "binding": "kubernetes",
        "idempotencyKey": "k-1",
    }
    body.update(overrides)
    return body


async def world(db: Database, policy: dict[str, Any]) -> None:
    await (
        World(db)
        .tenant("acme")
        .pool("pool_k", owner="acme", policy=policy)
        .nodes("pool_k", 1, labels={K8S_LABEL: ("true", "system")})
        .quota("acme", "gpu:H100", 64)
        .build()
    )


async def set_policy(db: Database, policy: dict[str, Any]) -> None:
    await inventory.upsert_pool(
        db,
        pool_id="pool_k",
        owner_tenant_id="acme",
        region="eu-west-1",
        gpu_model="H100",
        policy=policy,
    )


async def stored_policy(db: Database) -> dict[str, Any]:
    async with db.connection() as conn:
        row = await (await conn.execute("SELECT policy FROM pools WHERE id = 'pool_k'")).fetchone()
    assert row is not None
    return dict(row["policy"])


async def test_a_dra_pools_allocations_tell_the_node_to_use_claims(
    db: Database, service: ReservationService
):
    await world(db, DRA)
    view = await service.create(caller(), kube_input())
    await Reconciler(db).run_once()  # its window has begun: the allocation is the node's now
    [node] = await desired.nodes_of(db, reservation_id=view["id"])
    [wanted] = await desired.for_node(db, node_id=node)
    assert wanted["kubernetesApi"] == "dra"
    spec = allocations.allocation_spec(wanted, node=node)
    assert spec["kubernetesApi"] == "dra"
    # Claims, not an extended resource: the device plugin advertises nothing for it.
    assert "resourceName" not in spec


@pytest.mark.parametrize("policy", [{"kubernetes": True}, {"kubernetes": {}}])
async def test_a_device_plugin_pools_allocations_keep_their_extended_resource(
    db: Database, service: ReservationService, policy: dict[str, Any]
):
    await world(db, policy)
    view = await service.create(caller(), kube_input())
    await Reconciler(db).run_once()
    [node] = await desired.nodes_of(db, reservation_id=view["id"])
    [wanted] = await desired.for_node(db, node_id=node)
    assert wanted["kubernetesApi"] == "devicePlugin"
    spec = allocations.allocation_spec(wanted, node=node)
    assert spec["kubernetesApi"] == "devicePlugin"
    assert spec["resourceName"].startswith("bcd.dev/rsv-")


async def test_the_api_does_not_switch_while_a_live_reservation_uses_the_pool(
    db: Database, service: ReservationService
):
    await world(db, {"kubernetes": True})
    later = int(time.time() * 1000) + 3_600_000
    view = await service.create(caller(), kube_input(start=later))
    assert view["state"] == "placed"
    with pytest.raises(ComputeError) as refused:
        await set_policy(db, DRA)
    assert refused.value.code == "INVALID_STATE"
    assert refused.value.details["field"] == "policy.kubernetes.api"
    assert "policy.kubernetes.api" in refused.value.message
    assert view["id"] in refused.value.message
    assert await stored_policy(db) == {"kubernetes": True}  # nothing of the write kept
    # Other changes go on while it is live, as long as the api stays the same.
    await set_policy(db, {"kubernetes": {"api": "devicePlugin"}, "podAccess": "reservation"})
    assert (await stored_policy(db))["podAccess"] == "reservation"
    await service.cancel(caller(), {"tenantId": "acme", "reservationId": view["id"]})
    await set_policy(db, DRA)
    assert await stored_policy(db) == DRA
