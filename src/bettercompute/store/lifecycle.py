"""The lifecycle transactions: reconcile, release, cancel, renew, extend, node reports.

Lock order, in every transaction that takes more than one: the pool's advisory lock, then
reservation rows, then quota rows. Admission's transaction 2 is the one exception that locks its
own draft row first, which is safe because nothing else ever locks a draft row.

``reconcile`` is level-triggered: it looks at the reservation and ``compute_now()`` and does
what is due, so a wake-up that arrives twice or late does no harm. It never decides policy.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psycopg.errors

from bettercompute.core import errors, placement, pools, states
from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.core.states import Condition, Reason, State
from bettercompute.store import admission, journal, placing, views
from bettercompute.store.admission import from_ms, to_ms
from bettercompute.store.database import Conn, Database, Row, jsonb

BIND_TIMEOUT = dt.timedelta(minutes=5)
NODE_BIND_TIMEOUT = dt.timedelta(hours=2)
MAX_BIND_ATTEMPTS = 3
ACTIVE_RECHECK = dt.timedelta(minutes=15)
#: A release the node has not confirmed keeps its devices booked in steps of this, …
HELD_STEP = dt.timedelta(minutes=5)
#: … for at most this long after the release began.
HELD_LIMIT = dt.timedelta(hours=24)
EXTEND_HOLD_TTL = dt.timedelta(seconds=60)

_ROW = """
    SELECT r.*, lower(r.during) AS start_at, upper(r.during) AS end_at
      FROM reservations r WHERE r.id = %s FOR UPDATE
"""


async def _pool_of(conn: Conn, reservation_id: str) -> str | None:
    row = await (
        await conn.execute("SELECT pool_id FROM reservations WHERE id = %s", (reservation_id,))
    ).fetchone()
    return None if row is None else str(row["pool_id"])


async def _lock(conn: Conn, reservation_id: str, *, pool_lock: bool) -> Row | None:
    """Take the pool lock (when asked) and then the reservation's row lock."""
    if pool_lock:
        pool_id = await _pool_of(conn, reservation_id)
        if pool_id is None:
            return None
        await placing.lock_pool(conn, pool_id)
    row: Row | None = await (await conn.execute(_ROW, (reservation_id,))).fetchone()
    return row


# --- reconcile --------------------------------------------------------------------------------


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
    row = await _lock(conn, reservation_id, pool_lock=True)
    if row is None:
        return
    state = State(row["state"])
    if state in states.TERMINAL or state in (State.DRAFT, State.AWAITING_CONFIRMATION):
        if state == State.RELEASED:
            await _carry_held(conn, row)
        return
    now = await admission.current_time(conn)
    if row["lease_expires_at"] is not None and now >= row["lease_expires_at"]:
        await finish(conn, row, now=now, reason="lease-lapsed")
        return
    if row["end_at"] is not None and now >= row["end_at"]:
        await finish(conn, row, now=now, reason="expired")
        return
    if state == State.PENDING:
        await _retry_pending(conn, row, now)
    elif state == State.PLACED:
        await _placed(conn, row, now)
    elif state == State.BINDING:
        await _binding(conn, row, now)
    elif state == State.ACTIVE:
        await _active(conn, row, now)


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
    outcome = await placing.place(
        conn,
        reservation_id=row["id"],
        pool_id=row["pool_id"],
        request=row["request"],
        start=start,
        end=end,
    )
    if isinstance(outcome, placement.Placed):
        lease = now + dt.timedelta(seconds=row["lease_seconds"]) if row["lease_seconds"] else None
        await admission.mark_placed(
            conn,
            reservation_id=row["id"],
            pool_id=row["pool_id"],
            outcome=outcome,
            start=start,
            end=end,
            lease=lease,
            now=now,
        )
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
        outcome = await placing.place(
            conn,
            reservation_id=row["id"],
            pool_id=row["pool_id"],
            request=row["request"],
            start=max(start, now),
            end=end,
        )
        if isinstance(outcome, placement.Placed):
            await admission.mark_placed(
                conn,
                reservation_id=row["id"],
                pool_id=row["pool_id"],
                outcome=outcome,
                start=max(start, now),
                end=end,
                lease=None,
                now=now,
                event="reservation.repaired",
            )
        else:
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
    if attempt >= MAX_BIND_ATTEMPTS:
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
    end = row["end_at"]
    outcome = await placing.place(
        conn,
        reservation_id=row["id"],
        pool_id=row["pool_id"],
        request=row["request"],
        start=now,
        end=end,
    )
    if isinstance(outcome, placement.Placed):
        await admission.mark_placed(
            conn,
            reservation_id=row["id"],
            pool_id=row["pool_id"],
            outcome=outcome,
            start=now,
            end=end,
            lease=None,
            now=now,
        )
    else:
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


