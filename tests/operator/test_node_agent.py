"""The operator and the node agent together, nothing played by the test: the agent publishes
its GPUNode, the operator books its GPUs, writes the DeviceAllocation, the agent binds it and
hands the devices to the kubelet stand-in, and a release waits for the pod that holds them.

The real operator (kopf, reconciler, PostgreSQL) and the real agent (``agent.started``) run
against one API stand-in; the kubelet and PodResources stand-ins speak gRPC on unix sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from bettercompute.deviceplugin.agent import Agent, started
from bettercompute.deviceplugin.signing import NodeKey
from bettercompute.operator.running import Operator
from bettercompute.store.database import Database
from tests.deviceplugin import agents
from tests.deviceplugin.conftest import GPU, MIG, NODE, SLOT, Node
from tests.support import kubeworld, nodecerts
from tests.support.kubeobjects import DEVICEALLOCATIONS, GPUPOOLS, RESERVATIONS
from tests.support.kubeserver import KubeApi

NS = kubeworld.OPERATOR_NAMESPACE


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    async with agents.standing_node() as standing:
        yield standing


@pytest.fixture
async def agent(
    kube_api: KubeApi, db: Database, operator: Operator, node: Node
) -> AsyncIterator[Agent]:
    """A tenant namespace, a GPUPool taking nodes labelled bcd.dev/pool=h100, and the agent of
    a node with that label: its GPUNode is the only one, and the agent writes it."""
    await kube_api.create(kubeworld.namespace("ml", tenant="acme"))
    await kube_api.create(kubeworld.namespace(NS, tenant=None))
    await kube_api.create(kubeworld.gpuquota("acme", {"gpu:H100": 64}))
    await kube_api.create(kubeworld.gpupool("h100"))
    config = agents.agent_config(kube=kube_api, node=node)
    async with started(config) as running:
        # Enrolled: the node's own key, certified by the authority the operator trusts.
        certificate = nodecerts.certify(NODE, NodeKey.load(config.node_key))
        running.plugin.converger.certificate = lambda: certificate
        await node.kubelet.wait_registered([GPU, MIG, SLOT])
        # Not GPUPool status.nodes: the operator counts a pool's nodes only when the pool is
        # applied, and here the GPUNode may appear after that.
        await _atoms_stored(db, count=5)
        yield running


async def _atoms_stored(db: Database, *, count: int, within_s: float = 5.0) -> None:
    """The operator stored the node's GPUs as bookable atoms (nothing to wait on but a poll)."""
    async with asyncio.timeout(within_s):
        while True:
            async with db.connection() as conn:
                row = await (
                    await conn.execute(
                        "SELECT count(*) AS n FROM atoms WHERE node_id = %s AND NOT retired",
                        (NODE,),
                    )
                ).fetchone()
            if row is not None and row["n"] >= count:
                return
            await asyncio.sleep(0.02)


def _state(state: str):
    return lambda o: bool(o) and (o.get("status") or {}).get("state") == state


def _details(obj: dict | None, kind: str) -> dict:
    """What ``status.conditionDetails`` says beyond the ``kind`` condition."""
    return (((obj or {}).get("status") or {}).get("conditionDetails") or {}).get(kind) or {}


def _conditions(o) -> dict[str, dict]:
    """The conditions that hold (a cleared one stays, as status "False")."""
    found = ((o or {}).get("status") or {}).get("conditions") or ()
    return {c["type"]: c for c in found if c.get("status") == "True"}


async def _allocation_of(kube: KubeApi, rid: str) -> dict:
    async with asyncio.timeout(5):
        while True:
            seen = kube.emulator.revision
            for obj in await kube.list(DEVICEALLOCATIONS, NS):
                if obj["spec"]["reservationId"] == rid:
                    return obj
            await kube.emulator.written(since=seen)


async def test_a_kubernetes_reservation_reaches_the_kubelet_and_is_released_after_its_pod(
    kube_api: KubeApi, node: Node, agent: Agent
):
    await kube_api.create(kubeworld.reservation("train").gpus(2).kubernetes().obj())
    active = await kube_api.wait_for(RESERVATIONS, "ml", "train", _state("active"))
    rid = active["status"]["id"]
    assert active["status"]["nodes"] == NODE
    # kubectl get gp: the pool's status counts the two devices as bound (held while active).
    await kube_api.wait_for(
        GPUPOOLS,
        None,
        "h100",
        lambda o: (
            (((o or {}).get("status") or {}).get("devices") or {}).get("gpu", {}).get("bound") == 2
        ),
    )

    # Active with exactly the CDI devices the agent reported, and those devices advertised.
    allocation = await _allocation_of(kube_api, rid)
    name, devices = allocation["metadata"]["name"], allocation["spec"]["deviceIds"]
    assert allocation["status"]["phase"] == "Bound"
    assert allocation["status"]["nodeName"] == NODE
    reported = allocation["status"]["cdiDevices"]
    assert reported == [f"bcd.dev/gpu={d}" for d in devices]
    assert sorted(active["status"]["binding"]["cdiDevices"]) == sorted(reported)
    assert active["status"]["binding"]["nodeId"] == NODE
    own = active["status"]["resourceName"]
    await node.kubelet.wait_registered([own], within=3.0)
    await node.stream(own).wait_devices({d: "Healthy" for d in devices})
    response = await node.stream(own).allocate(devices)
    assert response.envs["BCD_RESERVATION_ID"] == rid

    # Released while a pod holds a device: DevicesHeld names it; nothing is advertised.
    node.pod_resources.holding({"ml/trainer-0": {own: devices[:1]}})
    await kube_api.patch(RESERVATIONS, "ml", "train", {"spec": {"release": True}})
    held = await kube_api.wait_for(
        RESERVATIONS,
        "ml",
        "train",
        lambda o: _details(o, "DevicesHeld").get("pods") == ["ml/trainer-0"],
    )
    assert _conditions(held)["DevicesHeld"]["reason"] == "PodsHoldDevices"
    await node.stream(own).wait_devices({})
    assert (node.root / "cdi" / f"bcd-{allocation['spec']['allocationId']}.json").is_file()

    # The pod is gone: the devices are free, DevicesHeld goes, the DeviceAllocation is deleted.
    node.pod_resources.holding({})
    await kube_api.wait_for(
        RESERVATIONS, "ml", "train", lambda o: "DevicesHeld" not in _conditions(o)
    )
    await kube_api.wait_for(DEVICEALLOCATIONS, NS, name, lambda o: o is None)
    assert node.files_on_disk() == ["key/node-key.pem"]
    assert node.stream(own).latest() == {}
