"""The admission webhooks and what routes to the operator: webhook configurations, the Service,
the certificate (Helm's own or cert-manager's), the PodDisruptionBudget, the ServiceMonitors
and the NetworkPolicies.

The webhook configurations are checked against the operator's real kopf registry: each points
at the Service path kopf serves for a handler id (``/stamp``, ``/check``), with that handler's
operations, through a Service port that reaches the container port the operator is told to
listen on. The generated certificate is checked with ``cryptography``: signed by the caBundle's
CA, for the Service's DNS names, with the key the pods mount.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from bettercompute.operator import handlers
from tests.chart import rendering

SERVICE = "bc-better-compute"
HOST = f"{SERVICE}.{rendering.NAMESPACE}.svc"
SECRET = "bc-better-compute-webhook-tls"


def _kopf_webhooks() -> dict[str, Any]:
    """kopf's webhook handlers by the path kopf serves each at (``/<handler id>``)."""
    return {f"/{h.id}": h for h in handlers.make_registry()._webhooks.get_all_handlers()}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_webhook_configurations_point_at_the_service_paths_kopf_serves(
    defaults: rendering.Rendered,
):
    service = defaults.one("Service", SERVICE)
    (container,) = rendering.pod_spec(defaults.one("StatefulSet"))["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    listening = int(rendering.env_of(container)["BCD_WEBHOOK_PORT"])
    kopf_webhooks = _kopf_webhooks()
    served = set()
    for kind, reason in (
        ("MutatingWebhookConfiguration", "mutating"),
        ("ValidatingWebhookConfiguration", "validating"),
    ):
        webhooks = defaults.one(kind)["webhooks"]
        assert [w["name"] for w in webhooks] == [
            f"{'stamp' if reason == 'mutating' else 'check'}.reservations.bcd.dev",
            f"{'rewrite' if reason == 'mutating' else 'check'}.pods.bcd.dev",
        ]
        for webhook in webhooks:
            target = webhook["clientConfig"]["service"]
            handler = kopf_webhooks[target["path"]]
            served.add(target["path"])
            assert handler.reason.value == reason
            assert (target["name"], target["namespace"]) == (SERVICE, rendering.NAMESPACE)
            (port,) = [p for p in service["spec"]["ports"] if p["port"] == target["port"]]
            assert container_ports[port["targetPort"]] == listening
            (rule,) = webhook["rules"]
            assert rule["operations"] == list(handler.operations)
            assert (rule["apiGroups"], rule["apiVersions"], rule["resources"]) == (
                [handler.selector.group or ""],
                [handler.selector.version],
                [handler.selector.any_name],
            )
            assert rule["scope"] == "Namespaced"
            assert webhook["failurePolicy"] == "Fail"
            assert webhook["sideEffects"] == "None"
            assert webhook["admissionReviewVersions"] == ["v1"]
    assert served == set(kopf_webhooks)  # every kopf webhook is registered, none twice


def test_the_service_routes_to_the_operator_only(defaults: rendering.Rendered):
    service = defaults.one("Service", SERVICE)
    statefulset = defaults.one("StatefulSet")
    operator_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    plugin_labels = defaults.one("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert _matches(service["spec"]["selector"], operator_labels)
    assert not _matches(service["spec"]["selector"], plugin_labels)
    assert statefulset["spec"]["serviceName"] == SERVICE
    # Never the metrics port: tenants reach this Service, and the metrics name every tenant.
    assert {p["name"] for p in service["spec"]["ports"]} == {"http", "webhook"}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http", "webhook"}


def test_the_operators_metrics_have_a_service_of_their_own(defaults: rendering.Rendered, render):
    (container,) = rendering.containers(defaults.one("StatefulSet"))
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container_ports["metrics"] == 9464
    assert container_ports["metrics"] not in {container_ports["http"], container_ports["webhook"]}
    assert rendering.env_of(container)["BCD_METRICS_PORT"] == "9464"
    metrics = defaults.one("Service", "bc-better-compute-operator-metrics")
    assert metrics["spec"]["clusterIP"] == "None"
    assert metrics["spec"]["ports"] == [
        {"name": "metrics", "port": 9464, "targetPort": "metrics", "protocol": "TCP"}
    ]
    labels = defaults.one("StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert _matches(metrics["spec"]["selector"], labels)
    # metrics.port moves all three.
    moved = render({"metrics": {"port": 9100}})
    (container,) = rendering.containers(moved.one("StatefulSet"))
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"] == 9100
    assert rendering.env_of(container)["BCD_METRICS_PORT"] == "9100"
    service = moved.one("Service", "bc-better-compute-operator-metrics")
    assert service["spec"]["ports"][0]["port"] == 9100


def _b64_pem(data: str) -> bytes:
    return base64.b64decode(data)


HELM_MADE = {"webhook": {"operatorManaged": False}}


def test_by_default_the_operator_keeps_the_certificate(defaults: rendering.Rendered):
    # No certificate of Helm's: no Secret, no mount, no caBundle; the operator is told where
    # to keep its own, for which Service, and which configurations to write its CA into.
    assert [s for s in defaults.of("Secret") if s["metadata"]["name"] == SECRET] == []
    template = defaults.one("StatefulSet")["spec"]["template"]
    assert "checksum/webhook-tls" not in (template["metadata"].get("annotations") or {})
    assert all(v["name"] != "webhook-tls" for v in template["spec"]["volumes"])
    env = rendering.env_of(next(rendering.containers(defaults.one("StatefulSet"))))
    assert env["BCD_WEBHOOK_SECRET"] == SECRET
    assert env["BCD_WEBHOOK_SERVICE"] == HOST.split(".")[0]
    assert "BCD_WEBHOOK_CERT" not in env
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        configuration = defaults.one(kind)
        assert env["BCD_WEBHOOK_CONFIGURATIONS"] == configuration["metadata"]["name"]
        assert all("caBundle" not in w["clientConfig"] for w in configuration["webhooks"])
    # The names the operator's certificate is for are the ones the API server calls.
    from bettercompute.operator.config import OperatorConfig

    config = OperatorConfig(
        database_url="",
        namespace=rendering.NAMESPACE,
        webhook_service=env["BCD_WEBHOOK_SERVICE"],
    )
    assert HOST in config.webhook_names


def test_the_generated_certificate_is_signed_by_the_ca_bundle(render):
    defaults = render(HELM_MADE)
    secret = defaults.one("Secret", SECRET)
    assert secret["type"] == "kubernetes.io/tls"
    ca = x509.load_pem_x509_certificate(_b64_pem(secret["data"]["ca.crt"]))
    cert = x509.load_pem_x509_certificate(_b64_pem(secret["data"]["tls.crt"]))
    key = serialization.load_pem_private_key(_b64_pem(secret["data"]["tls.key"]), password=None)
    cert.verify_directly_issued_by(ca)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert HOST in names.get_values_for_type(x509.DNSName)
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for webhook in defaults.one(kind)["webhooks"]:
            assert webhook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    # The recorded expiry is the certificate's, which is what an upgrade renews by.
    recorded = int(secret["metadata"]["annotations"]["bcd.dev/not-after"])
    not_after = cert.not_valid_after_utc.timestamp()
    assert abs(recorded - not_after) < 120
    days = (cert.not_valid_after_utc - dt.datetime.now(dt.UTC)).days
    assert 363 <= days <= 365


def test_the_pods_mount_the_certificate_and_roll_when_it_changes(render):
    defaults = render(HELM_MADE)
    secret = defaults.one("Secret", SECRET)
    template = defaults.one("StatefulSet")["spec"]["template"]
    checksum = template["metadata"]["annotations"]["checksum/webhook-tls"]
    assert checksum == hashlib.sha256(secret["data"]["tls.crt"].encode()).hexdigest()
    (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "webhook-tls"]
    assert volume["secret"]["secretName"] == SECRET
    # An upgrade that makes a new certificate (nothing to reuse offline) rolls the pods.
    again = render(HELM_MADE, upgrade=True).one("StatefulSet")["spec"]["template"]
    assert again["metadata"]["annotations"]["checksum/webhook-tls"] != checksum


def test_with_cert_manager_the_ca_is_injected_from_the_certificate(render):
    rendered = render({"webhook": {"certManager": {"enabled": True}}})
    assert rendered.of("Secret") == []
    certificate = rendered.one("Certificate", SECRET)
    assert certificate["spec"]["secretName"] == SECRET
    assert HOST in certificate["spec"]["dnsNames"]
    issuer = rendered.one("Issuer", certificate["spec"]["issuerRef"]["name"])
    ca_certificate = rendered.one("Certificate", "bc-better-compute-webhook-ca")
    assert issuer["spec"]["ca"]["secretName"] == ca_certificate["spec"]["secretName"]
    assert ca_certificate["spec"]["isCA"] is True
    self_signed = rendered.one("Issuer", ca_certificate["spec"]["issuerRef"]["name"])
    assert self_signed["spec"] == {"selfSigned": {}}
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        config = rendered.one(kind)
        annotation = config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
        assert annotation == f"{rendering.NAMESPACE}/{certificate['metadata']['name']}"
        assert all("caBundle" not in w["clientConfig"] for w in config["webhooks"])
    template = rendered.one("StatefulSet")["spec"]["template"]
    (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "webhook-tls"]
    assert volume["secret"]["secretName"] == SECRET


def test_with_cert_manager_an_existing_issuer_is_used_as_is(render):
    issuer = {"kind": "ClusterIssuer", "name": "corp-ca", "group": "cert-manager.io"}
    rendered = render({"webhook": {"certManager": {"enabled": True, "issuerRef": issuer}}})
    assert rendered.of("Issuer") == []
    assert rendered.one("Certificate")["spec"]["issuerRef"] == issuer


def test_the_disruption_budget_keeps_one_replica(defaults: rendering.Rendered, render):
    budget = defaults.one("PodDisruptionBudget")
    labels = defaults.one("StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert _matches(budget["spec"]["selector"]["matchLabels"], labels)
    assert budget["spec"]["minAvailable"] == 1
    assert render({"operator": {"replicas": 1}}).of("PodDisruptionBudget") == []


def test_service_monitors_scrape_both_components(everything: rendering.Rendered):
    monitors = {m["metadata"]["name"]: m for m in everything.of("ServiceMonitor")}
    assert set(monitors) == {"bc-better-compute-operator", "bc-better-compute-device-plugin"}
    for name, monitor in monitors.items():
        assert monitor["metadata"]["labels"]["release"] == "prom"
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics"
        services = [
            s
            for s in everything.of("Service")
            if _matches(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        assert services, name
        for service in services:
            assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    metrics = everything.one("Service", "bc-better-compute-device-plugin-metrics")
    plugin_labels = everything.one("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert _matches(metrics["spec"]["selector"], plugin_labels)


def test_the_operators_service_monitor_scrapes_the_metrics_port_only(render):
    everything = render(
        {"metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}}
    )
    monitor = everything.one("ServiceMonitor", "bc-better-compute-operator")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics"
    scraped = [
        s["metadata"]["name"]
        for s in everything.of("Service")
        if _matches(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert scraped == ["bc-better-compute-operator-metrics"]  # not the API's Service
    (container,) = rendering.containers(everything.one("StatefulSet"))
    (port,) = [p for p in container["ports"] if p["name"] == endpoint["port"]]
    assert port["containerPort"] == 9464
    # The job the alerts name (BetterComputeOperatorDown), not the metrics Service's name.
    assert endpoint["relabelings"] == [
        {"action": "replace", "targetLabel": "job", "replacement": "bc-better-compute-operator"}
    ]
    (rule,) = everything.of("PrometheusRule")
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert any('up{job="bc-better-compute-operator"' in e for e in exprs)


def test_service_monitors_are_off_by_default(defaults: rendering.Rendered):
    assert defaults.of("ServiceMonitor") == []
    assert defaults.of("NetworkPolicy") == []


def test_network_policies_leave_the_webhook_open_and_limit_the_rest(
    everything: rendering.Rendered,
):
    operator = everything.one("NetworkPolicy", "bc-better-compute-operator")
    labels = everything.one("StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert _matches(operator["spec"]["podSelector"]["matchLabels"], labels)
    webhook, http, operator_metrics = operator["spec"]["ingress"]
    assert webhook == {"ports": [{"port": "webhook", "protocol": "TCP"}]}
    assert http["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert http["from"] == [{"namespaceSelector": {"matchLabels": {"team": "platform"}}}]
    # The operator's metrics port: the monitoring peers only, not the API's.
    assert operator_metrics == {
        "ports": [{"port": "metrics", "protocol": "TCP"}],
        "from": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
    }
    plugin = everything.one("NetworkPolicy", "bc-better-compute-device-plugin")
    (metrics,) = plugin["spec"]["ingress"]
    assert metrics["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]


def test_a_metrics_token_secret_reaches_the_operator_and_the_service_monitor(render):
    rendered = render(
        {
            "metrics": {
                "tokenSecret": {"name": "bcd-metrics", "key": "token"},
                "serviceMonitor": {"enabled": True},
            }
        }
    )
    (container,) = rendering.containers(rendered.one("StatefulSet"))
    env = rendering.env_of(container)
    assert env["BETTER_COMPUTE_METRICS_TOKEN"] == {
        "secretKeyRef": {"name": "bcd-metrics", "key": "token"}
    }
    operator = rendered.one("ServiceMonitor", "bc-better-compute-operator")
    (endpoint,) = operator["spec"]["endpoints"]
    assert endpoint["bearerTokenSecret"] == {"name": "bcd-metrics", "key": "token"}


def test_metrics_are_open_without_a_token_secret(render):
    rendered = render({"metrics": {"serviceMonitor": {"enabled": True}}})
    (container,) = rendering.containers(rendered.one("StatefulSet"))
    assert "BETTER_COMPUTE_METRICS_TOKEN" not in rendering.env_of(container)
    operator = rendered.one("ServiceMonitor", "bc-better-compute-operator")
    assert "bearerTokenSecret" not in operator["spec"]["endpoints"][0]
