"""What the real-cluster scenarios share: a tenant's namespace and rights, a pool with nodes,
and calls that never block the event loop the operator runs in.

Every call goes through a thread (``asyncio.to_thread``): the real API server calls our
webhooks, which the operator serves from this test's event loop, so a call made from the
loop itself would wait on an answer the blocked loop could never give.

What it must never do: grant a tenant more than a platform team would (its namespace's
Reservations, never their status), or write as the admin what a test means a tenant to write.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bettercompute.kube import names
from tests.controlplane.cluster import ApiError, ControlPlane
from tests.support import kubeworld

RESERVATIONS = "/apis/bcd.dev/v1alpha1/namespaces/{ns}/reservations"


async def call(
    plane: ControlPlane,
    method: str,
    path: str,
    body: Any = None,
    *,
    token: str | None = None,
    content_type: str = "application/json",
) -> Any:
    return await asyncio.to_thread(
        plane.request, method, path, body, token=token, content_type=content_type
    )


async def kubectl(
    plane: ControlPlane, *args: str, kubeconfig: Path | None = None, check: bool = True
) -> Any:
    return await asyncio.to_thread(plane.kubectl, *args, kubeconfig=kubeconfig, check=check)


async def wait_for(
    plane: ControlPlane,
    path: str,
    predicate: Callable[[dict[str, Any] | None], bool],
    *,
    timeout_s: float = 30.0,
) -> dict[str, Any] | None:
    """Poll the object at ``path`` (as the admin) until ``predicate`` holds; fail showing it."""
    deadline = time.monotonic() + timeout_s
    seen: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        seen = await asyncio.to_thread(plane.get, path)
        if predicate(seen):
            return seen
        await asyncio.sleep(0.1)
    raise AssertionError(f"{path}: condition not met within {timeout_s:.0f} s; last seen: {seen}")


def state_is(*states: str) -> Callable[[dict[str, Any] | None], bool]:
    return lambda o: bool(o) and ((o or {}).get("status") or {}).get("state") in states


#: Placed, or already moved on by the reconciler (no node agent binds in these scenarios).
PLACED = ("placed", "binding")


async def tenant_namespace(plane: ControlPlane, namespace: str, *, tenant: str, user: str) -> None:
    """A tenant's namespace (labelled with its tenant) where ``user`` may manage Reservations
    and Pods, as a platform team grants it: no ``reservations/status``."""
    await asyncio.to_thread(plane.apply, kubeworld.namespace(namespace, tenant=tenant))
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "reservations-user", "namespace": namespace},
        "rules": [
            {
                "apiGroups": [names.GROUP],
                "resources": ["reservations"],
                "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
            },
            {
                "apiGroups": [""],
                "resources": ["pods"],
                "verbs": ["get", "list", "watch", "create", "delete"],
            },
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "reservations-user", "namespace": namespace},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "reservations-user",
        },
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }
    await asyncio.to_thread(plane.apply, role)
    await asyncio.to_thread(plane.apply, binding)
    # The ServiceAccount admission plugin refuses pods until the controller-manager has made
    # the namespace's default service account.
    await wait_for(plane, f"/api/v1/namespaces/{namespace}/serviceaccounts/default", bool)


async def pool_with_nodes(
    plane: ControlPlane,
    *,
    pool: str = "h100",
    nodes: int = 1,
    gpus: int = 8,
    tenants: tuple[str, ...] = ("acme",),
    quota: int = 64,
) -> list[str]:
    """A GPUPool, its GPUNodes with their inventories (as the node agent writes them), and a
    GPUQuota per tenant, applied as the platform admin; the node names."""
    for tenant in tenants:
        await asyncio.to_thread(plane.apply, kubeworld.gpuquota(tenant, {"gpu:H100": quota}))
    await asyncio.to_thread(plane.apply, kubeworld.gpupool(pool))
    made = [f"{pool}-node-{i}" for i in range(nodes)]
    for name in made:
        await asyncio.to_thread(plane.apply, kubeworld.gpunode(name, pool=pool))
        await call(
            plane,
            "PATCH",
            f"/apis/bcd.dev/v1alpha1/gpunodes/{name}/status",
            {"status": kubeworld.gpunode_status(name, gpus=gpus)},
            content_type="application/merge-patch+json",
        )
    await wait_for(
        plane,
        f"/apis/bcd.dev/v1alpha1/gpupools/{pool}",
        lambda o: bool(o) and ((o or {}).get("status") or {}).get("nodes") == nodes,
    )
    return made


def reservation(name: str, namespace: str, *, gpus: int = 1, **spec: Any) -> dict[str, Any]:
    """A Reservation as a tenant writes it: no identity stamps (the webhook adds them)."""
    obj = kubeworld.ReservationBuilder(name, namespace).gpus(gpus).obj()
    obj["metadata"].pop("annotations", None)
    obj["spec"].update(spec)
    return obj


def denied(error: BaseException) -> bool:
    return isinstance(error, ApiError) and error.status == 403


def conditions(obj: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions") or ()}


async def node_policy_enforced(
    plane: ControlPlane, *, namespace: str, account: str, timeout_s: float = 30.0
) -> None:
    """Until the API server enforces the chart's own-node admission policy.

    The API server's policy plugin learns a new ValidatingAdmissionPolicy from its informer a
    moment after the write; until then the policy lets everything through (a real cluster has
    the same gap right after ``helm install``). A dry-run GPUNode create with a token of the
    device plugin's account bound to no pod must be refused once the policy is in force."""
    token = await asyncio.to_thread(plane.service_account_token, namespace, account)
    probe = {
        "apiVersion": "bcd.dev/v1alpha1",
        "kind": "GPUNode",
        "metadata": {"name": "policy-probe"},
        "spec": {},
    }
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await call(
                plane, "POST", "/apis/bcd.dev/v1alpha1/gpunodes?dryRun=All", probe, token=token
            )
        except ApiError as e:
            if e.status == 422:
                return
            raise
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the own-node admission policy is not enforced after {timeout_s} s"
            )
        await asyncio.sleep(0.1)
