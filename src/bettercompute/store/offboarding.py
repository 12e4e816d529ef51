"""Handing an offboarded owner's reservations to a successor, in one transaction.

Why it exists: when a person leaves a tenant, their running reservations must not become
orphans that nobody may read, extend or release under owner-based policies (the policy
engine decides on ``resource.owner``). The reservations, and their rows in the authorization
projection, move to the successor together, and each move publishes
``reservation.reassigned`` (``reservationId``, ``from``, ``to``, ``reason``) in the same
transaction, with an audit row.

What it must never do: decide policy (the caller is IAM's event, already decided), move a
terminal reservation (its history keeps its owner), a draft (its id is derived from the old
identity's key and is the old identity's to retry), or another tenant's reservation.
"""

from __future__ import annotations

from bettercompute.core import states
from bettercompute.store import journal
from bettercompute.store.database import Database

#: States whose reservations are handed over: everything live, nothing terminal, no draft.
LIVE = tuple(
    s.value
    for s in states.State
    if s not in states.TERMINAL and s not in states.INTERNAL and s != states.State.DRAFT
)


async def reassign(
    db: Database, *, tenant_id: str, from_identity: str, to_identity: str, reason: str
) -> list[str]:
    """Move ``from_identity``'s live reservations in ``tenant_id`` to ``to_identity``; the ids
    moved, oldest first. Rows are taken in id order (``FOR UPDATE``), so two runs for the same
    person never deadlock, and a second run moves nothing."""
    async with db.transaction() as conn:
        rows = await (
            await conn.execute(
                "SELECT id, pool_id, state FROM reservations"
                " WHERE tenant_id = %s AND owner_identity_id = %s AND state = ANY(%s)"
                " ORDER BY id FOR UPDATE",
                (tenant_id, from_identity, list(LIVE)),
            )
        ).fetchall()
        moved = [r["id"] for r in rows]
        if not moved:
            return []
        await conn.execute(
            "UPDATE reservations SET owner_identity_id = %s, version = version + 1,"
            " updated_at = compute_now() WHERE id = ANY(%s)",
            (to_identity, moved),
        )
        await conn.execute(
            "UPDATE authz_resources SET owner_identity_id = %s WHERE id = ANY(%s)",
            (to_identity, moved),
        )
        for row in rows:
            await journal.emit(
                conn,
                "reservation.reassigned",
                reservation_id=row["id"],
                data={
                    "state": row["state"],
                    "poolId": row["pool_id"],
                    "reservationId": row["id"],
                    "from": from_identity,
                    "to": to_identity,
                    "reason": reason,
                },
            )
            await journal.audit(
                conn,
                action="offboard",
                outcome="reassigned",
                resource_id=row["id"],
                tenant_id=tenant_id,
                context={"from": from_identity, "to": to_identity, "reason": reason},
            )
        created = await (
            await conn.execute(
                "SELECT id FROM reservations WHERE id = ANY(%s) ORDER BY created_at, id", (moved,)
            )
        ).fetchall()
    return [r["id"] for r in created]
