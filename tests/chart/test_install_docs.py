"""The install pages' values are values the chart takes, and do what the pages say.

``docs/install/database.md`` gives a values file for a CloudNativePG cluster and
``docs/install/security.md`` one for the network policies; a newcomer copies them as they are.
Each is read from its page, checked by the chart's schema and rendered, so a renamed value
fails here rather than at someone's ``helm install``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python
import yaml

from tests.chart import rendering

DOCS = rendering.ROOT / "docs" / "install"
_YAML = re.compile(r"^```yaml\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def _blocks(page: Path) -> list[dict[str, Any]]:
    return [yaml.safe_load(b) for b in _YAML.findall(page.read_text(encoding="utf-8"))]


def _values(page: str, first_key: str) -> dict[str, Any]:
    found = [b for b in _blocks(DOCS / page) if isinstance(b, dict) and first_key in b]
    assert len(found) == 1, f"{page}: expected one values block with {first_key!r}"
    return found[0]


def test_the_cloudnativepg_values_connect_by_parts_and_check_the_certificate(
    chart: helm_python.Chart, render: Callable[..., rendering.Rendered]
) -> None:
    values = _values("database.md", "database")
    chart.validate_schema(values)
    operator = rendering.pod_spec(render(values).one("StatefulSet"))
    (container,) = [c for c in operator["containers"] if c["name"] == "operator"]
    env = rendering.env_of(container)
    assert env["DATABASE_URL"] == "postgresql://"
    assert env["PGHOST"] == "bcd-db-rw.better-compute.svc"
    assert env["PGUSER"] == "bcd"
    assert env["PGPASSWORD"] == {"secretKeyRef": {"name": "bcd-db-app", "key": "password"}}
    assert env["PGSSLMODE"] == "verify-full"
    assert env["PGSSLROOTCERT"] == "/etc/bcd/database-ca/ca.crt"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["database-ca"] == "/etc/bcd/database-ca"

    # The Cluster on the same page makes what the values name.
    (cluster,) = [b for b in _blocks(DOCS / "database.md") if b.get("kind") == "Cluster"]
    name = cluster["metadata"]["name"]
    assert values["database"]["host"] == f"{name}-rw.{cluster['metadata']['namespace']}.svc"
    assert values["database"]["passwordSecret"]["name"] == f"{name}-app"
    assert values["database"]["user"] == cluster["spec"]["bootstrap"]["initdb"]["owner"]
    assert values["database"]["name"] == cluster["spec"]["bootstrap"]["initdb"]["database"]


def test_the_network_policy_values_open_metrics_to_monitoring_only(
    chart: helm_python.Chart, render: Callable[..., rendering.Rendered]
) -> None:
    values = _values("security.md", "networkPolicy")
    chart.validate_schema(values)
    policies = {p["metadata"]["name"]: p for p in render(values).of("NetworkPolicy")}
    operator = policies[f"{rendering.RELEASE}-better-compute-operator"]["spec"]["ingress"]
    by_port = {rule["ports"][0]["port"]: rule.get("from") for rule in operator}
    assert by_port["webhook"] is None  # the API server's address differs by cluster
    assert by_port["http"] == values["networkPolicy"]["httpFrom"]
    assert by_port["metrics"] == values["networkPolicy"]["metricsFrom"]


def test_the_verify_checklist_objects_are_ones_the_operator_accepts() -> None:
    from bettercompute.operator import definitions, quotas, webhooks

    found = [
        o
        for block in _YAML.findall((DOCS / "verify.md").read_text(encoding="utf-8"))
        for o in yaml.safe_load_all(block)
    ]
    found += [
        o
        for block in re.findall(
            r"<<'YAML'\n(.*?)^YAML$", (DOCS / "verify.md").read_text(encoding="utf-8"), re.M | re.S
        )
        for o in yaml.safe_load_all(block)
    ]
    kinds = [o["kind"] for o in found]
    assert sorted(kinds) == ["GPUPool", "GPUQuota", "Reservation", "Reservation"]
    for o in found:
        if o["kind"] == "GPUPool":
            assert definitions.pool_definition(o["metadata"]["name"], o["spec"]).pool_id
        elif o["kind"] == "GPUQuota":
            quota = quotas.parse(o["spec"])
            # A pool without spec.model charges gpu:other: the quota must name that.
            assert "gpu:other" in o["spec"]["limits"], quota
        else:
            assert webhooks.spec_problem(o["spec"]) is None, o
