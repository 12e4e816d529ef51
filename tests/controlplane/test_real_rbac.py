"""The chart's RBAC is sufficient and minimal, as the real API server's audit log shows.

The API server records every request with who made it, what it was, and the authorizer's
decision (``authorization.k8s.io/decision``). One scenario drives the operator and the node
agent, each under its chart service account, through what they do in a cluster: the chart's
webhook configurations and node CA, a tenant's reservation bound through a DeviceAllocation, a
pod admitted by the pod webhook, the agent's GPUNode, node certificate and report, GPUQuota
and GPUPool status. Then:

- sufficient: neither account was refused anything (no ``forbid`` decision);
- minimal: every rule the chart grants either was used by the scenario, or is listed below
  with the scenario that needs it and why this one cannot show it (a multi-replica peering, a
  feature off in the tests' values); and every listed rule is still granted, so the list does
  not outlive the chart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from bettercompute.operator.running import Operator
from tests.controlplane import install
from tests.controlplane.cluster import ApiError, ControlPlane
from tests.controlplane.nodes import FakeNode
from tests.controlplane.plugin import Cluster
from tests.controlplane.scenarios import (
    RESERVATIONS,
    call,
    pool_with_nodes,
    reservation,
    state_is,
    tenant_namespace,
    wait_for,
)
from tests.controlplane.test_real_node_agent import (
    agent_pod,
    agent_running,
    agent_token,
    standing,
    until,
)
from tests.controlplane.test_real_pods import pod
from tests.deviceplugin import agents
from tests.deviceplugin.conftest import NODE, Node

NS = install.NAMESPACE
Rule = tuple[str, str, str]  # (API group, resource[/subresource], verb)
__all__ = ["standing"]  # the agent's node stand-in, a fixture of test_real_node_agent

#: Rules the scenario cannot show, each with why it is granted.
NOT_SHOWN: Mapping[str, Mapping[Rule, str]] = {
    "operator": {
        ("kopf.dev", "clusterkopfpeerings", "list"): "peering of several replicas; tests run one",
        ("kopf.dev", "clusterkopfpeerings", "watch"): "peering of several replicas",
        ("kopf.dev", "clusterkopfpeerings", "patch"): "peering of several replicas",
        ("certificates.k8s.io", "signers", "approve"): (
            "checked by the API server inside each /approval update (shown: those succeed)"
        ),
        ("certificates.k8s.io", "signers", "sign"): (
            "checked by the API server inside each /status update (shown: those succeed)"
        ),
        ("authentication.k8s.io", "tokenreviews", "create"): (
            "a Kubernetes bearer token presented to the operator's HTTP API"
        ),
        ("", "serviceaccounts", "get"): "delegated confirmation by a service account",
        ("bcd.dev", "eventsubscriptions", "patch"): "an EventSubscription's finalizer",
        ("bcd.dev", "eventsubscriptions/status", "patch"): "an EventSubscription's status",
        ("", "secrets", "update"): "writing over a subscription secret the operator made",
        # (Secrets' create is shown: the operator makes the node CA's Secret at start.)
    },
    "device-plugin": {
        ("", "events", "create"): "a Warning on a foreign pod holding a reservation's devices",
        ("bcd.dev", "gpunodes", "patch"): "labels merged into a GPUNode that already exists",
    },
}


def granted(cluster: Cluster, component: str) -> set[Rule]:
    """Every (group, resource, verb) the chart's roles give ``component``'s account."""
    account = cluster.chart.operator_account if component == "operator" else None
    account = account or cluster.chart.node_agent_account
    roles: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for kind in ("ClusterRole", "Role"):
        for role in cluster.chart.rendered.of(kind):
            roles[(kind, role["metadata"]["name"])] = role.get("rules") or []
    rules: set[Rule] = set()
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        for binding in cluster.chart.rendered.of(kind):
            if not any(
                s.get("kind") == "ServiceAccount" and s.get("name") == account
                for s in binding.get("subjects") or ()
            ):
                continue
            ref = binding["roleRef"]
            for rule in roles.get((ref["kind"], ref["name"]), ()):
                for group in rule.get("apiGroups") or ():
                    for resource in rule.get("resources") or ():
                        for verb in rule.get("verbs") or ():
                            rules.add((group, resource, verb))
    return rules


def audit_events(plane: ControlPlane, user: str, *, after: int) -> Iterator[dict[str, Any]]:
    """The audit log's completed requests of ``user`` written after byte ``after``."""
    with plane.audit_log.open() as log:
        log.seek(after)
        for line in log:
            event = json.loads(line)
            # A watch is answered (ResponseStarted) long before it completes, if ever.
            answered = event.get("stage") in ("ResponseStarted", "ResponseComplete")
            if answered and event["user"]["username"] == user:
                yield event


def rule_of(event: Mapping[str, Any]) -> Rule:
    ref = event.get("objectRef") or {}
    resource = ref.get("resource", "")
    if ref.get("subresource"):
        resource += "/" + ref["subresource"]
    return (ref.get("apiGroup", ""), resource, event["verb"])


