"""Extending a reservation: the two transactions around its policy decision.

One extend at a time stages the pending change, under a server-minted hold in
``extend_holds`` that names this process's holder (``store/holding.py``). The hold is taken over
at once when its holder's session has ended (a crashed replica), and after 60 s as a last resort
for a holder that is alive but hung. Transaction 2 takes the tenant's budget lock when the
built-in budget is checked, then the pool lock, applies only while its hold still owns the slot,
and moves every booking's end, all or nothing: the ``EXCLUDE`` constraint decides, and a
conflict answers the earliest start of the booking in the way (``availableUntil``). Never
decides policy.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import psycopg.errors

from bettercompute.core import errors, requests
from bettercompute.core.durations import from_ms, to_ms
from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.core.states import State
from bettercompute.store import budgets, journal, locking
from bettercompute.store.database import Conn, Database, jsonb

EXTEND_HOLD_TTL = dt.timedelta(seconds=60)


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
    db: Database,
    *,
    reservation_id: str,
    until_ms: int | None,
    by_ms: int | None,
    hold: str,
    holder: int,
) -> ExtendStart | AlreadyReached:
    """Extend's transaction 1: stage the pending change under the reservation's extend hold."""
    async with db.transaction() as conn:
        row = await locking.lock_reservation(conn, reservation_id, pool_lock=False)
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
        new_end_ms = until_ms if until_ms is not None else to_ms(end) + (by_ms or 0)
        if new_end_ms <= to_ms(end):
            return AlreadyReached()
        if new_end_ms > requests.MAX_EPOCH_MS:
            raise errors.invalid_input(
                "until" if until_ms is not None else "by", "the window must end by 9999-12-31"
            )
        new_end = from_ms(new_end_ms)
        taken = await (
            await conn.execute(
                "INSERT INTO extend_holds (reservation_id, hold, holder, taken_at)"
                " VALUES (%s, %s, %s, compute_now())"
                " ON CONFLICT (reservation_id) DO UPDATE"
                "   SET hold = excluded.hold, holder = excluded.holder,"
                "       taken_at = excluded.taken_at"
                " WHERE NOT bc_claim_live(extend_holds.hold, extend_holds.taken_at,"
                "                         extend_holds.holder, %s)"
                " RETURNING hold",
                (reservation_id, hold, holder, EXTEND_HOLD_TTL),
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
    db: Database,
    *,
    reservation_id: str,
    start: ExtendStart,
    actor: str,
    key: ExtendKey,
    budget_hours: float | None = None,
) -> ExtendOutcome:
    """Extend's transaction 2: every booking's end moves, all or nothing; ``EXCLUDE`` decides.

    ``budget_hours``: the GPU-hours the extension adds, checked against the built-in budget
    under the tenant's budget lock (``None``: no budget here); a spent budget raises
    ``SPEND_LIMIT_REACHED`` with nothing written. Then takes the pool lock. Applies only while
    its hold still owns the slot.
    """
    async with db.transaction() as conn:
        if budget_hours is not None:
            short = await (
                await conn.execute(
                    "SELECT bc_budget_lock_check(%s, %s::numeric) AS short",
                    (key.tenant_id, budget_hours),
                )
            ).fetchone()
            if short is not None and short["short"] is not None:
                raise budgets.short_error(short["short"])
        row = await locking.lock_reservation(conn, reservation_id, pool_lock=True)
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
                # Its hosts must give its CPUs and memory for the added time too.
                await conn.execute(
                    "SELECT bc_check_hosts(r.pool_id, ARRAY(SELECT a.node_id FROM allocations a"
                    " WHERE a.reservation_id = r.id AND a.host_vcpu + a.host_memory_gib"
                    " + a.host_hugepages_1gi > 0), %s, %s) FROM reservations r WHERE r.id = %s",
                    (old_end, new_end, reservation_id),
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
