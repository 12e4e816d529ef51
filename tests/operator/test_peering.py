"""Several operator replicas: kopf peering lets one act, the store keeps it idempotent anyway."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.operator.conftest import apply_world
from tests.support import kubeworld
from tests.support.kubeobjects import CLUSTER_KOPF_PEERINGS, RESERVATIONS
from tests.support.policies import CountingPolicy

PEERING = {
    "apiVersion": "kopf.dev/v1",
    "kind": "ClusterKopfPeering",
    "metadata": {"name": "better-compute"},
}


def _peers(count: int):
    return lambda o: bool(o) and len(o.get("status") or {}) >= count


async def test_two_operators_process_a_reservation_once(
    kube_api, db, start_operator: Callable[..., Any], policy: CountingPolicy
):
    await kube_api.create(PEERING)
    async with start_operator(standalone=False, priority=10) as leader:
        world = await apply_world(kube_api, db)
        async with start_operator(standalone=False, priority=1) as standby:
            await kube_api.wait_for(CLUSTER_KOPF_PEERINGS, None, "better-compute", _peers(2))
            await world.kube.create(kubeworld.reservation("train").gpus(2).obj())
            placed = await world.kube.wait_for(
                RESERVATIONS, "ml", "train", lambda o: (o.get("status") or {}).get("state")
            )
            assert placed["status"]["state"] in ("placed", "binding")
            assert leader.runtime.door.admissions == 1
            assert standby.runtime.door.admissions == 0
            assert policy.creates == 1