async def test_the_charts_rbac_is_sufficient_and_minimal(
    cluster: Cluster,
    start_real_operator: Callable[..., contextlib.AbstractAsyncContextManager[Operator]],
    standing: Node,
) -> None:
    plane = cluster.plane
    accounts = {
        "operator": f"system:serviceaccount:{NS}:{cluster.chart.operator_account}",
        "device-plugin": f"system:serviceaccount:{NS}:{cluster.chart.node_agent_account}",
    }
    # From here on: the operator's start counts too (kopf's watches, the webhook
    # configurations' caBundle, the node CA); earlier tests' requests do not.
    start = plane.audit_log.stat().st_size
    # As on a fresh install, the operator makes the node CA's Secret (an earlier test's
    # operator may have left one behind in the release namespace).
    ca_secret = cluster.chart.operator_setting("BCD_NODE_CA_SECRET")
    with contextlib.suppress(ApiError):
        await call(plane, "DELETE", f"/api/v1/namespaces/{NS}/secrets/{ca_secret}")
    async with start_real_operator():
        await drive(cluster, standing)
    judge(cluster, accounts, start)


async def drive(cluster: Cluster, standing: Node) -> None:
    plane = cluster.plane
    await tenant_namespace(plane, "ml", tenant="acme", user="alice@acme")
    await pool_with_nodes(plane, nodes=0)
    node = FakeNode(plane, NODE, labels=agents.POOL_LABELS)
    await node.register()
    agents_pod = await agent_pod(cluster, NODE)
    try:
        await scenario(cluster, node, standing, await agent_token(cluster, agents_pod))
    finally:
        # Bound to a node whose kubelet never confirms: only a forced delete ends it.
        await call(
            plane,
            "DELETE",
            f"/api/v1/namespaces/{NS}/pods/{agents_pod['metadata']['name']}?gracePeriodSeconds=0",
        )


async def scenario(cluster: Cluster, node: FakeNode, standing: Node, token: str) -> None:
    plane = cluster.plane
    async with agent_running(cluster, standing, token) as agent:
        await until(lambda: agent.certificate_pem is not None, within_s=60, what="enrolment")
        body = reservation("train", "ml", gpus=2, binding="kubernetes")
        tenant = plane.tokens["alice@acme"]
        await call(plane, "POST", RESERVATIONS.format(ns="ml"), body, token=tenant)
        active = await wait_for(
            plane, f"{RESERVATIONS.format(ns='ml')}/train", state_is("active"), timeout_s=60
        )
        assert active is not None
        # A tenant's pod for the reservation: the pod webhook reads the Reservation.
        await node.advertise_from(standing.kubelet)
        pod_body = pod("trainer", "ml", label="train", gpu=2)
        await call(plane, "POST", "/api/v1/namespaces/ml/pods", pod_body, token=tenant)
        # Released: the tenant deletes its pod and its Reservation; the operator ends the
        # DeviceAllocation once the agent reported the devices free.
        await call(plane, "DELETE", "/api/v1/namespaces/ml/pods/trainer?gracePeriodSeconds=0")
        await call(plane, "DELETE", f"{RESERVATIONS.format(ns='ml')}/train", token=tenant)
        await wait_for(plane, f"{RESERVATIONS.format(ns='ml')}/train", lambda o: o is None)
        await wait_for(
            plane,
            f"/apis/bcd.dev/v1alpha1/namespaces/{NS}/deviceallocations",
            lambda o: not (o or {}).get("items"),
            timeout_s=60,
        )
        # Let the status writers (pool, quota, reservation) catch up before reading the log.
        await asyncio.sleep(2)


def judge(cluster: Cluster, accounts: Mapping[str, str], start: int) -> None:
    plane = cluster.plane
    problems: list[str] = []
    for component, user in accounts.items():
        events = list(audit_events(plane, user, after=start))
        assert events, f"the audit log has nothing from {user}"
        refused = sorted(
            {
                rule_of(e)
                for e in events
                if (e.get("annotations") or {}).get("authorization.k8s.io/decision") == "forbid"
            }
        )
        if refused:
            problems.append(f"{component} was refused (the chart grants too little): {refused}")
        used = {
            rule_of(e)
            for e in events
            if (e.get("annotations") or {}).get("authorization.k8s.io/decision") == "allow"
        }
        rules = granted(cluster, component)
        excused = NOT_SHOWN[component]
        unused = sorted(r for r in rules - used if r not in excused)
        if unused:
            problems.append(f"{component} is granted rules nothing used: {unused}")
        stale = sorted(r for r in excused if r not in rules)
        if stale:
            problems.append(
                f"{component}: NOT_SHOWN lists rules the chart no longer grants: {stale}"
            )
        shown_anyway = sorted(r for r in excused if r in used)
        if shown_anyway:
            problems.append(f"{component}: NOT_SHOWN lists rules the scenario used: {shown_anyway}")
    assert not problems, "\n".join(problems)
