"""Reading a pool's timeline: its nodes and devices, its bookings in a window, and the
caller's own reservations among them (``pools.timeline``).

Why it exists: the console draws every booking of a pool, and a pool of 200 nodes × 8 GPUs
holds 20,000 bookings over two weeks; reading them one reservation at a time, or as the guide's
reservation objects, would take seconds. Here it is four statements in one read-only snapshot:

1. the pool, if the tenant may see it, with the database's now and the end of its last booking
   (``bookings_pool_during``: only bookings that end after now are looked at);
2. the inventory (nodes left-joined to their atoms, ``nodes_pool``);
3. the bookings overlapping the window, grouped per reservation, node and window in the
   database (``bookings_pool_during``), so that 90,000 atom rows leave it as 20,000;
4. the details of the caller's own reservations among them, by primary key, and its pending
   ones (``reservations_pool_pending``).

Tenant filtering happens in the SQL: another tenant's booking leaves the database as node,
atoms and window only; its reservation's id, key, request and state are never selected.

What it must never do: write or lock anything (a figure may be a moment old, never
inconsistent: one ``REPEATABLE READ`` snapshot), or select another tenant's reservation's
columns.
"""

from __future__ import annotations

from typing import Any

from bettercompute.core import timelines
from bettercompute.store.database import Conn, Database, Row

_INVENTORY = """
    SELECT n.id AS node_id, n.name AS node_name, n.ready, n.connected,
           a.id AS atom_id, a.device_id, a.kind, a.parent_gpu, a.profile, a.healthy
      FROM nodes n
      LEFT JOIN atoms a ON a.node_id = n.id AND NOT a.retired
     WHERE n.pool_id = %(pool)s
     ORDER BY n.name, a.numa_node NULLS LAST, a.nvlink_domain NULLS LAST, a.parent_gpu,
              a.kind, a.profile NULLS FIRST, a.device_id
"""

# The pool as ``tenant`` sees it (``pools.list``'s rule: owned or offered, not archived), the
# database's now, and the end of the pool's last booking (only those ending after now are read).
_POOL = """
    SELECT p.name, p.gpu_model, p.sharing_mode, epoch_ms(compute_now()) AS now_ms,
           (SELECT epoch_ms(max(upper(b.during))) FROM bookings b
             WHERE b.pool_id = p.id AND b.during && tstzrange(compute_now(), NULL))
               AS last_end_ms
      FROM pools p
     WHERE p.id = %(pool)s AND NOT p.archived
       AND (p.owner_tenant_id = %(tenant)s
            OR EXISTS (SELECT 1 FROM offers o WHERE o.pool_id = p.id AND o.tenant_id = %(tenant)s))
"""

# One row per reservation, node and window. ``mine`` decides what else is selected: for
# another tenant's booking, nothing of its reservation.
_BOOKINGS = """
    SELECT a.node_id, array_agg(b.atom_id) AS atom_ids,
           epoch_ms(lower(b.during)) AS start_ms, epoch_ms(upper(b.during)) AS end_ms,
           CASE WHEN %(all)s OR r.tenant_id = %(tenant)s THEN r.id END AS rid
      FROM bookings b
      JOIN atoms a ON a.id = b.atom_id
      JOIN reservations r ON r.id = b.reservation_id
     WHERE b.pool_id = %(pool)s
       AND b.during && tstzrange(to_timestamp(%(from)s / 1000.0), to_timestamp(%(to)s / 1000.0))
     GROUP BY a.node_id, r.id, b.during
     ORDER BY lower(b.during), a.node_id
"""

# The caller's reservations of the bookings read, and its pending ones in the pool. The name
# a person knows it by: its Kubernetes object's, else its idempotency key.
_OWN = """
    SELECT r.id, r.state, coalesce(o.namespace || '/' || o.name, r.idempotency_key) AS name,
           coalesce((r.request ->> 'spot')::boolean, false) AS spot,
           (SELECT coalesce(sum((d ->> 'count')::int), 0)
              FROM jsonb_array_elements(r.request -> 'devices') d)
             * coalesce((r.request -> 'gang' ->> 'size')::int, 1) AS gpus,
           epoch_ms(lower(r.during)) AS start_ms, epoch_ms(upper(r.during)) AS end_ms,
           epoch_ms(r.requested_start) AS requested_start_ms,
           jsonb_strip_nulls(jsonb_build_object(
               'project', r.request ->> 'projectId',
               'binding', r.request ->> 'binding',
               'namespace', o.namespace)) AS labels
      FROM reservations r
      LEFT JOIN kube_owners o ON o.reservation_id = r.id
     WHERE (r.id = ANY(%(ids)s) AND (%(all)s OR r.tenant_id = %(tenant)s))
        OR (r.pool_id = %(pool)s AND r.state = 'pending'
            AND (%(all)s OR r.tenant_id = %(tenant)s))
     ORDER BY r.created_at, r.id
"""


