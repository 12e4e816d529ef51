"""Fixtures for the chart tests: the chart loaded once, a renderer, and value sets.

``full()`` turns on every optional part with non-default settings (policies, pools, a
simulated inventory, node labels, ServiceMonitors, NetworkPolicies, a digest, the database by
host and parts, service-account annotations, changed security contexts, extra environment
variables, volumes and mounts, topology spread constraints), so one render covers every
template branch that the defaults leave out.
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
#: full()'s database: by host and parts, the password from a Secret the user manages.
DATABASE = {
    "host": "db.example",
    "port": 6432,
    "name": "bcd",
    "user": "bcd_operator",
    "passwordSecret": {"name": "bcd-db", "key": "password"},
    "sslmode": "verify-full",
}
#: Secrets full() names that the chart does not make: (name, key) → value.
USER_SECRETS = {("bcd-db", "password"): "s3cret"}
ROLE_ARN = "arn:aws:iam::123456789012:role/better-compute"
GSA = "bcd-node@example-project.iam.gserviceaccount.com"
QUOTAS = {
    "acme": {"tenant": "acme", "limits": {"gpu:H100": 16}},
    "globex": {"tenant": "globex", "limits": {"gpu:H100": 8}},
}


def full() -> dict[str, Any]:
    return {
        "dra": {"enabled": True},
        "image": {
            "repository": "registry.example/bcd/better-compute",
            "digest": "sha256:" + "ab" * 32,
            "nodeDigest": "sha256:" + "cd" * 32,
            "pullPolicy": "Always",
        },
        "imagePullSecrets": [{"name": "registry"}],
        "database": DATABASE,
        "eventSubscriptions": {"namespaces": ["ml", "team-b"]},
        "operator": {
            "replicas": 3,
            "rootTenant": "platform",
            "logLevel": "DEBUG",
            "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": ROLE_ARN}},
            # Merged into the defaults: one field added, one dropped.
            "podSecurityContext": {"fsGroupChangePolicy": "OnRootMismatch", "fsGroup": None},
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "extraEnv": [
                {"name": "PGSSLROOTCERT", "value": "/etc/bcd/database-ca/ca.crt"},
                {"name": "PGAPPNAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            ],
            "extraVolumes": [
                {
                    "name": "database-ca",
                    "secret": {
                        "secretName": "db-ca",
                        "items": [{"key": "ca.crt", "path": "ca.crt"}],
                    },
                }
            ],
            "extraVolumeMounts": [
                {"name": "database-ca", "mountPath": "/etc/bcd/database-ca", "readOnly": True}
            ],
            "nodeSelector": {"node-role/control": "true"},
            "tolerations": [{"key": "control", "operator": "Exists", "effect": "NoSchedule"}],
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "topology.kubernetes.io/zone",
                    "whenUnsatisfiable": "ScheduleAnyway",
                }
            ],
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
            "serviceAccount": {"annotations": {"iam.gke.io/gcp-service-account": GSA}},
            "podSecurityContext": {"supplementalGroups": [44]},
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "extraEnv": [{"name": "TZ", "value": "UTC"}],
            "extraVolumes": [{"name": "site-config", "configMap": {"name": "site-config"}}],
            "extraVolumeMounts": [
                {"name": "site-config", "mountPath": "/etc/site", "readOnly": True}
            ],
            "simulatedInventory": {"enabled": True},
        },
        "crds": {"upgrade": {"enabled": True, "resources": {"limits": {"memory": "96Mi"}}}},
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
