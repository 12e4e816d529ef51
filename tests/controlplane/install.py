"""Install what the Helm chart installs into the real control plane, as ``helm install`` would.

Why it exists: a missing RBAC rule, a CRD the real structural-schema check refuses, a webhook
configuration the real API server cannot call: each must fail a test here, not a platform
team's install. So the objects come from rendering the chart (``tests/chart/rendering.py``,
Helm's own engine) with the values given, and are applied as they are, with two changes a
cluster without a pod network needs, both said where they are made:

- workloads (the operator's StatefulSet, the device plugin's DaemonSet, the CRD-upgrade Job)
  are not applied: the tests run those programs as processes, under the chart's service
  accounts, with tokens from the TokenRequest API;
- each webhook's ``clientConfig.service`` becomes a ``url`` on 127.0.0.1 at the operator's
  webhook port (the API server cannot reach a Service without a pod network); the operator
  still makes its certificate (with 127.0.0.1 among its names) and writes its CA into
  ``caBundle`` itself, as it does in a cluster.

What it must never do: change an RBAC rule, a CRD or a webhook's rules, or apply anything the
chart does not render.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import yaml

from tests.chart import rendering
from tests.controlplane.cluster import ApiError, ControlPlane, object_path

NAMESPACE = rendering.NAMESPACE
RELEASE = rendering.RELEASE
#: What runs as a process in the tests instead of a pod.
WORKLOADS = frozenset({"StatefulSet", "DaemonSet", "Deployment", "Job", "PodDisruptionBudget"})
#: Applied first, as Helm orders an install (kinds it does not list go last).
ORDER = (
    "Namespace",
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "Service",
)


@dataclass(frozen=True)
class Installed:
    rendered: rendering.Rendered
    webhook_port: int
    #: The chart's service accounts, by component: ``operator``, ``device-plugin``.
    operator_account: str
    node_agent_account: str
    webhook_configuration: str
    #: The webhook configurations as applied (their Services turned into loopback URLs).
    webhook_configurations: tuple[dict[str, Any], ...]
    #: The operator container's plain environment values (``BCD_*`` settings) as rendered.
    operator_env: Mapping[str, str]

    def operator_setting(self, name: str) -> str:
        if name not in self.operator_env:
            raise AssertionError(f"the chart's operator container sets no {name}")
        return self.operator_env[name]


def crds() -> list[dict[str, Any]]:
    """The chart's CRDs (its ``crds/`` directory, which Helm installs before the templates)."""
    found = []
    for path in sorted((rendering.CHART / "crds").glob("*.yaml")):
        found.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return found


def install_crds(plane: ControlPlane, *, timeout_s: float = 60.0) -> None:
    """Apply the CRDs and wait until the API server serves each (``Established``)."""
    definitions = crds()
    for crd in definitions:
        plane.apply(crd)
    deadline = time.monotonic() + timeout_s
    for crd in definitions:
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}"
        while True:
            status = (plane.get(path) or {}).get("status") or {}
            conditions = {c["type"]: c for c in status.get("conditions") or ()}
            if conditions.get("Established", {}).get("status") == "True":
                break
            problem = conditions.get("NamesAccepted", {})
            if problem.get("status") == "False" or time.monotonic() > deadline:
                raise AssertionError(f"CRD {crd['metadata']['name']} not established: {status}")
            time.sleep(0.1)


def to_loopback(configuration: Mapping[str, Any], *, port: int) -> dict[str, Any]:
    """A webhook configuration whose Service references are URLs on 127.0.0.1:``port``."""
    changed = yaml.safe_load(yaml.safe_dump(dict(configuration)))
    for webhook in changed.get("webhooks") or ():
        service = webhook["clientConfig"].pop("service")
        webhook["clientConfig"]["url"] = f"https://127.0.0.1:{port}{service.get('path', '/')}"
    return changed