# --- release ----------------------------------------------------------------------------------


async def finish(
    conn: Conn,
    row: Row,
    *,
    now: dt.datetime,
    reason: str,
    state: State = State.RELEASED,
    actor: str | None = None,
) -> None:
    """End a reservation at ``now``: truncate the current booking, drop future ones, refund
    quota, hand allocations to their nodes for release, wake the pool's pending reservations.

    A ``kubernetes`` allocation the node has bound stays booked (in 5-minute steps, for at most
    24 hours) until the node reports its devices free: pods may still hold them.
    """
    rid = row["id"]
    held_step_end = now + HELD_STEP
    kubernetes = row["request"].get("binding") == "kubernetes"
    await conn.execute(
        "DELETE FROM allocations WHERE reservation_id = %s AND state = 'planned'", (rid,)
    )
    await conn.execute(
        "DELETE FROM bookings WHERE reservation_id = %s AND lower(during) >= %s", (rid, now)
    )
    if kubernetes:
        await _carry(conn, reservation_id=rid, states_=("bound", "lost"), until=held_step_end)
    await conn.execute(
        "UPDATE bookings b SET during = tstzrange(lower(b.during), %s)"
        " WHERE b.reservation_id = %s AND upper(b.during) > %s AND (NOT %s OR NOT EXISTS ("
        "   SELECT 1 FROM allocations a WHERE a.id = b.allocation_id"
        "      AND a.state IN ('bound', 'lost')))",
        (now, rid, now, kubernetes),
    )
    released = await (
        await conn.execute(
            "UPDATE allocations SET state = CASE WHEN state IN ('desired', 'bound', 'lost')"
            "   THEN 'releasing' ELSE 'released' END,"
            " releasing_since = CASE WHEN state IN ('desired', 'bound', 'lost')"
            "   THEN compute_now() END, updated_at = compute_now()"
            " WHERE reservation_id = %s AND state NOT IN ('releasing', 'released')"
            " RETURNING state",
            (rid,),
        )
    ).fetchall()
    await admission.refund_quota(conn, tenant_id=row["tenant_id"], charge=row["quota_charge"])
    await conn.execute(
        "UPDATE reservations SET state = %s, release_reason = %s, released_at = compute_now(),"
        " during = CASE WHEN during IS NULL OR lower(during) >= %s THEN NULL"
        "               ELSE tstzrange(lower(during), least(upper(during), %s)) END,"
        " version = version + 1, updated_at = compute_now() WHERE id = %s",
        (state.value, reason if state == State.RELEASED else None, now, now, rid),
    )
    event = {
        State.RELEASED: "reservation.released",
        State.CANCELLED: "reservation.cancelled",
    }[state]
    data: dict[str, Any] = {"state": state.value, "poolId": row["pool_id"]}
    if state == State.RELEASED:
        data["reason"] = reason
    await journal.emit(conn, event, reservation_id=rid, data=data)
    await journal.audit(
        conn,
        action="lifecycle",
        outcome=state.value,
        resource_id=rid,
        actor=actor,
        tenant_id=row["tenant_id"],
        context={"reason": reason},
    )
    await journal.wake_pending(conn, pool_id=row["pool_id"])
    if kubernetes and any(r["state"] == "releasing" for r in released):
        await journal.wake(conn, reservation_id=rid, at=held_step_end, why="devices-held")


