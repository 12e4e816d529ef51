"""A ``dra`` pool end to end on the real control plane: only the kubelet is a stand-in.

The real operator (under the chart's account) books the Reservation and writes its claim
template; the real node agent (under its chart account, with a token bound to its pod) binds
the DeviceAllocation, publishes the booked devices in its ResourceSlice and registers its DRA
plugin with the DRA kubelet stand-in (``tests/support/drakubelet.py``, real gRPC over unix
sockets); the real kube-controller-manager makes the pod's ResourceClaim from the template and
the real kube-scheduler allocates it from our slice and binds the pod. The stand-in then
prepares and unprepares the claim as the kubelet of that node would.

Attacks (with the chart's admission policies on, ``dra_chart``): a claim of another namespace
that the admission policies let through only because the cluster admin made a DeviceClass
matching every driver is allocated the reservation's devices by the real scheduler, and the
node refuses to prepare it; a forged report for a DRA allocation activates nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from bettercompute.deviceplugin.agent import Agent, started
from bettercompute.kube import dra
from bettercompute.operator.running import Operator
from bettercompute.store.database import Database
from tests.controlplane import install
from tests.controlplane.cluster import ApiError, ControlPlane
from tests.controlplane.plugin import Cluster
from tests.controlplane.scenarios import (
    RESERVATIONS,
    call,
    conditions,
    reservation,
    state_is,
    tenant_namespace,
    wait_for,
)
from tests.controlplane.test_real_dra_admission import (  # noqa: F401 - a module fixture
    dra_chart,
    dra_pool,
)
from tests.controlplane.test_real_node_agent import (  # noqa: F401 - fixtures
    agent_token,
    nodes,
    standing,
)
from tests.deviceplugin import agents
from tests.deviceplugin.conftest import NODE, Node
from tests.support import kubeworld
from tests.support.drakubelet import Claim, DraKubelet

NS, OTHER_NS = "ml", "intruders"
ALICE = "alice@acme"
RESOURCE = "/apis/resource.k8s.io/v1"
SLICE = f"{RESOURCE}/resourceslices/{dra.slice_name(NODE)}"
CLAIMS = RESOURCE + "/namespaces/{ns}/resourceclaims"
TEMPLATES = RESOURCE + "/namespaces/{ns}/resourceclaimtemplates"
PODS = "/api/v1/namespaces/{ns}/pods"
MERGE = {"content_type": "application/merge-patch+json"}


@contextlib.asynccontextmanager
async def dra_agent(cluster: Cluster, node: Node, token: str) -> AsyncIterator[Agent]:
    """The real agent with ``--dra``, as the chart runs it with ``dra.enabled`` (its kubelet
    folders are the stand-in's)."""
    kubeconfig = await asyncio.to_thread(cluster.plane.kubeconfig, f"agent-{NODE}", token=token)
    config = agents.agent_config(
        kube=None,
        node=node,
        node_name=NODE,
        kubeconfig=kubeconfig,
        node_labels=None,
        dra=True,
        kubelet_plugins_dir=node.root / "kplugins",
        kubelet_registry_dir=registry_dir(node),
    )
    async with started(config) as running:
        yield running


def registry_dir(node: Node) -> Path:
    path = node.root / "registry"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture
async def kubelet(standing: Node) -> AsyncIterator[DraKubelet]:  # noqa: F811 - the fixture
    stand_in = DraKubelet(registry_dir(standing))
    await stand_in.start()
    yield stand_in
    await stand_in.stop()


def pod_using(name: str, template: str) -> dict[str, Any]:
    """A tenant's pod that uses ``template`` (the Reservation's claim template)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}],
            "containers": [
                {
                    "name": "main",
                    "image": "cuda:test",
                    "resources": {"claims": [{"name": "gpus"}]},
                }
            ],
        },
    }


async def allocated_claim(cluster: Cluster, namespace: str, pod: str) -> dict[str, Any]:
    """The pod's claim once the real scheduler allocated it and bound the pod to a node."""
    bound = await wait_for(
        cluster.plane,
        f"{PODS.format(ns=namespace)}/{pod}",
        lambda o: (
            bool(((o or {}).get("spec") or {}).get("nodeName"))
            and bool(((o or {}).get("status") or {}).get("resourceClaimStatuses"))
        ),
        timeout_s=60,
    )
    assert bound is not None
    assert bound["spec"]["nodeName"] == NODE
    (status,) = bound["status"]["resourceClaimStatuses"]
    claim = await wait_for(
        cluster.plane,
        f"{CLAIMS.format(ns=namespace)}/{status['resourceClaimName']}",
        lambda o: bool(((o or {}).get("status") or {}).get("allocation")),
    )
    assert claim is not None
    return claim


def as_claim(obj: dict[str, Any]) -> Claim:
    meta = obj["metadata"]
    return Claim(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


def bcd_cdi(devices: Any) -> list[str]:
    """Our CDI devices among a prepare answer's: the booked devices' and the claim's own spec
    (``bcd.dev/gpu=claim-<uid>-<request>``, its environment), which must come exactly once."""
    ids = [i for d in devices for i in d.cdi_device_ids if i.startswith("bcd.dev/gpu=")]
    assert len([i for i in ids if i.startswith("bcd.dev/gpu=claim-")]) == 1, ids
    return sorted(i for i in ids if not i.startswith("bcd.dev/gpu=claim-"))


async def dra_tenancy(plane: ControlPlane) -> None:
    """Tenant acme's namespace (alice may manage its Reservations and Pods), its quota, and
    the dra pool ``h100`` (nodes join it by their labels)."""
    await tenant_namespace(plane, NS, tenant="acme", user=ALICE)
    await asyncio.to_thread(plane.apply, kubeworld.gpuquota("acme", {"gpu:H100": 64}))
    await asyncio.to_thread(plane.apply, dra_pool("h100"))


async def force_delete_pod(cluster: Cluster, namespace: str, name: str) -> None:
    # Bound to a node whose kubelet never confirms: only a forced delete ends it.
    with contextlib.suppress(ApiError):
        await call(
            cluster.plane, "DELETE", f"{PODS.format(ns=namespace)}/{name}?gracePeriodSeconds=0"
        )


async def test_a_dra_reservation_reaches_its_pod_through_the_real_scheduler(
    cluster: Cluster,
    dra_chart: None,  # noqa: F811 - the fixture
    start_real_operator: Callable[..., contextlib.AbstractAsyncContextManager[Operator]],
    nodes: dict[str, dict[str, Any]],  # noqa: F811
    standing: Node,  # noqa: F811
    kubelet: DraKubelet,
) -> None:
    plane = cluster.plane
    alice = plane.tokens[ALICE]
    rsv = f"{RESERVATIONS.format(ns=NS)}/train"
    await dra_tenancy(plane)
    token = await agent_token(cluster, nodes[NODE])

    async with start_real_operator():
        async with dra_agent(cluster, standing, token):
            await kubelet.wait_registered(dra.DRIVER, within=30)
            await wait_for(
                plane,
                "/apis/bcd.dev/v1alpha1/gpupools/h100",
                lambda o: ((o or {}).get("status") or {}).get("nodes") == 1,
                timeout_s=60,
            )
            body = reservation("train", NS, gpus=2, binding="kubernetes")
            await call(plane, "POST", RESERVATIONS.format(ns=NS), body, token=alice)
            active = await wait_for(plane, rsv, state_is("active"), timeout_s=60)
            assert active is not None
            status = active["status"]
            assert status["claimTemplate"] == "train"
            booked = sorted(status["binding"]["cdiDevices"])
            assert len(booked) == 2
            uuids = sorted(d.split("=", 1)[1] for d in booked)

            # The node published exactly the booked devices, with what claims select on.
            published = await wait_for(
                plane, SLICE, lambda o: len(((o or {}).get("spec") or {}).get("devices") or ()) == 2
            )
            assert published is not None
            spec = published["spec"]
            assert (spec["driver"], spec["nodeName"], spec["pool"]["name"]) == (
                dra.DRIVER,
                NODE,
                NODE,
            )
            attributes = [d["attributes"] for d in spec["devices"]]
            assert sorted(a["uuid"]["string"] for a in attributes) == uuids
            assert {a["reservation"]["string"] for a in attributes} == {status["id"]}
            assert {a["namespace"]["string"] for a in attributes} == {NS}

            # The tenant's pod names the template; the real controller-manager makes its claim
            # and the real scheduler allocates it our devices and binds it to our node.
            await call(
                plane, "POST", PODS.format(ns=NS), pod_using("trainer", "train"), token=alice
            )
            claim = await allocated_claim(cluster, NS, "trainer")
            results = claim["status"]["allocation"]["devices"]["results"]
            assert sorted(r["device"] for r in results) == sorted(dra.device_name(u) for u in uuids)
            assert {(r["driver"], r["pool"]) for r in results} == {(dra.DRIVER, NODE)}

            # The kubelet prepares it: exactly the booked CDI devices.
            answer = (await kubelet.prepare([as_claim(claim)]))[claim["metadata"]["uid"]]
            assert answer.error == ""
            assert bcd_cdi(answer.devices) == booked
            holder = f"{NS}/{claim['metadata']['name']}"
            await wait_for(
                plane,
                rsv,
                lambda o: (
                    holder in (((o or {}).get("status") or {}).get("binding") or {}).get("pods", ())
                ),
            )

        # The agent restarts: it registers again and still knows the prepared claim.
        after = kubelet.accepted()
        async with dra_agent(cluster, standing, token):
            await kubelet.wait_registered(dra.DRIVER, after=after, within=30)
            again = (await kubelet.prepare([as_claim(claim)]))[claim["metadata"]["uid"]]
            assert (again.error, bcd_cdi(again.devices)) == ("", booked)
            still = await wait_for(plane, rsv, state_is("active"))
            assert still is not None

    # The operator restarts too; nothing is lost: the reservation, its template, its slice.
    async with start_real_operator(), dra_agent(cluster, standing, token):
        await kubelet.wait_registered(dra.DRIVER, after=kubelet.accepted() - 1, within=30)
        template = await call(plane, "GET", f"{TEMPLATES.format(ns=NS)}/train")
        shown = await wait_for(plane, rsv, state_is("active"))
        assert shown is not None
        assert shown["status"]["claimTemplate"] == template["metadata"]["name"]

        # Extended: the template (selecting by attributes) stays as it is.
        window = shown["status"]["window"]
        await call(
            plane,
            "PATCH",
            rsv,
            {"spec": {"extendBy": "1h", "extendKey": "train-ext-1"}},
            token=alice,
            **MERGE,
        )
        await wait_for(
            plane, rsv, lambda o: ((o or {}).get("status") or {}).get("window") != window
        )
        unchanged = await call(plane, "GET", f"{TEMPLATES.format(ns=NS)}/train")
        assert unchanged["metadata"]["uid"] == template["metadata"]["uid"]

        # Released while the pod's claim is prepared: the devices stay booked, held by it.
        await call(plane, "PATCH", rsv, {"spec": {"release": True}}, token=alice, **MERGE)
        held = await wait_for(
            plane,
            rsv,
            lambda o: conditions(o).get("DevicesHeld", {}).get("status") == "True",
            timeout_s=60,
        )
        assert held is not None
        # Released, as the guide says, but its devices stay booked while the claim holds them.
        details = held["status"].get("conditionDetails") or {}
        assert details["DevicesHeld"]["pods"] == [holder]
        await wait_for(
            plane,
            f"{TEMPLATES.format(ns=NS)}/train",
            lambda o: o is None,
        )
        # No longer allocatable to anyone (an empty list, which the API server leaves out).
        await wait_for(plane, SLICE, lambda o: not ((o or {}).get("spec") or {}).get("devices"))

        # The pod goes; the kubelet unprepares its claim (twice: idempotent); released.
        await force_delete_pod(cluster, NS, "trainer")
        for _ in range(2):
            errors = await kubelet.unprepare([as_claim(claim)])
            assert errors == {claim["metadata"]["uid"]: ""}
        await wait_for(
            plane,
            rsv,
            lambda o: (
                o is None
                or (
                    state_is("released")(o)
                    and conditions(o).get("DevicesHeld", {}).get("status") != "True"
                )
            ),
            timeout_s=60,
        )


async def test_attack_another_namespaces_claim_that_got_through_is_refused_at_prepare(
    cluster: Cluster,
    dra_chart: None,  # noqa: F811 - the fixture
    real_operator: Operator,
    nodes: dict[str, dict[str, Any]],  # noqa: F811
    standing: Node,  # noqa: F811
    kubelet: DraKubelet,
) -> None:
    """The admission policies guard claims of our DeviceClass. A cluster admin who made a
    DeviceClass that matches every driver opened a way around them: another namespace's claim
    of that class selects the reservation's devices, and the real scheduler allocates them.
    The node is the second wall: it refuses to prepare the claim, so no container gets them."""
    plane = cluster.plane
    alice = plane.tokens[ALICE]
    await dra_tenancy(plane)
    await asyncio.to_thread(
        plane.apply, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OTHER_NS}}
    )
    everything = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "every-device"},
        "spec": {},
    }
    await asyncio.to_thread(plane.apply, everything)
    token = await agent_token(cluster, nodes[NODE])
    try:
        async with dra_agent(cluster, standing, token):
            await kubelet.wait_registered(dra.DRIVER, within=30)
            body = reservation("train", NS, gpus=2, binding="kubernetes")
            await call(plane, "POST", RESERVATIONS.format(ns=NS), body, token=alice)
            rsv = f"{RESERVATIONS.format(ns=NS)}/train"
            await wait_for(plane, rsv, state_is("active"), timeout_s=60)
            await wait_for(
                plane, SLICE, lambda o: len(((o or {}).get("spec") or {}).get("devices") or ()) == 2
            )
            stolen = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": "stolen", "namespace": OTHER_NS},
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "gpus",
                                "exactly": {
                                    "deviceClassName": "every-device",
                                    # Every device of every driver on the node: ours.
                                    "allocationMode": "All",
                                },
                            }
                        ]
                    }
                },
            }
            await call(plane, "POST", CLAIMS.format(ns=OTHER_NS), stolen)
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "thief", "namespace": OTHER_NS},
                "spec": {
                    "resourceClaims": [{"name": "gpus", "resourceClaimName": "stolen"}],
                    "containers": [
                        {
                            "name": "main",
                            "image": "x",
                            "resources": {"claims": [{"name": "gpus"}]},
                        }
                    ],
                },
            }
            await call(plane, "POST", PODS.format(ns=OTHER_NS), pod)
            claim = await wait_for(
                plane,
                f"{CLAIMS.format(ns=OTHER_NS)}/stolen",
                lambda o: bool(((o or {}).get("status") or {}).get("allocation")),
                timeout_s=60,
            )
            assert claim is not None
            # The real scheduler did allocate the reservation's devices to it...
            assert len(claim["status"]["allocation"]["devices"]["results"]) == 2
            # ...and the node refuses it, naming why.
            answer = (await kubelet.prepare([as_claim(claim)]))[claim["metadata"]["uid"]]
            assert answer.devices == ()
            assert NS in answer.error
            assert OTHER_NS in answer.error
            await force_delete_pod(cluster, OTHER_NS, "thief")
    finally:
        with contextlib.suppress(ApiError):
            await call(plane, "DELETE", f"{RESOURCE}/deviceclasses/every-device")


