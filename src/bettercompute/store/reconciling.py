"""Reconciling a reservation: do what is due for it now, by state.

Woken by the work queue at the moments that matter (start − 15 min, start, the bind deadline,
the end, the lease deadline, retries, node changes). Level-triggered: it looks at the
reservation and ``compute_now()`` and does what is due, so a wake-up that arrives twice or late
does no harm. It never decides policy, and while a reservation is active it only sets and
clears conditions: it never releases one (the end and the lease do).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from bettercompute.core import placement, pools, states
from bettercompute.core.states import Condition, Reason, State
from bettercompute.store import admission, journal, locking, placing, releasing
from bettercompute.store.admission import to_ms
from bettercompute.store.database import Conn, Database, Row, jsonb

BIND_TIMEOUT = dt.timedelta(minutes=5)
NODE_BIND_TIMEOUT = dt.timedelta(hours=2)
MAX_BIND_ATTEMPTS = 3
ACTIVE_RECHECK = dt.timedelta(minutes=15)


async def reconcile_due(db: Database, *, limit: int = 20) -> int:
    """Reconcile up to ``limit`` reservations whose wake-ups are due; returns how many.

    Each reservation is reconciled in its own transaction together with the deletion of its due
    queue rows, taken ``FOR UPDATE SKIP LOCKED`` so replicas share the queue without waiting on
    each other, and a crash mid-way leaves the wake-up in place.
    """
    done = 0
    for _ in range(limit):
        async with db.transaction() as conn:
            row = await (
                await conn.execute(
                    "SELECT id, reservation_id FROM work_queue WHERE due_at <= compute_now()"
                    " ORDER BY due_at LIMIT 1 FOR UPDATE SKIP LOCKED"
                )
            ).fetchone()
            if row is None:
                return done
            rid = row["reservation_id"]
            await conn.execute(
                "DELETE FROM work_queue WHERE id IN (SELECT id FROM work_queue"
                " WHERE reservation_id = %s AND due_at <= compute_now() FOR UPDATE SKIP LOCKED)",
                (rid,),
            )
            await reconcile(conn, rid)
            done += 1
    return done


async def next_due_in(db: Database) -> float | None:
    """Seconds until the earliest wake-up, for the reconciler's sleep (``None``: nothing)."""
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT extract(epoch FROM min(due_at) - compute_now()) AS s FROM work_queue"
            )
        ).fetchone()
    if row is None or row["s"] is None:
        return None
    return max(0.0, float(row["s"]))


async def reconcile(conn: Conn, reservation_id: str) -> None:
    """Do what is due for one reservation, in the caller's transaction."""
    if await _settled(conn, reservation_id):
        return
    row = await locking.lock_reservation(conn, reservation_id, pool_lock=True)
    if row is None:
        return
    state = State(row["state"])
    if state in states.TERMINAL or state in (State.DRAFT, State.AWAITING_CONFIRMATION):
        if state == State.RELEASED:
            await releasing.carry_held(conn, row)
        return
    now = await admission.current_time(conn)
    if row["lease_expires_at"] is not None and now >= row["lease_expires_at"]:
        await releasing.finish(conn, row, now=now, reason="lease-lapsed")
        return
    if row["end_at"] is not None and now >= row["end_at"]:
        await releasing.finish(conn, row, now=now, reason="expired")
        return
    if state == State.PENDING:
        await _retry_pending(conn, row, now)
    elif state == State.PLACED:
        await _placed(conn, row, now)
    elif state == State.BINDING:
        await _binding(conn, row, now)
    elif state == State.ACTIVE:
        await _active(conn, row, now)


async def _settled(conn: Conn, reservation_id: str) -> bool:
    """Whether the reservation needs nothing from the reconciler, read without any lock.

    Why: a wake-up often outlives its reason (a reservation released before its start was
    reconciled), and taking the pool lock for each of those queues them behind every admission
    of the pool; under steady load the queue fell minutes behind. Safe unlocked: a terminal
    state never changes, and a released reservation needs the reconciler only while an
    allocation is still ``releasing`` (its devices held), which is set before or with the
    release, never after. Drafts wait on their request, not on the reconciler.
    """
    row = await (
        await conn.execute(
            "SELECT r.state, EXISTS (SELECT 1 FROM allocations a WHERE a.reservation_id = r.id"
            "  AND a.state = 'releasing') AS held FROM reservations r WHERE r.id = %s",
            (reservation_id,),
        )
    ).fetchone()
    if row is None:
        return True
    state = State(row["state"])
    if state in (State.DRAFT, State.AWAITING_CONFIRMATION):
        return True
    return state in states.TERMINAL and not row["held"]