async def _carry_held(conn: Conn, row: Row) -> None:
    """A released ``kubernetes`` reservation whose node has not confirmed the release: carry the
    booking of its still-releasing allocations another 5 minutes, up to 24 hours."""
    now = await admission.current_time(conn)
    if await _carry(
        conn,
        reservation_id=row["id"],
        states_=("releasing",),
        until=now + HELD_STEP,
        since_after=now - HELD_LIMIT,
    ):
        await journal.wake(conn, reservation_id=row["id"], at=now + HELD_STEP, why="devices-held")


async def _carry(
    conn: Conn,
    *,
    reservation_id: str,
    states_: tuple[str, ...],
    until: dt.datetime,
    since_after: dt.datetime | None = None,
) -> bool:
    """Keep the bookings of held allocations until ``until``, where no other booking of the
    same device already starts first (that one was booked in good faith; the pods' hold shows
    as ``DevicesHeld``). Callers hold the pool lock, so the check cannot go stale."""
    carried = await (
        await conn.execute(
            "UPDATE bookings b SET during = tstzrange(lower(b.during), %s)"
            "  FROM allocations a"
            " WHERE a.id = b.allocation_id AND a.reservation_id = %s AND a.state = ANY(%s)"
            "   AND (%s::timestamptz IS NULL OR a.releasing_since > %s)"
            "   AND NOT EXISTS (SELECT 1 FROM bookings o WHERE o.atom_id = b.atom_id"
            "       AND o.id <> b.id AND o.during && tstzrange(lower(b.during), %s))"
            " RETURNING b.id",
            (until, reservation_id, list(states_), since_after, since_after, until),
        )
    ).fetchall()
    return bool(carried)


async def release(db: Database, *, reservation_id: str, actor: str) -> None:
    """``reservations.release``: end now; a pending one is cancelled; a terminal one is left."""
    async with db.transaction() as conn:
        row = await _lock(conn, reservation_id, pool_lock=True)
        if row is None:
            raise errors.not_found()
        state = State(row["state"])
        if state in states.TERMINAL or state in states.INTERNAL:
            return
        now = await admission.current_time(conn)
        if state in (State.PENDING, State.AWAITING_CONFIRMATION):
            await finish(conn, row, now=now, reason="release", state=State.CANCELLED, actor=actor)
        else:
            await finish(conn, row, now=now, reason="release", actor=actor)


async def cancel(db: Database, *, reservation_id: str, actor: str) -> None:
    """``reservations.cancel``: withdraw one that has not started (pending or placed)."""
    async with db.transaction() as conn:
        row = await _lock(conn, reservation_id, pool_lock=True)
        if row is None:
            raise errors.not_found()
        state = State(row["state"])
        if state not in states.CANCELLABLE:
            raise errors.invalid_state(
                f"only a pending or placed reservation can be cancelled; this one is {state.value}",
                state=state.value,
            )
        now = await admission.current_time(conn)
        await finish(conn, row, now=now, reason="cancel", state=State.CANCELLED, actor=actor)


async def renew(db: Database, *, reservation_id: str) -> None:
    """``reservations.renew``: the lease runs out ``leaseSeconds`` from now; ``during`` stays."""
    async with db.transaction() as conn:
        row = await _lock(conn, reservation_id, pool_lock=False)
        if row is None:
            raise errors.not_found()
        if row["lease_seconds"] is None:
            raise errors.invalid_state("this reservation was created without leaseSeconds")
        state = State(row["state"])
        if state not in states.RENEWABLE:
            raise errors.invalid_state(
                f"a lease can be renewed while placed, binding or active; this one is "
                f"{state.value}",
                state=state.value,
            )
        now = await admission.current_time(conn)
        if row["lease_expires_at"] is not None and now >= row["lease_expires_at"]:
            # Lapsed, and the reconciler is about to release it: a renew cannot bring it back.
            raise errors.invalid_state(
                "the lease has lapsed; the reservation is being released", state=state.value
            )
        until = now + dt.timedelta(seconds=row["lease_seconds"])
        await conn.execute(
            "UPDATE reservations SET lease_expires_at = %s, version = version + 1,"
            " updated_at = compute_now() WHERE id = %s",
            (until, reservation_id),
        )
        await journal.wake(conn, reservation_id=reservation_id, at=until, why="lease")


