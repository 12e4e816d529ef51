"""The chart's Grafana dashboard and Prometheus alerts: off by default, and when on, built only
from the metrics the operator and the node agents expose.

``metrics.dashboard.enabled`` renders ``dashboards/better-compute.json`` into a ConfigMap that
the Grafana sidecar loads (by its labels); ``metrics.prometheusRule.enabled`` renders a
PrometheusRule whose thresholds come from the values. A PrometheusRule has no schema here (the
Prometheus Operator's CRD is not shipped), so its fields are checked one by one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import helm_python
import pytest

from tests.chart import rendering

#: The names the product exposes (operator and node agents), as the docs list them.
GAUGES_AND_COUNTERS = frozenset(
    {
        "bettercompute_gpus",
        "bettercompute_reservations",
        "bettercompute_quota_used",
        "bettercompute_quota_limit",
        "bettercompute_api_operations_total",
        "bettercompute_work_queue_depth",
        "bettercompute_work_queue_due",
        "bettercompute_database_up",
        "bettercompute_work_queue_lag_seconds",
        "bettercompute_outbox_lag_seconds",
        "bettercompute_webhook_certificate_expiry_timestamp_seconds",
        "bettercompute_build_info",
        "bettercompute_node_advertised_devices",
        "bettercompute_node_allocations",
        "bettercompute_node_gpunode_published_timestamp_seconds",
        "bettercompute_node_gpunode_publish_failures_total",
    }
)
#: Histograms: queried only through their ``_bucket``, ``_sum`` and ``_count`` series.
HISTOGRAMS = frozenset(
    {
        "bettercompute_reservation_wait_seconds",
        "bettercompute_api_request_duration_seconds",
        "bettercompute_decision_duration_seconds",
        "bettercompute_placement_duration_seconds",
        "bettercompute_node_allocate_duration_seconds",
    }
)
HISTOGRAM_SUFFIXES = ("bucket", "sum", "count")
METRIC = re.compile(r"bettercompute_[a-z_]+")

DASHBOARD_FILE = rendering.CHART / "dashboards" / "better-compute.json"
DASHBOARD_NAME = f"{rendering.RELEASE}-better-compute-dashboard"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ALERTS = {
    "BetterComputeBindingStuck",
    "BetterComputePoolNearlyFull",
    "BetterComputeWebhookCertificateExpiring",
    "BetterComputeDatabaseUnreachable",
    "BetterComputeOperatorDown",
    "BetterComputeReconcilerLagging",
    "BetterComputeOutboxLagging",
}
#: Prometheus's duration format (the PrometheusRule CRD's pattern for ``for``).
DURATION = re.compile(
    r"^(0|([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?)$"
)
RULE_FIELDS = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}


def unknown_metrics(expr: str) -> set[str]:
    """The ``bettercompute_`` names in ``expr`` that no exposed series has."""
    unknown = set()
    for name in METRIC.findall(expr):
        base, _, suffix = name.rpartition("_")
        if name in GAUGES_AND_COUNTERS or (suffix in HISTOGRAM_SUFFIXES and base in HISTOGRAMS):
            continue
        unknown.add(name)
    return unknown


def flat(expr: str) -> str:
    return " ".join(expr.split())


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside (collapsed) rows included."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: the panels' targets and the variables'."""
    found = [t["expr"] for p in all_panels(dashboard["panels"]) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found.append(variable["query"]["query"])
    return found


def monitoring(**settings: Any) -> dict[str, Any]:
    return {"metrics": settings}


ON = monitoring(dashboard={"enabled": True}, prometheusRule={"enabled": True})


@pytest.fixture(scope="module")
def dashboard(render: Callable[..., rendering.Rendered]) -> dict[str, Any]:
    config_map = render(ON).one("ConfigMap", DASHBOARD_NAME)
    parsed: dict[str, Any] = json.loads(config_map["data"]["better-compute.json"])
    return parsed


def alerts(rendered: rendering.Rendered) -> dict[str, dict[str, Any]]:
    (rule,) = rendered.of("PrometheusRule")
    (group,) = rule["spec"]["groups"]
    assert group["name"] == "better-compute"
    return {r["alert"]: r for r in group["rules"]}


# ---- off by default ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [{}, monitoring(serviceMonitor={"enabled": True})],
    ids=["defaults", "service-monitors-only"],
)
def test_nothing_is_rendered_by_default(render: Callable, values: dict[str, Any]):
    rendered = render(values)
    assert rendered.of("PrometheusRule") == []
    assert DASHBOARD_NAME not in {o["metadata"]["name"] for o in rendered.of("ConfigMap")}
    assert not [
        o
        for o in rendered.of("ConfigMap")
        if "grafana_dashboard" in o["metadata"].get("labels", {})
    ]
    templates = {path.rsplit("/", 1)[-1] for path in rendered.sources.values()}
    assert not templates & {"dashboard.yaml", "prometheus-rule.yaml"}


