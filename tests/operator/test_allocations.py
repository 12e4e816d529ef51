"""A ``binding: kubernetes`` reservation through its DeviceAllocation: the operator creates it
at the start, relays the node's reports, and shows DevicesHeld while pods hold the devices."""

from __future__ import annotations

import asyncio

from bettercompute.core import moments
from bettercompute.operator.running import Operator
from tests.operator.conftest import World
from tests.support import kubeworld
from tests.support.kubeobjects import DEVICEALLOCATIONS, RESERVATIONS

NS = kubeworld.OPERATOR_NAMESPACE


def _condition(kind: str, status: str):
    def check(o: dict | None) -> bool:
        found = [c for c in ((o or {}).get("status") or {}).get("conditions") or ()]
        return any(c["type"] == kind and c["status"] == status for c in found)

    return check


def _state(state: str):
    return lambda o: bool(o) and (o.get("status") or {}).get("state") == state


def _details(obj, kind: str) -> dict:
    """What ``status.conditionDetails`` says beyond the ``kind`` condition."""
    return (((obj or {}).get("status") or {}).get("conditionDetails") or {}).get(kind) or {}


def _conditions(o) -> dict[str, dict]:
    """The conditions that hold (a cleared one stays, as status "False")."""
    found = ((o or {}).get("status") or {}).get("conditions") or ()
    return {c["type"]: c for c in found if c.get("status") == "True"}


async def _allocation_of(world: World, rid: str) -> dict:
    """The reservation's DeviceAllocation, once it exists (woken by each stand-in write)."""
    async with asyncio.timeout(5):
        while True:
            seen = world.kube.emulator.revision
            items = [
                o
                for o in await world.kube.list(DEVICEALLOCATIONS, NS)
                if o["spec"]["reservationId"] == rid
            ]
            if items:
                return items[0]
            await world.kube.emulator.written(since=seen)


