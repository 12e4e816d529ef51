"""The device plugin's Prometheus metrics, registered on a registry the caller owns.

Why it exists: an operator wants to see, per node, how many devices each resource advertises,
how many allocations the node holds and in what phase, and how long the kubelet waits on
Allocate (it blocks pod admission). The composition root exposes the registry on ``/metrics``.

Gauges are computed when scraped, from ``Allocations`` itself, so they can never drift from what
ListAndWatch sends. The Allocate histogram is observed by ``serving``.

What it must never do: register on prometheus-client's global registry (two plugins in one test
process would collide), or change ``Allocations``.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

from prometheus_client import CollectorRegistry, Gauge, Histogram, disable_created_metrics

from bettercompute.deviceplugin.allocations import RESOURCES, Allocations, Phase, Resource

# Allocate is a dictionary lookup: buckets from 100 µs up to the kubelet's patience.
ALLOCATE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0, 10.0)


def _version() -> str:
    try:
        return metadata.version("better-compute")
    except metadata.PackageNotFoundError:
        return "0.0.0"


class DevicePluginMetrics:
    """``bettercompute_node_*`` metrics over one node's ``Allocations``."""

    def __init__(self, *, registry: CollectorRegistry, allocations: Allocations) -> None:
        # No ``_created`` series, as on the operator: one prefix, one shape, for dashboards.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        build = Gauge(
            "bettercompute_build_info",
            "The running build: always 1, its version as a label.",
            ["version"],
            registry=registry,
        )
        build.labels(version=_version()).set(1)
        self.advertised = Gauge(
            "bettercompute_node_advertised_devices",
            "Devices advertised to the kubelet, by resource",
            ["resource"],
            registry=registry,
        )
        for resource in RESOURCES:
            self.advertised.labels(resource.name).set_function(
                _advertised_count(allocations, resource)
            )
        self.held = Gauge(
            "bettercompute_node_allocations",
            "Allocations the node holds, by phase",
            ["phase"],
            registry=registry,
        )
        for phase in Phase:
            self.held.labels(phase.value).set_function(_held_count(allocations, phase))
        self.allocate_seconds = Histogram(
            "bettercompute_node_allocate_duration_seconds",
            "Time to answer the kubelet's Allocate, by resource",
            ["resource"],
            registry=registry,
            buckets=ALLOCATE_BUCKETS,
        )

    def observe_allocate(self, *, resource: str, seconds: float) -> None:
        self.allocate_seconds.labels(resource).observe(seconds)


def _advertised_count(allocations: Allocations, resource: Resource) -> Callable[[], float]:
    return lambda: float(len(allocations.advertised(resource)))


def _held_count(allocations: Allocations, phase: Phase) -> Callable[[], float]:
    return lambda: float(allocations.count(phase))
