"""Fixtures for the chart tests: the chart loaded once, a renderer, and value sets.

``full_values`` turns on every optional part with non-default settings (policies, pools, a
simulated inventory, node labels, ServiceMonitors, NetworkPolicies, a digest), so one render
covers every template branch that the defaults leave out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import helm_python
import pytest

from tests.chart import rendering

POLICY = """@id("one-week-at-most")
forbid (
  principal,
  action == Compute::Action::"compute:reservations:create",
  resource is Compute::Reservation
)
when { resource.durationHours.greaterThan(decimal("168.0")) };
"""

POOL = {
    "model": "H100",
    "region": "eu-west-1",
    "sharing": {"mode": "exclusive"},
    "policy": {"kubernetes": True, "maxPending": "24h"},
    "nodeSelector": {"matchLabels": {"bcd.dev/pool": "h100-train"}},
    "owner": {"tenant": "acme"},
    "offers": [{"tenant": "globex", "onBudgetExceeded": "stop-new"}],
}
QUOTAS = {
    "acme": {"tenant": "acme", "limits": {"gpu:H100": 16}},
    "globex": {"tenant": "globex", "limits": {"gpu:H100": 8}},
}


def full() -> dict[str, Any]:
    return {
        "image": {
            "repository": "registry.example/bcd/better-compute",
            "digest": "sha256:" + "ab" * 32,
            "pullPolicy": "Always",
        },
        "imagePullSecrets": [{"name": "registry"}],
        "database": {"url": "postgresql://bcd:secret@db.example:5432/bcd"},
        "operator": {
            "replicas": 3,
            "rootTenant": "platform",
            "logLevel": "DEBUG",
            "nodeSelector": {"node-role/control": "true"},
            "tolerations": [{"key": "control", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "system-cluster-critical",
            "podAnnotations": {"example.com/team": "platform"},
        },
        "policies": {"includeDefaults": False, "files": {"one-week-at-most": POLICY}},
        "pools": {"h100-train": POOL},
        "quotas": QUOTAS,
        "webhook": {"failurePolicy": "Fail", "timeoutSeconds": 5, "rotateOnUpgrade": True},
        "devicePlugin": {
            "nodeSelector": {"bcd.dev/gpu-node": "true"},
            "nodeLabels": {"bcd.dev/pool": "h100-train", "topology.example/rack": "r1"},
            "runtimeClassName": "nvidia",
            "simulatedInventory": {"enabled": True},
        },
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
        "networkPolicy": {
            "enabled": True,
            "httpFrom": [{"namespaceSelector": {"matchLabels": {"team": "platform"}}}],
            "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
        },
    }


@pytest.fixture(scope="session")
def chart() -> Iterator[helm_python.Chart]:
    loaded = helm_python.Chart.load(rendering.CHART)
    try:
        yield loaded
    finally:
        loaded.close()


@pytest.fixture(scope="session")
def render(chart: helm_python.Chart) -> Callable[..., rendering.Rendered]:
    def rendered(values: dict[str, Any] | None = None, **kwargs: Any) -> rendering.Rendered:
        return rendering.render(chart, values, **kwargs)

    return rendered


@pytest.fixture(scope="session")
def defaults(render: Callable[..., rendering.Rendered]) -> rendering.Rendered:
    return render({})


@pytest.fixture(scope="session")
def everything(render: Callable[..., rendering.Rendered]) -> rendering.Rendered:
    return render(full())


@pytest.fixture(scope="session")
def schemas() -> dict[tuple[str, str], dict[str, Any]]:
    return rendering.crd_schemas()
