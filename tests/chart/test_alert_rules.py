"""The chart's alerts, evaluated: each fires on the series that mean its trouble and stays quiet
on healthy ones, and every metric it reads is one the operator really exports.

Rendered with Helm (``tests/chart/rendering.py``) and evaluated by ``tests/chart/promql.py``
(the subset of PromQL the rules use, with Prometheus's semantics; anything else fails loudly),
since promtool cannot be installed here. A case is the series a Prometheus would hold at one
instant; ``for`` is checked as configured, not simulated over time.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bettercompute.api.metrics import Metrics
from bettercompute.store.stats import Stats
from tests.chart import promql, rendering
from tests.chart.promql import sample
from tests.chart.test_monitoring import alerts, monitoring

NOW = 1_800_000_000.0
NS = rendering.NAMESPACE
OPERATOR_JOB = f"{rendering.RELEASE}-better-compute-operator"
DAY = 86_400.0


@pytest.fixture(scope="module")
def rules(render: Callable[..., rendering.Rendered]) -> dict[str, dict[str, Any]]:
    return alerts(render(monitoring(prometheusRule={"enabled": True})))


def firing(rule: dict[str, Any], series: Sequence[promql.Sample]) -> list[dict[str, str]]:
    """The label sets the rule's expression yields now (each one an alert)."""
    value = promql.evaluate(rule["expr"], series, now=NOW)
    assert isinstance(value, list), rule["expr"]
    return sorted((labels for labels, _ in value), key=lambda labels: sorted(labels.items()))


def test_binding_stuck_fires_once_per_pool_whatever_the_replicas(rules: dict[str, Any]) -> None:
    rule = rules["BetterComputeBindingStuck"]
    name = "bettercompute_reservations"
    both = [
        sample(name, 2, namespace=NS, pool="a", state="binding", instance=i) for i in ("r0", "r1")
    ]
    assert firing(rule, both) == [{"namespace": NS, "pool": "a"}]
    quiet = [sample(name, 0, namespace=NS, pool="a", state="binding", instance="r0")]
    quiet.append(sample(name, 5, namespace=NS, pool="a", state="active", instance="r0"))
    assert firing(rule, quiet) == []


def test_pool_nearly_full_fires_above_the_ratio(rules: dict[str, Any]) -> None:
    rule = rules["BetterComputePoolNearlyFull"]

    def pool(booked: float, bound: float, free: float) -> list[promql.Sample]:
        return [
            sample("bettercompute_gpus", n, pool="a", model="H100", state=state)
            for state, n in (("booked", booked), ("bound", bound), ("free", free))
        ]

    assert firing(rule, pool(5, 5, 0)) == [{"pool": "a"}]
    assert firing(rule, pool(5, 4, 1)) == []  # 0.9 is not above 0.9


@pytest.mark.parametrize(
    ("series", "fires"),
    [
        ([], False),  # no webhook here: the series is absent
        ([0.0], False),  # an older build's "unknown"
        ([math.nan], False),
        ([NOW + 30 * DAY], False),
        ([NOW + 3 * DAY], True),
        ([NOW - DAY], True),  # already expired
    ],
    ids=["absent", "zero", "nan", "in-30-days", "in-3-days", "expired"],
)
def test_certificate_expiry_fires_only_on_a_known_near_expiry(
    rules: dict[str, Any], series: list[float], fires: bool
) -> None:
    rule = rules["BetterComputeWebhookCertificateExpiring"]
    name = "bettercompute_webhook_certificate_expiry_timestamp_seconds"
    found = firing(rule, [sample(name, v, namespace=NS, instance="r0") for v in series])
    assert bool(found) is fires, found


def test_database_unreachable_fires_when_no_replica_reads_it(rules: dict[str, Any]) -> None:
    rule = rules["BetterComputeDatabaseUnreachable"]
    name = "bettercompute_database_up"
    down = [sample(name, 0, namespace=NS, instance=i) for i in ("r0", "r1")]
    assert firing(rule, down) == [{"namespace": NS}]
    one_up = [sample(name, 0, namespace=NS, instance="r0")]
    one_up.append(sample(name, 1, namespace=NS, instance="r1"))
    assert firing(rule, one_up) == []


