"""Which Kubernetes object owns a stored reservation: one row per reservation, first claim wins.

Why a table and not a look at the objects: two operator replicas may admit two objects that
name the same reservation at the same moment; only a primary key in the database settles that
atomically. An object recreated under the same namespace and name (a new uid: the old one is
gone, Kubernetes never holds two objects by one name) takes its row over.

What it must never do: delete a claim. The row outlives its object so that another object
with the same key stays refused instead of adopting the released reservation.
"""

from __future__ import annotations

from dataclasses import dataclass

from bettercompute.core.errors import StoreError
from bettercompute.store.database import Database

#: A claim racing its own row's removal (the reservation row deleted) reads nothing back; a
#: retry or two then inserts afresh.
_ATTEMPTS = 3


@dataclass(frozen=True)
class Owner:
    reservation_id: str
    object_uid: str
    namespace: str
    name: str


async def claim(
    db: Database, *, reservation_id: str, object_uid: str, namespace: str, name: str
) -> Owner:
    """Record the object as the reservation's owner unless another holds it; the owner."""
    for _ in range(_ATTEMPTS):
        async with db.connection() as conn:
            # ON CONFLICT waits for a concurrent claim to commit, then sees it: exactly one
            # insert wins. The update only moves a row to the same namespace/name's new uid.
            won = await (
                await conn.execute(
                    "INSERT INTO kube_owners (reservation_id, object_uid, namespace, name)"
                    " VALUES (%s, %s, %s, %s)"
                    " ON CONFLICT (reservation_id) DO UPDATE SET object_uid = EXCLUDED.object_uid"
                    " WHERE kube_owners.namespace = EXCLUDED.namespace"
                    "   AND kube_owners.name = EXCLUDED.name"
                    " RETURNING reservation_id, object_uid, namespace, name",
                    (reservation_id, object_uid, namespace, name),
                )
            ).fetchone()
            # Another object holds it: read it in a new statement, whose snapshot sees the
            # concurrent claim the insert waited for.
            row = (
                won
                or await (
                    await conn.execute(
                        "SELECT reservation_id, object_uid, namespace, name FROM kube_owners"
                        " WHERE reservation_id = %s",
                        (reservation_id,),
                    )
                ).fetchone()
            )
        if row is not None:
            return Owner(**row)
    raise StoreError(f"could not record the owner of {reservation_id}")
