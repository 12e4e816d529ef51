"""The chart's node-certificate settings reach both programs, and the cert-manager CA option.

The RBAC they need is in ``test_rbac.py``'s table; here: the values become the operator's and
the device plugin's environment (the names ``better-compute-operator --help`` and
``better-compute-deviceplugin --help`` list), the CA Certificate cert-manager is asked for,
and the schema's refusals.
"""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from tests.chart import rendering


def _env(rendered: rendering.Rendered, kind: str) -> dict[str, Any]:
    return rendering.env_of(next(rendering.containers(rendered.one(kind))))


def test_the_defaults_enrol_every_node_and_name_the_agent(defaults: rendering.Rendered):
    operator = _env(defaults, "StatefulSet")
    assert operator["BCD_NODE_CERTIFICATES"] == "true"
    assert operator["BCD_NODE_AGENT_SERVICE_ACCOUNT"] == "bc-better-compute-device-plugin"
    assert operator["BCD_NODE_CERTIFICATE_LIFETIME_HOURS"] == "168"
    assert operator["BCD_NODE_CERTIFICATE_GRACE_MINUTES"] == "60"
    assert operator["BCD_NODE_CA_SECRET"] == "bc-node-ca"
    assert operator["BCD_NODE_CA_CREATE"] == "true"
    plugin = _env(defaults, "DaemonSet")
    assert plugin["BCD_ENROL"] == "true"
    assert plugin["BCD_CERTIFICATE_LIFETIME_HOURS"] == "168"
    assert plugin["BCD_NODE_CERTIFICATE"] == "/var/lib/bcd/node-cert.pem"
    # Beside the key, on the host path that keeps the key across restarts.
    assert plugin["BCD_NODE_KEY"] == "/var/lib/bcd/node-key.pem"
    # The pod's own projected token is what the operator checks: never switched off.
    daemonset = rendering.pod_spec(defaults.one("DaemonSet"))
    assert daemonset.get("automountServiceAccountToken", True) is True
    assert defaults.of("Certificate") == [] or all(
        c["metadata"]["name"] != "bc-better-compute-node-ca" for c in defaults.of("Certificate")
    )


def test_values_change_the_lifetime_grace_and_secret(render):
    rendered = render(
        {
            "nodeCertificates": {"lifetimeHours": 24, "graceMinutes": 15},
            "operator": {"nodeCA": {"secretName": "corp-ca"}},
        }
    )
    operator = _env(rendered, "StatefulSet")
    assert operator["BCD_NODE_CERTIFICATE_LIFETIME_HOURS"] == "24"
    assert operator["BCD_NODE_CERTIFICATE_GRACE_MINUTES"] == "15"
    assert operator["BCD_NODE_CA_SECRET"] == "corp-ca"
    assert _env(rendered, "DaemonSet")["BCD_CERTIFICATE_LIFETIME_HOURS"] == "24"


def test_cert_manager_makes_an_ed25519_ca_that_keeps_its_key(render):
    issuer = {"kind": "ClusterIssuer", "name": "corp-root"}
    rendered = render({"nodeCertificates": {"certManager": {"enabled": True, "issuerRef": issuer}}})
    assert _env(rendered, "StatefulSet")["BCD_NODE_CA_CREATE"] == "false"
    certificate = rendered.one("Certificate", "bc-better-compute-node-ca")
    # cert-manager writes the node CA's Secret, which the operator only reads.
    spec = certificate["spec"]
    assert spec["isCA"] is True
    assert spec["secretName"] == "bc-node-ca"
    assert spec["privateKey"] == {"algorithm": "Ed25519", "rotationPolicy": "Never"}
    assert spec["issuerRef"] == issuer
    assert (spec["duration"], spec["renewBefore"]) == ("87600h", "720h")


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        ({"nodeCertificates": {"certManager": {"enabled": True}}}, "issuerRef"),
        ({"nodeCertificates": {"lifetimeHours": 0}}, "lifetimeHours"),
        ({"nodeCertificates": {"renew": True}}, "'renew' not allowed"),
    ],
)
def test_bad_values_are_refused_naming_the_key(
    chart: helm_python.Chart, values: dict[str, Any], reason: str
):
    with pytest.raises(helm_python.HelmValuesError) as refused:
        rendering.render(chart, values)
    assert reason in str(refused.value)
