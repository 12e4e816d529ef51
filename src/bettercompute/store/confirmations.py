"""Delegated confirmations in SQL (``confirmations``; migration 0010): open, find, decide, expire.

Why here: a confirmation and the reservation it holds move together. Opening one moves the draft
to ``awaiting-confirmation`` with its ``ConfirmationRequired`` condition, gives the admission
claim back and writes the event, the audit row and the wake-up at the deadline, all in one
transaction; a person's "no" denies the reservation in the transaction that records it; a
deadline that passed expires both. ``service/reservations.py`` decides *when* (it holds the
policy decision); the reconciler calls ``expire_due`` at the deadline.

Lock order: the reservation's row, then its confirmation's, everywhere (as the reconciler locks
a reservation first).

What it must never do: call the policy engine, charge quota, or let anyone but the person a
confirmation names decide it (``decide`` answers ``None`` for everyone else, whether or not the
confirmation exists, so nothing leaks).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from bettercompute.core import answers, errors, ids, requests, states
from bettercompute.core.errors import ErrorCode
from bettercompute.store import journal
from bettercompute.store.database import Conn, Database, jsonb

Verdict = Literal["approved", "denied"]

_COLUMNS = (
    "c.id, c.tenant_id, c.reservation_id, c.action, c.person_id, c.agent_id, c.request_hash,"
    " c.state, epoch_ms(c.created_at) AS created_at, epoch_ms(c.expires_at) AS expires_at,"
    " epoch_ms(c.decided_at) AS decided_at, c.decided_by,"
    " c.expires_at <= compute_now() AS past_deadline, r.request, r.pool_id"
)
_FROM = " FROM confirmations c JOIN reservations r ON r.id = c.reservation_id"


@dataclass(frozen=True)
class Found:
    """A confirmation as a retry finds it; ``past_deadline`` by the database's clock."""

    id: str
    state: str
    request_hash: str
    expires_at_ms: int
    decided_by: str | None
    past_deadline: bool


def _answer(row: Mapping[str, Any]) -> answers.Confirmation:
    # A pending one past its deadline is expired, whether or not the reconciler came yet.
    state: requests.ConfirmationState = (
        "expired" if row["state"] == "pending" and row["past_deadline"] else row["state"]
    )
    return {
        "id": row["id"],
        "tenantId": row["tenant_id"],
        "reservationId": row["reservation_id"],
        "action": row["action"],
        "personId": row["person_id"],
        "agentId": row["agent_id"],
        "state": state,
        "request": row["request"],
        "createdAt": int(row["created_at"]),
        "expiresAt": int(row["expires_at"]),
        "decidedAt": None if row["decided_at"] is None else int(row["decided_at"]),
        "decidedBy": row["decided_by"],
    }


def _found(row: Mapping[str, Any]) -> Found:
    return Found(
        id=row["id"],
        state=row["state"],
        request_hash=row["request_hash"],
        expires_at_ms=int(row["expires_at"]),
        decided_by=row["decided_by"],
        past_deadline=bool(row["past_deadline"]),
    )


async def find(db: Database, *, reservation_id: str, action: str) -> Found | None:
    """The confirmation asked for ``action`` on the reservation, if one was."""
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                f"SELECT {_COLUMNS}{_FROM} WHERE c.reservation_id = %s AND c.action = %s",
                (reservation_id, action),
            )
        ).fetchone()
    return None if row is None else _found(row)


