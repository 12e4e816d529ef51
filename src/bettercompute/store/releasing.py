"""Ending reservations: release, cancel, expiry and lapsed leases; renewing a lease.

A release truncates the current booking at ``compute_now()``, drops future ones, refunds quota
and hands allocations to their nodes; a ``kubernetes`` allocation the node has bound stays
booked (in 5-minute steps, for at most 24 hours) until the node reports its devices free; at
24 hours the release ends without it. Never decides policy: the service asks before it calls.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from bettercompute.core import errors, states
from bettercompute.core.states import State
from bettercompute.store import clock, journal, locking, quotas
from bettercompute.store.database import Conn, Database, Row

#: A release the node has not confirmed keeps its devices booked in steps of this, …
HELD_STEP = dt.timedelta(minutes=5)
#: … for at most this long after the release began.
HELD_LIMIT = dt.timedelta(hours=24)


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
    await quotas.refund(conn, tenant_id=row["tenant_id"], charge=row["quota_charge"])
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


async def carry_held(conn: Conn, row: Row) -> None:
    """A released ``kubernetes`` reservation whose node has not confirmed the release: carry the
    booking of its still-releasing allocations another 5 minutes, up to 24 hours.

    At 24 hours the release ends as the node's ``AllocationReleased`` would end it: the
    allocation is ``released``, its booking ends now at the latest, and ``DevicesHeld`` is gone.
    Why: a node that never confirms (gone, or pods that never stop) must not keep the devices
    booked and the condition shown forever. The next wake-up is kept while any allocation is
    still releasing, even when a booking could not be carried (another starts first), so the
    cap is always reached.
    """
    rid = row["id"]
    if row["request"].get("binding") != "kubernetes":
        # Only pods hold devices past a release (the guide's DevicesHeld); a hold's booking
        # ended with the release. Carrying it too, a stale wake-up of a released hold (its
        # recheck) booked its devices again for 5 minutes, ahead of the pending retries.
        return
    now = await clock.current_time(conn)
    await _carry(
        conn,
        reservation_id=rid,
        states_=("releasing",),
        until=now + HELD_STEP,
        since_after=now - HELD_LIMIT,
    )
    ended = await (
        await conn.execute(
            "UPDATE allocations SET state = 'released', updated_at = compute_now()"
            " WHERE reservation_id = %s AND state = 'releasing' AND releasing_since <= %s"
            " RETURNING id, node_id",
            (rid, now - HELD_LIMIT),
        )
    ).fetchall()
    if ended:
        # As the node's AllocationReleased would end it (store/reports.py).
        freed = [a["id"] for a in ended]
        await conn.execute(
            "DELETE FROM bookings WHERE allocation_id = ANY(%s) AND lower(during) >= %s",
            (freed, now),
        )
        await conn.execute(
            "UPDATE bookings SET during = tstzrange(lower(during), %s)"
            " WHERE allocation_id = ANY(%s) AND upper(during) > %s",
            (now, freed, now),
        )
        await journal.audit(
            conn,
            action="lifecycle",
            outcome="devices-held-ended",
            resource_id=rid,
            tenant_id=row["tenant_id"],
            context={
                "reason": "the node did not confirm the release within 24 hours",
                "allocations": freed,
                "nodes": sorted({a["node_id"] for a in ended}),
            },
        )
        await journal.wake_pending(conn, pool_id=row["pool_id"])
    left = await (
        await conn.execute(
            "SELECT min(releasing_since) AS since FROM allocations"
            " WHERE reservation_id = %s AND state = 'releasing'",
            (rid,),
        )
    ).fetchone()
    if left is not None and left["since"] is not None:
        # The next step, or the cap if it comes first: the release ends exactly at 24 hours.
        at = min(now + HELD_STEP, left["since"] + HELD_LIMIT)
        await journal.wake(conn, reservation_id=rid, at=at, why="devices-held")


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
        row = await locking.lock_reservation(conn, reservation_id, pool_lock=True)
        if row is None:
            raise errors.not_found()
        state = State(row["state"])
        if state in states.TERMINAL or state in states.INTERNAL:
            return
        now = await clock.current_time(conn)
        if state in (State.PENDING, State.AWAITING_CONFIRMATION):
            await finish(conn, row, now=now, reason="release", state=State.CANCELLED, actor=actor)
        else:
            await finish(conn, row, now=now, reason="release", actor=actor)


async def cancel(db: Database, *, reservation_id: str, actor: str) -> None:
    """``reservations.cancel``: withdraw one that has not started (pending or placed)."""
    async with db.transaction() as conn:
        row = await locking.lock_reservation(conn, reservation_id, pool_lock=True)
        if row is None:
            raise errors.not_found()
        state = State(row["state"])
        if state not in states.CANCELLABLE:
            raise errors.invalid_state(
                f"only a pending or placed reservation can be cancelled; this one is {state.value}",
                state=state.value,
            )
        now = await clock.current_time(conn)
        await finish(conn, row, now=now, reason="cancel", state=State.CANCELLED, actor=actor)


async def renew(db: Database, *, reservation_id: str) -> None:
    """``reservations.renew``: the lease runs out ``leaseSeconds`` from now; ``during`` stays."""
    async with db.transaction() as conn:
        row = await locking.lock_reservation(conn, reservation_id, pool_lock=False)
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
        now = await clock.current_time(conn)
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
