"""What a cluster says it has: pools, their offers and quotas, nodes and their devices.

Why a service of its own: the operator learns the world from ``GPUPool`` and ``GPUNode``
objects and must write it where the placer reads it, without speaking SQL. Every call is an
upsert, so the operator may replay any object at any time (a resume, a second replica) and
change nothing.

What it must never do: delete history. A pool that goes away is archived, a node that goes
away is marked not ready and not connected; their bookings stay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bettercompute.core.inventories import NodeSpec
from bettercompute.store import inventory
from bettercompute.store.database import Database


@dataclass(frozen=True)
class Quota:
    tenant_id: str
    resource: str
    limit: int


@dataclass(frozen=True)
class PoolDefinition:
    """A pool as a ``GPUPool`` describes it."""

    pool_id: str
    owner_tenant_id: str
    region: str
    gpu_model: str | None
    sharing_mode: str = "exclusive"
    replicas: int = 1
    policy: Mapping[str, Any] = field(default_factory=dict)
    archived: bool = False
    name: str = ""
    #: tenant → ``onBudgetExceeded`` (or ``None``): exactly the tenants it is offered to.
    offers: Mapping[str, str | None] = field(default_factory=dict)
    quotas: Sequence[Quota] = ()


class ClusterService:
    """Pool and node writes for the operator, over one database."""

    def __init__(self, db: Database):
        self.db = db

    async def ensure_root_tenant(self, tenant_id: str) -> None:
        """The platform team's tenant, whose members pass every tenant pre-check."""
        await inventory.upsert_tenant(self.db, tenant_id=tenant_id, name=tenant_id, root=True)

    async def apply_pool(self, pool: PoolDefinition) -> None:
        tenants = {pool.owner_tenant_id, *pool.offers, *(q.tenant_id for q in pool.quotas)}
        for tenant_id in sorted(tenants):
            await inventory.ensure_tenant(self.db, tenant_id=tenant_id)
        await inventory.upsert_pool(
            self.db,
            pool_id=pool.pool_id,
            owner_tenant_id=pool.owner_tenant_id,
            region=pool.region,
            gpu_model=pool.gpu_model,
            sharing_mode=pool.sharing_mode,
            replicas=pool.replicas,
            policy=pool.policy,
            archived=pool.archived,
            name=pool.name,
        )
        await inventory.replace_offers(self.db, pool_id=pool.pool_id, offers=pool.offers)
        for quota in pool.quotas:
            await inventory.set_quota(
                self.db, tenant_id=quota.tenant_id, resource=quota.resource, limit=quota.limit
            )

    async def archive_pool(self, pool_id: str) -> None:
        await inventory.archive_pool(self.db, pool_id=pool_id)

    async def apply_node(self, node: NodeSpec) -> None:
        await inventory.upsert_node(self.db, node)

    async def node_gone(self, node_id: str) -> None:
        """The node's object was deleted: nothing new is placed there; bookings stay."""
        await inventory.set_node_status(self.db, node_id=node_id, ready=False, connected=False)