async def open_(
    db: Database,
    *,
    tenant_id: str,
    reservation_id: str,
    idempotency_id: str,
    claim: str,
    action: str,
    person_id: str,
    agent_id: str,
    request_hash: str,
    deadline: dt.timedelta,
    context: Mapping[str, Any],
) -> Found:
    """Ask the person: the confirmation, the draft ``awaiting-confirmation`` with its condition
    (reason: the confirmation id; message: the deadline in epoch ms), the claim given back, the
    ``reservation.awaiting-confirmation`` event, the audit row and a wake-up at the deadline.
    Nothing is charged. Raises ``CONFLICT`` when the claim was lost to a takeover."""
    cid = ids.new_id("cnf")
    async with db.transaction() as conn:
        row = await (
            await conn.execute(
                "INSERT INTO confirmations (id, tenant_id, reservation_id, action, person_id,"
                " agent_id, request_hash, expires_at)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, compute_now() + %s) RETURNING"
                " epoch_ms(created_at) AS created_at, epoch_ms(expires_at) AS expires_at,"
                " expires_at AS deadline",
                (
                    cid,
                    tenant_id,
                    reservation_id,
                    action,
                    person_id,
                    agent_id,
                    request_hash,
                    deadline,
                ),
            )
        ).fetchone()
        assert row is not None
        expires_ms = int(row["expires_at"])
        condition = states.condition(
            states.Condition.CONFIRMATION_REQUIRED,
            cid,
            str(expires_ms),
            at_ms=int(row["created_at"]),
        )
        moved = await (
            await conn.execute(
                "UPDATE reservations SET state = 'awaiting-confirmation',"
                " conditions = jsonb_build_array(%s::jsonb), version = version + 1,"
                " updated_at = compute_now()"
                " WHERE id = %s AND state IN ('draft', 'awaiting-confirmation')"
                " RETURNING pool_id",
                (jsonb(condition), reservation_id),
            )
        ).fetchone()
        released = await conn.execute(
            "UPDATE idempotency SET claim = NULL, claimed_at = NULL, claim_holder = NULL"
            " WHERE id = %s AND claim = %s",
            (idempotency_id, claim),
        )
        if moved is None or released.rowcount != 1:
            # Leaving the block rolls it all back: whoever took the key over decides it.
            raise errors.claim_taken_over(reservation_id)
        await journal.emit(
            conn,
            "reservation.awaiting-confirmation",
            reservation_id=reservation_id,
            data={
                "state": states.State.AWAITING_CONFIRMATION.value,
                "poolId": moved["pool_id"],
                "confirmationId": cid,
                "expiresAt": expires_ms,
            },
        )
        await journal.audit(
            conn,
            action=action,
            outcome=ErrorCode.CONFIRMATION_REQUIRED.value,
            resource_id=reservation_id,
            actor=agent_id,
            tenant_id=tenant_id,
            context={**context, "confirmationId": cid, "person": person_id},
        )
        await journal.wake(
            conn, reservation_id=reservation_id, at=row["deadline"], why="confirmation-deadline"
        )
    return Found(cid, "pending", request_hash, expires_ms, None, False)


async def list_for(
    db: Database, *, tenant_id: str, identity_id: str, state: str | None, limit: int
) -> list[answers.Confirmation]:
    """The tenant's confirmations that name ``identity_id`` as the person or as the agent,
    newest first; ``state`` as shown (a pending one past its deadline shows ``expired``)."""
    where = ["c.tenant_id = %s", "(c.person_id = %s OR c.agent_id = %s)"]
    params: list[Any] = [tenant_id, identity_id, identity_id]
    if state == "pending":
        where.append("c.state = 'pending' AND c.expires_at > compute_now()")
    elif state == "expired":
        where.append(
            "(c.state = 'expired' OR (c.state = 'pending' AND c.expires_at <= compute_now()))"
        )
    elif state is not None:
        where.append("c.state = %s")
        params.append(state)
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                f"SELECT {_COLUMNS}{_FROM} WHERE {' AND '.join(where)}"
                " ORDER BY c.created_at DESC, c.id DESC LIMIT %s",
                (*params, limit),
            )
        ).fetchall()
    return [_answer(row) for row in rows]


async def decide(
    db: Database, *, tenant_id: str, confirmation_id: str, person_id: str, verdict: Verdict
) -> answers.Confirmation | None:
    """The person's ``verdict`` on their confirmation, answered as it then stands.

    ``None`` when there is no such confirmation in the tenant or it names another person (the
    service answers both alike). The same verdict twice is a no-op; the other verdict after one
    is ``INVALID_STATE``, as is any verdict past the deadline, which expires the reservation
    then and there. A denial denies the reservation in the same transaction, so the agent's
    retry is refused for good (its key stays refused).
    """
    async with db.transaction() as conn:
        peek = await (
            await conn.execute(
                "SELECT reservation_id, person_id FROM confirmations"
                " WHERE id = %s AND tenant_id = %s",
                (confirmation_id, tenant_id),
            )
        ).fetchone()
        if peek is None or peek["person_id"] != person_id:
            return None
        rid = peek["reservation_id"]
        # Lock order: the reservation, then its confirmation.
        await conn.execute("SELECT 1 FROM reservations WHERE id = %s FOR UPDATE", (rid,))
        row = await _locked(conn, confirmation_id)
        if row["state"] == verdict:
            return _answer(row)
        if row["state"] == "pending" and row["past_deadline"]:
            await _expire(conn, reservation_id=rid, confirmation_id=confirmation_id)
            row = await _locked(conn, confirmation_id)
        if row["state"] != "pending":
            # Raised after the block: raising here would roll back an expiry just stored.
            refusal = errors.invalid_state(
                f"confirmation {confirmation_id} is already {row['state']}",
                confirmationId=confirmation_id,
                state=row["state"],
                reservationId=rid,
            )
        else:
            refusal = None
            await conn.execute(
                "UPDATE confirmations SET state = %s, decided_at = compute_now(),"
                " decided_by = %s WHERE id = %s",
                (verdict, person_id, confirmation_id),
            )
            if verdict == "denied":
                await conn.execute(
                    "UPDATE reservations SET state = 'denied', conditions = '[]',"
                    " version = version + 1, updated_at = compute_now(), failure = %s"
                    " WHERE id = %s AND state IN ('draft', 'awaiting-confirmation')",
                    (jsonb({"message": f"{person_id} denied the request"}), rid),
                )
            await journal.audit(
                conn,
                action=f"compute:confirmations:{'approve' if verdict == 'approved' else 'deny'}",
                outcome=verdict,
                resource_id=rid,
                actor=person_id,
                tenant_id=tenant_id,
                context={"confirmationId": confirmation_id, "action": row["action"]},
            )
            row = await _locked(conn, confirmation_id)
    if refusal is not None:
        raise refusal
    return _answer(row)


