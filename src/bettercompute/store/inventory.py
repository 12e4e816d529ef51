"""Writing the world the placer works on: tenants, pools, offers, quotas, budgets, nodes, atoms.

Called by configuration loading (``dev``), the operator's GPUPool/GPUNode sync and tests.
Every write is an upsert, so applying the same configuration twice changes nothing.
Inventory changes that can free or break capacity wake the reservations that care.

What it must never do: change how a pool's ``kubernetes`` bindings reach pods
(``policy.kubernetes.api``) while a live reservation uses the pool: its nodes hold devices
the way the old api handed them out, so the switch is refused in the same transaction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bettercompute.core import errors, pools, states
from bettercompute.core.inventories import AtomSpec as AtomSpec
from bettercompute.core.inventories import NodeSpec as NodeSpec
from bettercompute.store import journal, placing
from bettercompute.store.database import Conn, Database, jsonb


async def upsert_tenant(
    db: Database, *, tenant_id: str, name: str = "", root: bool = False
) -> None:
    async with db.transaction() as conn:
        await conn.execute(
            "INSERT INTO tenants (id, name, is_root) VALUES (%s, %s, %s)"
            " ON CONFLICT (id) DO UPDATE SET name = excluded.name, is_root = excluded.is_root",
            (tenant_id, name, root),
        )


async def ensure_tenant(db: Database, *, tenant_id: str) -> None:
    """The tenant exists, named by its id unless it already has a name; never demotes a root."""
    async with db.transaction() as conn:
        await conn.execute(
            "INSERT INTO tenants (id, name) VALUES (%s, %s) ON CONFLICT (id) DO NOTHING",
            (tenant_id, tenant_id),
        )


async def upsert_pool(
    db: Database,
    *,
    pool_id: str,
    owner_tenant_id: str,
    region: str,
    gpu_model: str | None,
    sharing_mode: str = "exclusive",
    replicas: int = 1,
    policy: Mapping[str, Any] | None = None,
    archived: bool = False,
    name: str = "",
) -> None:
    """Write the pool's row; INVALID_STATE naming ``policy.kubernetes.api`` when that would
    change while a live reservation uses the pool (its row is then unchanged)."""
    async with db.transaction() as conn:
        await _refuse_api_switch(conn, pool_id=pool_id, policy=policy)
        await conn.execute(
            "INSERT INTO pools (id, owner_tenant_id, name, region, gpu_model, sharing_mode,"
            " replicas, archived, policy) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)"
            " ON CONFLICT (id) DO UPDATE SET owner_tenant_id = excluded.owner_tenant_id,"
            " name = excluded.name, region = excluded.region, gpu_model = excluded.gpu_model,"
            " sharing_mode = excluded.sharing_mode, replicas = excluded.replicas,"
            " archived = excluded.archived, policy = excluded.policy,"
            " updated_at = compute_now()",
            (
                pool_id,
                owner_tenant_id,
                name,
                region,
                gpu_model,
                sharing_mode,
                replicas,
                archived,
                jsonb(dict(policy or {})),
            ),
        )
        # The per-GPU share and the nodes' bookable CPUs read the pool's hostReserve, which
        # this may have changed: a new version makes placers read the nodes again.
        await conn.execute(
            "UPDATE pools SET host_share = coalesce(bc_pool_host_share(id), '{}'),"
            " inventory_version = nextval('inventory_versions') WHERE id = %s",
            (pool_id,),
        )
        if archived:
            await journal.wake_pending(conn, pool_id=pool_id)


#: A reservation in one of these states holds, or may still come to hold, devices through the
#: pool's api; only the others (ended, or a draft not yet decided) let the api change.
_NOT_LIVE = sorted({*states.TERMINAL, states.State.DRAFT})


async def _refuse_api_switch(conn: Conn, *, pool_id: str, policy: Mapping[str, Any] | None) -> None:
    # The pool lock first (the order of store/locking.py): an admission placing in this pool
    # holds it, so a reservation is either counted here or placed after the new api is kept.
    await placing.lock_pool(conn, pool_id)
    row = await (
        await conn.execute("SELECT policy FROM pools WHERE id = %s FOR UPDATE", (pool_id,))
    ).fetchone()
    if row is None:
        return
    was, wanted = pools.kubernetes_api(row["policy"]), pools.kubernetes_api(policy)
    if was == wanted:
        return
    live = await (
        await conn.execute(
            "SELECT id, state FROM reservations WHERE pool_id = %s AND state <> ALL(%s)"
            " ORDER BY created_at, id LIMIT 5",
            (pool_id, [str(s) for s in _NOT_LIVE]),
        )
    ).fetchall()
    if live:
        shown = ", ".join(f"{r['id']} ({r['state']})" for r in live)
        raise errors.invalid_state(
            f"policy.kubernetes.api: pool {pool_id} stays '{was}' while live reservations use"
            f" it ({shown}); switch to '{wanted}' once they are released, cancelled or expired",
            field="policy.kubernetes.api",
            poolId=pool_id,
            api=was,
            reservations=[r["id"] for r in live],
        )


async def set_offer(
    db: Database,
    *,
    pool_id: str,
    tenant_id: str,
    offered: bool = True,
    on_budget_exceeded: str | None = None,
) -> None:
    async with db.transaction() as conn:
        if offered:
            await conn.execute(
                "INSERT INTO offers (pool_id, tenant_id, on_budget_exceeded) VALUES (%s, %s, %s)"
                " ON CONFLICT (pool_id, tenant_id) DO UPDATE"
                " SET on_budget_exceeded = excluded.on_budget_exceeded",
                (pool_id, tenant_id, on_budget_exceeded),
            )
        else:
            await conn.execute(
                "DELETE FROM offers WHERE pool_id = %s AND tenant_id = %s", (pool_id, tenant_id)
            )
            await journal.wake_pending(conn, pool_id=pool_id)


async def replace_offers(db: Database, *, pool_id: str, offers: Mapping[str, str | None]) -> None:
    """The pool is offered to exactly these tenants (tenant → ``onBudgetExceeded``); a tenant
    no longer offered loses it at once, and the pool's pending reservations are woken to see."""
    async with db.transaction() as conn:
        await conn.execute(
            "DELETE FROM offers WHERE pool_id = %s AND NOT (tenant_id = ANY(%s))",
            (pool_id, list(offers)),
        )
        for tenant_id, on_budget_exceeded in offers.items():
            await conn.execute(
                "INSERT INTO offers (pool_id, tenant_id, on_budget_exceeded) VALUES (%s, %s, %s)"
                " ON CONFLICT (pool_id, tenant_id) DO UPDATE"
                " SET on_budget_exceeded = excluded.on_budget_exceeded",
                (pool_id, tenant_id, on_budget_exceeded),
            )
        await journal.wake_pending(conn, pool_id=pool_id)


