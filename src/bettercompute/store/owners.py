"""Which Kubernetes object owns a stored reservation: one row per reservation, first claim wins.

Why a table and not a look at the objects: two operator replicas may admit two objects that
name the same reservation at the same moment; only a primary key in the database settles that
atomically. An object recreated under the same namespace and name (a new uid: the old one is
gone, Kubernetes never holds two objects by one name) takes its row over.

It is also what the pod webhooks trust for "whose is this reservation": a row is written only
by the operator, after it admitted the object, so it names the namespace that really owns a
reservation, whatever a Reservation's status (which a tenant may be able to write) says.

What it must never do: delete a claim. The row outlives its object so that another object
with the same key stays refused instead of adopting the released reservation.
"""

from __future__ import annotations

from dataclasses import dataclass

from bettercompute.core import ids
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


_COLUMNS = "reservation_id, object_uid, namespace, name"


async def read(db: Database, reservation_id: str) -> Owner | None:
    """The object that owns ``reservation_id``, or ``None`` when no object claimed it."""
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                f"SELECT {_COLUMNS} FROM kube_owners WHERE reservation_id = %s", (reservation_id,)
            )
        ).fetchone()
    return None if row is None else Owner(**row)


async def of_resource(db: Database, resource: str) -> Owner | None:
    """The object owning the reservation advertised as ``resource`` (``bcd.dev/rsv-…``), or
    ``None``: no such reservation, or (never seen: 120 bits) two whose names collide."""
    body = resource.removeprefix(ids.RESERVATION_RESOURCE_PREFIX)
    if body == resource or not body.isascii() or not body.isalnum() or body != body.lower():
        return None
    async with db.connection() as conn:
        # A refusal's path only (a pod asking a resource that is not its own Reservation's):
        # a scan of the claims is fine there.
        rows = await (
            await conn.execute(
                f"SELECT {_COLUMNS} FROM kube_owners WHERE starts_with(reservation_id, %s)",
                ("rsv_" + body,),
            )
        ).fetchall()
    found = [
        Owner(**r) for r in rows if ids.reservation_resource_name(r["reservation_id"]) == resource
    ]
    return found[0] if len(found) == 1 else None
