"""Pods and a reservation's devices through the real admission chain, scheduler and Node
authorizer.

A tenant's pod names its reservation; the real API server sends it through our mutating and
validating pod webhooks (the chart's configurations, ``matchConditions`` evaluated by the real
CEL), the real scheduler places it on the node whose kubelet advertised the reservation's
resource, and the node, as ``system:node:<name>``, marks it running. Attack tests: a pod of
another tenant's namespace asking the reservation's resource is refused by the admission
chain; another node cannot write the status of a pod bound elsewhere.
"""

from __future__ import annotations

from typing import Any

import pytest

from bettercompute.operator.running import Operator
from tests.controlplane.cluster import ApiError
from tests.controlplane.nodes import HEALTHY, FakeNode
from tests.controlplane.plugin import Cluster
from tests.controlplane.scenarios import (
    PLACED,
    RESERVATIONS,
    call,
    pool_with_nodes,
    reservation,
    state_is,
    tenant_namespace,
    wait_for,
)

PODS = "/api/v1/namespaces/{ns}/pods"


def pod(name: str, namespace: str, *, label: str | None = None, **limits: int) -> dict[str, Any]:
    resources = {("bcd.dev/gpu" if k == "gpu" else k): str(v) for k, v in limits.items()}
    labels = {"app": name}
    if label is not None:
        labels["bcd.dev/reservation"] = label
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "containers": [
                {"name": "main", "image": "trainer:1", "resources": {"limits": resources}}
            ],
        },
    }


async def _booked(cluster: Cluster) -> tuple[str, FakeNode]:
    """acme's Reservation ``train`` (2 GPUs, bound to Kubernetes) placed on a node whose kubelet
    advertises the reservation's resource; (resource name, node)."""
    plane = cluster.plane
    await tenant_namespace(plane, "ml", tenant="acme", user="alice@acme")
    await tenant_namespace(plane, "team-b", tenant="globex", user="mallory@globex")
    (node_name,) = await pool_with_nodes(plane, tenants=("acme", "globex"))
    await call(
        plane,
        "POST",
        RESERVATIONS.format(ns="ml"),
        reservation(
            "train", "ml", gpus=2, devices=[{"class": "gpu", "count": 2}], binding="kubernetes"
        ),
        token=plane.tokens["alice@acme"],
    )
    placed = await wait_for(
        plane,
        f"{RESERVATIONS.format(ns='ml')}/train",
        lambda o: (
            state_is(*PLACED)(o) and bool(((o or {}).get("status") or {}).get("resourceName"))
        ),
    )
    assert placed is not None
    resource = str(placed["status"]["resourceName"])
    assert resource.startswith("bcd.dev/rsv-")
    node = FakeNode(plane, node_name, labels={"bcd.dev/pool": "h100"})
    await node.register()
    await node.advertise(resource, {"GPU-0": HEALTHY, "GPU-1": HEALTHY})
    return resource, node


async def test_a_reservations_pod_is_rewritten_scheduled_onto_its_node_and_run(
    cluster: Cluster, real_operator: Operator
):
    plane = cluster.plane
    resource, node = await _booked(cluster)
    created = await call(
        plane,
        "POST",
        PODS.format(ns="ml"),
        pod("trainer", "ml", label="train", gpu=2),
        token=plane.tokens["alice@acme"],
    )
    limits = created["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {resource: "2"}, "the mutating webhook gave the pod its reservation's resource"
    scheduled = await wait_for(
        plane,
        f"{PODS.format(ns='ml')}/trainer",
        lambda o: bool(((o or {}).get("spec") or {}).get("nodeName")),
    )
    assert scheduled is not None
    assert scheduled["spec"]["nodeName"] == node.name
    running = await node.run_pod("ml", "trainer")
    assert running["status"]["phase"] == "Running"
    # A third GPU is more than the node advertises for the reservation: it stays pending.
    await call(
        plane,
        "POST",
        PODS.format(ns="ml"),
        pod("extra", "ml", **{resource: 1}, label="train"),
        token=plane.tokens["alice@acme"],
    )
    unschedulable = await wait_for(
        plane,
        f"{PODS.format(ns='ml')}/extra",
        lambda o: any(
            c.get("reason") == "Unschedulable"
            for c in ((o or {}).get("status") or {}).get("conditions") or ()
        ),
    )
    assert unschedulable is not None
    assert not unschedulable["spec"].get("nodeName")


async def test_another_tenants_pod_never_gets_the_reservations_resource(
    cluster: Cluster, real_operator: Operator
):
    """mallory, in her own namespace, asks acme's reservation's resource by name, and by the
    label: the real admission chain calls our webhooks and refuses both."""
    plane = cluster.plane
    resource, _node = await _booked(cluster)
    mallory = plane.tokens["mallory@globex"]
    for attempt in (
        pod("thief", "team-b", **{resource: 1}),
        pod("thief-2", "team-b", label="train", gpu=1),
    ):
        with pytest.raises(ApiError) as refused:
            await call(plane, "POST", PODS.format(ns="team-b"), attempt, token=mallory)
        assert refused.value.status in (400, 403), refused.value.body
        assert "denied the request" in str(refused.value.body.get("message")), refused.value.body
    listed = await call(plane, "GET", PODS.format(ns="team-b"))
    assert listed["items"] == []


async def test_a_node_cannot_write_another_nodes_pod(cluster: Cluster, real_operator: Operator):
    """The Node authorizer: the pod is bound to the reservation's node; another node's kubelet
    credentials are refused when they try to write its status."""
    plane = cluster.plane
    resource, node = await _booked(cluster)
    await call(
        plane,
        "POST",
        PODS.format(ns="ml"),
        pod("trainer", "ml", label="train", gpu=1),
        token=plane.tokens["alice@acme"],
    )
    await wait_for(
        plane,
        f"{PODS.format(ns='ml')}/trainer",
        lambda o: ((o or {}).get("spec") or {}).get("nodeName") == node.name,
    )
    intruder = FakeNode(plane, "intruder-node")
    await intruder.register()
    with pytest.raises(ApiError) as refused:
        await intruder.run_pod("ml", "trainer")
    assert refused.value.status == 403
    # The intruder's credentials, writing the reservation's node's status.
    intruder.name, own = node.name, intruder.name
    try:
        with pytest.raises(ApiError) as refused_node:
            await intruder.advertise(resource, {"GPU-9": HEALTHY})
    finally:
        intruder.name = own
    assert refused_node.value.status == 403
