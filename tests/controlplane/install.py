"""Install what the Helm chart installs into the real control plane, as ``helm install`` would:
``bettercompute.dev.controlplane.chart`` (the one copy, which ``better-compute dev --kube``
runs too), with the tests' render (``tests/chart/rendering.py``, values per test) and what the
tests need between them: ``empty``, which leaves the next test a freshly installed chart.

What it must never do: change an RBAC rule, a CRD or a webhook's rules, or apply anything the
chart does not render.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import yaml

from bettercompute.dev.controlplane import chart as product_chart
from bettercompute.dev.controlplane.chart import ORDER, WORKLOADS, install_crds, to_loopback
from tests.chart import rendering
from tests.controlplane.cluster import ApiError, ControlPlane, object_path

__all__ = [
    "NAMESPACE",
    "ORDER",
    "OUR_KINDS",
    "RELEASE",
    "WORKLOADS",
    "Installed",
    "crds",
    "empty",
    "install",
    "install_crds",
    "to_loopback",
    "write_values",
]

NAMESPACE = rendering.NAMESPACE
RELEASE = rendering.RELEASE
assert (NAMESPACE, RELEASE) == (product_chart.NAMESPACE, product_chart.RELEASE)


@dataclass(frozen=True)
class Installed(product_chart.Applied):
    """What the install applied, and the rendered chart the tests read its roles from."""

    rendered: rendering.Rendered


def crds() -> list[dict[str, Any]]:
    """The chart's CRDs (its ``crds/`` directory, which Helm installs before the templates)."""
    return product_chart.crds(rendering.CHART)


def install(
    plane: ControlPlane, *, webhook_port: int, values: Mapping[str, Any] | None = None
) -> Installed:
    """Render the chart with ``values`` and apply everything but its workloads."""
    chart = helm_python.Chart.load(str(rendering.CHART))
    try:
        rendered = rendering.render(chart, values)
    finally:
        chart.close()
    applied = product_chart.apply(
        plane, rendered.objects, chart=rendering.CHART, webhook_port=webhook_port
    )
    kept = {f.name: getattr(applied, f.name) for f in dataclasses.fields(applied)}
    return Installed(rendered=rendered, **kept)


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
    # Nodes, and the CSRs tests' agents and attackers made (cluster-scoped, like Nodes).
    for path in ("/api/v1/nodes", "/apis/certificates.k8s.io/v1/certificatesigningrequests"):
        listed = plane.get(path) or {"items": []}
        for obj in listed["items"]:
            try:
                plane.request("DELETE", f"{path}/{obj['metadata']['name']}")
            except ApiError as e:
                if e.status != 404:
                    raise
    for configuration in installed.webhook_configurations:
        plane.apply(configuration)


def write_values(path: Path, values: Mapping[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(dict(values)))
    return path
