"""The Helm chart rendered offline, as Kubernetes objects the chart tests can query and validate.

Why it exists: every chart test asks the same questions of a render (the objects of a kind, one
object by name, the containers of a workload) and checks objects the same way (the Kubernetes
schema of the chart's minimum version, our CRDs for our own kinds). Rendering goes through
``helm_python`` (Helm v4's engine, in process, offline: ``lookup`` finds nothing), so what is
tested is what ``helm install`` would send.

Who calls it: ``tests/chart/*`` through the fixtures in ``tests/chart/conftest.py``.

What it must never do: reach a cluster or the network, or pass an object it cannot check: a
kind with neither a Kubernetes schema nor one of our CRDs is reported, never skipped, unless it
is one of the ``FOREIGN`` kinds whose tests check them field by field.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import yaml

from tests.support import crdschema

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "better-compute"
EXAMPLES = ROOT / "examples"
RELEASE = "bc"
NAMESPACE = "better-compute"
#: The chart's kubeVersion floor: objects must be valid there (and so on every later version).
KUBERNETES = "1.30.0"
#: What ``dra.enabled`` needs: ``resource.k8s.io/v1`` (GA in 1.34), its objects checked there.
DRA_KUBERNETES = "1.34.0"
DRA_API = "resource.k8s.io/v1"
#: Kinds of other projects' CRDs (cert-manager, Prometheus Operator), whose schemas are not
#: here: the tests that enable them check their fields one by one.
FOREIGN = frozenset(
    {
        ("cert-manager.io/v1", "Issuer"),
        ("cert-manager.io/v1", "Certificate"),
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
        # Kueue's (examples/kueue-queues.yaml): sent with dryRun=All to the real API server
        # serving Kueue's own CRDs (tests/controlplane/test_real_kueue.py).
        ("kueue.x-k8s.io/v1beta1", "AdmissionCheck"),
        ("kueue.x-k8s.io/v1beta1", "ResourceFlavor"),
        ("kueue.x-k8s.io/v1beta1", "ClusterQueue"),
        ("kueue.x-k8s.io/v1beta1", "LocalQueue"),
    }
)


def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) → openAPIV3Schema, for every CRD the chart ships."""
    schemas: dict[tuple[str, str], dict[str, Any]] = {}
    for crd in crdschema.load_crds(CHART / "crds").values():
        for version in crd["spec"]["versions"]:
            key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
            schemas[key] = version["schema"]["openAPIV3Schema"]
    return schemas


def problems(
    obj: Mapping[str, Any],
    *,
    schemas: Mapping[tuple[str, str], Any],
    kubernetes: str | None = None,
) -> list[str]:
    """Why the API server would refuse (or prune part of) ``obj``; [] when it would not.
    Built-in kinds are checked against ``kubernetes`` (a version; by default the oldest we
    support, 1.34 for the DRA API's kinds)."""
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    if key in FOREIGN:
        return []
    if key in schemas:
        return crdschema.validate(dict(obj), with_implicit_root(schemas[key]))
    version = kubernetes or (DRA_KUBERNETES if key[0] == DRA_API else KUBERNETES)
    try:
        kubernetes_validate.validate(dict(obj), version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return [f"{key}: no schema for this kind in Kubernetes {version} nor among our CRDs"]
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path) or "(root)"
        return [f"{where}: {e.message}"]
    return []


def with_implicit_root(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` with the root fields the API server specifies implicitly for every custom
    resource (apiVersion, kind, metadata): kopf's peering CRD leaves them out."""
    properties = dict(schema.get("properties", {}))
    properties.setdefault("apiVersion", {"type": "string"})
    properties.setdefault("kind", {"type": "string"})
    properties.setdefault("metadata", {"type": "object"})
    return {**schema, "properties": properties}


@dataclass
class Rendered:
    """One render: the objects in order, by template, and the NOTES."""

    objects: list[dict[str, Any]]
    sources: dict[int, str] = field(default_factory=dict)
    notes: str = ""

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [o for o in self.of(kind) if name is None or o["metadata"]["name"] == name]
        if len(found) != 1:
            names = [o["metadata"]["name"] for o in self.of(kind)]
            raise AssertionError(f"expected one {kind} named {name!r}, found {names}")
        return found[0]

    def kinds(self) -> list[str]:
        return sorted({o["kind"] for o in self.objects})


def render(
    chart: helm_python.Chart, values: Mapping[str, Any] | None = None, *, upgrade: bool = False
) -> Rendered:
    """Render as ``helm install`` (or ``upgrade``) of release ``bc`` in ``better-compute``."""
    manifests = chart.render(
        dict(values or {}),
        name=RELEASE,
        namespace=NAMESPACE,
        is_install=not upgrade,
        is_upgrade=upgrade,
    )
    rendered = Rendered(objects=[])
    for path in sorted(manifests):
        text = manifests[path]
        if path.endswith("NOTES.txt"):
            rendered.notes = text
            continue
        for document in yaml.safe_load_all(text):
            if document:
                rendered.sources[len(rendered.objects)] = path
                rendered.objects.append(document)
    return rendered


def load_examples() -> list[tuple[str, dict[str, Any]]]:
    """(file name, object) for every object of every file in ``examples/``."""
    found = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if document:
                found.append((path.name, document))
    return found


def pod_spec(workload: Mapping[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def containers(workload: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    spec = pod_spec(workload)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def env_of(container: Mapping[str, Any]) -> dict[str, Any]:
    """Name → value, or → valueFrom for the ones the API server fills in."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}