async def archive_pool(db: Database, *, pool_id: str) -> None:
    """The pool takes no new work; its pending reservations fail with ``PoolGone``."""
    async with db.transaction() as conn:
        await conn.execute(
            "UPDATE pools SET archived = true, updated_at = compute_now() WHERE id = %s",
            (pool_id,),
        )
        await journal.wake_pending(conn, pool_id=pool_id)


async def set_quota(db: Database, *, tenant_id: str, resource: str, limit: int) -> None:
    async with db.transaction() as conn:
        await conn.execute(
            "INSERT INTO quotas (tenant_id, resource, limit_) VALUES (%s, %s, %s)"
            " ON CONFLICT (tenant_id, resource) DO UPDATE SET limit_ = excluded.limit_",
            (tenant_id, resource, limit),
        )


async def replace_quotas(db: Database, *, tenant_id: str, limits: Mapping[str, int]) -> None:
    """The tenant's limits are exactly ``limits``: each given resource set, every other row of
    the tenant set to 0 (a missing quota grants nothing, as a missing row does). What is charged
    (``used``) stays: reservations keep their charge until they end."""
    resources = sorted(limits)
    async with db.transaction() as conn:
        await conn.execute(
            "UPDATE quotas SET limit_ = 0 WHERE tenant_id = %s AND NOT (resource = ANY(%s))",
            (tenant_id, resources),
        )
        if resources:
            await conn.execute(
                "INSERT INTO quotas (tenant_id, resource, limit_)"
                " SELECT %s, r, n FROM unnest(%s::text[], %s::bigint[]) AS d(r, n)"
                " ON CONFLICT (tenant_id, resource) DO UPDATE SET limit_ = excluded.limit_",
                (tenant_id, resources, [limits[r] for r in resources]),
            )


async def quota(db: Database, *, tenant_id: str, resource: str) -> tuple[int, int] | None:
    """(limit, used) of one quota row, or ``None``."""
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT limit_, used FROM quotas WHERE tenant_id = %s AND resource = %s",
                (tenant_id, resource),
            )
        ).fetchone()
    return None if row is None else (int(row["limit_"]), int(row["used"]))