# --- node reports -----------------------------------------------------------------------------


REPORT_KINDS = ("bound", "failed", "releasing", "released")


async def report(
    db: Database, *, node_id: str, allocation_id: str, kind: str, details: Mapping[str, Any]
) -> bool:
    """A node's report on one of its allocations; ``False`` when ignored.

    A report is accepted only for an allocation placed on the reporting node: one naming
    another node's allocation is ignored exactly like an unknown one.
    """
    if kind not in REPORT_KINDS:
        raise errors.invalid_input("kind", f"must be one of {', '.join(REPORT_KINDS)}")
    async with db.transaction() as conn:
        pool_row = await (
            await conn.execute(
                "SELECT r.pool_id FROM allocations a JOIN reservations r"
                " ON r.id = a.reservation_id WHERE a.id = %s AND a.node_id = %s",
                (allocation_id, node_id),
            )
        ).fetchone()
        if pool_row is None:
            return False
        await placing.lock_pool(conn, pool_row["pool_id"])
        alloc = await (
            await conn.execute(
                "SELECT a.*, r.state AS reservation_state, r.request ->> 'binding' AS binding"
                "  FROM allocations a JOIN reservations r ON r.id = a.reservation_id"
                " WHERE a.id = %s AND a.node_id = %s FOR UPDATE OF a",
                (allocation_id, node_id),
            )
        ).fetchone()
        if alloc is None:
            return False
        new_state = _next_allocation_state(alloc["state"], kind)
        if new_state is None:
            return False
        report_body = {**(alloc["report"] or {}), **dict(details), "kind": kind}
        await conn.execute(
            "UPDATE allocations SET state = %s, report = %s, updated_at = compute_now(),"
            " bound_at = CASE WHEN %s = 'bound' THEN compute_now() ELSE bound_at END"
            " WHERE id = %s",
            (new_state, jsonb(report_body), new_state, allocation_id),
        )
        if new_state == "released" and alloc["state"] == "releasing":
            # The node confirmed its devices are free: end the held booking now.
            now = await admission.current_time(conn)
            await conn.execute(
                "DELETE FROM bookings WHERE allocation_id = %s AND lower(during) >= %s",
                (allocation_id, now),
            )
            await conn.execute(
                "UPDATE bookings SET during = tstzrange(lower(during), %s)"
                " WHERE allocation_id = %s AND upper(during) > %s",
                (now, allocation_id, now),
            )
            await journal.wake_pending(conn, pool_id=pool_row["pool_id"])
        await journal.wake(conn, reservation_id=alloc["reservation_id"], at=None, why=kind)
    return True


def _next_allocation_state(current: str, kind: str) -> str | None:
    """The allocation's state after a report, or ``None`` to ignore the report."""
    table: dict[tuple[str, str], str] = {
        ("planned", "bound"): "bound",  # early: judged once the start is reached
        ("desired", "bound"): "bound",
        ("lost", "bound"): "bound",
        ("bound", "bound"): "bound",
        ("planned", "failed"): "failed",
        ("desired", "failed"): "failed",
        ("bound", "released"): "lost",
        ("bound", "failed"): "lost",
        ("releasing", "releasing"): "releasing",
        ("releasing", "released"): "released",
    }
    return table.get((current, kind))


# --- extend -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExtendStart:
    """The hold is ours and the pending change is staged: decide, then commit or clear."""

    hold: str
    new_end: dt.datetime
    attributes: dict[str, Any]
    pool_id: str


@dataclass(frozen=True)
class AlreadyReached:
    """``until`` is already reached: ``extended: false`` without a decision."""