async def test_a_kubernetes_binding_goes_through_its_device_allocation(
    world: World, operator: Operator
):
    node = world.nodes[0]
    await world.kube.create(kubeworld.reservation("train").gpus(2).kubernetes().obj())
    placed = await world.kube.wait_for(
        RESERVATIONS, "ml", "train", lambda o: (o.get("status") or {}).get("id")
    )
    rid = placed["status"]["id"]

    # The window starts at placement: the reservation binds and its allocation appears.
    allocation = await _allocation_of(world, rid)
    spec = allocation["spec"]
    assert allocation["metadata"]["labels"] == {"bcd.dev/node": node, "bcd.dev/reservation": rid}
    assert (spec["nodeName"], spec["class"], spec["binding"]) == (node, "gpu", "kubernetes")
    assert len(spec["deviceIds"]) == 2
    assert spec["release"] is False
    # The host share it booked (128 CPUs less 2 kept, and 2048 GiB, over 8 GPUs; 2 GPUs'
    # worth), as limits, with a cpuset on its GPUs' NUMA node less the reserved CPUs.
    assert spec["limits"] == {
        "cpuMillis": 30_000,
        "memoryBytes": 512 * 2**30,
        "hugepages1Gi": 0,
        "cpus": "2-63",
    }
    status = (await world.kube.wait_for(RESERVATIONS, "ml", "train", _state("binding")))["status"]
    assert status["hostShare"] == {"vcpu": 30, "memoryGiB": 512}
    assert status["resources"] == {"vcpu": 30, "memoryGiB": 512, "hugepages1Gi": 0}

    # Another node's report about this allocation is ignored.
    name = allocation["metadata"]["name"]
    await world.kube.patch(
        DEVICEALLOCATIONS, NS, name, {"status": kubeworld.bound("other-node", spec)}, status=True
    )
    await asyncio.sleep(0.3)  # time for a wrongly accepted report to be judged
    async with world.db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT state FROM allocations WHERE id = %s", (spec["allocationId"],)
            )
        ).fetchone()
    assert row["state"] == "desired"
    assert world.kube.stored(RESERVATIONS, "ml", "train")["status"]["state"] == "binding"
    # The node's own report binds it: active, with the CDI devices it reported.
    await world.kube.patch(
        DEVICEALLOCATIONS,
        NS,
        name,
        {"status": kubeworld.bound(node, spec, at="2026-12-02T00:00:02Z")},
        status=True,
    )
    # As `kubectl wait --for=condition=Ready` polls: Ready turns True once it is active.
    active = await world.kube.wait_for(RESERVATIONS, "ml", "train", _condition("Ready", "True"))
    assert active is not None
    assert active["status"]["state"] == "active"
    assert sorted(active["status"]["binding"]["cdiDevices"]) == sorted(
        f"bcd.dev/gpu={d}" for d in spec["deviceIds"]
    )
    summary = {c["type"]: c for c in active["status"]["conditions"]}
    assert (summary["Ready"]["reason"], summary["Placed"]["status"]) == ("Active", "True")
    assert summary["Ready"]["observedGeneration"] == active["metadata"]["generation"]

    # Release while a pod still holds the devices: DevicesHeld with the pod, since the release.
    await world.kube.patch(RESERVATIONS, "ml", "train", {"spec": {"release": True}})
    released = await world.kube.wait_for(RESERVATIONS, "ml", "train", _state("released"))
    assert released is not None
    summary = {c["type"]: c for c in released["status"]["conditions"]}
    assert (summary["Ready"]["status"], summary["Ready"]["reason"]) == ("False", "Released")
    assert summary["Placed"]["status"] == "False"
    releasing = await world.kube.wait_for(
        DEVICEALLOCATIONS, NS, name, lambda o: o["spec"]["release"] is True
    )
    since = 1_790_000_000_000
    await world.kube.patch(
        DEVICEALLOCATIONS,
        NS,
        name,
        {
            "status": kubeworld.releasing(
                node, spec, pods=["ml/trainer-0"], since=since, at="2026-12-02T00:00:03Z"
            )
        },
        status=True,
    )
    held = await world.kube.wait_for(
        RESERVATIONS,
        "ml",
        "train",
        lambda o: _details(o, "DevicesHeld").get("pods") == ["ml/trainer-0"],
    )
    condition = _conditions(held)["DevicesHeld"]
    assert condition["reason"] == "PodsHoldDevices"
    assert node in condition["message"]
    since = _details(held, "DevicesHeld")["since"]
    assert moments.parse_ms(since) > 0, since  # a time people read: RFC 3339
    assert releasing["spec"]["nodeName"] == node

    # The pod is gone: the node reports released, DevicesHeld goes, the allocation is deleted.
    await world.kube.patch(
        DEVICEALLOCATIONS,
        NS,
        name,
        {"status": kubeworld.released(node, spec, at="2026-12-02T00:00:04Z")},
        status=True,
    )
    await world.kube.wait_for(
        RESERVATIONS, "ml", "train", lambda o: "DevicesHeld" not in _conditions(o)
    )
    await world.kube.wait_for(DEVICEALLOCATIONS, NS, name, lambda o: o is None)


async def test_a_hold_binding_gets_an_allocation_too_and_a_failed_report_re_places(
    world: World, operator: Operator
):
    await world.kube.create(kubeworld.reservation("hold").gpus(1).obj())
    placed = await world.kube.wait_for(
        RESERVATIONS, "ml", "hold", lambda o: (o.get("status") or {}).get("id")
    )
    allocation = await _allocation_of(world, placed["status"]["id"])
    assert allocation["spec"]["binding"] == "hold"
    name = allocation["metadata"]["name"]
    await world.kube.patch(
        DEVICEALLOCATIONS,
        NS,
        name,
        {
            "status": kubeworld.failed(
                world.nodes[0],
                allocation["spec"],
                reason="no such device",
                at="2026-12-02T00:00:05Z",
            )
        },
        status=True,
    )
    # The failed allocation is no longer the node's business: its object is deleted.
    await world.kube.wait_for(DEVICEALLOCATIONS, NS, name, lambda o: o is None)
