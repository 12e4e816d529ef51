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
* ``bettercompute_reservations{pool, state}``, ``bettercompute_gpus{pool, model, state}``
  (free, booked, bound, unhealthy), ``bettercompute_quota_used`` / ``_limit{tenant,
  resource}``, ``bettercompute_reservation_wait_seconds{pool, phase}`` (placed: from create;
  active: from the window's start) and ``bettercompute_work_queue_depth`` /
  ``bettercompute_work_queue_due``: read from the database at scrape time, through
  ``CachedCounts``: at most one read every few seconds (5 by default) however many scrapers
  there are and however often they come, and concurrent scrapes share one read. The read
  aggregates every reservation row, so an unauthenticated ``/metrics`` hammered in a loop would
  otherwise be a full-table scan per request.
* ``bettercompute_billed_gpu_seconds_total{pool, tenant}``: GPU-equivalent seconds billed so
  far by the usage ledger (a GPU 1, a MIG instance 1/7, a slot 1/replicas), read the same way.
  A counter whose value is the ledger's own total, so every replica reports the same figure
  and a restart does not reset it: aggregate it with ``max``, not ``sum``, across replicas.
* ``bettercompute_work_queue_lag_seconds{lane}`` and ``bettercompute_outbox_lag_seconds
  {subscriber}``: how long the oldest due wake-up of a lane, and the oldest event a subscriber
  has not handled, have waited; read the same way (the reconciler and outbox alerts).
* ``bettercompute_kueue_admission_checks{state}``: told by the operator, 1 for the state of its
  Kueue AdmissionCheck controller (``running``, ``disabled``, ``kueue-missing``).
* ``bettercompute_database_up``: 0 when that read failed (the other figures are then stale).
* ``bettercompute_webhook_certificate_expiry_timestamp_seconds``: told by the operator, which
  serves the admission webhook; absent (never 0) where no certificate is known.

This module must never read the database itself: the app hands it the figures, or the reader.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
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
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bettercompute.core import states
from bettercompute.service.reservations import Stats

CONTENT_TYPE = CONTENT_TYPE_LATEST
UNMATCHED = "unmatched"

# A create costs milliseconds; a create with ``wait`` may take up to 30 s.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A wait for placement or for binding: from milliseconds to a day in a busy pool.
_WAIT_BUCKETS = (0.01, 0.1, 0.5, 1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0)


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
            "Reservations by pool and state, read from the database at scrape time.",
            ["pool", "state"],
            registry=self.registry,
        )
        self.gpus = Gauge(
            "bettercompute_gpus",
            "Devices of a pool now, by model and state: free, booked (not bound), bound (held"
            " by an active reservation), unhealthy.",
            ["pool", "model", "state"],
            registry=self.registry,
        )
        self.quota_used = Gauge(
            "bettercompute_quota_used",
            "What a tenant's live reservations have charged now, by resource.",
            ["tenant", "resource"],
            registry=self.registry,
        )
        self.quota_limit = Gauge(
            "bettercompute_quota_limit",
            "A tenant's quota limit, by resource.",
            ["tenant", "resource"],
            registry=self.registry,
        )
        self.waits = Histogram(
            "bettercompute_reservation_wait_seconds",
            "How long reservations waited, by pool and phase: placed (from create) and active"
            " (from the window's start, or placement if later).",
            ["pool", "phase"],
            buckets=_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.certificate_expiry = _CertificateExpiry()
        self.registry.register(self.certificate_expiry)
        #: The newest wait observed: a cached read handed out again observes nothing twice.
        self._waits_seen = 0
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
        self.work_lag = Gauge(
            "bettercompute_work_queue_lag_seconds",
            "How long the oldest due reconciler wake-up of a lane has been due (0: none due):"
            " lifecycle (starts, node reports, deadlines) or retry (pending placements).",
            ["lane"],
            registry=self.registry,
        )
        self.outbox_lag = Gauge(
            "bettercompute_outbox_lag_seconds",
            "How long the oldest event an outbox subscriber has not handled yet has waited"
            " (0: caught up), by subscriber.",
            ["subscriber"],
            registry=self.registry,
        )
        self.billed = _Billed()
        self.registry.register(self.billed)
        self.database_up = Gauge(
            "bettercompute_database_up",
            "1 when the scrape-time read of the database succeeded, else 0.",
            registry=self.registry,
        )
        self.kueue_checks = Gauge(
            "bettercompute_kueue_admission_checks",
            "1 for the state of the operator's Kueue AdmissionCheck controller: running, "
            "disabled, or kueue-missing (enabled, but the API server serves no Kueue v1beta1).",
            ["state"],
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

    def update(self, figures: Stats) -> None:
        # Every state of every pool seen is written, zeros included, so a state that empties
        # drops to 0 instead of keeping its last count.
        pools = {pool for pool, _ in figures.reservations} | {p for p, _, _ in figures.devices}
        for pool in sorted(pools):
            for state in states.State:
                self.reservations.labels(pool=pool, state=state.value).set(
                    figures.reservations.get((pool, state.value), 0)
                )
        for (pool, model, condition), n in figures.devices.items():
            self.gpus.labels(pool=pool, model=model, state=condition).set(n)
        for row in figures.quotas:
            labels = {"tenant": str(row["tenantId"]), "resource": str(row["resource"])}
            self.quota_used.labels(**labels).set(float(str(row["used"])))
            self.quota_limit.labels(**labels).set(float(str(row["limit"])))
        for wait in figures.waits:
            if wait.event_id > self._waits_seen:
                self.waits.labels(pool=wait.pool, phase=wait.phase).observe(wait.seconds)
                self._waits_seen = wait.event_id
        self.work_queued.set(figures.work_queued)
        self.work_due.set(figures.work_due)
        for lane, seconds in figures.work_lag.items():
            self.work_lag.labels(lane=lane).set(seconds)
        for subscriber, seconds in figures.outbox_lag.items():
            self.outbox_lag.labels(subscriber=subscriber).set(seconds)
        self.billed.figures = dict(figures.billed)
        self.database_up.set(1)

    def certificate_expires(self, epoch_s: float | Callable[[], float | None]) -> None:
        """When the webhook's certificate expires: a time, or a function read at each scrape
        (``None`` from it: not known now, and the series is absent)."""
        self.certificate_expiry.expires = epoch_s

    def kueue_checks_state(self, state: str) -> None:
        """The operator's Kueue AdmissionCheck controller is ``state`` (its series 1, the
        other states' absent)."""
        self.kueue_checks.clear()
        self.kueue_checks.labels(state=state).set(1)

    def database_down(self) -> None:
        self.database_up.set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Billed(Collector):
    """The billed GPU-seconds as a counter: the ledger's totals as last read. A custom
    collector because the value is an absolute total from the database, not increments this
    process saw."""

    def __init__(self) -> None:
        self.figures: dict[tuple[str, str], float] = {}

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> list[Metric]:
        family = self._family()
        for (pool, tenant), seconds in sorted(self.figures.items()):
            family.add_metric([pool, tenant], seconds)
        return [family]

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "bettercompute_billed_gpu_seconds",
            "GPU-equivalent seconds billed by the usage ledger, by pool and tenant.",
            labels=["pool", "tenant"],
        )


class _CertificateExpiry(Collector):
    """The webhook certificate's expiry, exported only while it is known.

    Why not a plain Gauge: a Gauge exports 0 from the start, in every process that has the
    metric (the dev server, an operator that serves no webhook), and 0 reads as "expired in
    1970": the shipped critical alert fired on any of them. Absent when unknown, never 0."""

    def __init__(self) -> None:
        self.expires: float | Callable[[], float | None] | None = None

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> list[Metric]:
        family = self._family()
        value = self.expires() if callable(self.expires) else self.expires
        if value is not None and value > 0:
            family.add_metric([], value)
        return [family]

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "bettercompute_webhook_certificate_expiry_timestamp_seconds",
            "When the admission webhook's serving certificate expires (unix time); absent"
            " while this process does not know one.",
        )