async def _pool(conn: Conn, row: Row) -> pools.PoolInfo | None:
    return await admission.read_pool(conn, pool_id=row["pool_id"], tenant_id=row["tenant_id"])


async def _fail(conn: Conn, row: Row, *, reason: str, message: str, kind: Condition) -> None:
    now = await admission.current_time(conn)
    await placing.unbook(conn, reservation_id=row["id"])
    await admission.refund_quota(conn, tenant_id=row["tenant_id"], charge=row["quota_charge"])
    cond = states.condition(kind, reason, message, at_ms=to_ms(now))
    await conn.execute(
        "UPDATE reservations SET state = 'failed', conditions = %s, failure = %s,"
        " during = NULL, binding = NULL, version = version + 1, updated_at = compute_now()"
        " WHERE id = %s",
        (jsonb([cond]), jsonb({"reason": reason, "message": message}), row["id"]),
    )
    await journal.emit(
        conn,
        "reservation.failed",
        reservation_id=row["id"],
        data={"state": "failed", "poolId": row["pool_id"], "reason": reason},
    )
    await journal.audit(
        conn,
        action="reconcile",
        outcome="failed",
        resource_id=row["id"],
        tenant_id=row["tenant_id"],
        context={"reason": reason, "message": message},
    )
    await journal.wake_pending(conn, pool_id=row["pool_id"])