async def extend_begin(
    db: Database, *, reservation_id: str, until_ms: int | None, by_ms: int | None, hold: str
) -> ExtendStart | AlreadyReached:
    """Extend's transaction 1: stage the pending change under the reservation's extend hold."""
    async with db.transaction() as conn:
        row = await _lock(conn, reservation_id, pool_lock=False)
        if row is None or row["state"] == State.DRAFT:
            raise errors.not_found()
        state = State(row["state"])
        if state not in (State.PLACED, State.BINDING, State.ACTIVE) or row["end_at"] is None:
            raise errors.invalid_state(
                f"only a placed, binding or active reservation can be extended; this one is "
                f"{state.value}",
                state=state.value,
            )
        end: dt.datetime = row["end_at"]
        new_end = (
            from_ms(until_ms)
            if until_ms is not None
            else end + dt.timedelta(milliseconds=by_ms or 0)
        )
        if new_end <= end:
            return AlreadyReached()
        taken = await (
            await conn.execute(
                "INSERT INTO extend_holds (reservation_id, hold, taken_at)"
                " VALUES (%s, %s, compute_now())"
                " ON CONFLICT (reservation_id) DO UPDATE"
                "   SET hold = excluded.hold, taken_at = excluded.taken_at"
                " WHERE extend_holds.taken_at < compute_now() - %s RETURNING hold",
                (reservation_id, hold, EXTEND_HOLD_TTL),
            )
        ).fetchone()
        if taken is None:
            raise ComputeError(
                ErrorCode.CONFLICT,
                "another extend of this reservation is in flight; retry in a minute",
                {
                    "reason": "extend-in-flight",
                    "retryAfterSeconds": 60,
                    "reservationId": reservation_id,
                },
            )
        authz = await (
            await conn.execute(
                "SELECT attributes FROM authz_resources WHERE id = %s", (reservation_id,)
            )
        ).fetchone()
        total_ms = int((new_end - row["start_at"]).total_seconds() * 1000)
        attrs = dict(authz["attributes"] if authz else {})
        attrs["durationHours"] = round(total_ms / 3_600_000, 3)
        await conn.execute(
            "UPDATE authz_resources SET pending = %s WHERE id = %s",
            (
                jsonb(
                    {
                        "durationHours": attrs["durationHours"],
                        "until": to_ms(new_end),
                        "hold": hold,
                    }
                ),
                reservation_id,
            ),
        )
    return ExtendStart(hold=hold, new_end=new_end, attributes=attrs, pool_id=row["pool_id"])


async def extend_clear(db: Database, *, reservation_id: str, hold: str) -> None:
    """A refusal or an abandon clears the pending change, only when the hold is its own."""
    async with db.transaction() as conn:
        await _clear_hold(conn, reservation_id, hold)


async def _clear_hold(conn: Conn, reservation_id: str, hold: str) -> None:
    gone = await (
        await conn.execute(
            "DELETE FROM extend_holds WHERE reservation_id = %s AND hold = %s RETURNING hold",
            (reservation_id, hold),
        )
    ).fetchone()
    if gone is not None:
        await conn.execute(
            "UPDATE authz_resources SET pending = NULL WHERE id = %s", (reservation_id,)
        )


@dataclass(frozen=True)
class ExtendOutcome:
    extended: bool
    available_until_ms: int | None = None


async def extend_replay(
    db: Database, *, idempotency_id: str, request_hash: str
) -> ExtendOutcome | None:
    """The stored outcome of an extend already applied with this key, or ``None``.

    Only applied extends are remembered: a refused or unavailable one is decided again on retry.
    """
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT request_hash, result FROM idempotency WHERE id = %s", (idempotency_id,)
            )
        ).fetchone()
    if row is None:
        return None
    if row["request_hash"] != request_hash:
        raise ComputeError(
            ErrorCode.CONFLICT,
            "this idempotency key was used with a different extend",
            {"reservationId": row["result"].get("reservationId") if row["result"] else None},
        )
    return ExtendOutcome(extended=bool(row["result"]["extended"]))


@dataclass(frozen=True)
class ExtendKey:
    idempotency_id: str
    tenant_id: str
    identity_id: str
    key: str
    request_hash: str


