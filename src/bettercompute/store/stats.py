"""Figures for the metrics endpoint: reservations by pool and state, devices by pool, model and
state, quota by tenant and resource, the work queue and its lag per lane, each outbox
subscriber's lag, the waits that ended since last read, and the GPU-seconds billed so far by
pool and tenant (``store.usage.billed_totals``).

Why here: ``/metrics`` shows the state of the system, not only what one process saw, and the
database is where that state lives. Read at scrape time, so the figures are never stale and no
process keeps counters of its own that could drift from the tables.

What it must never do: write or lock. One round trip of aggregate reads. The first scans every
reservation row, terminal ones included, so its cost grows with history: the API calls it
through ``api.metrics.CachedCounts``, at most once every few seconds however often ``/metrics``
is scraped and by however many scrapers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bettercompute.store import capacity, quotas, reconciling, usage
from bettercompute.store.database import Database, script
from bettercompute.store.outbox import FRONTIER

#: How many ended waits one read takes at most (a backlog is read over several scrapes).
WAITS_PER_READ = 5000


@dataclass(frozen=True)
class Wait:
    """A wait that ended: ``phase`` ``placed`` (create to placed) or ``active`` (the window's
    start, or placement if later, to active), in ``pool``; ``event_id`` orders them."""

    event_id: int
    pool: str
    phase: str
    seconds: float


@dataclass(frozen=True)
class Stats:
    #: Reservations per (pool, state); pairs with none are absent.
    reservations: dict[tuple[str, str], int]
    #: Wake-ups queued for the reconciler, and those already due.
    work_queued: int
    work_due: int
    #: Devices now per (pool, model, state): free, booked (not bound), bound, unhealthy.
    devices: dict[tuple[str, str, str], int] = field(default_factory=dict)
    #: Quota rows: ``{tenantId, resource, limit, used}``.
    quotas: list[dict[str, object]] = field(default_factory=list)
    #: Waits that ended after the ``waits_after`` event asked for, oldest first.
    waits: list[Wait] = field(default_factory=list)
    #: The newest event id seen: the next read's ``waits_after``.
    last_event_id: int = 0
    #: GPU-equivalent seconds billed so far per (pool, tenant): only grows.
    billed: dict[tuple[str, str], float] = field(default_factory=dict)
    #: Per work-queue lane (``lifecycle``, ``retry``): how long its oldest due wake-up has
    #: been due, in seconds (0 when none is due). The reconciler's lag.
    work_lag: dict[str, float] = field(default_factory=dict)
    #: Per outbox subscriber (its cursor): how long the oldest event it has not handled yet
    #: has waited, in seconds (0 when it is caught up). Delivery's lag.
    outbox_lag: dict[str, float] = field(default_factory=dict)


# The newest event id is the outbox's frontier, not max(id): an event below max(id) may still
# commit, and a wait it ends must not be skipped by the next read (store/outbox.py).
_COUNTS = (
    "SELECT pool_id, state, count(*) AS n FROM reservations GROUP BY pool_id, state;"
    " SELECT count(*) AS queued,"
    "        count(*) FILTER (WHERE due_at <= compute_now()) AS due FROM work_queue;"
    f" SELECT {FRONTIER} AS last;"
    " SELECT coalesce(extract(epoch FROM compute_now() - min(due_at)"
    f"          FILTER (WHERE {reconciling.NOT_RETRY})), 0) AS lifecycle,"
    "        coalesce(extract(epoch FROM compute_now() - min(due_at)"
    f"          FILTER (WHERE NOT {reconciling.NOT_RETRY})), 0) AS retry"
    "   FROM work_queue WHERE due_at <= compute_now();"
    f" WITH f AS (SELECT {FRONTIER} AS id)"
    " SELECT c.subscriber, coalesce(extract(epoch FROM compute_now() - (SELECT o.created_at"
    "          FROM outbox o WHERE o.id > c.last_id AND o.id <= f.id ORDER BY o.id LIMIT 1)), 0)"
    "        AS lag"
    "   FROM outbox_cursors c, f"
)

_WAITS = f"""
    SELECT o.id, o.type, r.pool_id,
           extract(epoch FROM o.created_at - r.created_at) AS since_created,
           extract(epoch FROM o.created_at
                   - greatest(coalesce(lower(r.during), r.created_at), r.created_at))
               AS since_due
      FROM outbox o
      JOIN reservations r ON o.subject = 'reservation/' || r.id
     WHERE o.id > %s AND o.id <= {FRONTIER}
       AND o.type IN ('reservation.placed', 'reservation.active')
     ORDER BY o.id
     LIMIT %s
"""


async def read(db: Database, *, waits_after: int | None = None) -> Stats:
    """The figures now; ``waits_after`` (an event id) also reads the waits that ended since
    (``None``: none, only where the events stand now)."""
    async with db.connection() as conn:
        by_state, [queue], [last], [lag], outbox_lag = await script(conn, _COUNTS)
        waits: list[Wait] = []
        if waits_after is not None:
            rows = await (await conn.execute(_WAITS, (waits_after, WAITS_PER_READ))).fetchall()
            for row in rows:
                placed = row["type"] == "reservation.placed"
                seconds = row["since_created"] if placed else row["since_due"]
                waits.append(
                    Wait(
                        event_id=int(row["id"]),
                        pool=str(row["pool_id"]),
                        phase="placed" if placed else "active",
                        seconds=max(float(seconds or 0.0), 0.0),
                    )
                )
    devices: dict[tuple[str, str, str], int] = {}
    for pool in await capacity.pools(db, tenant_id=None):
        model = str(pool.get("gpuModel") or "")
        for figures in pool["devices"].values():
            for state, n in (
                ("free", figures["free"]),
                ("booked", figures["booked"] - figures["bound"]),
                ("bound", figures["bound"]),
                ("unhealthy", figures["total"] - figures["healthy"]),
            ):
                key = (str(pool["poolId"]), model, state)
                devices[key] = devices.get(key, 0) + int(n)
    newest = waits[-1].event_id if len(waits) == WAITS_PER_READ else int(last["last"])
    return Stats(
        reservations={(str(r["pool_id"]), str(r["state"])): int(r["n"]) for r in by_state},
        work_queued=int(queue["queued"]),
        work_due=int(queue["due"]),
        devices=devices,
        quotas=list(await quotas.every_tenant(db)),
        waits=waits,
        last_event_id=newest,
        billed=await usage.billed_totals(db),
        work_lag={"lifecycle": float(lag["lifecycle"]), "retry": float(lag["retry"])},
        outbox_lag={str(r["subscriber"]): max(float(r["lag"]), 0.0) for r in outbox_lag},
    )
