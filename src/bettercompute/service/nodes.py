"""The node side of the service: what a node should hold now.

Why a service of its own: a node agent (the simulator's, later the device plugin's) needs one
read the reservation API does not offer, its node's desired allocations. It reports back
through ``ReservationService.report``, the same call every node uses. The only writes here
are revocations of node certificates (attested bindings): after one, no report signed with a
revoked certificate binds anything.
"""

from __future__ import annotations

from typing import Any

from bettercompute.kube import allocations
from bettercompute.store import desired, reports
from bettercompute.store.database import Database


class NodeService:
    """Reads for node agents, over one database."""

    def __init__(self, db: Database):
        self.db = db

    async def desired(self, node_id: str) -> list[dict[str, Any]]:
        """The node's allocations to bind or keep, and those to free (``release: true``), as
        DeviceAllocation ``spec``s (``kube.allocations.AllocationSpec``): the operator writes
        them as objects, a simulated node hands them to its agent as they are."""
        rows = await desired.for_node(self.db, node_id=node_id)
        return [allocations.allocation_spec(row, node=node_id) for row in rows]

    async def nodes_of(self, reservation_id: str) -> list[str]:
        """The nodes ``reservation_id`` has allocations on."""
        return await desired.nodes_of(self.db, reservation_id=reservation_id)

    async def node_ids(self) -> list[str]:
        """Every node the database knows."""
        return await desired.node_ids(self.db)

    async def revoke_node_certificates(self, node_id: str) -> None:
        """Every certificate issued to ``node_id`` until now stops counting (the node was
        removed or is no longer trusted); certificates issued later count again."""
        await reports.revoke_node_certificates(self.db, node_id=node_id)

    async def revoke_certificate(self, serial: int) -> None:
        """The one certificate with ``serial`` stops counting."""
        await reports.revoke_certificate(self.db, serial=serial)