async def extend_commit(
    db: Database, *, reservation_id: str, start: ExtendStart, actor: str, key: ExtendKey
) -> ExtendOutcome:
    """Extend's transaction 2: every booking's end moves, all or nothing; ``EXCLUDE`` decides.

    Takes the pool lock first. Applies only while its hold still owns the slot.
    """
    async with db.transaction() as conn:
        row = await _lock(conn, reservation_id, pool_lock=True)
        owned = await (
            await conn.execute(
                "SELECT 1 FROM extend_holds WHERE reservation_id = %s AND hold = %s",
                (reservation_id, start.hold),
            )
        ).fetchone()
        if row is None or owned is None:
            raise ComputeError(
                ErrorCode.CONFLICT,
                "another extend took over this reservation's extend slot",
                {"reason": "extend-in-flight", "retryAfterSeconds": 60},
            )
        if State(row["state"]) not in (State.PLACED, State.BINDING, State.ACTIVE):
            await _clear_hold(conn, reservation_id, start.hold)
            raise errors.invalid_state(
                f"the reservation became {row['state']} while the extend was decided"
            )
        old_end: dt.datetime = row["end_at"]
        new_end = start.new_end
        if new_end <= old_end:
            await _clear_hold(conn, reservation_id, start.hold)
            return ExtendOutcome(extended=False)
        try:
            async with conn.transaction():
                await conn.execute(
                    "UPDATE bookings SET during = tstzrange(lower(during), %s)"
                    " WHERE reservation_id = %s AND upper(during) = %s",
                    (new_end, reservation_id, old_end),
                )
        except psycopg.errors.ExclusionViolation:
            available = await (
                await conn.execute(
                    "SELECT min(lower(o.during)) AS at FROM bookings mine"
                    "  JOIN bookings o ON o.atom_id = mine.atom_id"
                    "   AND o.reservation_id <> mine.reservation_id"
                    " WHERE mine.reservation_id = %s AND lower(o.during) >= %s",
                    (reservation_id, old_end),
                )
            ).fetchone()
            await _clear_hold(conn, reservation_id, start.hold)
            at = available["at"] if available else None
            return ExtendOutcome(
                extended=False, available_until_ms=to_ms(at) if at is not None else None
            )
        await conn.execute(
            "UPDATE allocations SET until = %s, updated_at = compute_now()"
            " WHERE reservation_id = %s AND state NOT IN ('released')",
            (new_end, reservation_id),
        )
        await conn.execute(
            "UPDATE reservations SET during = tstzrange(lower(during), %s),"
            " duration = %s - lower(during), version = version + 1, updated_at = compute_now()"
            " WHERE id = %s",
            (new_end, new_end, reservation_id),
        )
        await conn.execute(
            "UPDATE authz_resources SET attributes = attributes || jsonb_build_object("
            " 'durationHours', %s::numeric) WHERE id = %s",
            (start.attributes["durationHours"], reservation_id),
        )
        await _clear_hold(conn, reservation_id, start.hold)
        await conn.execute(
            "INSERT INTO idempotency (id, scope, tenant_id, identity_id, key, request_hash,"
            " reservation_id, outcome, result) VALUES (%s, 'extend', %s, %s, %s, %s, %s,"
            " 'extended', %s) ON CONFLICT (id) DO NOTHING",
            (
                key.idempotency_id,
                key.tenant_id,
                key.identity_id,
                key.key,
                key.request_hash,
                reservation_id,
                jsonb(
                    {
                        "extended": True,
                        "reservationId": reservation_id,
                        "until": to_ms(new_end),
                    }
                ),
            ),
        )
        await journal.wake(conn, reservation_id=reservation_id, at=new_end, why="end")
        await journal.emit(
            conn,
            "reservation.extended",
            reservation_id=reservation_id,
            data={
                "state": row["state"],
                "poolId": row["pool_id"],
                "end": to_ms(new_end),
                "previousEnd": to_ms(old_end),
            },
        )
        await journal.audit(
            conn,
            action="compute:reservations:extend",
            outcome="extended",
            resource_id=reservation_id,
            actor=actor,
            tenant_id=row["tenant_id"],
            context={"until": to_ms(new_end)},
        )
    return ExtendOutcome(extended=True)


async def get_view(db: Database, reservation_id: str) -> dict[str, Any] | None:
    async with db.connection() as conn:
        row = await views.read(conn, reservation_id)
    return None if row is None else views.to_view(row)