def test_each_flag_turns_on_only_its_own_object(render: Callable):
    only_dashboard = render(monitoring(dashboard={"enabled": True}))
    assert only_dashboard.one("ConfigMap", DASHBOARD_NAME)
    assert only_dashboard.of("PrometheusRule") == []
    only_rule = render(monitoring(prometheusRule={"enabled": True}))
    assert len(only_rule.of("PrometheusRule")) == 1
    assert DASHBOARD_NAME not in {o["metadata"]["name"] for o in only_rule.of("ConfigMap")}


def test_the_chart_lints_strictly_with_both_on():
    report = helm_python.lint(rendering.CHART, ON, strict=True, namespace=rendering.NAMESPACE)
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# ---- the dashboard -----------------------------------------------------------------------------


def test_the_dashboard_configmap_is_labelled_for_the_grafana_sidecar(render: Callable, schemas):
    config_map = render(ON).one("ConfigMap", DASHBOARD_NAME)
    assert rendering.problems(config_map, schemas=schemas) == []
    assert config_map["metadata"]["namespace"] == rendering.NAMESPACE
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["labels"]["app.kubernetes.io/component"] == "monitoring"
    assert "annotations" not in config_map["metadata"]
    assert list(config_map["data"]) == ["better-compute.json"]


def test_the_dashboards_labels_and_annotations_are_configurable(render: Callable):
    values = monitoring(
        dashboard={
            "enabled": True,
            "labels": {"grafana_dashboard": "yes", "team": "gpu"},
            "annotations": {"grafana_folder": "Better Compute"},
        }
    )
    metadata = render(values).one("ConfigMap", DASHBOARD_NAME)["metadata"]
    assert metadata["labels"]["grafana_dashboard"] == "yes"
    assert metadata["labels"]["team"] == "gpu"
    assert metadata["annotations"] == {"grafana_folder": "Better Compute"}
    # A sidecar with another label: the default one can be dropped.
    values = monitoring(
        dashboard={"enabled": True, "labels": {"grafana_dashboard": None, "d": "1"}}
    )
    labels = render(values).one("ConfigMap", DASHBOARD_NAME)["metadata"]["labels"]
    assert "grafana_dashboard" not in labels
    assert labels["d"] == "1"


def test_the_configmap_carries_the_charts_dashboard_as_is(dashboard: dict[str, Any]):
    assert dashboard == json.loads(DASHBOARD_FILE.read_text(encoding="utf-8"))
    assert dashboard["uid"] == "better-compute"
    assert dashboard["title"]


def test_every_query_uses_only_metrics_the_product_exposes(dashboard: dict[str, Any]):
    exprs = queries(dashboard)
    assert len(exprs) >= 20
    for expr in exprs:
        assert METRIC.search(expr), f"queries no bettercompute_ metric: {expr}"
        assert unknown_metrics(expr) == set(), expr
        assert expr.count("(") == expr.count(")"), expr
        assert expr.count("{") == expr.count("}"), expr


def test_the_metric_check_refuses_names_nobody_exposes():
    # The check above must be able to fail: a misspelt gauge, a bare histogram (no such series),
    # a histogram suffix on a gauge, and a counter without its _total.
    assert unknown_metrics("sum(bettercompute_gpu{state='free'})") == {"bettercompute_gpu"}
    assert unknown_metrics("rate(bettercompute_api_request_duration_seconds[5m])") == {
        "bettercompute_api_request_duration_seconds"
    }
    assert unknown_metrics("bettercompute_gpus_bucket") == {"bettercompute_gpus_bucket"}
    assert unknown_metrics("rate(bettercompute_api_operations[5m])") == {
        "bettercompute_api_operations"
    }
    assert (
        unknown_metrics(
            "bettercompute_reservation_wait_seconds_bucket + bettercompute_gpus"
            " + bettercompute_placement_duration_seconds_count"
        )
        == set()
    )


