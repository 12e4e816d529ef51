"""Reconciling a reservation: lock, read a snapshot, let ``core.lifecycle`` decide, apply.

Woken by the work queue at the moments that matter (start − 15 min, start, the bind deadline,
the end, the lease deadline, retries, node changes). Level-triggered: it looks at the
reservation and ``compute_now()`` and does what is due, so a wake-up that arrives twice or late
does no harm.

This module holds the SQL and the races (which rows to lock and in what order, what to read for
a state, the statements that apply a step); every rule of the lifecycle (what is due, what a
failed binding or a lost node means) is ``core.lifecycle.decide``. It never decides policy.
Its state-changing statements are guarded by the state the decision was made on; the
reservation's row lock makes the guard hold, so it documents what each step expects.

On a pool-lease pool it never places a pending reservation itself: a retry that is due is handed
to the pool's batch (``lifecycle.Requeue``, ``store/batching.py``), together with every other
retry of the pool due now, so that one batch sees them all and orders them fairly.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from bettercompute.core import lifecycle, placement, states
from bettercompute.core.states import State
from bettercompute.store import clock, confirmations, journal, locking, placing, quotas, releasing
from bettercompute.store import pools as pool_rows
from bettercompute.store.database import Conn, Database, Row, jsonb

#: The wake-ups of pending reservations: placement retries, every 30 s and whenever capacity
#: is freed or changes. Migration 0016's partial index names the same list.
RETRY_WHYS = ("retry", "capacity-freed", "capacity-changed")
NOT_RETRY = "why NOT IN (" + ", ".join(f"'{w}'" for w in RETRY_WHYS) + ")"

# The oldest due wake-up of the lifecycle lane (everything but retries), then of any.
_TAKE_LIFECYCLE = (
    "SELECT id, reservation_id FROM work_queue WHERE due_at <= compute_now()"
    f" AND {NOT_RETRY} ORDER BY due_at LIMIT 1 FOR UPDATE SKIP LOCKED"
)
_TAKE_ANY = (
    "SELECT id, reservation_id FROM work_queue WHERE due_at <= compute_now()"
    " ORDER BY due_at LIMIT 1 FOR UPDATE SKIP LOCKED"
)


async def reconcile_due(db: Database, *, limit: int = 20) -> int:
    """Reconcile up to ``limit`` reservations whose wake-ups are due; returns how many.

    Each reservation is reconciled in its own transaction together with the deletion of its due
    queue rows, taken ``FOR UPDATE SKIP LOCKED`` so replicas share the queue without waiting on
    each other, and a crash mid-way leaves the wake-up in place. (A pool-lease pool's retries
    due at once share one transaction: ``_requeue_due``.)

    Two lanes: each step takes the oldest due lifecycle wake-up (a start, a node's report, a
    deadline, an end) before any pending retry (``RETRY_WHYS``), however long the retries have
    been due. Why: a release wakes every pending reservation of its pool, each a placement
    attempt; in due order, a reservation placed after a release with 2,000 pending waited
    behind all of them for its start and again for its node's report (seconds, minutes under
    churn), while a retry taken a moment later loses nothing: the capacity it waits for is
    still there. Retries still run whenever no lifecycle wake-up is due.
    """
    done = 0
    for _ in range(limit):
        async with db.transaction() as conn:
            row = await (await conn.execute(_TAKE_LIFECYCLE)).fetchone()
            if row is None:
                row = await (await conn.execute(_TAKE_ANY)).fetchone()
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
    await _reconcile(conn, reservation_id, together=True)


async def _reconcile(conn: Conn, reservation_id: str, *, together: bool) -> None:
    state = await _unsettled(conn, reservation_id)
    if state is None:
        return
    if state == State.AWAITING_CONFIRMATION:
        # Only its confirmation's deadline can be due (woken then); core.lifecycle has no step
        # for a reservation that holds nothing. The row lock alone, never the pool's: the
        # agent's retry being admitted holds this row and then wants the pool lock.
        # (expire_due checks the state again under the lock.)
        await locking.lock_reservation(conn, reservation_id, pool_lock=False)
        await confirmations.expire_due(conn, reservation_id)
        return
    row = await locking.lock_reservation(conn, reservation_id, pool_lock=True)
    if row is None:
        return
    now = await clock.current_time(conn)
    reservation = await _snapshot(conn, row)
    allocations = await _allocations(conn, row["id"], reservation.state)
    step = lifecycle.decide(reservation, allocations, now=now)
    await _apply(conn, row, reservation, step, now)
    if together and isinstance(step, lifecycle.Requeue) and reservation.pool is not None:
        await _requeue_due(
            conn, pool_id=row["pool_id"], skip=row["id"], limit=reservation.pool.max_batch
        )


# The pool's other pending reservations with a wake-up due now (at most one batch of them, the
# first in the batch's fair order): their due rows taken as ``reconcile_due`` takes them.
_DUE_IN_POOL = """
    WITH due AS (
        SELECT DISTINCT r.id, r.tenant_id, coalesce(r.requested_start, r.created_at) AS requested,
               r.created_at
          FROM work_queue w JOIN reservations r ON r.id = w.reservation_id
         WHERE w.due_at <= compute_now() AND r.pool_id = %(pool)s AND r.state = 'pending'
           AND r.id <> %(skip)s AND NOT r.conditions @> '[{"type": "Queued"}]'
    ), picked AS (
        SELECT id FROM due
         ORDER BY row_number() OVER (PARTITION BY tenant_id ORDER BY requested, created_at, id),
                  requested, created_at, id
         LIMIT %(limit)s
    ), taken AS (
        SELECT w.id FROM work_queue w
         WHERE w.reservation_id IN (SELECT id FROM picked) AND w.due_at <= compute_now()
           FOR UPDATE SKIP LOCKED
    )
    DELETE FROM work_queue w USING taken t WHERE w.id = t.id RETURNING w.reservation_id