async def read(
    db: Database, value: timelines.TimelineInput, *, tenant_id: str, everyone: bool
) -> dict[str, Any] | None:
    """The timeline's answer for ``tenant_id`` (``None`` when it cannot see the pool): the
    caller's own bookings named (everyone's with ``everyone``), the others ``busy``; all read
    in one snapshot. ``INVALID_INPUT`` for a window ``timelines.span`` refuses."""
    pool_id = value.poolId
    async with db.connection() as conn:
        await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        try:
            found = await _read(conn, _POOL, {"pool": pool_id, "tenant": tenant_id})
            if not found:
                return None
            pool = found[0]
            now_ms = int(pool["now_ms"])
            horizon_ms = timelines.horizon(now_ms=now_ms, last_end_ms=pool["last_end_ms"])
            from_ms, to_ms = timelines.span(value, now_ms=now_ms, horizon_ms=horizon_ms)
            atoms = await _read(conn, _INVENTORY, {"pool": pool_id})
            rows = await _read(
                conn,
                _BOOKINGS,
                {
                    "pool": pool_id,
                    "tenant": tenant_id,
                    "all": everyone,
                    "from": from_ms,
                    "to": to_ms,
                },
            )
            ids = sorted({row["rid"] for row in rows if row["rid"] is not None})
            own = await _read(
                conn, _OWN, {"ids": ids, "pool": pool_id, "tenant": tenant_id, "all": everyone}
            )
        finally:
            await conn.execute("ROLLBACK")
    nodes, index = timelines.nodes(atoms)
    bookings, reservations, pending = timelines.assemble(rows, own, index)
    return {
        "pool": {
            "id": pool_id,
            "name": pool["name"] or pool_id,
            "sharing": pool["sharing_mode"],
            "model": pool["gpu_model"],
            "horizon": horizon_ms,
        },
        "now": now_ms,
        "from": from_ms,
        "to": to_ms,
        "nodes": nodes,
        "bookings": bookings,
        "states": list(timelines.STATES),
        "reservations": reservations,
        "pending": pending,
    }


async def _read(conn: Conn, sql: str, params: dict[str, Any]) -> list[Row]:
    return await (await conn.execute(sql, params)).fetchall()


# A reservation's transitions (written by the database's trigger, ``audit_transition``), each
# with who made it and why: the audit row of the same transaction that names an actor (the
# create, release, extend or reconcile that caused it).
_TRANSITIONS = """
    SELECT epoch_ms(t.at) AS at_ms, t.context ->> 'from' AS from_state,
           t.context ->> 'to' AS to_state,
           coalesce(t.context ->> 'releaseReason', x.reason) AS reason, x.actor
      FROM audit_log t
      LEFT JOIN LATERAL (
          SELECT a.actor, a.context ->> 'reason' AS reason FROM audit_log a
           WHERE a.resource_id = t.resource_id AND a.at = t.at AND a.action <> 'transition'
           ORDER BY a.actor IS NULL, a.id LIMIT 1
      ) x ON true
     WHERE t.resource_id = %(rid)s AND t.action = 'transition'
     ORDER BY t.id
"""

# Its events, as the outbox holds them (``outbox_subject``).
_EVENTS = """
    SELECT o.type, epoch_ms(o.created_at) AS at_ms, o.data
      FROM outbox o
     WHERE o.subject = 'reservation/' || %(rid)s
     ORDER BY o.id
"""


async def history(db: Database, *, reservation_id: str) -> tuple[list[Row], list[Row]]:
    """The reservation's transitions and its events, oldest first, read in one snapshot."""
    async with db.connection() as conn:
        await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        try:
            transitions = await _read(conn, _TRANSITIONS, {"rid": reservation_id})
            events = await _read(conn, _EVENTS, {"rid": reservation_id})
        finally:
            await conn.execute("ROLLBACK")
    return transitions, events
