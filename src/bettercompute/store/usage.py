"""The usage ledger: what a tenant was billed for, read back for reports, budgets and metrics.

Why it exists: a budget must count what was used, not what was asked. A reservation released
after a second used a second, not its eight requested hours. The ledger is the table
``usage_intervals`` (migration ``0011_usage``), written by triggers on the rows every transition
already writes, so it records each one in the transition's own transaction, whichever code path
(a node report, the reconciler, release, extend, renew, the inventory) made it.

The rules, as the triggers implement them:

* Billing of an allocation opens when a node first reports it bound, one row per device, and
  never earlier than the reservation's start (a node may bind early).
* It runs while the allocation is bound or lost: a binding marked lost (a rejected or replayed
  report, a node's unexpected release) keeps its booking, and is billed, so a report can
  neither start nor stop billing by itself.
* It stops when the allocation is released, handed back (releasing) or failed, at that moment,
  and never past the allocation's own end: the reservation's end or its lease's, whichever is
  first, followed while billing runs (an extend moves it later, a renew moves the lease, a
  release moves it to now). Devices that pods still hold after a release or past the end are
  booked (``DevicesHeld``) but not billed.
* A node lease (``binding: node``) is not billed for a GPU while it is unhealthy
  (``UnhealthyAtoms/NotBilled``): its row closes when the GPU turns unhealthy, and a new one
  opens when it turns healthy again. Atoms keep only their present health, so every change is
  recorded from this migration on (``atom_health_changes``); the split rows are the billing
  record. Other bindings keep their unhealthy devices booked and billed (they show
  ``Degraded/AtomUnhealthy``; the node is still theirs to use or release).
* An allocation that was never bound is billed nothing.

Figures: ``gpuSeconds`` counts devices × seconds (a whole GPU, a MIG instance and a slot each
count one); ``gpuEquivalentSeconds`` weighs each device by ``core.hosts.device_worth``
(a GPU 1, a MIG instance 1/7, a slot 1/replicas); GPU-hours are equivalent seconds / 3600.

Reads are cheap: a tenant's window is an index range on (tenant, start), open rows are few, and
the metrics' totals are kept per pool and tenant as rows close (``usage_totals``), plus the open
rows. What it must never do: write the ledger (only the triggers do) or decide anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bettercompute.core import durations, usage
from bettercompute.store.database import Database

_SPANS = """
    WITH spans AS (
        SELECT u.pool_id, u.project_id, u.gpu_equivalent,
               greatest(u.started_at, %(from)s) AS s,
               least(bc_usage_end(u.started_at, u.until, u.ended_at, compute_now()), %(to)s) AS e
          FROM usage_intervals u
         WHERE u.tenant_id = %(tenant)s AND u.started_at < %(to)s
           AND bc_usage_end(u.started_at, u.until, u.ended_at, compute_now()) > %(from)s
    )
"""

#: Per ``by``: the bucket key, the rows it comes from, and its order. Fixed fragments only.
_BUCKETS: dict[str | None, tuple[str, str]] = {
    None: ("NULL::text", "spans"),
    "pool": ("pool_id", "spans"),
    "project": ("project_id", "spans"),
    # A span over midnight (UTC) counts in each day it touches, cut at the day's bounds.
    "day": (
        "epoch_ms(day)::text",
        "(SELECT sp.pool_id, sp.project_id, sp.gpu_equivalent, d.day,"
        "        greatest(sp.s, d.day) AS s, least(sp.e, d.day + interval '1 day') AS e"
        "   FROM spans sp, LATERAL generate_series(date_trunc('day', sp.s, 'UTC'),"
        "        sp.e - interval '1 microsecond', interval '1 day') AS d(day)) AS spans",
    ),
}


@dataclass(frozen=True)
class Billed:
    """One bucket of a report: its key (a pool, a project, a day's epoch ms, or ``None``)."""

    key: str | None
    gpu_seconds: float
    gpu_equivalent_seconds: float


async def now_ms(db: Database) -> int:
    """The database's now, epoch ms: what a report without ``to`` ends at."""
    async with db.connection() as conn:
        row = await (await conn.execute("SELECT compute_now() AS now")).fetchone()
    assert row is not None
    return durations.to_ms(row["now"])


async def report(
    db: Database, *, tenant_id: str, from_ms: int, to_ms: int, by: usage.By | None
) -> list[Billed]:
    """The tenant's billing in ``[from_ms, to_ms)``, one row per bucket, in key order."""
    key, source = _BUCKETS[by]
    sql = (
        _SPANS + f"SELECT {key} AS key,"
        "       coalesce(sum(extract(epoch FROM e - s)), 0) AS gpu_seconds,"
        "       coalesce(sum(gpu_equivalent * extract(epoch FROM e - s)), 0) AS eq_seconds"
        f"  FROM {source} WHERE e > s GROUP BY 1 ORDER BY 1 NULLS FIRST"
    )
    params: dict[str, Any] = {
        "tenant": tenant_id,
        "from": durations.from_ms(from_ms),
        "to": durations.from_ms(to_ms),
    }
    async with db.connection() as conn:
        rows = await (await conn.execute(sql.encode(), params)).fetchall()
    return [
        Billed(
            key=row["key"],
            gpu_seconds=float(row["gpu_seconds"]),
            gpu_equivalent_seconds=float(row["eq_seconds"]),
        )
        for row in rows
    ]


async def billed_totals(db: Database) -> dict[tuple[str, str], float]:
    """GPU-equivalent seconds billed so far per (pool, tenant): the closed rows' totals plus
    the open rows up to now. Only grows: an open row's end moves only later."""
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT pool_id, tenant_id, sum(seconds) AS seconds FROM ("
                "  SELECT pool_id, tenant_id, gpu_equivalent_seconds AS seconds"
                "    FROM usage_totals"
                "  UNION ALL"
                "  SELECT pool_id, tenant_id, gpu_equivalent * extract(epoch FROM"
                "         bc_usage_end(started_at, until, NULL, compute_now()) - started_at)"
                "    FROM usage_intervals WHERE ended_at IS NULL"
                ") t GROUP BY pool_id, tenant_id ORDER BY pool_id, tenant_id"
            )
        ).fetchall()
    return {(row["pool_id"], row["tenant_id"]): float(row["seconds"]) for row in rows}
