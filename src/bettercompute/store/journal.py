"""What a transaction leaves behind besides its rows: outbox events, audit rows, wake-ups.

Each is written in the caller's transaction, so an event is published exactly when the change
it reports commits (the outbox pattern), and a wake-up is scheduled exactly when the state that
needs it exists.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from bettercompute.store.database import Conn, jsonb


async def emit(
    conn: Conn, event_type: str, *, reservation_id: str, data: Mapping[str, Any]
) -> None:
    """An event with subject ``reservation/<id>``; ``data`` carries at least state and poolId."""
    await conn.execute(
        "INSERT INTO outbox (type, subject, data) VALUES (%s, %s, %s)",
        (event_type, f"reservation/{reservation_id}", jsonb(dict(data))),
    )


async def audit(
    conn: Conn,
    *,
    action: str,
    outcome: str,
    resource_id: str | None,
    actor: str | None = None,
    tenant_id: str | None = None,
    context: Mapping[str, Any] | None = None,
) -> None:
    await conn.execute(
        "INSERT INTO audit_log (actor, tenant_id, action, resource_id, outcome, context)"
        " VALUES (%s, %s, %s, %s, %s, %s)",
        (actor, tenant_id, action, resource_id, outcome, jsonb(dict(context or {}))),
    )


async def wake(conn: Conn, *, reservation_id: str, at: dt.datetime | None, why: str) -> None:
    """Reconcile the reservation at ``at`` (``None``: now)."""
    if at is None:
        await conn.execute(
            "INSERT INTO work_queue (reservation_id, due_at, why) VALUES (%s, compute_now(), %s)",
            (reservation_id, why),
        )
    else:
        await conn.execute(
            "INSERT INTO work_queue (reservation_id, due_at, why) VALUES (%s, %s, %s)",
            (reservation_id, at, why),
        )


async def wake_many(
    conn: Conn, *, reservation_id: str, moments: Mapping[str, dt.datetime | None]
) -> None:
    """Several wake-ups in one statement (start − 15 min, start, end, lease …)."""
    whys = [w for w, at in moments.items() if at is not None]
    ats = [at for at in moments.values() if at is not None]
    if whys:
        await conn.execute(
            "INSERT INTO work_queue (reservation_id, due_at, why)"
            " SELECT %s, w.at, w.why FROM unnest(%s::timestamptz[], %s::text[]) AS w(at, why)",
            (reservation_id, ats, whys),
        )


async def wake_pending(conn: Conn, *, pool_id: str) -> None:
    """Freed capacity: retry the pool's pending reservations now, not at their next 30 s.

    One that already has a wake-up due is not woken twice: its retry, still to come, sees the
    freed capacity. Why: every release woke every pending reservation of the pool again, so
    with 2,000 pending and the retries behind (they yield to lifecycle wake-ups,
    ``store.reconciling.reconcile_due``), each release added 2,000 rows to a queue that only
    grew."""
    await conn.execute(
        "INSERT INTO work_queue (reservation_id, due_at, why)"
        " SELECT r.id, compute_now(), 'capacity-freed' FROM reservations r"
        " WHERE r.pool_id = %s AND r.state = 'pending' AND NOT EXISTS (SELECT 1 FROM work_queue w"
        "  WHERE w.reservation_id = r.id AND w.due_at <= compute_now())",
        (pool_id,),
    )