async def test_attack_a_forged_report_for_a_dra_allocation_activates_nothing(
    cluster: Cluster,
    dra_chart: None,  # noqa: F811 - the fixture
    real_operator: Operator,
    db: Database,
) -> None:
    """Whoever can write a DeviceAllocation's status (here the admin, as a stolen operator
    account would) writes a Bound report for a dra allocation that no node signed: the
    reservation does not become active, and no claim template hands devices to a pod."""
    plane = cluster.plane
    alice = plane.tokens[ALICE]
    await dra_tenancy(plane)
    await asyncio.to_thread(plane.apply, kubeworld.gpunode("h100-node-0", pool="h100"))
    await call(
        plane,
        "PATCH",
        "/apis/bcd.dev/v1alpha1/gpunodes/h100-node-0/status",
        {"status": kubeworld.gpunode_status("h100-node-0", gpus=8)},
        **MERGE,
    )
    body = reservation("train", NS, gpus=2, binding="kubernetes")
    await call(plane, "POST", RESERVATIONS.format(ns=NS), body, token=alice)
    rsv = f"{RESERVATIONS.format(ns=NS)}/train"
    placed = await wait_for(plane, rsv, state_is("placed", "binding"), timeout_s=60)
    assert placed is not None
    allocations = f"/apis/bcd.dev/v1alpha1/namespaces/{install.NAMESPACE}/deviceallocations"
    listed = await wait_for(
        plane,
        allocations,
        lambda o: any(
            i["spec"]["reservationId"] == placed["status"]["id"] for i in (o or {}).get("items", ())
        ),
    )
    (allocation,) = [
        i for i in (listed or {})["items"] if i["spec"]["reservationId"] == placed["status"]["id"]
    ]
    assert allocation["spec"]["kubernetesApi"] == "dra"
    name = allocation["metadata"]["name"]
    forged = {
        "status": {
            "nodeName": "h100-node-0",
            "phase": "Bound",
            "cdiDevices": [f"bcd.dev/gpu={d}" for d in allocation["spec"]["deviceIds"]],
            "pods": [f"{NS}/anything"],
        }
    }
    await call(plane, "PATCH", f"{allocations}/{name}/status", forged, **MERGE)
    rid = placed["status"]["id"]
    async with asyncio.timeout(30):
        while not await rejections(db, rid):  # noqa: ASYNC110 - the outbox has no event to await
            await asyncio.sleep(0.1)
    (event,) = await rejections(db, rid)
    assert event["allocationId"] == allocation["spec"]["allocationId"]
    shown = await call(plane, "GET", rsv)
    assert shown["status"]["state"] in ("placed", "binding")
    assert not (shown["status"].get("binding") or {}).get("attested")


async def rejections(db: Database, rid: str) -> list[dict[str, Any]]:
    """The reservation's ``reservation.binding-rejected`` events (the outbox, the truth)."""
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT data FROM outbox WHERE subject = %s AND type = %s ORDER BY id",
                (f"reservation/{rid}", "reservation.binding-rejected"),
            )
        ).fetchall()
    return [r["data"] for r in rows]
