"""The node agent under its chart service account, against the real control plane.

The agent runs as a DaemonSet pod runs it: as the chart's device-plugin service account, with
a token the API server bound to a pod on its node (``TokenRequest`` with the pod as bound
object), so the API server itself puts the node's name in the request's user extra. Nothing
is certified or written for it by the test: it publishes its GPUNode, asks for its node
certificate through the real ``certificates.k8s.io`` API (the operator approves through
``/approval`` and signs through ``/status``, as the real API server authorizes those against
the ``signers`` resource), binds the DeviceAllocation the operator writes, and its signed
report makes the tenant's Reservation active.

The attack tests use the same account the way a compromised node would: another node's
GPUNode and DeviceAllocation, a token bound to no pod, Secrets; the chart's RBAC and its
ValidatingAdmissionPolicy, enforced by the real API server, refuse each.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from cryptography import x509

from bettercompute.deviceplugin.agent import Agent, started
from bettercompute.kube import names
from bettercompute.operator.running import Operator
from tests.controlplane import install
from tests.controlplane.cluster import ApiError, ControlPlane
from tests.controlplane.nodes import FakeNode
from tests.controlplane.plugin import Cluster
from tests.controlplane.scenarios import (
    RESERVATIONS,
    call,
    node_policy_enforced,
    pool_with_nodes,
    reservation,
    state_is,
    tenant_namespace,
    wait_for,
)
from tests.deviceplugin import agents
from tests.deviceplugin.conftest import NODE, Node, allocation_spec
from tests.operator.test_node_certificates import csr_body, request_pem
from tests.support import kubeworld

NS = install.NAMESPACE
CSRS = "/apis/certificates.k8s.io/v1/certificatesigningrequests"
GPUNODES = "/apis/bcd.dev/v1alpha1/gpunodes"
ALLOCATIONS = f"/apis/bcd.dev/v1alpha1/namespaces/{NS}/deviceallocations"
OTHER = "gpu-node-2"


async def agent_pod(cluster: Cluster, node: str) -> dict[str, Any]:
    """The agent's DaemonSet pod as the scheduler would have bound it: on ``node``, under the
    chart's device-plugin service account (no kubelet runs it; it exists to bind tokens)."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"node-agent-{node}", "namespace": NS},
        "spec": {
            "serviceAccountName": cluster.chart.node_agent_account,
            "nodeName": node,
            "containers": [{"name": "agent", "image": "better-compute:test"}],
        },
    }
    made: dict[str, Any] = await call(cluster.plane, "POST", f"/api/v1/namespaces/{NS}/pods", pod)
    return made


async def agent_token(cluster: Cluster, pod: dict[str, Any] | None) -> str:
    """A token of the chart's device-plugin account, bound to ``pod`` (None: to nothing)."""
    return await asyncio.to_thread(
        cluster.plane.service_account_token, NS, cluster.chart.node_agent_account, pod=pod
    )


@pytest.fixture
async def nodes(cluster: Cluster) -> AsyncIterator[dict[str, dict[str, Any]]]:
    """Two registered nodes labelled for the pool, each with the agent's pod bound to it."""
    pods: dict[str, dict[str, Any]] = {}
    for name in (NODE, OTHER):
        await FakeNode(cluster.plane, name, labels=agents.POOL_LABELS).register()
        pods[name] = await agent_pod(cluster, name)
    yield pods
    for pod in pods.values():
        # Bound to a node whose kubelet never confirms: only a forced delete ends it.
        with contextlib.suppress(ApiError):
            await call(
                cluster.plane,
                "DELETE",
                f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}?gracePeriodSeconds=0",
            )


@pytest.fixture
async def standing() -> AsyncIterator[Node]:
    async with agents.standing_node() as node:
        yield node


@contextlib.asynccontextmanager
async def agent_running(
    cluster: Cluster, node: Node, token: str, *, node_name: str = NODE
) -> AsyncIterator[Agent]:
    """The real agent, configured by a kubeconfig holding only its token and the cluster CA;
    it reads its pool labels from its Kubernetes Node, as the chart runs it."""
    kubeconfig = await asyncio.to_thread(
        cluster.plane.kubeconfig, f"agent-{node_name}", token=token
    )
    config = agents.agent_config(
        kube=None, node=node, node_name=node_name, kubeconfig=kubeconfig, node_labels=None
    )
    async with started(config) as running:
        yield running


async def until(condition: Callable[[], bool], *, within_s: float, what: str) -> None:
    try:
        async with asyncio.timeout(within_s):
            while not condition():  # noqa: ASYNC110 - the agent's state has no event to await
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {within_s:.0f} s: {what}") from None


