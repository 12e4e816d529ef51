"""The Prometheus metrics of one API application, in a registry of its own.

Why a registry per app and not prometheus-client's global one: tests, the dev server and the
benchmarks may run several apps in one process, and a global registry would refuse the second
app's metrics (duplicate names) or mix their counts. Nothing here is a module-level singleton.

What is measured:

* ``bettercompute_api_operations_total{operation, outcome}``: every call of an operation, by
  outcome: the error code when refused, else the reservation's state for ``reservations.create``
  (``placed``, ``pending`` …), ``extended``/``not-extended`` for ``reservations.extend``,
  ``fits``/``no-fit`` for ``capacity.preview`` and ``ok`` for the rest.
* ``bettercompute_api_request_duration_seconds{route}``: latency of every request, by route
  (``unmatched`` for unknown routes, so a scanner cannot blow up the label set). For create
  this is the whole admission: draft, decision, quota and placement.
* ``bettercompute_decision_duration_seconds{action, decision}``: each policy decision, and
  ``bettercompute_placement_duration_seconds{outcome}``: each admission's transaction 2 (quota,
  snapshot, placer, writes), told by the service (``Metrics`` is its ``AdmissionObserver``).
* ``bettercompute_reservations{state}`` and ``bettercompute_work_queue_depth`` /
  ``bettercompute_work_queue_due``: read from the database at scrape time, through
  ``CachedCounts``: at most one read every few seconds (5 by default) however many scrapers
  there are and however often they come, and concurrent scrapes share one read. The read
  aggregates every reservation row, so an unauthenticated ``/metrics`` hammered in a loop would
  otherwise be a full-table scan per request.
* ``bettercompute_database_up``: 0 when that read failed (the other figures are then stale).

This module must never read the database itself: the app hands it the figures, or the reader.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from importlib import metadata

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from bettercompute.core import states
from bettercompute.service.reservations import Stats

CONTENT_TYPE = CONTENT_TYPE_LATEST
UNMATCHED = "unmatched"

# A create costs milliseconds; a create with ``wait`` may take up to 30 s.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _version() -> str:
    try:
        return metadata.version("better-compute")
    except metadata.PackageNotFoundError:
        return "0.0.0"


class Metrics:
    def __init__(self) -> None:
        # No ``_created`` series: a timestamp per counter and histogram that dashboards never
        # use and every scrape carries (prometheus_client's setting is per process).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        build = Gauge(
            "bettercompute_build_info",
            "The running build: always 1, its version as a label.",
            ["version"],
            registry=self.registry,
        )
        build.labels(version=_version()).set(1)
        self.operations = Counter(
            "bettercompute_api_operations",
            "Operation calls by outcome: the error code, or the result (create: the state).",
            ["operation", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "bettercompute_api_request_duration_seconds",
            "Time to answer a request, by route (a create: the whole admission sequence).",
            ["route"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.decision_latency = Histogram(
            "bettercompute_decision_duration_seconds",
            "Time a policy decision took, by action and decision (allow or deny).",
            ["action", "decision"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.placement_latency = Histogram(
            "bettercompute_placement_duration_seconds",
            "Time of an admission's quota, placement and writes, by outcome (placed, pending).",
            ["outcome"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.reservations = Gauge(
            "bettercompute_reservations",
            "Reservations by state, read from the database at scrape time.",
            ["state"],
            registry=self.registry,
        )
        self.work_queued = Gauge(
            "bettercompute_work_queue_depth",
            "Reconciler wake-ups queued, read at scrape time.",
            registry=self.registry,
        )
        self.work_due = Gauge(
            "bettercompute_work_queue_due",
            "Reconciler wake-ups already due (a growing figure: the reconciler lags).",
            registry=self.registry,
        )
        self.database_up = Gauge(
            "bettercompute_database_up",
            "1 when the scrape-time read of the database succeeded, else 0.",
            registry=self.registry,
        )

    def observe(self, *, route: str, operation: str | None, outcome: str, seconds: float) -> None:
        self.latency.labels(route=route).observe(seconds)
        if operation is not None:
            self.operations.labels(operation=operation, outcome=outcome).inc()

    def decided(self, *, action: str, allowed: bool, seconds: float) -> None:
        self.decision_latency.labels(
            action=action, decision="allow" if allowed else "deny"
        ).observe(seconds)

    def placed(self, *, outcome: str, seconds: float) -> None:
        self.placement_latency.labels(outcome=outcome).observe(seconds)

    def update(self, *, reservations: Mapping[str, int], queued: int, due: int) -> None:
        # Every state is written, zeros included, so a state that empties drops to 0 instead of
        # keeping its last count.
        for state in states.State:
            self.reservations.labels(state=state.value).set(reservations.get(state.value, 0))
        self.work_queued.set(queued)
        self.work_due.set(due)
        self.database_up.set(1)

    def database_down(self) -> None:
        self.database_up.set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CachedCounts:
    """The database's counts, read by ``read_counts`` at most once per ``max_age_seconds``.

    A failed read is not cached: the next scrape tries again (and reports the database down
    meanwhile). Scrapes that arrive while a read is in flight wait for that read."""

    def __init__(
        self, read_counts: Callable[[], Awaitable[Stats]], *, max_age_seconds: float
    ) -> None:
        self._read_counts = read_counts
        self._max_age = max_age_seconds
        self._figures: Stats | None = None
        self._read_at = 0.0
        self._lock = asyncio.Lock()

    async def read(self) -> Stats:
        async with self._lock:
            if self._figures is None or time.monotonic() - self._read_at >= self._max_age:
                self._figures = await self._read_counts()
                self._read_at = time.monotonic()
            return self._figures