def test_the_dashboard_has_the_panels_operators_need(dashboard: dict[str, Any]):
    exprs = [flat(e) for e in queries(dashboard)]

    def some(*parts: str) -> bool:
        return any(all(part in e for part in parts) for e in exprs)

    assert some("bettercompute_gpus", "pool", "state")
    assert some("bettercompute_reservations", "by (state)")
    assert some("bettercompute_quota_used", "tenant")
    assert some("bettercompute_quota_limit", "tenant")
    wait = "bettercompute_reservation_wait_seconds_bucket"
    assert some("histogram_quantile(0.5,", wait, "phase, le")
    assert some("histogram_quantile(0.95,", wait, "phase, le")
    latency = "bettercompute_api_request_duration_seconds_bucket"
    assert some("histogram_quantile(0.99,", latency, "route, le")
    assert some("bettercompute_database_up")
    assert some("bettercompute_node_allocations", "phase")


def test_every_panel_queries_through_the_datasource_variable(dashboard: dict[str, Any]):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE, variable["name"]
    panels = [p for p in all_panels(dashboard["panels"]) if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]


def test_the_panels_have_unique_ids_and_fit_the_grid(dashboard: dict[str, Any]):
    panels = list(all_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0, panel["title"]
        assert grid["w"] > 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine


# ---- the PrometheusRule ------------------------------------------------------------------------


def test_the_rule_has_its_alerts_in_a_valid_shape(render: Callable):
    rendered = render(monitoring(prometheusRule={"enabled": True, "labels": {"release": "prom"}}))
    (rule,) = rendered.of("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == rendering.NAMESPACE
    assert rule["metadata"]["labels"]["release"] == "prom"
    found = alerts(rendered)
    assert set(found) == ALERTS
    for name, alert in found.items():
        assert set(alert) <= RULE_FIELDS, name
        assert DURATION.match(alert["for"]), name
        assert unknown_metrics(alert["expr"]) == set(), name
        # Every alert reads our metrics, except the one about the operator's scrape itself.
        assert METRIC.search(alert["expr"]) or name == "BetterComputeOperatorDown", name
        assert alert["annotations"]["summary"].strip(), name
        assert alert["annotations"]["description"].strip(), name
    severities = {name: a["labels"]["severity"] for name, a in found.items()}
    assert severities == {
        "BetterComputeBindingStuck": "warning",
        "BetterComputePoolNearlyFull": "warning",
        "BetterComputeWebhookCertificateExpiring": "critical",
        "BetterComputeDatabaseUnreachable": "critical",
        "BetterComputeOperatorDown": "critical",
        "BetterComputeReconcilerLagging": "warning",
        "BetterComputeOutboxLagging": "warning",
    }
    # Prometheus's own templating reaches the annotations intact (Helm must not eat it).
    assert "{{ $labels.pool }}" in found["BetterComputePoolNearlyFull"]["annotations"]["summary"]


BINDING = re.compile(
    r'max by \(namespace, pool\) \(bettercompute_reservations\{state="binding"\}\) > 0'
)
POOL_FULL = re.compile(
    r'sum by \(pool\) \(bettercompute_gpus\{state=~"booked\|bound"\}\)'
    r" / sum by \(pool\) \(bettercompute_gpus\) > (\S+)"
)
EXPIRY = re.compile(
    r"\(bettercompute_webhook_certificate_expiry_timestamp_seconds > 0\) - time\(\)"
    r" < (\S+) \* 86400"
)


@pytest.mark.parametrize(
    ("settings", "minutes", "ratio", "days"),
    [
        ({}, 15, 0.9, 14),
        (
            {"stuckBindingMinutes": 40, "poolFullRatio": 0.75, "certificateExpiryDays": 21},
            40,
            0.75,
            21,
        ),
        ({"poolFullRatio": 1}, 15, 1.0, 14),
    ],
    ids=["defaults", "configured", "integer-ratio"],
)
def test_the_alerts_carry_the_configured_thresholds(
    render: Callable, settings: dict[str, Any], minutes: int, ratio: float, days: int
):
    found = alerts(render(monitoring(prometheusRule={"enabled": True, **settings})))

    binding = found["BetterComputeBindingStuck"]
    assert BINDING.fullmatch(flat(binding["expr"])), binding["expr"]
    assert binding["for"] == f"{minutes}m"
    assert f"for {minutes} minutes" in flat(binding["annotations"]["description"])

    full = found["BetterComputePoolNearlyFull"]
    matched = POOL_FULL.fullmatch(flat(full["expr"]))
    assert matched, full["expr"]
    assert float(matched.group(1)) == ratio
    assert full["for"] == "15m"

    expiry = found["BetterComputeWebhookCertificateExpiring"]
    matched = EXPIRY.fullmatch(flat(expiry["expr"]))
    assert matched, expiry["expr"]
    assert int(matched.group(1)) == days
    assert expiry["for"] == "5m"
    assert f"threshold {days} days" in flat(expiry["annotations"]["description"])


# ---- the values schema -------------------------------------------------------------------------

# (values, the path the message must name, a word of the reason)
REFUSED = [
    (
        monitoring(prometheusRule={"poolFullRatio": "x"}),
        "/metrics/prometheusRule/poolFullRatio",
        "want number",
    ),
    (
        monitoring(prometheusRule={"poolFullRatio": 1.5}),
        "/metrics/prometheusRule/poolFullRatio",
        "maximum",
    ),
    (
        monitoring(prometheusRule={"poolFullRatio": 0}),
        "/metrics/prometheusRule/poolFullRatio",
        "exclusiveMinimum",
    ),
    (
        monitoring(prometheusRule={"stuckBindingMinutes": 2.5}),
        "/metrics/prometheusRule/stuckBindingMinutes",
        "want integer",
    ),
    (
        monitoring(prometheusRule={"certificateExpiryDays": 0}),
        "/metrics/prometheusRule/certificateExpiryDays",
        "minimum",
    ),
    (
        monitoring(prometheusRule={"enabled": "yes"}),
        "/metrics/prometheusRule/enabled",
        "want boolean",
    ),
    (
        monitoring(prometheusRule={"labels": {"release": 1}}),
        "/metrics/prometheusRule/labels/release",
        "want string",
    ),
    (monitoring(dashboard={"enabled": "yes"}), "/metrics/dashboard/enabled", "want boolean"),
    (
        monitoring(dashboard={"annotations": {"a": 2}}),
        "/metrics/dashboard/annotations/a",
        "want string",
    ),
    (monitoring(dashboard={"folder": "x"}), "/metrics/dashboard", "'folder' not allowed"),
    # Helm reports a bad map key at '' but names the key.
    (monitoring(dashboard={"labels": {"bad key!": "1"}}), "", "invalid propertyName 'bad key!'"),
]


@pytest.mark.parametrize(("values", "path", "reason"), REFUSED, ids=[str(r[0]) for r in REFUSED])
def test_the_schema_refuses_a_wrong_monitoring_value(
    chart: helm_python.Chart, values: dict[str, Any], path: str, reason: str
):
    with pytest.raises(helm_python.HelmValuesError) as refused:
        rendering.render(chart, values)
    message = str(refused.value)
    assert f"at '{path}" in message, message
    assert reason in message, message


def test_the_schema_accepts_every_monitoring_setting(chart: helm_python.Chart):
    chart.validate_schema(
        monitoring(
            serviceMonitor={"enabled": True, "labels": {"release": "prom"}},
            dashboard={
                "enabled": True,
                "labels": {"grafana_dashboard": "1", "team": "gpu"},
                "annotations": {"grafana_folder": "Better Compute"},
            },
            prometheusRule={
                "enabled": True,
                "labels": {"release": "prom"},
                "stuckBindingMinutes": 30,
                "poolFullRatio": 0.8,
                "certificateExpiryDays": 7,
                "databaseDownMinutes": 3,
                "operatorDownMinutes": 10,
                "reconcilerLagSeconds": 120,
                "outboxLagSeconds": 600,
            },
        )
    )
    defaults = chart.values["metrics"]
    assert defaults["dashboard"] == {
        "enabled": False,
        "labels": {"grafana_dashboard": "1"},
        "annotations": {},
    }
    assert defaults["prometheusRule"] == {
        "enabled": False,
        "labels": {},
        "stuckBindingMinutes": 15,
        "poolFullRatio": 0.9,
        "certificateExpiryDays": 14,
        "databaseDownMinutes": 2,
        "operatorDownMinutes": 5,
        "reconcilerLagSeconds": 60,
        "outboxLagSeconds": 300,
    }
