"""The control side of DRA on the real control plane (issue 28): the chart with ``dra.enabled``
(its DeviceClass, admission policies and RBAC, applied as Helm would), tenants, the operator
and the node agent each acting with their own credentials.

- Attacks the chart's ValidatingAdmissionPolicies refuse (templates/dra.yaml and
  device-plugin-policy.yaml): a claim or template of one namespace selecting another's
  reserved devices (no namespace selector, another namespace's, a ``|| true`` widening, a
  ``firstAvailable`` subrequest, another class naming our driver), ``adminAccess`` from a
  namespace the admin did not mark, a tenant's (and the admin's) edit of the operator's
  template, a node agent writing another node's ResourceSlice or another driver's.
- The operator's template lifecycle: a ``binding: kubernetes`` Reservation on a ``dra`` pool
  gets a ResourceClaimTemplate with the namespace and reservation selectors, named in
  ``status.claimTemplate``, deleted once released; the pool says ``DraAvailable``, its api
  does not switch while the reservation lives, and a malformed ``policy.kubernetes`` makes a
  GPUPool Ready=False naming the field.

The policies are enforced only once the API server's informer has them (tests/README.md):
``enforced`` waits for each with a dry-run probe, so no refusal below is a race won by luck.

What it must never do: write as the admin what a tenant, the operator or an agent writes in
the scenario (the admin sets up namespaces, nodes and the other node's slice only).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import helm_python
import pytest

from bettercompute.kube import dra
from bettercompute.operator import claiming
from bettercompute.operator.running import Operator
from tests.chart import rendering
from tests.controlplane import install
from tests.controlplane.cluster import ApiError, ControlPlane, object_path
from tests.controlplane.nodes import FakeNode
from tests.controlplane.plugin import Cluster
from tests.controlplane.scenarios import (
    RESERVATIONS,
    call,
    conditions,
    reservation,
    tenant_namespace,
    wait_for,
)
from tests.controlplane.test_real_node_agent import agent_pod, agent_token
from tests.support import kubeworld

RESOURCE = "/apis/resource.k8s.io/v1"
TEMPLATES = RESOURCE + "/namespaces/{ns}/resourceclaimtemplates"
CLAIMS = RESOURCE + "/namespaces/{ns}/resourceclaims"
SLICES = RESOURCE + "/resourceslices"
NS, OTHER_NS = "ml", "team-b"
ALICE = "alice@acme"
NODE, OTHER_NODE = "dra-node-1", "dra-node-2"
#: A namespace with Kubernetes' own admin-access label (which the API server itself asks for
#: adminAccess), so that a refusal there is our policy's, not the API server's.
K8S_ADMIN_ACCESS = "resource.kubernetes.io/admin-access"
PINNED = "must carry the selector"
#: The DRA objects the chart adds with dra.enabled (removed again after this module).
DRA_KINDS = ("DeviceClass", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


@pytest.fixture(scope="module")
def dra_chart(control_plane: ControlPlane, chart: install.Installed) -> Iterator[None]:
    """The chart's DRA parts (``dra.enabled: true``) on the session's install: the DeviceClass,
    the admission policies and the ClusterRoles with their DRA rules; afterwards the install
    is as the session made it (its ClusterRoles put back, the DRA objects removed)."""
    loaded = helm_python.Chart.load(str(rendering.CHART))
    try:
        rendered = rendering.render(loaded, {"dra": {"enabled": True}})
    finally:
        loaded.close()
    added = [o for o in rendered.objects if o["kind"] in DRA_KINDS]
    roles = [o for o in rendered.objects if o["kind"] == "ClusterRole"]
    for obj in [*added, *roles]:
        control_plane.apply(obj)
    yield
    for obj in (o for o in chart.rendered.objects if o["kind"] == "ClusterRole"):
        control_plane.request("PUT", object_path(obj), obj)
    before = {(o["kind"], o["metadata"]["name"]) for o in chart.rendered.objects}
    for obj in added:
        if (obj["kind"], obj["metadata"]["name"]) not in before:
            with contextlib.suppress(ApiError):
                control_plane.request("DELETE", object_path(obj))


# --- objects ---------------------------------------------------------------------------------


def request(
    name: str = "gpus",
    *,
    selectors: list[str],
    device_class: str = dra.DEVICE_CLASS,
    admin: bool = False,
) -> dict[str, Any]:
    exactly: dict[str, Any] = {
        "deviceClassName": device_class,
        "allocationMode": "All",
        "selectors": [{"cel": {"expression": e}} for e in selectors],
    }
    if admin:
        exactly["adminAccess"] = True
    return {"name": name, "exactly": exactly}


def first_available(*subs: list[str]) -> dict[str, Any]:
    return {
        "name": "any",
        "firstAvailable": [
            {
                "name": f"s{i}",
                "deviceClassName": dra.DEVICE_CLASS,
                "allocationMode": "All",
                "selectors": [{"cel": {"expression": e}} for e in selectors],
            }
            for i, selectors in enumerate(subs)
        ],
    }


def claim_template(
    name: str, namespace: str, *requests: dict[str, Any], labels: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
        "spec": {"spec": {"devices": {"requests": list(requests)}}},
    }


def claim(name: str, namespace: str, *requests: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": list(requests)}},
    }


def resource_slice(name: str, *, node: str, driver: str = dra.DRIVER) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }


# --- set-up --------------------------------------------------------------------------------


async def claims_user(plane: ControlPlane, namespace: str, user: str) -> None:
    """``user`` may manage ResourceClaims and ResourceClaimTemplates in ``namespace``, as a
    platform team grants DRA users (on top of ``tenant_namespace``)."""
    rule = {
        "apiGroups": ["resource.k8s.io"],
        "resources": ["resourceclaims", "resourceclaimtemplates"],
        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "claims-user", "namespace": namespace},
        "rules": [rule],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "claims-user", "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "claims-user"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }
    await asyncio.to_thread(plane.apply, role)
    await asyncio.to_thread(plane.apply, binding)


async def enforced(plane: ControlPlane, *, timeout_s: float = 30.0) -> None:
    """Until the API server enforces each of the chart's three claim policies: a dry-run
    create (as the admin) that only that policy refuses is refused, naming it."""
    probe_ns = "dra-probe"
    labels = {K8S_ADMIN_ACCESS: "true"}
    await asyncio.to_thread(
        plane.apply,
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": probe_ns, "labels": labels}},
    )
    pin = dra.namespace_selector(probe_ns)
    probes = [
        (claim_template("p1", probe_ns, request(selectors=["true"])), PINNED),
        (claim_template("p2", probe_ns, request(selectors=[pin], admin=True)), "adminAccess"),
        (
            claim_template(
                "p3",
                probe_ns,
                request(selectors=[pin]),
                labels={dra.MANAGED_BY_LABEL: dra.MANAGED_BY},
            ),
            "managed by the better-compute operator",
        ),
    ]
    deadline = time.monotonic() + timeout_s
    for body, said in probes:
        while True:
            try:
                await call(plane, "POST", TEMPLATES.format(ns=probe_ns) + "?dryRun=All", body)
            except ApiError as e:
                if e.status == 422 and said in str(e):
                    break
                if e.status != 422:
                    raise
            if time.monotonic() > deadline:
                raise AssertionError(f"the policy refusing '{said}' is not enforced")
            await asyncio.sleep(0.1)


async def refused(
    plane: ControlPlane, method: str, path: str, body: Any, *, token: str | None, what: str = ""
) -> str:
    """The call is refused by an admission policy (422 Invalid); its message. ``what`` names
    the attack in a failure."""
    caught: ApiError | None = None
    try:
        await call(plane, method, path, body, token=token)
    except ApiError as e:
        caught = e
    if caught is None:
        pytest.fail(f"not refused: {what or method + ' ' + path}")
    assert caught.status == 422, (what, caught)
    return str(caught)


# --- the claim policies ----------------------------------------------------------------------


async def test_attack_a_claim_selects_only_its_own_namespaces_devices(
    cluster: Cluster, dra_chart: None
) -> None:
    """A tenant of ``ml`` tries every way to make a claim that could be allocated another
    namespace's reserved devices; each is refused, and the pinned forms pass."""
    plane = cluster.plane
    await tenant_namespace(plane, NS, tenant="acme", user=ALICE)
    await claims_user(plane, NS, ALICE)
    await enforced(plane)
    alice = plane.tokens[ALICE]
    mine = dra.namespace_selector(NS)
    theirs = dra.namespace_selector(OTHER_NS)
    their_reservation = dra.reservation_selector("rsv_theirs")
    templates = TEMPLATES.format(ns=NS)

    # Control cases: pinned to its own namespace, the forms pass.
    await call(
        plane,
        "POST",
        templates,
        claim_template("ok", NS, request(selectors=[mine, dra.reservation_selector("rsv_1")])),
        token=alice,
    )
    await call(
        plane, "POST", CLAIMS.format(ns=NS), claim("ok", NS, request(selectors=[mine])), token=alice
    )
    await call(
        plane, "POST", templates, claim_template("first", NS, first_available([mine])), token=alice
    )
    # Another driver's class, not naming ours: not our business.
    await call(
        plane,
        "POST",
        templates,
        claim_template("nvidia", NS, request(selectors=["true"], device_class="gpu.nvidia.com")),
        token=alice,
    )

    attacks = {
        "no namespace selector": claim_template("a1", NS, request(selectors=[their_reservation])),
        "another namespace's": claim_template(
            "a2", NS, request(selectors=[theirs, their_reservation])
        ),
        "a widened pin": claim_template("a3", NS, request(selectors=[f"{mine} || true"])),
        "one request of two unpinned": claim_template(
            "a4", NS, request("a", selectors=[mine]), request("b", selectors=["true"])
        ),
        "a firstAvailable subrequest": claim_template("a5", NS, first_available([mine], ["true"])),
        "another class naming our driver": claim_template(
            "a6",
            NS,
            request(selectors=[f'device.driver == "{dra.DRIVER}"'], device_class="catch-all"),
        ),
    }
    for what, body in attacks.items():
        why = await refused(plane, "POST", templates, body, token=alice, what=what)
        assert PINNED in why, what
        assert mine in why, what
    why = await refused(
        plane,
        "POST",
        CLAIMS.format(ns=NS),
        claim("a7", NS, request(selectors=[theirs])),
        token=alice,
    )
    assert PINNED in why
    # An edit cannot widen the pinned template either (its spec is immutable as well).
    current = await call(plane, "GET", f"{templates}/ok")
    current["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": "true"}}
    ]
    await refused(plane, "PUT", f"{templates}/ok", current, token=alice)


