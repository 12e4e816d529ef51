"""The chart as a whole: it lints strictly, ships exactly the repository's CRDs, and every object
it renders, with the defaults, with every option on, and with cert-manager, is one the API
server of the chart's minimum Kubernetes version would accept as is.

Everything runs offline through Helm v4's engine (``helm_python``) and the Kubernetes JSON
schemas that ``kubernetes_validate`` ships; our own kinds are checked against our CRDs with
``tests/support/crdschema.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import helm_python
import pytest
import yaml

from tests.chart import rendering
from tests.chart.conftest import full
from tests.support import crdschema

REPO_CRDS = sorted(p.name for p in (rendering.ROOT / "crds").glob("*.yaml"))
KOPF_CRDS = {
    "clusterkopfpeerings.yaml": ("clusterkopfpeerings.kopf.dev", "ClusterKopfPeering", "Cluster"),
    "kopfpeerings.yaml": ("kopfpeerings.kopf.dev", "KopfPeering", "Namespaced"),
}


def _findings(report: dict) -> list[dict]:
    """Lint messages worse than "info" (severity 1: icon is recommended)."""
    return [m for m in report["messages"] if m["severity"] >= 2]


def test_lints_strictly_with_the_defaults():
    report = helm_python.lint(rendering.CHART, strict=True)
    assert report["errors"] == [], report
    assert _findings(report) == []


def test_lints_strictly_with_every_option_on():
    report = helm_python.lint(rendering.CHART, full(), strict=True, namespace=rendering.NAMESPACE)
    assert report["errors"] == [], report
    assert _findings(report) == []


def test_lint_reports_a_value_the_schema_refuses():
    # The same lint call must be able to fail, or the two above prove nothing.
    report = helm_python.lint(rendering.CHART, {"operator": {"replicas": 0}}, strict=True)
    assert any("/operator/replicas" in e for e in report["errors"]), report


def test_the_crds_are_the_repositorys_byte_for_byte(chart: helm_python.Chart):
    shipped = sorted(p.name for p in (rendering.CHART / "crds").glob("*.yaml"))
    assert shipped == sorted([*REPO_CRDS, *KOPF_CRDS])
    for name in REPO_CRDS:
        repo = (rendering.ROOT / "crds" / name).read_bytes()
        assert (rendering.CHART / "crds" / name).read_bytes() == repo, f"crds/{name} differs"
    # And Helm loads every one of them as a CRD to install before the templates.
    loaded = {c["filename"].rsplit("/", 1)[-1] for c in chart.crds}
    assert loaded == set(shipped)


@pytest.mark.parametrize("name", sorted(KOPF_CRDS))
def test_kopfs_peering_crds_are_what_kopf_looks_for(name: str):
    crd = yaml.safe_load((rendering.CHART / "crds" / name).read_text(encoding="utf-8"))
    full_name, kind, scope = KOPF_CRDS[name]
    assert crd["metadata"]["name"] == full_name
    assert crd["spec"]["group"] == "kopf.dev"
    assert crd["spec"]["names"]["kind"] == kind
    assert crd["spec"]["scope"] == scope
    (version,) = crd["spec"]["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1", True, True)
    schema = version["schema"]["openAPIV3Schema"]
    assert crdschema.structural_errors(schema) == []
    # kopf writes each peer under status.<identity>: status must keep unknown fields.
    assert schema["properties"]["status"]["x-kubernetes-preserve-unknown-fields"] is True


def test_every_crd_is_itself_a_valid_object(chart: helm_python.Chart):
    for crd in chart.crds:
        obj = yaml.safe_load(crd["data"])
        assert rendering.problems(obj, schemas={}) == [], crd["filename"]


def _assert_all_valid(rendered: rendering.Rendered, schemas) -> None:
    found = {}
    for i, obj in enumerate(rendered.objects):
        issues = rendering.problems(obj, schemas=schemas)
        if issues:
            found[f"{rendered.sources[i]}: {obj['kind']}/{obj['metadata']['name']}"] = issues
    assert found == {}


def test_every_default_object_is_valid(defaults: rendering.Rendered, schemas):
    _assert_all_valid(defaults, schemas)
    assert {"StatefulSet", "DaemonSet", "Service", "ClusterKopfPeering"} <= set(defaults.kinds())


def test_every_object_with_every_option_on_is_valid(everything: rendering.Rendered, schemas):
    _assert_all_valid(everything, schemas)
    assert {"GPUPool", "GPUQuota", "NetworkPolicy", "ServiceMonitor", "ConfigMap"} <= set(
        everything.kinds()
    )


def test_every_object_with_cert_manager_is_valid(render: Callable, schemas):
    rendered = render({"webhook": {"certManager": {"enabled": True}}})
    _assert_all_valid(rendered, schemas)


def test_the_validator_refuses_a_broken_object(defaults: rendering.Rendered, schemas):
    # The checks above must be able to fail: a misspelt field in a rendered workload.
    statefulset = dict(defaults.one("StatefulSet"))
    statefulset["spec"] = {**statefulset["spec"], "replica": 2}
    assert rendering.problems(statefulset, schemas=schemas) != []
    pool = {"apiVersion": "bcd.dev/v1alpha1", "kind": "GPUPool", "metadata": {"name": "p"}}
    assert "spec: required" in rendering.problems(pool, schemas=schemas)


def test_every_namespaced_object_is_in_the_release_namespace(everything: rendering.Rendered):
    cluster_scoped = {
        "ClusterRole",
        "ClusterRoleBinding",
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "DeviceClass",
        "ClusterKopfPeering",
        "GPUPool",
        "GPUQuota",
    }
    opened = []
    for obj in everything.objects:
        if obj["kind"] in cluster_scoped:
            assert "namespace" not in obj["metadata"], obj["kind"]
        elif obj["metadata"]["name"].endswith("-operator-subscription-secrets"):
            # The one exception: the RoleBindings that let the operator write EventSubscriptions'
            # Secrets in the namespaces listed for them (tests/chart/test_rbac.py).
            assert obj["kind"] == "RoleBinding"
            opened.append(obj["metadata"]["namespace"])
        else:
            assert obj["metadata"]["namespace"] == rendering.NAMESPACE, obj["kind"]
    assert opened == ["ml", "team-b"]


def test_the_peering_object_is_the_one_the_operator_joins(defaults: rendering.Rendered):
    from bettercompute.operator.config import OperatorConfig

    peering = defaults.one("ClusterKopfPeering")
    assert peering["apiVersion"] == "kopf.dev/v1"
    assert peering["metadata"]["name"] == OperatorConfig(database_url="").peering_name


def test_pools_become_gpupools_the_operator_accepts(everything: rendering.Rendered):
    from bettercompute.operator import definitions
    from tests.chart.conftest import POOL

    pool = everything.one("GPUPool", "h100-train")
    assert pool["spec"] == POOL
    definition = definitions.pool_definition("h100-train", pool["spec"])
    assert definition.pool_id == "h100-train"


def test_quotas_become_gpuquotas_the_operator_accepts(everything: rendering.Rendered):
    from bettercompute.operator import quotas
    from tests.chart.conftest import QUOTAS

    for name, spec in QUOTAS.items():
        quota = everything.one("GPUQuota", name)
        assert quota["spec"] == spec
        assert quotas.parse(quota["spec"]).tenant == spec["tenant"]


def test_notes_tell_what_to_do_next(defaults: rendering.Rendered, everything: rendering.Rendered):
    notes = defaults.notes
    for needle in (
        "kind: Reservation",
        "kubectl get rsv",
        "bcd.dev/gpu:",
        "binding: kubernetes",
        "create secret generic bc-better-compute-database",
    ):
        assert needle in notes, needle
    # The Reservation in the NOTES is one the validating webhook would let through.
    from bettercompute.operator import webhooks

    blocks = [
        block.split("YAML", 1)[0] for block in notes.split("cat <<'YAML' | kubectl apply -f -")[1:]
    ]
    objects = {
        o["kind"]: o
        for block in blocks
        for o in yaml.safe_load_all("\n".join(line[5:] for line in block.splitlines()))
    }
    assert set(objects) == {"GPUPool", "GPUQuota", "Reservation", "Pod"}
    assert webhooks.spec_problem(objects["Reservation"]["spec"]) is None
    from bettercompute.operator import definitions, quotas

    assert definitions.pool_definition("h100-train", objects["GPUPool"]["spec"]).pool_id
    assert quotas.parse(objects["GPUQuota"]["spec"]).tenant == "acme"
    # The pod asks for what the Reservation holds, under the label the pod webhook reads.
    pod = objects["Pod"]
    assert pod["metadata"]["labels"] == {"bcd.dev/reservation": "train-1"}
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"] == {"bcd.dev/gpu": 4}
    # Helm prints these wherever the chart came from: no path of a repository checkout.
    for text in (notes, everything.notes):
        assert "examples/" not in text
        assert ".venv" not in text
        assert "charts/better-compute" not in text
    # Given the database by host, the NOTES name it and ask for the password's Secret, not for
    # the URL's; they name the pools made.
    assert "create secret generic bc-better-compute-database" not in everything.notes
    assert "PostgreSQL at db.example:6432, database bcd, as bcd_operator" in everything.notes
    assert "create secret generic bcd-db --from-literal=password=" in everything.notes
    assert "this release created: h100-train" in everything.notes