async def _window(row: Row, now: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
    """A pending reservation keeps its requested start while it is ahead; once it has passed,
    the window begins at placement with the full duration."""
    requested = row["requested_start"]
    start = max(now, requested) if requested is not None else now
    return start, start + row["duration"]


async def _place(
    conn: Conn,
    row: Row,
    *,
    start: dt.datetime,
    end: dt.datetime,
    now: dt.datetime,
    lease: dt.datetime | None = None,
    event: str = "reservation.placed",
) -> placement.Outcome:
    """Place the reservation on [start, end) and, when it fits, mark it placed; the caller
    decides what a no-fit means (still pending, repair failed, re-placement failed)."""
    outcome = await placing.place(
        conn,
        reservation_id=row["id"],
        pool_id=row["pool_id"],
        request=row["request"],
        start=start,
        end=end,
    )
    if isinstance(outcome, placement.Placed):
        await admission.mark_placed(
            conn,
            reservation_id=row["id"],
            pool_id=row["pool_id"],
            outcome=outcome,
            start=start,
            end=end,
            lease=lease,
            now=now,
            event=event,
        )
    return outcome


async def _retry_pending(conn: Conn, row: Row, now: dt.datetime) -> None:
    pool = await _pool(conn, row)
    if pool is None or not pool.visible_to(row["tenant_id"]):
        await _fail(
            conn,
            row,
            reason=Reason.POOL_GONE,
            kind=Condition.UNSCHEDULABLE,
            message="the pool is archived or no longer offered to the tenant",
        )
        return
    if row["pending_since"] is not None and now - row["pending_since"] > dt.timedelta(
        milliseconds=pool.max_pending_ms
    ):
        await _fail(
            conn,
            row,
            reason=Reason.MAX_PENDING_EXCEEDED,
            kind=Condition.UNSCHEDULABLE,
            message=f"pending longer than the pool's maxPending ({pool.max_pending_ms} ms)",
        )
        return
    start, end = await _window(row, now)
    lease = now + dt.timedelta(seconds=row["lease_seconds"]) if row["lease_seconds"] else None
    outcome = await _place(conn, row, start=start, end=end, now=now, lease=lease)
    if isinstance(outcome, placement.Placed):
        return
    current = next((c for c in row["conditions"] if c.get("type") == "Unschedulable"), None)
    if current is not None and current.get("reason") == Reason.BOOKING_REPAIR_FAILED:
        # Still no fit: the reason the reservation waits is still the booking that went bad.
        return await _still_pending(conn, row, now)
    if current is not None and current.get("message") == outcome.message:
        return await _still_pending(conn, row, now)
    await admission.mark_pending(
        conn,
        reservation_id=row["id"],
        pool_id=row["pool_id"],
        message=outcome.message,
        now=now,
        first=False,
    )


async def _still_pending(conn: Conn, row: Row, now: dt.datetime) -> None:
    # Nothing changed: keep the version still, so watchers see no churn; try again in 30 s.
    await journal.wake(
        conn, reservation_id=row["id"], at=now + admission.PENDING_RETRY, why="retry"
    )


async def _booking_is_sound(conn: Conn, reservation_id: str) -> bool:
    row = await (
        await conn.execute(
            "SELECT bool_and(a.healthy AND NOT a.retired AND n.ready AND n.pool_id = r.pool_id)"
            "       AS sound"
            "  FROM bookings b JOIN atoms a ON a.id = b.atom_id JOIN nodes n ON n.id = a.node_id"
            "  JOIN reservations r ON r.id = b.reservation_id WHERE b.reservation_id = %s",
            (reservation_id,),
        )
    ).fetchone()
    return bool(row and row["sound"] is not False)


async def _placed(conn: Conn, row: Row, now: dt.datetime) -> None:
    start, end = row["start_at"], row["end_at"]
    if not await _booking_is_sound(conn, row["id"]):
        # Repair before the start: book the same window elsewhere, or wait pending.
        await placing.unbook(conn, reservation_id=row["id"])
        outcome = await _place(
            conn, row, start=max(start, now), end=end, now=now, event="reservation.repaired"
        )
        if isinstance(outcome, placement.NoFit):
            await admission.mark_pending(
                conn,
                reservation_id=row["id"],
                pool_id=row["pool_id"],
                now=now,
                first=True,
                reason=Reason.BOOKING_REPAIR_FAILED,
                message=f"the booking went bad before the start: {outcome.message}",
            )
        return
    if now < start:
        return
    deadline = now + (NODE_BIND_TIMEOUT if row["request"]["binding"] == "node" else BIND_TIMEOUT)
    await conn.execute(
        "UPDATE allocations SET state = 'desired', updated_at = compute_now()"
        " WHERE reservation_id = %s AND state = 'planned'",
        (row["id"],),
    )
    await conn.execute(
        "UPDATE reservations SET state = 'binding', bind_deadline = %s, version = version + 1,"
        " updated_at = compute_now() WHERE id = %s",
        (deadline, row["id"]),
    )
    await journal.emit(
        conn,
        "reservation.binding",
        reservation_id=row["id"],
        data={"state": "binding", "poolId": row["pool_id"]},
    )
    await journal.wake(conn, reservation_id=row["id"], at=deadline, why="bind-deadline")
    row = {**row, "state": "binding", "bind_deadline": deadline}
    # Reports that arrived while the reservation was still placed are judged now.
    await _binding(conn, row, now)


async def _allocations(conn: Conn, reservation_id: str) -> list[Row]:
    return await (
        await conn.execute(
            "SELECT * FROM allocations WHERE reservation_id = %s ORDER BY node_id",
            (reservation_id,),
        )
    ).fetchall()


async def _binding(conn: Conn, row: Row, now: dt.datetime) -> None:
    allocs = await _allocations(conn, row["id"])
    failed = [a for a in allocs if a["state"] == "failed"]
    if allocs and not failed and all(a["state"] == "bound" for a in allocs):
        await _activate(conn, row, allocs)
        return
    if not failed and row["bind_deadline"] is not None and now < row["bind_deadline"]:
        return
    attempt = row["bind_failures"] + 1
    reason = Reason.NODE_REJECTED_BINDING if failed else Reason.NODE_DID_NOT_BIND
    nodes = sorted(
        {a["node_id"] for a in (failed or allocs if failed else allocs) if a["state"] != "bound"}
    )
    detail = "; ".join(
        f"{a['node_id']}: {(a['report'] or {}).get('reason', 'failed')}" for a in failed
    )
    message = f"attempt {attempt} of {MAX_BIND_ATTEMPTS}: " + (
        f"node refused the binding ({detail})"
        if failed
        else f"no bound report within the deadline from {', '.join(nodes)}"
    )
    # A node lease (binding 'node') gets no second placement: its machines were deployed for it.
    if attempt >= MAX_BIND_ATTEMPTS or row["request"]["binding"] == "node":
        await conn.execute(
            "UPDATE reservations SET bind_failures = %s WHERE id = %s", (attempt, row["id"])
        )
        await _fail(conn, row, reason=reason, message=message, kind=Condition.BIND_TIMEOUT)
        return
    # Release the bookings and place again, for what remains of the window.
    await placing.unbook(conn, reservation_id=row["id"])
    cond = states.condition(Condition.BIND_TIMEOUT, reason, message, at_ms=to_ms(now))
    await conn.execute(
        "UPDATE reservations SET bind_failures = %s, bind_deadline = NULL WHERE id = %s",
        (attempt, row["id"]),
    )
    outcome = await _place(conn, row, start=now, end=row["end_at"], now=now)
    if isinstance(outcome, placement.NoFit):
        await admission.mark_pending(
            conn,
            reservation_id=row["id"],
            pool_id=row["pool_id"],
            message=outcome.message,
            now=now,
            first=True,
        )
    await conn.execute(
        "UPDATE reservations SET conditions = conditions || %s WHERE id = %s",
        (jsonb([cond]), row["id"]),
    )


def _binding_view(row: Row, allocs: list[Row]) -> dict[str, Any]:
    reports = [a["report"] or {} for a in allocs]
    view: dict[str, Any] = {
        "nodeId": allocs[0]["node_id"],
        "nodeIds": [a["node_id"] for a in allocs],
        "allocationIds": [a["id"] for a in allocs],
        "cdiDevices": [d for r in reports for d in r.get("cdiDevices", [])],
    }
    env_files = [r["envFile"] for r in reports if r.get("envFile")]
    if env_files:
        view["envFile"] = env_files[0]
        if len(env_files) > 1:
            view["envFiles"] = env_files
    return view


async def _activate(conn: Conn, row: Row, allocs: list[Row]) -> None:
    await conn.execute(
        "UPDATE reservations SET state = 'active', binding = %s, conditions = %s,"
        " version = version + 1, updated_at = compute_now() WHERE id = %s",
        (
            jsonb(_binding_view(row, allocs)),
            jsonb(states.without(row["conditions"], Condition.BIND_TIMEOUT)),
            row["id"],
        ),
    )
    await journal.emit(
        conn,
        "reservation.active",
        reservation_id=row["id"],
        data={"state": "active", "poolId": row["pool_id"]},
    )
    now = await admission.current_time(conn)
    await journal.wake(conn, reservation_id=row["id"], at=now + ACTIVE_RECHECK, why="recheck")


async def _active(conn: Conn, row: Row, now: dt.datetime) -> None:
    """While active, only set and clear conditions from nodes and atoms; never release."""
    allocs = await _allocations(conn, row["id"])
    lost = sorted(a["node_id"] for a in allocs if a["state"] == "lost")
    health = await (
        await conn.execute(
            "SELECT array_agg(DISTINCT a.device_id ORDER BY a.device_id)"
            "         FILTER (WHERE NOT a.healthy) AS unhealthy,"
            "       array_agg(DISTINCT n.id ORDER BY n.id) FILTER (WHERE NOT n.connected)"
            "         AS unreachable"
            "  FROM bookings b JOIN atoms a ON a.id = b.atom_id JOIN nodes n ON n.id = a.node_id"
            " WHERE b.reservation_id = %s",
            (row["id"],),
        )
    ).fetchone()
    unhealthy = (health or {}).get("unhealthy") or []
    unreachable = (health or {}).get("unreachable") or []
    at = to_ms(now)
    kept = {c["type"]: c for c in row["conditions"]}
    wanted: list[dict[str, Any]] = []
    if lost:
        wanted.append(
            _keep(
                kept,
                states.condition(
                    Condition.DEGRADED,
                    Reason.BINDING_LOST,
                    f"nodes reported lost devices: {', '.join(lost)}",
                    at_ms=at,
                ),
            )
        )
    elif unhealthy:
        wanted.append(
            _keep(
                kept,
                states.condition(
                    Condition.DEGRADED,
                    Reason.ATOM_UNHEALTHY,
                    f"unhealthy booked devices: {', '.join(unhealthy)}",
                    at_ms=at,
                ),
            )
        )
    if unreachable:
        wanted.append(
            _keep(
                kept,
                states.condition(
                    Condition.NODE_UNREACHABLE,
                    Reason.UNREACHABLE,
                    f"nodes not connected: {', '.join(unreachable)}",
                    at_ms=at,
                ),
            )
        )
    others = [
        c
        for c in row["conditions"]
        if c["type"] not in (Condition.DEGRADED, Condition.NODE_UNREACHABLE)
    ]
    conditions = others + wanted
    if conditions != row["conditions"]:
        binding = _binding_view(row, allocs) if allocs and not lost else row["binding"]
        await conn.execute(
            "UPDATE reservations SET conditions = %s, binding = %s, version = version + 1,"
            " updated_at = compute_now() WHERE id = %s",
            (jsonb(conditions), jsonb(binding), row["id"]),
        )
    await journal.wake(conn, reservation_id=row["id"], at=now + ACTIVE_RECHECK, why="recheck")


def _keep(existing: Mapping[str, Mapping[str, Any]], new: dict[str, Any]) -> dict[str, Any]:
    # A condition that still holds keeps its original ``since``.
    old = existing.get(new["type"])
    if old and old.get("reason") == new["reason"] and old.get("message") == new["message"]:
        return dict(old)
    return new