async def test_attack_admin_access_only_from_a_namespace_the_admin_marked(
    cluster: Cluster, dra_chart: None
) -> None:
    plane = cluster.plane
    await tenant_namespace(plane, NS, tenant="acme", user=ALICE)
    await claims_user(plane, NS, ALICE)
    # Kubernetes' own label is there (the API server asks for it): only ours is missing.
    await asyncio.to_thread(
        plane.apply,
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": NS, "labels": {K8S_ADMIN_ACCESS: "true"}},
        },
    )
    await enforced(plane)
    alice = plane.tokens[ALICE]
    body = claim_template("monitor", NS, request(selectors=["true"], admin=True))
    why = await refused(plane, "POST", TEMPLATES.format(ns=NS), body, token=alice)
    assert "adminAccess" in why
    assert dra.ADMIN_ACCESS_LABEL in why
    # The cluster admin marks the namespace: the same template passes.
    await asyncio.to_thread(
        plane.apply,
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": NS,
                "labels": {K8S_ADMIN_ACCESS: "true", dra.ADMIN_ACCESS_LABEL: "true"},
            },
        },
    )
    made = await call(plane, "POST", TEMPLATES.format(ns=NS), body, token=alice)
    assert made["spec"]["spec"]["devices"]["requests"][0]["exactly"]["adminAccess"] is True