def condition_of(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for c in (obj.get("status") or {}).get("conditions") or ():
        if c["type"] == kind:
            return dict(c)
    return None


async def csrs_of(plane: ControlPlane) -> list[dict[str, Any]]:
    listed = await asyncio.to_thread(plane.get, CSRS)
    return [
        o
        for o in (listed or {"items": []})["items"]
        if o["spec"]["signerName"] == names.NODE_REPORT_SIGNER
    ]


async def test_the_agent_under_its_chart_account_enrols_binds_and_activates(
    cluster: Cluster,
    real_operator: Operator,
    nodes: dict[str, dict[str, Any]],
    standing: Node,
) -> None:
    plane = cluster.plane
    await tenant_namespace(plane, "ml", tenant="acme", user="alice@acme")
    await pool_with_nodes(plane, nodes=0)
    token = await agent_token(cluster, nodes[NODE])
    async with agent_running(cluster, standing, token) as agent:
        await until(
            lambda: agent.certificate_pem is not None,
            within_s=60,
            what="the node certificate, through the real CSR API",
        )
        # The API server recorded the requester and the node its token was bound to; the
        # operator approved through /approval and signed through /status.
        (csr,) = await csrs_of(plane)
        assert csr["spec"]["username"] == install_user(cluster)
        assert csr["spec"]["extra"][NODE_NAME_EXTRA] == [NODE]
        approved = condition_of(csr, "Approved")
        assert approved is not None
        assert approved["status"] == "True"
        issued = x509.load_pem_x509_certificate(base64.b64decode(csr["status"]["certificate"]))
        assert issued.public_key() == agent.plugin.converger.key.public_key
        assert agent.certificate_pem == base64.b64decode(csr["status"]["certificate"])

        # The GPUNode it published (labels copied from its Node) joined the pool.
        await wait_for(
            plane,
            f"{GPUNODES}/{NODE}",
            lambda o: bool(o) and (o or {})["metadata"]["labels"].get("bcd.dev/pool") == "h100",
        )
        await wait_for(
            plane,
            "/apis/bcd.dev/v1alpha1/gpupools/h100",
            lambda o: bool(o) and ((o or {}).get("status") or {}).get("nodes") == 1,
        )

        # A tenant's reservation: the operator writes its DeviceAllocation, the agent binds
        # it and its signed report (with the certificate above) makes the reservation active.
        body = reservation("train", "ml", gpus=2, binding="kubernetes")
        await call(plane, "POST", RESERVATIONS.format(ns="ml"), body, token=tenant(cluster))
        active = await wait_for(
            plane, f"{RESERVATIONS.format(ns='ml')}/train", state_is("active"), timeout_s=60
        )
        assert active is not None
        assert active["status"]["binding"]["nodeId"] == NODE
        listed = await asyncio.to_thread(plane.get, ALLOCATIONS)
        (allocation,) = [
            o
            for o in (listed or {"items": []})["items"]
            if o["spec"]["reservationId"] == active["status"]["id"]
        ]
        assert allocation["metadata"]["labels"]["bcd.dev/node"] == NODE
        assert allocation["status"]["nodeName"] == NODE
        # The kubelet stand-in heard the reservation's devices on the plugin's real stream.
        resource = active["status"]["resourceName"]
        await standing.kubelet.wait_registered([resource])


async def test_attack_csrs_for_another_node_or_from_another_user_are_never_signed(
    cluster: Cluster, real_operator: Operator, nodes: dict[str, dict[str, Any]]
) -> None:
    """A compromised node (OTHER) asks, with its agent's own token, for a certificate naming
    NODE; a tenant who may create CSRs asks too. The API server records who asked and for
    which node the token was bound; the operator denies both and signs nothing. (An agent
    started as NODE with OTHER's token never even gets that far: the admission policy
    refuses its GPUNode, the next test.)"""
    plane = cluster.plane
    await pool_with_nodes(plane, nodes=0)
    for name in (NODE, OTHER):
        await asyncio.to_thread(plane.apply, kubeworld.gpunode(name, pool="h100"))
    stolen = await agent_token(cluster, nodes[OTHER])
    await call(plane, "POST", CSRS, csr_body("claims-node", request_pem(node=NODE)), token=stolen)
    # A person allowed to create CSRs (a platform engineer's token, say) is not the agent.
    csr_creator = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "csr-creator"},
        "rules": [
            {
                "apiGroups": ["certificates.k8s.io"],
                "resources": ["certificatesigningrequests"],
                "verbs": ["create", "get"],
            }
        ],
    }
    await asyncio.to_thread(plane.apply, csr_creator)
    await asyncio.to_thread(
        plane.apply,
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "csr-creator"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "csr-creator",
            },
            "subjects": [
                {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "mallory@globex"}
            ],
        },
    )
    try:
        await call(
            plane,
            "POST",
            CSRS,
            csr_body("from-a-person", request_pem(node=NODE)),
            token=plane.tokens["mallory@globex"],
        )
        reasons: dict[str, str] = {}
        for name in ("claims-node", "from-a-person"):
            answered = await wait_for(
                plane,
                f"{CSRS}/{name}",
                lambda o: bool(o) and condition_of(o or {}, "Denied") is not None,
            )
            assert answered is not None
            assert not (answered.get("status") or {}).get("certificate")
            reasons[name] = str((condition_of(answered, "Denied") or {}).get("reason"))
        assert reasons == {"claims-node": "OtherNode", "from-a-person": "NotNodeAgent"}
    finally:
        for kind in ("clusterrolebindings", "clusterroles"):
            with contextlib.suppress(ApiError):
                await call(
                    plane, "DELETE", f"/apis/rbac.authorization.k8s.io/v1/{kind}/csr-creator"
                )
        for name in ("claims-node", "from-a-person"):
            with contextlib.suppress(ApiError):
                await call(plane, "DELETE", f"{CSRS}/{name}")


