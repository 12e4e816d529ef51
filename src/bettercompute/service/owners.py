"""Which Kubernetes object a stored reservation belongs to, for the operator.

Why: two Reservation objects with the same idempotency key and request (same tenant, same
requester) name the same stored reservation. Only one may act for it: the other is refused, so
deleting it can never release the first object's reservation. The store settles who came
first in one row, atomically across operator replicas.

The pod webhooks ask it whose a reservation (or a reservation's resource name) is, and the
operator whether a Reservation's ``status.id`` is really its own before it acts on it or
projects onto it: the claim is written by the operator alone, from the service's answers,
never from a field a tenant can write.

What it must never do: touch the reservation itself. The HTTP API's same-key replay does not
come through here and keeps the guide's behaviour.
"""

from __future__ import annotations

from bettercompute.store import owners
from bettercompute.store.database import Database
from bettercompute.store.owners import Owner

__all__ = ["Owner", "ReservationOwners"]


class ReservationOwners:
    """Claims of stored reservations by Kubernetes objects, over one database."""

    def __init__(self, db: Database):
        self.db = db

    async def claim(
        self, reservation_id: str, *, object_uid: str, namespace: str, name: str
    ) -> Owner:
        """The object that owns ``reservation_id``: this one, unless another claimed it first
        (an object recreated under the same namespace and name is the same claimant)."""
        return await owners.claim(
            self.db,
            reservation_id=reservation_id,
            object_uid=object_uid,
            namespace=namespace,
            name=name,
        )

    async def owner(self, reservation_id: str) -> Owner | None:
        """The object that claimed ``reservation_id``, if any."""
        return await owners.read(self.db, reservation_id)

    async def owns(
        self, reservation_id: str, *, object_uid: str, namespace: str, name: str
    ) -> bool:
        """Whether the store's claim of ``reservation_id`` names exactly this object (its
        namespace, name and uid): the one test of a reservation id read from a status, which a
        tenant may be able to write."""
        owner = await owners.read(self.db, reservation_id)
        return owner is not None and (owner.namespace, owner.name, owner.object_uid) == (
            namespace,
            name,
            object_uid,
        )

    async def owner_of_resource(self, resource: str) -> Owner | None:
        """The object that owns the reservation advertised as ``resource``, if any."""
        return await owners.of_resource(self.db, resource)