async def test_attack_no_one_but_the_operator_writes_its_template(
    cluster: Cluster, dra_chart: None
) -> None:
    plane = cluster.plane
    await tenant_namespace(plane, NS, tenant="acme", user=ALICE)
    await claims_user(plane, NS, ALICE)
    await enforced(plane)
    alice = plane.tokens[ALICE]
    operator = await asyncio.to_thread(
        plane.service_account_token, install.NAMESPACE, cluster.chart.operator_account
    )
    made = claiming.template(namespace=NS, name="train", uid="unused", reservation_id="rsv_1")
    # No owner here (a Reservation needs the operator's webhooks): the garbage collector would
    # delete a template whose owner does not exist.
    del made["metadata"]["ownerReferences"]
    templates = TEMPLATES.format(ns=NS)
    await call(plane, "POST", templates, made, token=operator)  # the operator may
    path = f"{templates}/train"
    merge = "application/merge-patch+json"
    said = "managed by the better-compute operator"
    # The tenant (RBAC lets it write templates in its namespace), then the cluster admin (RBAC
    # lets it do anything): neither may delete it or take its label off.
    for token in (alice, None):
        with pytest.raises(ApiError) as caught:
            await call(plane, "DELETE", path, token=token)
        assert caught.value.status == 422
        assert said in str(caught.value)
        with pytest.raises(ApiError) as caught:
            await call(
                plane,
                "PATCH",
                path,
                {"metadata": {"labels": {dra.MANAGED_BY_LABEL: None}}},
                token=token,
                content_type=merge,
            )
        assert caught.value.status == 422
        assert said in str(caught.value)
    # A tenant's own template passing itself off as the operator's.
    fake = claim_template(
        "fake",
        NS,
        request(selectors=[dra.namespace_selector(NS)]),
        labels={dra.MANAGED_BY_LABEL: dra.MANAGED_BY},
    )
    why = await refused(plane, "POST", templates, fake, token=alice)
    assert said in why
    await call(plane, "DELETE", path, token=operator)


