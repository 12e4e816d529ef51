"""The web console in the chart: on the API's Service port, and an optional Ingress
(``console.ingress``) that routes its host to that port and nothing else."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import helm_python
import pytest

from tests.chart import rendering

Render = Callable[..., rendering.Rendered]


def test_no_ingress_by_default_and_the_notes_say_how_to_open_it(defaults: rendering.Rendered):
    assert defaults.of("Ingress") == []
    assert "http://127.0.0.1:8080/console/" in defaults.notes


def test_the_ingress_routes_its_host_to_the_apis_http_port(render: Render):
    rendered = render(
        {
            "console": {
                "ingress": {
                    "enabled": True,
                    "host": "compute.example.com",
                    "className": "nginx",
                    "annotations": {"cert-manager.io/cluster-issuer": "letsencrypt"},
                    "tls": {"enabled": True, "secretName": "compute-tls"},
                }
            }
        }
    )
    ingress = rendered.one("Ingress")
    assert ingress["apiVersion"] == "networking.k8s.io/v1"
    assert ingress["metadata"]["namespace"] == rendering.NAMESPACE
    assert ingress["metadata"]["annotations"] == {"cert-manager.io/cluster-issuer": "letsencrypt"}
    spec = ingress["spec"]
    assert spec["ingressClassName"] == "nginx"
    assert spec["tls"] == [{"hosts": ["compute.example.com"], "secretName": "compute-tls"}]
    (rule,) = spec["rules"]
    assert rule["host"] == "compute.example.com"
    (path,) = rule["http"]["paths"]
    assert path["path"] == "/"
    assert path["pathType"] == "Prefix"
    backend = path["backend"]["service"]
    # The API's Service (not the metrics one), by its http port: never the webhook port.
    services = {s["metadata"]["name"]: s for s in rendered.of("Service")}
    api = services[backend["name"]]
    assert backend["port"] == {"name": "http"}
    assert {p["name"] for p in api["spec"]["ports"]} == {"http", "webhook"}
    assert "metrics" not in {p["name"] for p in api["spec"]["ports"]}
    assert "https://compute.example.com/console/" in rendered.notes


def test_tls_without_a_secret_uses_the_controllers_certificate(render: Render):
    rendered = render(
        {"console": {"ingress": {"enabled": True, "host": "c.example", "tls": {"enabled": True}}}}
    )
    spec = rendered.one("Ingress")["spec"]
    assert spec["tls"] == [{"hosts": ["c.example"]}]
    assert "ingressClassName" not in spec
    plain = render({"console": {"ingress": {"enabled": True, "host": "c.example"}}})
    assert "tls" not in plain.one("Ingress")["spec"]
    assert "http://c.example/console/" in plain.notes


@pytest.mark.parametrize(
    ("ingress", "path", "reason"),
    [
        ({"enabled": True}, "/console/ingress", "host"),
        ({"enabled": True, "host": ""}, "/console/ingress/host", "minLength"),
        ({"enabled": True, "host": "Not A Host"}, "/console/ingress/host", "pattern"),
        ({"enabled": "yes"}, "/console/ingress/enabled", "want boolean"),
        ({"enabled": False, "hosts": ["a"]}, "/console/ingress", "'hosts' not allowed"),
        (
            {"enabled": True, "host": "a.b", "tls": {"enabled": True, "secretName": "A B"}},
            "/console/ingress/tls/secretName",
            "pattern",
        ),
        ({"enabled": False, "annotations": {"a": 1}}, "/console/ingress/annotations/a", "string"),
    ],
)
def test_a_wrong_ingress_value_fails_naming_it(
    chart: helm_python.Chart, ingress: dict[str, Any], path: str, reason: str
):
    with pytest.raises(helm_python.HelmValuesError) as refused:
        rendering.render(chart, {"console": {"ingress": ingress}})
    message = str(refused.value)
    assert f"at '{path}" in message, message
    assert reason in message, message