async def set_budget(
    db: Database, *, tenant_id: str, gpu_hours: float, window_seconds: int
) -> None:
    async with db.transaction() as conn:
        await conn.execute(
            "INSERT INTO budgets (tenant_id, gpu_hours, window_seconds) VALUES (%s, %s, %s)"
            " ON CONFLICT (tenant_id) DO UPDATE SET gpu_hours = excluded.gpu_hours,"
            " window_seconds = excluded.window_seconds",
            (tenant_id, gpu_hours, window_seconds),
        )


async def upsert_node(db: Database, node: NodeSpec) -> None:
    """The node and its atoms as inventoried now. Atoms that disappeared are retired (their
    bookings' history stays); a node or atom change wakes the reservations booked on it."""
    labels = {k: {"value": v, "source": src} for k, (v, src) in node.labels.items()}
    async with db.transaction() as conn:
        # Two writers of one new node (a GPUNode event and a GPUPool's re-apply, or two
        # replicas) would race on the name's unique index, which ON CONFLICT (id) cannot absorb.
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext('node:' || %s))", (node.id,))
        before = await (
            await conn.execute("SELECT pool_id FROM nodes WHERE id = %s FOR UPDATE", (node.id,))
        ).fetchone()
        # The pools' locks, as a placement holds them: a reservation being admitted either sees
        # this node as written here, or is pending already when the wake-up below looks.
        await _lock_pools(conn, [before["pool_id"] if before else None, node.pool_id])
        await conn.execute(
            "INSERT INTO nodes (id, name, pool_id, labels, ready, connected, resources,"
            " foreign_exposure) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
            " ON CONFLICT (id) DO UPDATE SET name = excluded.name, pool_id = excluded.pool_id,"
            " labels = excluded.labels, ready = excluded.ready, connected = excluded.connected,"
            " resources = excluded.resources, foreign_exposure = excluded.foreign_exposure,"
            " updated_at = compute_now()",
            (
                node.id,
                node.name,
                node.pool_id,
                jsonb(labels),
                node.ready,
                node.connected,
                jsonb(dict(node.resources)),
                node.foreign_exposure,
            ),
        )
        await conn.execute(
            """
            INSERT INTO atoms (id, node_id, kind, device_id, parent_gpu, profile, numa_node,
                               nvlink_domain, healthy)
            SELECT 'atom_' || md5(%s || '/' || a.device_id), %s, a.kind, a.device_id,
                   a.parent_gpu, a.profile, a.numa_node, a.nvlink_domain, a.healthy
              FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::int[], %s::text[],
                          %s::bool[])
                   AS a(device_id, kind, parent_gpu, profile, numa_node, nvlink_domain, healthy)
            ON CONFLICT (node_id, device_id) DO UPDATE SET kind = excluded.kind,
                parent_gpu = excluded.parent_gpu, profile = excluded.profile,
                numa_node = excluded.numa_node, nvlink_domain = excluded.nvlink_domain,
                healthy = excluded.healthy, retired = false
            """,
            (
                node.id,
                node.id,
                [a.device_id for a in node.atoms],
                [a.kind for a in node.atoms],
                [a.parent_gpu or a.device_id for a in node.atoms],
                [a.profile for a in node.atoms],
                [a.numa_node for a in node.atoms],
                [a.nvlink_domain for a in node.atoms],
                [a.healthy for a in node.atoms],
            ),
        )
        await conn.execute(
            "UPDATE atoms SET retired = true WHERE node_id = %s AND NOT (device_id = ANY(%s))",
            (node.id, [a.device_id for a in node.atoms]),
        )
        rows = host_rows(node.resources)
        await conn.execute(
            "DELETE FROM host_resources WHERE node_id = %s AND NOT (resource = ANY(%s))",
            (node.id, list(rows)),
        )
        await conn.execute(
            "INSERT INTO host_resources (node_id, resource, capacity)"
            " SELECT %s, r.resource, r.capacity FROM unnest(%s::text[], %s::bigint[])"
            " AS r(resource, capacity)"
            " ON CONFLICT (node_id, resource) DO UPDATE SET capacity = excluded.capacity",
            (node.id, list(rows), list(rows.values())),
        )
        old_pool = before["pool_id"] if before else None
        if old_pool != node.pool_id and node.pool_id is not None:
            await conn.execute(
                "UPDATE bookings b SET pool_id = %s FROM atoms a"
                " WHERE a.id = b.atom_id AND a.node_id = %s",
                (node.pool_id, node.id),
            )
        await _bump(conn, [p for p in (old_pool, node.pool_id) if p is not None])
        await _wake_node(conn, node.id)


