"""What each pool holds right now: nodes, and devices by class (total, healthy, booked, free).

Why: nobody should learn that a pool is full from a refusal. ``pools.list`` answers it for a
tenant's pools, the operator writes it into each GPUPool's status, and the CLI prints it.

What it must never do: write, or lock anything a create waits on (it reads under ``READ
COMMITTED``, one statement, no pool lock: a figure may be a moment old, never inconsistent
within a pool).
"""

from __future__ import annotations

from typing import Any

from bettercompute.store.database import Database

_CAPACITY = """
    SELECT p.id, p.name, p.region, p.gpu_model, p.sharing_mode, p.owner_tenant_id,
           (SELECT count(*) FROM nodes n WHERE n.pool_id = p.id) AS nodes,
           (SELECT count(*) FROM nodes n
             WHERE n.pool_id = p.id AND n.ready AND n.connected) AS nodes_ready,
           a.kind,
           count(a.id) AS total,
           count(a.id) FILTER (WHERE a.healthy) AS healthy,
           count(a.id) FILTER (WHERE b.atom_id IS NOT NULL) AS booked,
           count(a.id) FILTER (WHERE b.bound) AS bound,
           count(a.id) FILTER (WHERE a.healthy AND b.atom_id IS NULL AND n.ready
                                 AND n.connected) AS free,
           min(b.ends) AS next_end
      FROM pools p
      LEFT JOIN nodes n ON n.pool_id = p.id
      LEFT JOIN atoms a ON a.node_id = n.id AND NOT a.retired
      LEFT JOIN LATERAL (
          SELECT bk.atom_id, upper(bk.during) AS ends,
                 EXISTS (SELECT 1 FROM reservations r
                          WHERE r.id = bk.reservation_id AND r.state = 'active') AS bound
            FROM bookings bk
           WHERE bk.atom_id = a.id AND bk.during @> compute_now() LIMIT 1
      ) b ON true
     WHERE NOT p.archived AND (%(tenant)s::text IS NULL OR p.owner_tenant_id = %(tenant)s
           OR EXISTS (SELECT 1 FROM offers o WHERE o.pool_id = p.id AND o.tenant_id = %(tenant)s))
       AND (%(pool)s::text IS NULL OR p.id = %(pool)s)
     GROUP BY p.id, a.kind
     ORDER BY p.id, a.kind
"""


async def pools(
    db: Database, *, tenant_id: str | None, pool_id: str | None = None
) -> list[dict[str, Any]]:
    """The pools ``tenant_id`` owns or is offered (every pool for ``None``), each as
    ``{poolId, name, region, gpuModel, sharing, nodes, nodesReady, devices: {class: {total,
    healthy, booked, bound, free}}, nextFreeAt}``: ``booked`` counts devices booked now (of
    them ``bound``: held by an active reservation), ``free``
    those healthy, unbooked and on a ready node; ``nextFreeAt`` (epoch ms) is when the first
    booked device frees, given only when none is free now."""
    async with db.connection() as conn:
        rows = await (
            await conn.execute(_CAPACITY, {"tenant": tenant_id, "pool": pool_id})
        ).fetchall()
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        pool = out.setdefault(
            row["id"],
            {
                "poolId": row["id"],
                "name": row["name"] or row["id"],
                "region": row["region"],
                "gpuModel": row["gpu_model"],
                "sharing": row["sharing_mode"],
                "nodes": int(row["nodes"]),
                "nodesReady": int(row["nodes_ready"]),
                "devices": {},
                "_next": None,
            },
        )
        if row["kind"] is None:
            continue
        pool["devices"][row["kind"]] = {
            "total": int(row["total"]),
            "healthy": int(row["healthy"]),
            "booked": int(row["booked"]),
            "bound": int(row["bound"]),
            "free": int(row["free"]),
        }
        if row["next_end"] is not None:
            ends = int(row["next_end"].timestamp() * 1000)
            pool["_next"] = ends if pool["_next"] is None else min(pool["_next"], ends)
    answer = []
    for pool in out.values():
        following = pool.pop("_next")
        if not any(d["free"] for d in pool["devices"].values()) and following is not None:
            pool["nextFreeAt"] = following
        answer.append(pool)
    return answer
