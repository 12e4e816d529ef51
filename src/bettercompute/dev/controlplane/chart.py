"""Install what the Helm chart installs into the real control plane, as ``helm install`` would.

Why it exists: ``better-compute dev --kube`` and the tests need the chart's CRDs, RBAC and
webhook configurations in the cluster before the operator starts, and a missing RBAC rule, a
CRD the real structural-schema check refuses or a webhook configuration the API server cannot
call must fail there, not in a platform team's install. So the objects come from rendering the
chart (``render``: Helm's own engine, ``helm_python``, offline) and are applied as they are,
with two changes a cluster without a pod network needs, both made here:

- workloads (the operator's StatefulSet, the device plugin's DaemonSet, the CRD-upgrade Job)
  are not applied: the operator runs as a process on this machine, under the chart's service
  account, with a token from the TokenRequest API;
- each webhook's ``clientConfig.service`` becomes a ``url`` on 127.0.0.1 at the operator's
  webhook port (the API server cannot reach a Service without a pod network); the operator
  still makes its certificate (with 127.0.0.1 among its names) and writes its CA into
  ``caBundle`` itself, as it does in a cluster.

What it must never do: change an RBAC rule, a CRD or a webhook's rules, apply anything the
chart does not render, or reach anything but the control plane it is given.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from bettercompute.dev.controlplane import binary
from bettercompute.dev.controlplane.plane import ControlPlane

#: The release and namespace, as the chart's README installs it.
RELEASE = "bc"
NAMESPACE = "better-compute"
#: Where the chart is, relative to a checkout.
RELATIVE = Path("charts") / "better-compute"
#: What runs as a process on this machine instead of a pod.
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


class ChartError(Exception):
    """The chart cannot be found, rendered or installed; the message says why."""


@dataclass(frozen=True)
class Applied:
    """What an install put in the cluster, and what running the operator needs of it."""

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
            raise ChartError(f"the chart's operator container sets no {name}")
        return self.operator_env[name]


def find() -> Path:
    """The chart of the checkout this package runs from, else of the current directory."""
    roots = binary.checkouts()
    for root in roots:
        if (root / RELATIVE / "Chart.yaml").is_file():
            return root / RELATIVE
    where = " or ".join(str(root / RELATIVE) for root in roots) or str(RELATIVE)
    raise ChartError(f"no Helm chart at {where}: run from a checkout of better-compute")


def engine() -> ModuleType:
    """Helm's engine (``helm_python``: the test extra has it, the product's extras do not)."""
    try:
        import helm_python
    except ModuleNotFoundError:
        raise ChartError(
            "rendering the Helm chart needs helm-python-sdk (Helm's engine, no helm binary): "
            "pip install 'helm-python-sdk>=0.2.2,<0.3', or install the checkout with its test "
            "extra: pip install -e '.[test]'"
        ) from None
    return helm_python


def render(chart: Path, values: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart's objects as ``helm install`` of release ``bc`` in ``better-compute`` renders
    them (Helm's engine in process, offline: ``lookup`` finds nothing)."""
    loaded = engine().Chart.load(str(chart))
    try:
        manifests = loaded.render(
            dict(values or {}),
            name=RELEASE,
            namespace=NAMESPACE,
            is_install=True,
            is_upgrade=False,
        )
    finally:
        loaded.close()
    objects: list[dict[str, Any]] = []
    for path in sorted(manifests):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(d for d in yaml.safe_load_all(manifests[path]) if d)
    return objects


def crds(chart: Path) -> list[dict[str, Any]]:
    """The chart's CRDs (its ``crds/`` directory, which Helm installs before the templates)."""
    found: list[dict[str, Any]] = []
    for path in sorted((chart / "crds").glob("*.yaml")):
        found.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return found


def install_crds(
    plane: ControlPlane, definitions: Sequence[Mapping[str, Any]], *, timeout_s: float = 60.0
) -> None:
    """Apply the CRDs and wait until the API server serves each (``Established``)."""
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
                raise ChartError(f"CRD {crd['metadata']['name']} not established: {status}")
            time.sleep(0.1)
        # Established is not served yet: a list answers 429 "storage is (re)initializing" for
        # a moment (request() waits that out), which an operator started now would log.
        spec = crd["spec"]
        version = next(v["name"] for v in spec["versions"] if v.get("served", True))
        plane.get(f"/apis/{spec['group']}/{version}/{spec['names']['plural']}?limit=1")


def to_loopback(configuration: Mapping[str, Any], *, port: int) -> dict[str, Any]:
    """A webhook configuration whose Service references are URLs on 127.0.0.1:``port``."""
    changed: dict[str, Any] = yaml.safe_load(yaml.safe_dump(dict(configuration)))
    for webhook in changed.get("webhooks") or ():
        service = webhook["clientConfig"].pop("service")
        webhook["clientConfig"]["url"] = f"https://127.0.0.1:{port}{service.get('path', '/')}"
    return changed


def apply(
    plane: ControlPlane,
    objects: Sequence[Mapping[str, Any]],
    *,
    chart: Path,
    webhook_port: int,
) -> Applied:
    """Install a render of ``chart`` (``objects``): its CRDs, then everything but its
    workloads and kopf's peering objects (the operator here is one standalone replica)."""
    install_crds(plane, crds(chart))
    plane.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})

    def rank(obj: Mapping[str, Any]) -> int:
        kind = obj["kind"]
        return ORDER.index(kind) if kind in ORDER else len(ORDER)

    configuration = ""
    webhooks: list[dict[str, Any]] = []
    for obj in sorted((o for o in objects if o["kind"] not in WORKLOADS), key=rank):
        if obj["kind"] in ("ClusterKopfPeering", "KopfPeering"):
            continue
        if obj["kind"].endswith("WebhookConfiguration"):
            configuration = obj["metadata"]["name"]
            obj = to_loopback(obj, port=webhook_port)
            webhooks.append(dict(obj))
        plane.apply(obj)

    def account(component: str) -> str:
        for sa in (o for o in objects if o["kind"] == "ServiceAccount"):
            labels = sa["metadata"].get("labels") or {}
            if labels.get("app.kubernetes.io/component") == component:
                return str(sa["metadata"]["name"])
        raise ChartError(f"the chart renders no ServiceAccount for {component}")

    return Applied(
        webhook_port=webhook_port,
        operator_account=account("operator"),
        node_agent_account=account("device-plugin"),
        webhook_configuration=configuration,
        webhook_configurations=tuple(webhooks),
        operator_env=operator_env(objects),
    )


def operator_env(objects: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The operator container's plain ``env`` values, as its StatefulSet gives them."""
    (workload,) = (o for o in objects if o["kind"] == "StatefulSet")
    containers = workload["spec"]["template"]["spec"]["containers"]
    operator = next(c for c in containers if "better-compute-operator" in (c.get("command") or ()))
    return {e["name"]: str(e["value"]) for e in operator.get("env") or () if "value" in e}
