"""Counts for the metrics endpoint: reservations by state and the depth of the work queue.

Why here: ``/metrics`` shows the state of the system, not only what one process saw, and the
database is where that state lives. Read at scrape time, so the figures are never stale and no
process keeps counters of its own that could drift from the tables.

What it must never do: write or lock. Two aggregate reads in one round trip. The first scans
every reservation row, terminal ones included, so its cost grows with history: the API calls it
through ``api.metrics.CachedCounts``, at most once every few seconds however often ``/metrics``
is scraped and by however many scrapers.
"""

from __future__ import annotations

from dataclasses import dataclass

from bettercompute.store.database import Database, script


@dataclass(frozen=True)
class Stats:
    #: Reservations per state; states with none are absent.
    reservations: dict[str, int]
    #: Wake-ups queued for the reconciler, and those already due.
    work_queued: int
    work_due: int


async def read(db: Database) -> Stats:
    async with db.connection() as conn:
        by_state, [queue] = await script(
            conn,
            "SELECT state, count(*) AS n FROM reservations GROUP BY state;"
            " SELECT count(*) AS queued,"
            "        count(*) FILTER (WHERE due_at <= compute_now()) AS due FROM work_queue",
        )
    return Stats(
        reservations={str(r["state"]): int(r["n"]) for r in by_state},
        work_queued=int(queue["queued"]),
        work_due=int(queue["due"]),
    )
