"""What a cluster says it has: tenants, pools, their offers and quotas, budgets, nodes and devices.

Why a service of its own: the operator learns the world from ``GPUPool`` and ``GPUNode``
objects, and ``dev`` from its configuration file; both must write it where the placer reads it,
without speaking SQL, and in the same way. Every call is an upsert, so either may replay its
whole world at any time (a resume, a second replica, a restart on the same state dir) and
change nothing.

What it must never do: delete history. A pool that goes away is archived, a node that goes
away is marked not ready and not connected; their bookings stay.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bettercompute.core.inventories import NodeSpec
from bettercompute.core.pools import Offer, Pool, PoolDefinition, Quota
from bettercompute.store import capacity, desired, inventory, queries, quotas
from bettercompute.store import pools as stored_pools
from bettercompute.store.database import Database


class ClusterService:
    """Tenant, pool and node writes for the operator and ``dev``, over one database."""

    def __init__(self, db: Database):
        self.db = db

    async def ensure_root_tenant(self, tenant_id: str) -> None:
        """The platform team's tenant, whose members pass every tenant pre-check."""
        await inventory.upsert_tenant(self.db, tenant_id=tenant_id, name=tenant_id, root=True)

    async def root_tenant(self) -> str | None:
        """The root tenant's id, if there is one."""
        return await queries.root_tenant(self.db)

    async def put_tenant(self, tenant_id: str, *, name: str = "", root: bool = False) -> None:
        await inventory.upsert_tenant(self.db, tenant_id=tenant_id, name=name, root=root)

    async def put_pool(self, pool: Pool) -> None:
        """The pool's own row; its offers stay as they are."""
        await inventory.upsert_pool(
            self.db,
            pool_id=pool.id,
            owner_tenant_id=pool.owner,
            region=pool.region,
            gpu_model=pool.model,
            sharing_mode=pool.sharing,
            replicas=pool.replicas,
            policy=pool.policy.as_json(),
            archived=pool.archived,
            name=pool.name,
        )

    async def put_offer(self, offer: Offer) -> None:
        await inventory.set_offer(
            self.db,
            pool_id=offer.pool,
            tenant_id=offer.tenant,
            on_budget_exceeded=offer.onBudgetExceeded,
        )

    async def put_quota(self, quota: Quota) -> None:
        await inventory.set_quota(
            self.db, tenant_id=quota.tenant, resource=quota.resource, limit=quota.limit
        )

    async def apply_quota(self, tenant_id: str, limits: Mapping[str, int]) -> None:
        """The tenant's quota is exactly ``limits`` (a ``GPUQuota``): resources it does not
        name grant 0 from now on; charges already made stay until their reservations end."""
        await inventory.ensure_tenant(self.db, tenant_id=tenant_id)
        await inventory.replace_quotas(self.db, tenant_id=tenant_id, limits=limits)

    async def quotas_of(self, tenant_id: str) -> list[dict[str, Any]]:
        """The tenant's quota rows: ``{resource, limit, used}``."""
        return await quotas.of_tenant(self.db, tenant_id=tenant_id)

    async def put_budget(self, tenant_id: str, *, gpu_hours: float, window_seconds: int) -> None:
        await inventory.set_budget(
            self.db, tenant_id=tenant_id, gpu_hours=gpu_hours, window_seconds=window_seconds
        )

    async def apply_pool(self, definition: PoolDefinition) -> None:
        """The pool, offered to exactly its offers' tenants (others lose it), and its quotas;
        tenants it names that do not exist yet are created, named by their ids."""
        pool = definition.pool
        tenants = {
            pool.owner,
            *(o.tenant for o in definition.offers),
            *(q.tenant for q in definition.quotas),
        }
        for tenant_id in sorted(tenants):
            await inventory.ensure_tenant(self.db, tenant_id=tenant_id)
        await self.put_pool(pool)
        offers = {o.tenant: o.onBudgetExceeded for o in definition.offers}
        await inventory.replace_offers(self.db, pool_id=pool.id, offers=offers)
        for quota in definition.quotas:
            await self.put_quota(quota)

    async def kubernetes_api(self, pool_id: str) -> str | None:
        """The pool's ``policy.kubernetes.api`` as stored (``devicePlugin`` or ``dra``), or
        ``None`` for an unknown pool: the operator's claim templates follow it."""
        return await stored_pools.kubernetes_api(self.db, pool_id=pool_id)

    async def pool_capacity(self, pool_id: str) -> dict[str, Any] | None:
        """What the pool holds now (``store.capacity``), or ``None`` for an unknown pool."""
        found = await capacity.pools(self.db, tenant_id=None, pool_id=pool_id)
        return found[0] if found else None

    async def archive_pool(self, pool_id: str) -> None:
        await inventory.archive_pool(self.db, pool_id=pool_id)

    async def apply_node(self, node: NodeSpec) -> None:
        await inventory.upsert_node(self.db, node)

    async def node_ids(self) -> list[str]:
        """Every node the database knows, so a writer can tell which it no longer runs."""
        return await desired.node_ids(self.db)

    async def node_gone(self, node_id: str) -> None:
        """The node's object was deleted: nothing new is placed there; bookings stay."""
        await inventory.set_node_status(self.db, node_id=node_id, ready=False, connected=False)