# --- the node agent's slices -------------------------------------------------------------------


async def test_attack_an_agent_writes_only_its_own_nodes_slices(
    cluster: Cluster, dra_chart: None
) -> None:
    plane = cluster.plane
    pods = {}
    for name in (NODE, OTHER_NODE):
        await FakeNode(plane, name).register()
        pods[name] = await agent_pod(cluster, name)
    mine = await agent_token(cluster, pods[NODE])
    own, other = dra.slice_name(NODE), dra.slice_name(OTHER_NODE)
    try:
        # Until the policy is in force: a token bound to no pod (it carries no node) is refused
        # by its first rule, whatever the rules under test below say.
        unbound = await agent_token(cluster, None)
        deadline = time.monotonic() + 30
        while True:
            try:
                await call(
                    plane,
                    "POST",
                    SLICES + "?dryRun=All",
                    resource_slice(own, node=NODE),
                    token=unbound,
                )
            except ApiError as e:
                if e.status == 422:
                    break
                raise
            assert time.monotonic() < deadline, "the own-slices policy is not enforced"
            await asyncio.sleep(0.1)
        await call(plane, "POST", SLICES, resource_slice(own, node=NODE), token=mine)  # control
        why = await refused(
            plane, "POST", SLICES, resource_slice(other, node=OTHER_NODE), token=mine
        )
        assert f"spec.nodeName {NODE}" in why
        why = await refused(
            plane,
            "POST",
            SLICES,
            resource_slice("nvidia-" + own, node=NODE, driver="gpu.nvidia.com"),
            token=mine,
        )
        assert "driver gpu.bcd.dev" in why
        # Another node's slice (as its own agent would have written it): no update, no delete.
        theirs = await call(plane, "POST", SLICES, resource_slice(other, node=OTHER_NODE))
        taken = {**theirs, "spec": {**theirs["spec"], "devices": [{"name": "gpu-9"}]}}
        await refused(plane, "PUT", f"{SLICES}/{other}", taken, token=mine)
        moved = {**theirs, "spec": {**theirs["spec"], "nodeName": NODE}}
        await refused(plane, "PUT", f"{SLICES}/{other}", moved, token=mine)
        await refused(plane, "DELETE", f"{SLICES}/{other}", None, token=mine)
        await call(plane, "DELETE", f"{SLICES}/{own}", token=mine)  # its own: allowed
    finally:
        for name in (own, other, "nvidia-" + own):
            with contextlib.suppress(ApiError):
                await call(plane, "DELETE", f"{SLICES}/{name}")
        for pod in pods.values():
            with contextlib.suppress(ApiError):
                await call(
                    plane,
                    "DELETE",
                    f"/api/v1/namespaces/{install.NAMESPACE}/pods/{pod['metadata']['name']}"
                    "?gracePeriodSeconds=0",
                )


# --- the operator's template ---------------------------------------------------------------------


def dra_pool(name: str) -> dict[str, Any]:
    pool = kubeworld.gpupool(name)
    pool["spec"]["policy"] = {"kubernetes": {"api": "dra"}}
    return pool


