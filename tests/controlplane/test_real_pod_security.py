"""The chart's pods against the real API server's Pod Security admission, at each level.

The install page tells a platform team to label the release namespace
``pod-security.kubernetes.io/enforce: privileged`` because the node agent runs as root with host
paths, and says the operator and the CRD hook meet ``restricted``. Here the chart's rendered pod
templates are sent (``dryRun=All``: admitted or refused, never run) into namespaces labelled
with each level, so those sentences are the API server's verdict, not a reading of the spec.
"""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from tests.chart import rendering
from tests.controlplane.cluster import ApiError, ControlPlane
from tests.controlplane.plugin import Cluster

#: The labels docs/install/pod-security.md gives the release namespace.
PRIVILEGED = {
    "pod-security.kubernetes.io/enforce": "privileged",
    "pod-security.kubernetes.io/enforce-version": "latest",
    "pod-security.kubernetes.io/audit": "restricted",
    "pod-security.kubernetes.io/audit-version": "latest",
}


def _level(level: str) -> dict[str, str]:
    return {
        "pod-security.kubernetes.io/enforce": level,
        "pod-security.kubernetes.io/enforce-version": "latest",
    }


@pytest.fixture(scope="module")
def templates() -> dict[str, dict[str, Any]]:
    """The pod templates of the chart's workloads, by component, with default values."""
    chart = helm_python.Chart.load(str(rendering.CHART))
    try:
        rendered = rendering.render(chart, {})
    finally:
        chart.close()
    workloads = {
        "operator": rendering.pod_spec(rendered.one("StatefulSet")),
        "device-plugin": rendering.pod_spec(rendered.one("DaemonSet")),
        "crd-upgrade": rendering.pod_spec(rendered.one("Job")),
    }
    return workloads


def _namespace(plane: ControlPlane, name: str, labels: dict[str, str], spec: Any) -> None:
    plane.apply(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
    )
    for pod in spec.values():
        account = pod.get("serviceAccountName")
        if account:  # the ServiceAccount admission plugin wants it to exist
            plane.apply(
                {
                    "apiVersion": "v1",
                    "kind": "ServiceAccount",
                    "metadata": {"name": account, "namespace": name},
                }
            )


def _admit(plane: ControlPlane, namespace: str, component: str, spec: dict[str, Any]) -> None:
    """Create the pod with ``dryRun=All``: every admission check runs, nothing is stored."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"psa-{component}", "namespace": namespace},
        "spec": spec,
    }
    plane.request("POST", f"/api/v1/namespaces/{namespace}/pods?dryRun=All", pod)


def test_the_operator_and_the_crd_hook_run_under_restricted(
    cluster: Cluster, templates: dict[str, dict[str, Any]]
) -> None:
    plane = cluster.plane
    _namespace(plane, "psa-restricted", _level("restricted"), templates)
    _admit(plane, "psa-restricted", "operator", templates["operator"])
    _admit(plane, "psa-restricted", "crd-upgrade", templates["crd-upgrade"])


@pytest.mark.parametrize("level", ["restricted", "baseline"])
def test_the_node_agent_is_refused_below_privileged(
    cluster: Cluster, templates: dict[str, dict[str, Any]], level: str
) -> None:
    plane = cluster.plane
    namespace = f"psa-{level}-agent"
    _namespace(plane, namespace, _level(level), templates)
    with pytest.raises(ApiError) as refused:
        _admit(plane, namespace, "device-plugin", templates["device-plugin"])
    assert refused.value.status == 403
    message = str(refused.value)
    assert f'violates PodSecurity "{level}:latest"' in message
    assert "hostPath" in message  # its host paths, which even baseline forbids


def test_the_documented_labels_admit_every_pod_of_the_chart(
    cluster: Cluster, templates: dict[str, dict[str, Any]]
) -> None:
    plane = cluster.plane
    _namespace(plane, "psa-release", PRIVILEGED, templates)
    for component, spec in templates.items():
        _admit(plane, "psa-release", component, spec)
