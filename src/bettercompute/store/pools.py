"""Reading a pool as a tenant sees it: the pool's row and whether it is offered to the tenant.

Why here: admission, previews, the reconciler and the service all judge a request against the
same ``core.pools.PoolInfo``, built from one query; the operator asks a pool's Kubernetes api.
Never writes, never locks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bettercompute.core import errors, pools
from bettercompute.store.database import Conn, Database

_POOL = """
    SELECT p.id, p.owner_tenant_id, p.region, p.gpu_model, p.sharing_mode, p.replicas,
           p.archived, p.policy, o.tenant_id IS NOT NULL AS offered, o.on_budget_exceeded
      FROM pools p LEFT JOIN offers o ON o.pool_id = p.id AND o.tenant_id = %s
     WHERE p.id = %s
"""


async def read_pool(conn: Conn, *, pool_id: str, tenant_id: str) -> pools.PoolInfo | None:
    row = await (await conn.execute(_POOL, (tenant_id, pool_id))).fetchone()
    return None if row is None else pool_info(row)


async def host_share(conn: Conn, *, pool_id: str) -> dict[str, Any]:
    """The per-GPU share the pool's hosts can give (``{}`` when none has host rows)."""
    row = await (
        await conn.execute("SELECT host_share FROM pools WHERE id = %s", (pool_id,))
    ).fetchone()
    return dict(row["host_share"] or {}) if row is not None else {}


async def kubernetes_api(db: Database, *, pool_id: str) -> str | None:
    """How the pool's ``kubernetes`` bindings reach pods now (``policy.kubernetes.api``, with
    its default), ``None`` for an unknown pool. Read each time, never cached: the api may
    change once nothing live uses the pool."""
    async with db.connection() as conn:
        row = await (
            await conn.execute("SELECT policy FROM pools WHERE id = %s", (pool_id,))
        ).fetchone()
    return None if row is None else pools.kubernetes_api(row["policy"])


def pool_info(row: Mapping[str, Any]) -> pools.PoolInfo:
    """A ``PoolInfo`` from a row with the columns of ``_POOL`` (``bc_draft_begin`` has them)."""
    return pools.PoolInfo(
        id=row["id"],
        owner_tenant_id=row["owner_tenant_id"],
        region=row["region"],
        gpu_model=row["gpu_model"],
        sharing_mode=row["sharing_mode"],
        replicas=row["replicas"],
        archived=row["archived"],
        policy=pools.PoolPolicy.stored(row["policy"]),
        offered=row["offered"],
        on_budget_exceeded=row["on_budget_exceeded"],
    )


async def resolved_request(
    conn: Conn, *, tenant_id: str, request: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, int]]:
    """What a preview and a search both start with: the pool the tenant sees (``NOT_FOUND``
    otherwise), its class and binding rules (``core.pools.check_request``), and the request
    with the host resources a create would book, and its share."""
    pool_id = str(request["poolId"])
    pool = await read_pool(conn, pool_id=pool_id, tenant_id=tenant_id)
    if pool is None:
        raise errors.not_found("pool")
    pools.check_request(request=request, pool=pool, tenant_id=tenant_id)
    return pools.resolve_host(
        request, pool=pool, hosts_share=await host_share(conn, pool_id=pool_id)
    )