@pytest.mark.parametrize(
    ("ups", "fires"),
    [
        ([1.0, 0.0], False),
        ([0.0, 0.0], True),
        ([], True),  # no target at all: pods not ready leave the Service
    ],
    ids=["one-up", "all-down", "no-target"],
)
def test_operator_down_fires_when_no_operator_answers(
    rules: dict[str, Any], ups: list[float], fires: bool
) -> None:
    rule = rules["BetterComputeOperatorDown"]
    series = [
        sample("up", v, job=OPERATOR_JOB, namespace=NS, instance=f"r{i}") for i, v in enumerate(ups)
    ]
    # Another job being up changes nothing.
    series.append(sample("up", 1, job="kube-state-metrics", namespace=NS, instance="x"))
    found = firing(rule, series)
    assert bool(found) is fires, found
    if fires:
        assert found == [{"job": OPERATOR_JOB, "namespace": NS}]


def test_reconciler_lagging_reads_the_lifecycle_lane_only(rules: dict[str, Any]) -> None:
    rule = rules["BetterComputeReconcilerLagging"]
    name = "bettercompute_work_queue_lag_seconds"
    late = [sample(name, 120, namespace=NS, lane="lifecycle", instance="r0")]
    assert firing(rule, late) == [{"namespace": NS}]
    # A backlog of pending retries waits by design: no alert.
    retries = [sample(name, 0, namespace=NS, lane="lifecycle", instance="r0")]
    retries.append(sample(name, 3600, namespace=NS, lane="retry", instance="r0"))
    assert firing(rule, retries) == []


def test_outbox_lagging_names_the_subscriber(rules: dict[str, Any]) -> None:
    rule = rules["BetterComputeOutboxLagging"]
    name = "bettercompute_outbox_lag_seconds"
    series = [
        sample(name, 900, namespace=NS, subscriber="operator-events", instance="r0"),
        sample(name, 2, namespace=NS, subscriber="webhooks", instance="r0"),
    ]
    assert firing(rule, series) == [{"namespace": NS, "subscriber": "operator-events"}]


def test_the_thresholds_come_from_the_values(render: Callable[..., rendering.Rendered]) -> None:
    found = alerts(
        render(
            monitoring(
                prometheusRule={
                    "enabled": True,
                    "databaseDownMinutes": 7,
                    "operatorDownMinutes": 9,
                    "reconcilerLagSeconds": 30,
                    "outboxLagSeconds": 45,
                }
            )
        )
    )
    assert found["BetterComputeDatabaseUnreachable"]["for"] == "7m"
    assert found["BetterComputeOperatorDown"]["for"] == "9m"
    lag = "bettercompute_work_queue_lag_seconds"
    at = [sample(lag, 31, namespace=NS, lane="lifecycle")]
    assert firing(found["BetterComputeReconcilerLagging"], at)
    assert not firing(found["BetterComputeReconcilerLagging"], [(at[0][0], 29.0)])
    outbox = [sample("bettercompute_outbox_lag_seconds", 46, namespace=NS, subscriber="s")]
    assert firing(found["BetterComputeOutboxLagging"], outbox)


def exported() -> dict[str, list[dict[str, str]]]:
    """What an operator's ``/metrics`` exports, by series name, after one database read."""
    figures = Metrics()
    figures.update(
        Stats(
            reservations={("a", "binding"): 1},
            work_queued=3,
            work_due=1,
            devices={("a", "H100", "free"): 8},
            work_lag={"lifecycle": 0.0, "retry": 12.0},
            outbox_lag={"operator-events": 0.5},
        )
    )
    figures.certificate_expires(NOW)
    names: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(figures.render().decode()):
        for s in family.samples:
            names.setdefault(s.name, []).append(dict(s.labels))
    return names


def test_every_metric_an_alert_reads_is_exported(rules: dict[str, Any]) -> None:
    names = exported()
    for name, rule in rules.items():
        for metric in rendering_names(rule["expr"]):
            assert metric in names, f"{name} reads {metric}, which /metrics does not export"
    assert {"lane": "lifecycle"} in names["bettercompute_work_queue_lag_seconds"]


def rendering_names(expr: str) -> set[str]:
    return set(re.findall(r"bettercompute_[a-z_]+", expr))


def test_the_certificate_expiry_is_absent_until_known() -> None:
    name = "bettercompute_webhook_certificate_expiry_timestamp_seconds"

    def values(figures: Metrics) -> list[float]:
        text = figures.render().decode()
        families = text_string_to_metric_families(text)
        return [s.value for f in families for s in f.samples if s.name == name]

    figures = Metrics()
    assert values(figures) == []
    figures.certificate_expires(lambda: None)  # a kept certificate not loaded yet
    assert values(figures) == []
    figures.certificate_expires(lambda: NOW)
    assert values(figures) == [NOW]