async def test_attack_the_agents_account_writes_only_its_own_nodes_objects(
    cluster: Cluster, nodes: dict[str, dict[str, Any]]
) -> None:
    """Direct calls with the agent's own credentials, as an attacker on the node would make
    them: the real authorizer (RBAC) and the chart's admission policy refuse each."""
    plane = cluster.plane
    mine = await agent_token(cluster, nodes[NODE])
    unbound = await agent_token(cluster, None)
    for name in (NODE, OTHER):
        await asyncio.to_thread(plane.apply, kubeworld.gpunode(name, pool="h100"))
    await node_policy_enforced(plane, namespace=NS, account=cluster.chart.node_agent_account)

    async def refused(
        token: str, method: str, path: str, body: Any = None, *, status: int = 403, **kw: Any
    ) -> str:
        """403 from the authorizer (RBAC); 422 from the admission policy (a
        ValidatingAdmissionPolicy's refusal is ``Invalid`` unless it names a reason)."""
        with pytest.raises(ApiError) as caught:
            await call(plane, method, path, body, token=token, **kw)
        assert caught.value.status == status, caught.value
        return str(caught.value)

    merge = {"content_type": "application/merge-patch+json"}
    inventory = {"status": kubeworld.gpunode_status(OTHER, gpus=8)}
    # Its own node's GPUNode status: allowed (the control case, so the refusals below are
    # about whose object it is, not about the call).
    await call(plane, "PATCH", f"{GPUNODES}/{NODE}/status", inventory, token=mine, **merge)
    why = await refused(mine, "PATCH", f"{GPUNODES}/{OTHER}/status", inventory, status=422, **merge)
    assert "may write only GPUNode" in why
    # A DeviceAllocation of another node (the operator's object, labelled for OTHER).
    allocation = agents.device_allocation(
        allocation_spec("alloc_attack", ["GPU-2"]), node=OTHER, namespace=NS
    )
    await call(plane, "POST", ALLOCATIONS, allocation)  # as the admin (the operator's write)
    report = {"status": {"phase": "Bound", "nodeName": NODE}}
    why = await refused(
        mine, "PATCH", f"{ALLOCATIONS}/alloc-attack/status", report, status=422, **merge
    )
    assert "labelled bcd.dev/node=" + NODE in why
    # A token bound to no pod carries no node: every write refused.
    why = await refused(
        unbound, "PATCH", f"{GPUNODES}/{NODE}/status", inventory, status=422, **merge
    )
    assert "token bound to a pod" in why
    # RBAC: no Secrets (the node CA's key lives in one), no deletes, no Reservations.
    await refused(mine, "GET", f"/api/v1/namespaces/{NS}/secrets")
    await refused(mine, "DELETE", f"{GPUNODES}/{OTHER}")
    await refused(mine, "GET", "/apis/bcd.dev/v1alpha1/reservations")
    await refused(mine, "PATCH", f"{ALLOCATIONS}/alloc-attack", {"spec": {}}, **merge)


NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


def install_user(cluster: Cluster) -> str:
    return f"system:serviceaccount:{NS}:{cluster.chart.node_agent_account}"


def tenant(cluster: Cluster) -> str:
    return cluster.plane.tokens["alice@acme"]
