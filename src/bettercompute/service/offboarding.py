"""Owner offboarding: what compute does when IAM says a person left a tenant.

The guide lists ``reservation.reassigned``: "an offboarded owner's reservation handed to the
successor, with ``reservationId``, ``from``, ``to`` and ``reason``". IAM decides who leaves and
who takes over; this is the use case its event calls (the ``dev`` stack and tests call it
directly). Kubernetes ownership of a reservation (which object acts for it) is a different
matter, kept by ``service/owners.py``, and is not changed here.

What it must never do: decide policy, or reassign across tenants.
"""

from __future__ import annotations

from bettercompute.core import errors
from bettercompute.store import offboarding
from bettercompute.store.database import Database


class Offboarding:
    """Reassigns an offboarded identity's live reservations, over one database."""

    def __init__(self, db: Database):
        self.db = db

    async def offboard(
        self, *, tenant_id: str, identity_id: str, successor_id: str, reason: str = "offboarded"
    ) -> list[str]:
        """Hand ``identity_id``'s live reservations in ``tenant_id`` to ``successor_id``; the
        ids handed over (none when there is nothing left to move: safe to repeat)."""
        if not successor_id or successor_id == identity_id:
            raise errors.invalid_input(
                "successorId", "the successor must be another identity than the one leaving"
            )
        return await offboarding.reassign(
            self.db,
            tenant_id=tenant_id,
            from_identity=identity_id,
            to_identity=successor_id,
            reason=reason,
        )