async def test_a_dra_reservation_gets_its_claim_template_until_released(
    cluster: Cluster, dra_chart: None, real_operator: Operator
) -> None:
    plane = cluster.plane
    # A malformed policy.kubernetes: the CRD keeps it (a field of two types has no schema
    # type), the operator refuses the pool, naming the field.
    bad = kubeworld.gpupool("bad")
    bad["spec"]["policy"] = {"kubernetes": {"api": "cdi"}}
    await call(plane, "POST", "/apis/bcd.dev/v1alpha1/gpupools", bad)
    shown_bad = await wait_for(
        plane,
        "/apis/bcd.dev/v1alpha1/gpupools/bad",
        lambda o: conditions(o).get("Ready", {}).get("status") == "False",
    )
    assert conditions(shown_bad)["Ready"]["reason"] == "INVALID_INPUT"
    assert "spec.policy.kubernetes" in conditions(shown_bad)["Ready"]["message"]

    await tenant_namespace(plane, NS, tenant="acme", user=ALICE)
    await asyncio.to_thread(plane.apply, kubeworld.gpuquota("acme", {"gpu:H100": 64}))
    await asyncio.to_thread(plane.apply, dra_pool("h100"))
    await asyncio.to_thread(plane.apply, kubeworld.gpunode("h100-node-0", pool="h100"))
    await call(
        plane,
        "PATCH",
        "/apis/bcd.dev/v1alpha1/gpunodes/h100-node-0/status",
        {"status": kubeworld.gpunode_status("h100-node-0", gpus=8)},
        content_type="application/merge-patch+json",
    )
    pool = await wait_for(
        plane,
        "/apis/bcd.dev/v1alpha1/gpupools/h100",
        lambda o: (
            ((o or {}).get("status") or {}).get("nodes") == 1
            and claiming.CONDITION in conditions(o)
        ),
    )
    assert conditions(pool)[claiming.CONDITION]["status"] == "True"

    await call(
        plane,
        "POST",
        RESERVATIONS.format(ns=NS),
        reservation("train", NS, gpus=2, binding="kubernetes"),
        token=plane.tokens[ALICE],
    )
    shown = await wait_for(
        plane,
        f"{RESERVATIONS.format(ns=NS)}/train",
        lambda o: ((o or {}).get("status") or {}).get("claimTemplate") == "train",
    )
    assert shown is not None
    status = shown["status"]
    assert "resourceName" not in status, "a dra pool advertises no extended resource"
    made = await call(plane, "GET", f"{TEMPLATES.format(ns=NS)}/train")
    (req,) = made["spec"]["spec"]["devices"]["requests"]
    assert req["name"] == claiming.REQUEST
    assert req["exactly"]["deviceClassName"] == dra.DEVICE_CLASS
    assert req["exactly"]["allocationMode"] == "All"
    assert [s["cel"]["expression"] for s in req["exactly"]["selectors"]] == [
        dra.namespace_selector(NS),
        dra.reservation_selector(status["id"]),
    ]
    labels = made["metadata"]["labels"]
    assert labels[dra.MANAGED_BY_LABEL] == dra.MANAGED_BY
    assert labels[claiming.LABEL] == "train"
    (owner,) = made["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "Reservation",
        "train",
        shown["metadata"]["uid"],
    )

    # A template of another Reservation's name, made by the tenant before it (pinned, so the
    # policies let it): the operator neither adopts it nor names it in that status.
    await claims_user(plane, NS, ALICE)
    squat = claim_template("squat", NS, request(selectors=[dra.namespace_selector(NS)]))
    await call(plane, "POST", TEMPLATES.format(ns=NS), squat, token=plane.tokens[ALICE])
    await call(
        plane,
        "POST",
        RESERVATIONS.format(ns=NS),
        reservation("squat", NS, gpus=1, binding="kubernetes"),
        token=plane.tokens[ALICE],
    )
    placed = await wait_for(
        plane,
        f"{RESERVATIONS.format(ns=NS)}/squat",
        lambda o: ((o or {}).get("status") or {}).get("state") in ("placed", "binding"),
    )
    assert "claimTemplate" not in placed["status"]
    kept = await call(plane, "GET", f"{TEMPLATES.format(ns=NS)}/squat")
    assert "ownerReferences" not in kept["metadata"]

    # The pool's api does not switch while the reservation lives.
    await call(
        plane,
        "PATCH",
        "/apis/bcd.dev/v1alpha1/gpupools/h100",
        {"spec": {"policy": {"kubernetes": {"api": "devicePlugin"}}}},
        content_type="application/merge-patch+json",
    )
    refused_pool = await wait_for(
        plane,
        "/apis/bcd.dev/v1alpha1/gpupools/h100",
        lambda o: conditions(o).get("Ready", {}).get("status") == "False",
    )
    ready = conditions(refused_pool)["Ready"]
    assert ready["reason"] == "INVALID_STATE"
    assert "policy.kubernetes.api" in ready["message"]
    assert status["id"] in ready["message"]

    # Released: the template goes (claims made from it keep their devices until unprepared).
    await call(
        plane,
        "PATCH",
        f"{RESERVATIONS.format(ns=NS)}/train",
        {"spec": {"release": True}},
        token=plane.tokens[ALICE],
        content_type="application/merge-patch+json",
    )
    await wait_for(plane, f"{TEMPLATES.format(ns=NS)}/train", lambda o: o is None)
    gone = await wait_for(
        plane,
        f"{RESERVATIONS.format(ns=NS)}/train",
        lambda o: "claimTemplate" not in ((o or {}).get("status") or {}),
    )
    assert gone is not None