async def set_atom_health(db: Database, *, node_id: str, device_id: str, healthy: bool) -> None:
    async with db.transaction() as conn:
        await _lock_node_pool(conn, node_id)
        await conn.execute(
            "UPDATE atoms SET healthy = %s WHERE node_id = %s AND device_id = %s",
            (healthy, node_id, device_id),
        )
        await _bump_node_pool(conn, node_id)
        await _wake_node(conn, node_id)


async def set_node_status(
    db: Database, *, node_id: str, ready: bool | None = None, connected: bool | None = None
) -> None:
    async with db.transaction() as conn:
        await _lock_node_pool(conn, node_id)
        await conn.execute(
            "UPDATE nodes SET ready = coalesce(%s, ready), connected = coalesce(%s, connected),"
            " updated_at = compute_now() WHERE id = %s",
            (ready, connected, node_id),
        )
        await _bump_node_pool(conn, node_id)
        await _wake_node(conn, node_id)


#: The host resources a node's inventory can make bookable.
HOST_RESOURCES = ("vcpu", "memoryGiB", "hugepages2Mi", "hugepages1Gi")


def host_rows(resources: Mapping[str, Any]) -> dict[str, int]:
    """A node's bookable host rows from its inventory: each known resource given as a whole
    number of at least 0; anything else (unknown keys, ``None``, a bool) makes no row."""
    rows: dict[str, int] = {}
    for name in HOST_RESOURCES:
        value = resources.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            rows[name] = value
    return rows


async def _lock_pools(conn: Any, pool_ids: list[str | None]) -> None:
    for pool_id in sorted({p for p in pool_ids if p is not None}):  # one order: no deadlock
        await placing.lock_pool(conn, pool_id)


async def _lock_node_pool(conn: Any, node_id: str) -> None:
    row = await (
        await conn.execute("SELECT pool_id FROM nodes WHERE id = %s", (node_id,))
    ).fetchone()
    await _lock_pools(conn, [row["pool_id"] if row else None])


async def _bump(conn: Any, pool_ids: list[str]) -> None:
    # Placers cache a pool's nodes and atoms by this version (see ``placing``); the per-GPU
    # share its hosts can give moves with them.
    await conn.execute(
        "UPDATE pools SET inventory_version = nextval('inventory_versions'),"
        " host_share = coalesce(bc_pool_host_share(id), '{}') WHERE id = ANY(%s)",
        (pool_ids,),
    )


async def _bump_node_pool(conn: Any, node_id: str) -> None:
    await conn.execute(
        "UPDATE pools SET inventory_version = nextval('inventory_versions')"
        " WHERE id = (SELECT pool_id FROM nodes WHERE id = %s)",
        (node_id,),
    )


async def _wake_node(conn: Any, node_id: str) -> None:
    # Connectivity and health changes wake the live reservations booked on the node, and
    # capacity that came back wakes the pending ones of its pool.
    await conn.execute(
        "INSERT INTO work_queue (reservation_id, due_at, why)"
        " SELECT DISTINCT r.id, compute_now(), 'node-changed'"
        "   FROM bookings b JOIN atoms a ON a.id = b.atom_id"
        "   JOIN reservations r ON r.id = b.reservation_id"
        "  WHERE a.node_id = %s AND upper(b.during) > compute_now()"
        "    AND r.state IN ('placed', 'binding', 'active')",
        (node_id,),
    )
    await conn.execute(
        "INSERT INTO work_queue (reservation_id, due_at, why)"
        " SELECT r.id, compute_now(), 'capacity-changed' FROM reservations r"
        "   JOIN nodes n ON n.pool_id = r.pool_id WHERE n.id = %s AND r.state = 'pending'",
        (node_id,),
    )


async def advance_clock(db: Database, *, seconds: float) -> None:
    """Move business time forward (tests and drills only): ``compute_now()`` reads the offset."""
    async with db.transaction() as conn:
        await conn.execute(
            "UPDATE compute_clock SET offset_ = offset_ + %s * interval '1 second'", (seconds,)
        )