"""


async def _requeue_due(conn: Conn, *, pool_id: str, skip: str, limit: int) -> None:
    """Reconcile, in this transaction, the pool's other pending reservations whose wake-ups are
    due now (under the pool lock already held).

    Why: freed capacity wakes every pending reservation of the pool at once, and the reconciler
    takes them one per transaction. Requeued one by one, each commit would wake the batch,
    which could place the first few (one tenant's oldest flood) before the others were requeued
    and so before its fair order could see them. Each is still decided by its own rules (one may
    fail or be released instead); what is requeued here wakes the batch once, at commit.
    """
    taken = await (
        await conn.execute(_DUE_IN_POOL, {"pool": pool_id, "skip": skip, "limit": limit})
    ).fetchall()
    for rid in dict.fromkeys(r["reservation_id"] for r in taken):
        await _reconcile(conn, rid, together=False)


async def _unsettled(conn: Conn, reservation_id: str) -> State | None:
    """The reservation's state when it may need the reconciler, else ``None``; read without
    any lock.

    Why: a wake-up often outlives its reason (a reservation released before its start was
    reconciled), and taking the pool lock for each of those queues them behind every admission
    of the pool; under steady load the queue fell minutes behind. Safe unlocked: a terminal
    state never changes, and a released reservation needs the reconciler only while an
    allocation is still ``releasing`` (its devices held), which is set before or with the
    release, never after. Drafts wait on their request, not on the reconciler; a reservation
    awaiting confirmation needs it at its deadline (``store.confirmations.expire_due``).
    """
    row = await (
        await conn.execute(
            "SELECT r.state, EXISTS (SELECT 1 FROM allocations a WHERE a.reservation_id = r.id"
            "  AND a.state = 'releasing') AS held FROM reservations r WHERE r.id = %s",
            (reservation_id,),
        )
    ).fetchone()
    if row is None:
        return None
    state = State(row["state"])
    if state == State.DRAFT or (state in states.TERMINAL and not row["held"]):
        return None
    # Awaiting confirmation included: its confirmation may have passed its deadline.
    return state


async def _snapshot(conn: Conn, row: Row) -> lifecycle.Reservation:
    """The locked row and the facts its state needs, and only those (each is a query)."""
    state = State(row["state"])
    pool = None
    sound = True
    unhealthy: list[str] = []
    unreachable: list[str] = []
    exposed: list[str] = []
    if state == State.PENDING:
        pool = await pool_rows.read_pool(conn, pool_id=row["pool_id"], tenant_id=row["tenant_id"])
    elif state == State.PLACED:
        sound = await _booking_is_sound(conn, row["id"])
    elif state == State.ACTIVE:
        unhealthy, unreachable, exposed = await _health(conn, row["id"])
    return lifecycle.Reservation(
        state=state,
        tenant_id=row["tenant_id"],
        binding_mode=row["request"].get("binding", ""),
        conditions=row["conditions"],
        binding=row["binding"],
        start=row["start_at"],
        end=row["end_at"],
        requested_start=row["requested_start"],
        duration=row["duration"],
        lease_seconds=row["lease_seconds"],
        lease_expires_at=row["lease_expires_at"],
        pending_since=row["pending_since"],
        bind_deadline=row["bind_deadline"],
        bind_failures=row["bind_failures"],
        pool=pool,
        booking_sound=sound,
        unhealthy_devices=unhealthy,
        unreachable_nodes=unreachable,
        foreign_exposed_nodes=exposed,
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


async def _health(conn: Conn, reservation_id: str) -> tuple[list[str], list[str], list[str]]:
    """The booked devices that are unhealthy, the booked nodes that are not connected, and those
    where something besides bcd can hand the GPUs out."""
    health = await (
        await conn.execute(
            "SELECT array_agg(DISTINCT a.device_id ORDER BY a.device_id)"
            "         FILTER (WHERE NOT a.healthy) AS unhealthy,"
            "       array_agg(DISTINCT n.id ORDER BY n.id) FILTER (WHERE NOT n.connected)"
            "         AS unreachable,"
            "       array_agg(DISTINCT n.id ORDER BY n.id)"
            "         FILTER (WHERE n.foreign_exposure IS NOT NULL) AS exposed"
            "  FROM bookings b JOIN atoms a ON a.id = b.atom_id JOIN nodes n ON n.id = a.node_id"
            " WHERE b.reservation_id = %s",
            (reservation_id,),
        )
    ).fetchone()
    found = health or {}
    return found.get("unhealthy") or [], found.get("unreachable") or [], found.get("exposed") or []


async def _allocations(conn: Conn, reservation_id: str, state: State) -> list[lifecycle.Allocation]:
    """The reservation's allocations, read only in the states whose rules look at them."""
    if state not in (State.BINDING, State.ACTIVE):
        return []
    rows = await (
        await conn.execute(
            "SELECT id, node_id, state, report FROM allocations WHERE reservation_id = %s"
            " ORDER BY node_id",
            (reservation_id,),
        )
    ).fetchall()
    return [
        lifecycle.Allocation(id=a["id"], node_id=a["node_id"], state=a["state"], report=a["report"])
        for a in rows
    ]


async def _apply(
    conn: Conn,
    row: Row,
    reservation: lifecycle.Reservation,
    step: lifecycle.Step,
    now: dt.datetime,
) -> None:
    """Carry out ``step`` with guarded statements, in the caller's transaction."""
    rid = row["id"]
    match step:
        case lifecycle.NothingDue():
            return
        case lifecycle.WaitUntil(at=at, why=why):
            await journal.wake(conn, reservation_id=rid, at=at, why=why)
        case lifecycle.Release(reason=reason):
            await releasing.finish(conn, row, now=now, reason=reason)
        case lifecycle.CarryHeld():
            await releasing.carry_held(conn, row)
        case lifecycle.Fail():
            await _fail(conn, row, reservation.state, step)
        case lifecycle.Place():
            await _place(conn, row, reservation, step, now)
        case lifecycle.Requeue():
            # Nothing about the reservation changes (no condition, no version: no churn for
            # watchers) and no wake-up is queued: the batch tries it and schedules its next
            # retry. The notification wakes the pool's lease holder as this commits.
            await conn.execute(
                "INSERT INTO batch_retries (reservation_id, pool_id)"
                " SELECT id, pool_id FROM reservations WHERE id = %s AND state = 'pending'"
                " ON CONFLICT (reservation_id) DO NOTHING",
                (rid,),
            )
            await conn.execute(
                "SELECT pg_notify('compute_placer', %s)", (f"queued:{row['pool_id']}",)
            )
        case lifecycle.MarkPending(reason=reason, message=message, first=first):
            await conn.execute(
                *placing.mark_pending_statement(
                    reservation_id=rid,
                    pool_id=row["pool_id"],
                    message=message,
                    now=now,
                    first=first,
                    reason=reason,
                )
            )
        case lifecycle.StartBinding(deadline=deadline):
            await _start_binding(conn, row, deadline)
            # Reports that arrived while the reservation was still placed are judged now.
            binding = dataclasses.replace(reservation, state=State.BINDING, bind_deadline=deadline)
            allocations = await _allocations(conn, rid, binding.state)
            await _apply(conn, row, binding, lifecycle.decide(binding, allocations, now=now), now)
        case lifecycle.Activate():
            await _activate(conn, row, step)
        case lifecycle.SetConditions():
            await conn.execute(
                "UPDATE reservations SET conditions = %s, binding = %s, version = version + 1,"
                " updated_at = compute_now() WHERE id = %s AND state = 'active'",
                (jsonb(list(step.conditions)), jsonb(step.binding), rid),
            )
            await journal.wake(conn, reservation_id=rid, at=step.recheck_at, why="recheck")


async def _fail(conn: Conn, row: Row, state: State, step: lifecycle.Fail) -> None:
    if step.bind_failures is not None:
        await conn.execute(
            "UPDATE reservations SET bind_failures = %s WHERE id = %s",
            (step.bind_failures, row["id"]),
        )
    await placing.unbook(conn, reservation_id=row["id"])
    await quotas.refund(conn, tenant_id=row["tenant_id"], charge=row["quota_charge"])
    await conn.execute(
        "UPDATE reservations SET state = 'failed', conditions = %s, failure = %s,"
        " during = NULL, binding = NULL, version = version + 1, updated_at = compute_now()"
        " WHERE id = %s AND state = %s",
        (
            jsonb([dict(step.condition)]),
            jsonb({"reason": step.reason, "message": step.message}),
            row["id"],
            state.value,
        ),
    )
    await journal.emit(
        conn,
        "reservation.failed",
        reservation_id=row["id"],
        data={"state": "failed", "poolId": row["pool_id"], "reason": step.reason},
    )
    await journal.audit(
        conn,
        action="reconcile",
        outcome="failed",
        resource_id=row["id"],
        tenant_id=row["tenant_id"],
        context={"reason": step.reason, "message": step.message},
    )
    await journal.wake_pending(conn, pool_id=row["pool_id"])


async def _place(
    conn: Conn,
    row: Row,
    reservation: lifecycle.Reservation,
    step: lifecycle.Place,
    now: dt.datetime,
) -> None:
    """Book the step's window and mark the reservation placed; on no fit, apply what
    ``lifecycle.after_no_fit`` says (still pending, pending again, repair failed)."""
    if step.unbook:
        await placing.unbook(conn, reservation_id=row["id"])
    if step.bind_failures is not None:
        await conn.execute(
            "UPDATE reservations SET bind_failures = %s, bind_deadline = NULL WHERE id = %s",
            (step.bind_failures, row["id"]),
        )
    outcome = await placing.place(
        conn,
        reservation_id=row["id"],
        pool_id=row["pool_id"],
        request=row["request"],
        start=step.start,
        end=step.end,
    )
    if isinstance(outcome, placement.Placed):
        await conn.execute(
            *placing.mark_placed_statement(
                reservation_id=row["id"],
                pool_id=row["pool_id"],
                outcome=outcome,
                start=step.start,
                end=step.end,
                lease=step.lease,
                now=now,
                event=step.event,
            )
        )
    else:
        after = lifecycle.after_no_fit(reservation, step, outcome.message, now=now)
        await _apply(conn, row, reservation, after, now)
    if step.then_condition is not None:
        await conn.execute(
            "UPDATE reservations SET conditions = conditions || %s WHERE id = %s",
            (jsonb([dict(step.then_condition)]), row["id"]),
        )


async def _start_binding(conn: Conn, row: Row, deadline: dt.datetime) -> None:
    await conn.execute(
        "UPDATE allocations SET state = 'desired', updated_at = compute_now()"
        " WHERE reservation_id = %s AND state = 'planned'",
        (row["id"],),
    )
    await conn.execute(
        "UPDATE reservations SET state = 'binding', bind_deadline = %s, version = version + 1,"
        " updated_at = compute_now() WHERE id = %s AND state = 'placed'",
        (deadline, row["id"]),
    )
    await journal.emit(
        conn,
        "reservation.binding",
        reservation_id=row["id"],
        data={"state": "binding", "poolId": row["pool_id"]},
    )
    await journal.wake(conn, reservation_id=row["id"], at=deadline, why="bind-deadline")


async def _activate(conn: Conn, row: Row, step: lifecycle.Activate) -> None:
    await conn.execute(
        "UPDATE reservations SET state = 'active', binding = %s, conditions = %s,"
        " version = version + 1, updated_at = compute_now() WHERE id = %s AND state = 'binding'",
        (jsonb(dict(step.binding)), jsonb(list(step.conditions)), row["id"]),
    )
    await journal.emit(
        conn,
        "reservation.active",
        reservation_id=row["id"],
        data={"state": "active", "poolId": row["pool_id"]},
    )
    await journal.wake(conn, reservation_id=row["id"], at=step.recheck_at, why="recheck")