class CachedCounts:
    """The database's counts, read by ``read_counts`` at most once per ``max_age_seconds``.

    A failed read is not cached: the next scrape tries again (and reports the database down
    meanwhile). Scrapes that arrive while a read is in flight wait for that read. Each read
    asks for the waits that ended after the newest event the previous one saw. ``start`` (at
    the app's start) reads where the events stand, so the first scrape observes every wait that
    ended since: a process observes the waits that end while it runs, not all history, and not
    only those after its first scrape (before ``start`` existed, those were lost)."""

    def __init__(
        self, read_counts: Callable[[int | None], Awaitable[Stats]], *, max_age_seconds: float
    ) -> None:
        self._read_counts = read_counts
        self._max_age = max_age_seconds
        self._figures: Stats | None = None
        self._read_at = 0.0
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Read where the events stand now; the next ``read`` reads again, with the waits since.
        A store error is left to the first scrape (which then starts from there)."""
        async with self._lock:
            if self._figures is None:
                self._figures = await self._read_counts(None)
                self._read_at = float("-inf")  # stale at once: the first scrape reads again

    async def read(self) -> Stats:
        async with self._lock:
            if self._figures is None or time.monotonic() - self._read_at >= self._max_age:
                after = None if self._figures is None else self._figures.last_event_id
                self._figures = await self._read_counts(after)
                self._read_at = time.monotonic()
            return self._figures