async def _locked(conn: Conn, confirmation_id: str) -> dict[str, Any]:
    row = await (
        await conn.execute(
            f"SELECT {_COLUMNS}{_FROM} WHERE c.id = %s FOR UPDATE OF c", (confirmation_id,)
        )
    ).fetchone()
    assert row is not None
    return dict(row)


async def expire_late(
    db: Database, *, reservation_id: str, idempotency_id: str, claim: str
) -> None:
    """A retry found the deadline passed: expire the reservation (if still awaiting) and give
    the claim back, in one transaction."""
    async with db.transaction() as conn:
        await conn.execute("SELECT 1 FROM reservations WHERE id = %s FOR UPDATE", (reservation_id,))
        await expire_due(conn, reservation_id)
        await conn.execute(
            "UPDATE idempotency SET claim = NULL, claimed_at = NULL, claim_holder = NULL"
            " WHERE id = %s AND claim = %s",
            (idempotency_id, claim),
        )


async def expire_due(conn: Conn, reservation_id: str) -> bool:
    """In the caller's transaction, the reservation's row locked by it: when it awaits a
    confirmation whose deadline passed, it becomes ``expired``. Returns whether it did."""
    row = await (
        await conn.execute(
            "SELECT c.id FROM confirmations c JOIN reservations r ON r.id = c.reservation_id"
            " WHERE c.reservation_id = %s AND r.state = 'awaiting-confirmation'"
            "   AND c.state IN ('pending', 'approved') AND c.expires_at <= compute_now()"
            " ORDER BY c.expires_at LIMIT 1 FOR UPDATE OF c",
            (reservation_id,),
        )
    ).fetchone()
    if row is None:
        return False
    await _expire(conn, reservation_id=reservation_id, confirmation_id=row["id"])
    return True


async def _expire(conn: Conn, *, reservation_id: str, confirmation_id: str) -> None:
    """The confirmation and (when still awaiting it) its reservation expire: event and audit."""
    await conn.execute(
        "UPDATE confirmations SET state = 'expired' WHERE id = %s AND state IN"
        " ('pending', 'approved')",
        (confirmation_id,),
    )
    moved = await (
        await conn.execute(
            "UPDATE reservations SET state = 'expired', conditions = '[]', version = version + 1,"
            " updated_at = compute_now(), failure = %s"
            " WHERE id = %s AND state = 'awaiting-confirmation' RETURNING pool_id, tenant_id",
            (
                jsonb(
                    {
                        "message": f"confirmation {confirmation_id} was not given before its"
                        " deadline; the request expired"
                    }
                ),
                reservation_id,
            ),
        )
    ).fetchone()
    if moved is None:
        return
    await journal.emit(
        conn,
        "reservation.expired",
        reservation_id=reservation_id,
        data={
            "state": states.State.EXPIRED.value,
            "poolId": moved["pool_id"],
            "confirmationId": confirmation_id,
        },
    )
    await journal.audit(
        conn,
        action="compute:reservations:create",
        outcome="expired",
        resource_id=reservation_id,
        tenant_id=moved["tenant_id"],
        context={"confirmationId": confirmation_id},
    )