def install(
    plane: ControlPlane, *, webhook_port: int, values: Mapping[str, Any] | None = None
) -> Installed:
    """Render the chart with ``values`` and apply everything but its workloads."""
    chart = helm_python.Chart.load(str(rendering.CHART))
    try:
        rendered = rendering.render(chart, values)
    finally:
        chart.close()
    install_crds(plane)
    plane.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    objects = [o for o in rendered.objects if o["kind"] not in WORKLOADS]

    def rank(obj: Mapping[str, Any]) -> int:
        kind = obj["kind"]
        return ORDER.index(kind) if kind in ORDER else len(ORDER)

    configuration = ""
    webhooks: list[dict[str, Any]] = []
    for obj in sorted(objects, key=rank):
        if obj["kind"].endswith("WebhookConfiguration"):
            configuration = obj["metadata"]["name"]
            obj = to_loopback(obj, port=webhook_port)
            webhooks.append(obj)
        if obj["kind"] in ("ClusterKopfPeering", "KopfPeering"):
            # The tests run one operator replica, standalone (no peering to watch).
            continue
        plane.apply(obj)

    def account(component: str) -> str:
        for sa in rendered.of("ServiceAccount"):
            labels = sa["metadata"].get("labels") or {}
            if labels.get("app.kubernetes.io/component") == component:
                return str(sa["metadata"]["name"])
        raise AssertionError(f"the chart renders no ServiceAccount for {component}")

    return Installed(
        rendered=rendered,
        webhook_port=webhook_port,
        operator_account=account("operator"),
        node_agent_account=account("device-plugin"),
        webhook_configuration=configuration,
        webhook_configurations=tuple(webhooks),
        operator_env=_operator_env(rendered),
    )


def _operator_env(rendered: rendering.Rendered) -> dict[str, str]:
    (workload,) = rendered.of("StatefulSet")
    containers = workload["spec"]["template"]["spec"]["containers"]
    operator = next(c for c in containers if "better-compute-operator" in (c.get("command") or ()))
    return {e["name"]: str(e["value"]) for e in operator.get("env") or () if "value" in e}


#: Our namespaced and cluster-scoped kinds, emptied between tests.
OUR_KINDS = (
    ("reservations", True),
    ("deviceallocations", True),
    ("eventsubscriptions", True),
    ("gpuquotas", False),
    ("gpunodes", False),
    ("gpupools", False),
)


def empty(
    plane: ControlPlane,
    installed: Installed,
    *,
    keep_namespaces: frozenset[str] = frozenset(),
) -> None:
    """Remove every object of our kinds (finalizers first: no operator may be running) and the
    namespaces and nodes tests made, so the next test starts from a freshly installed chart.

    The webhook configurations go first and come back last, without the ``caBundle`` the last
    operator wrote: with no operator to answer them, every update here would be refused, and
    the next operator writes its CA again, as a freshly installed one does."""
    for configuration in installed.webhook_configurations:
        try:
            plane.request("DELETE", object_path(configuration))
        except ApiError as e:
            if e.status != 404:
                raise
    for plural, _namespaced in OUR_KINDS:
        listed = plane.get(f"/apis/bcd.dev/v1alpha1/{plural}") or {"items": []}
        for obj in listed["items"]:
            meta = obj["metadata"]
            where = f"/namespaces/{meta['namespace']}" if meta.get("namespace") else ""
            path = f"/apis/bcd.dev/v1alpha1{where}/{plural}/{meta['name']}"
            try:
                if meta.get("finalizers"):
                    plane.request(
                        "PATCH",
                        path,
                        {"metadata": {"finalizers": None}},
                        content_type="application/merge-patch+json",
                    )
                plane.request("DELETE", path)
            except ApiError as e:
                if e.status != 404:
                    raise
    listed = plane.get("/api/v1/namespaces") or {"items": []}
    system = {"default", "kube-system", "kube-public", "kube-node-lease", NAMESPACE}
    for ns in listed["items"]:
        name = ns["metadata"]["name"]
        if name in system or name in keep_namespaces or ns["metadata"].get("deletionTimestamp"):
            continue
        try:
            plane.request("DELETE", f"/api/v1/namespaces/{name}")
        except ApiError as e:
            if e.status != 404:
                raise
    # The namespace controller empties and removes them; the next test may reuse the names.
    deadline = time.monotonic() + 60
    while any(
        ns["metadata"]["name"] not in system | keep_namespaces
        for ns in (plane.get("/api/v1/namespaces") or {"items": []})["items"]
    ):
        if time.monotonic() > deadline:
            raise AssertionError("test namespaces still terminating after 60 s")
        # A pod bound to a node ends only when its kubelet confirms; there are no kubelets.
        for pod in (plane.get("/api/v1/pods") or {"items": []})["items"]:
            meta = pod["metadata"]
            if meta["namespace"] in system | keep_namespaces:
                continue
            try:
                plane.request(
                    "DELETE",
                    f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
                    "?gracePeriodSeconds=0",
                )
            except ApiError as e:
                if e.status != 404:
                    raise
        time.sleep(0.2)
    for kind in ("nodes",):
        listed = plane.get(f"/api/v1/{kind}") or {"items": []}
        for obj in listed["items"]:
            try:
                plane.request("DELETE", f"/api/v1/{kind}/{obj['metadata']['name']}")
            except ApiError as e:
                if e.status != 404:
                    raise
    for configuration in installed.webhook_configurations:
        plane.apply(configuration)


def write_values(path: Path, values: Mapping[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(dict(values)))
    return path
