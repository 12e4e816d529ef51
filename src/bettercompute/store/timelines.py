"""Reading a pool's timeline: its nodes and devices, its bookings in a window, and the
caller's own reservations among them (``pools.timeline``).

Why it exists: the console draws every booking of a pool, and a pool of 200 nodes × 8 GPUs
holds 20,000 bookings over two weeks; reading them one reservation at a time, or as the guide's
reservation objects, would take seconds. Here it is four statements in one read-only snapshot:

1. the pool, if the tenant may see it, with the database's now and the end of its last booking
   (``bookings_pool_during``: only bookings that end beyond two weeks from now are looked at);
2. the inventory (nodes left-joined to their atoms, ``nodes_pool``);
3. the bookings overlapping the window (``bookings_pool_during``), grouped per reservation,
   node and window in the database, each with its reservation's details when it is the
   caller's, and sent as the answer's two JSON arrays (80,000 atom rows leave it as two
   values);
4. the caller's pending reservations in the pool (``reservations_pool_pending``).

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

# The pool's nodes numbered in display order (by name), and their bookable atoms numbered
# within each node (NUMA node, NVLink domain, GPU, then its MIG instances or slots): the
# indexes of the answer's ``nodes`` and ``devices``, which its bookings refer to. Computed in
# the database, once per statement, so the bookings arrive already as indexes.
_NUMBERED = """
    numbered_nodes AS (
        SELECT n.id, n.name, n.ready, n.connected,
               row_number() OVER (ORDER BY n.name) - 1 AS node_idx
          FROM nodes n
         WHERE n.pool_id = %(pool)s
    ), numbered_atoms AS (
        SELECT a.id, a.node_id, a.device_id, a.kind, a.parent_gpu, a.profile, a.healthy,
               nn.node_idx,
               row_number() OVER (
                   PARTITION BY a.node_id
                   ORDER BY a.numa_node NULLS LAST, a.nvlink_domain NULLS LAST, a.parent_gpu,
                            a.kind, a.profile NULLS FIRST, a.device_id
               ) - 1 AS dev_idx
          FROM numbered_nodes nn
          JOIN atoms a ON a.node_id = nn.id AND NOT a.retired
    )
"""

# One row per atom (or per node without any), in display order.
_INVENTORY = f"""
    WITH {_NUMBERED}
    SELECT nn.id AS node_id, nn.name AS node_name, nn.ready, nn.connected,
           na.id AS atom_id, na.device_id, na.kind, na.parent_gpu, na.profile, na.healthy
      FROM numbered_nodes nn
      LEFT JOIN numbered_atoms na ON na.node_id = nn.id
     ORDER BY nn.node_idx, na.dev_idx
"""

# The pool as ``tenant`` sees it (``pools.list``'s rule: owned or offered, not archived), the
# database's now, and the end of the pool's last booking if it ends beyond the horizon's
# least (``ahead``): only those few bookings are read.
_POOL = """
    SELECT p.name, p.gpu_model, p.sharing_mode, epoch_ms(compute_now()) AS now_ms,
           (SELECT epoch_ms(max(upper(b.during))) FROM bookings b
             WHERE b.pool_id = p.id
               AND b.during && tstzrange(compute_now() + %(ahead)s * interval '1 millisecond',
                                         NULL))
               AS last_end_ms
      FROM pools p
     WHERE p.id = %(pool)s AND NOT p.archived
       AND (p.owner_tenant_id = %(tenant)s
            OR EXISTS (SELECT 1 FROM offers o WHERE o.pool_id = p.id AND o.tenant_id = %(tenant)s))
"""

# What the timeline shows of one of the caller's reservations (``r``, its Kubernetes owner
# ``k``): the name a person knows it by (its object's, else its idempotency key), the devices
# it asked for, its window and its labels.
_DETAILS = """
           r.state, coalesce(k.namespace || '/' || k.name, r.idempotency_key) AS name,
           coalesce((r.request ->> 'spot')::boolean, false) AS spot,
           (SELECT coalesce(sum((d ->> 'count')::int), 0)
              FROM jsonb_array_elements(r.request -> 'devices') d)
             * coalesce((r.request -> 'gang' ->> 'size')::int, 1) AS gpus,
           epoch_ms(lower(r.during)) AS r_start_ms, epoch_ms(upper(r.during)) AS r_end_ms,
           epoch_ms(r.requested_start) AS requested_start_ms,
           jsonb_strip_nulls(jsonb_build_object(
               'project', r.request ->> 'projectId',
               'binding', r.request ->> 'binding',
               'namespace', k.namespace)) AS labels
"""

# The answer's ``bookings`` and ``reservations``, built as JSON by the database: 20,000 rows
# leave it as two values instead of 20,000 rows to decode and reassemble (that took longer
# than the query). ``grouped``: one row per reservation, node and window, the atoms as device
# indexes. ``shown``: each joined to its reservation only when it is the caller's (the join's
# condition), so another tenant's row keeps node, devices and window, its reservation's
# columns all null. ``own``: the caller's reservations among them, numbered (``ref``).
# A booking's ``stateCode`` indexes ``states``: ``ended`` for the ``ended`` states, ``spot``
# for a spot reservation, else its state (``core.timelines.STATES``).
_BOOKINGS = f"""
    WITH {_NUMBERED}, grouped AS (
        SELECT na.node_idx, b.reservation_id, b.during,
               array_agg(na.dev_idx ORDER BY na.dev_idx) AS devices
          FROM bookings b
          JOIN numbered_atoms na ON na.id = b.atom_id
         WHERE b.pool_id = %(pool)s
           AND b.during && tstzrange(to_timestamp(%(from)s / 1000.0),
                                     to_timestamp(%(to)s / 1000.0))
         GROUP BY b.reservation_id, na.node_idx, b.during
    ), shown AS MATERIALIZED (
        SELECT g.node_idx, g.devices,
               epoch_ms(lower(g.during)) AS start_ms, epoch_ms(upper(g.during)) AS end_ms,
               r.id AS rid, {_DETAILS}
          FROM grouped g
          LEFT JOIN reservations r
            ON r.id = g.reservation_id AND (%(all)s OR r.tenant_id = %(tenant)s)
          LEFT JOIN kube_owners k ON k.reservation_id = r.id
    ), own AS MATERIALIZED (
        SELECT o.*, row_number() OVER (ORDER BY o.r_start_ms, o.rid) - 1 AS ref
          FROM (SELECT DISTINCT ON (s.rid) s.* FROM shown s
                 WHERE s.rid IS NOT NULL ORDER BY s.rid) o
    )
    SELECT
        (SELECT coalesce(json_agg(json_build_array(
                    s.node_idx, s.devices, s.start_ms, s.end_ms,
                    CASE WHEN o.ref IS NULL THEN 0
                         ELSE coalesce(array_position(%(states)s::text[],
                             CASE WHEN o.state = ANY(%(ended)s::text[]) THEN 'ended'
                                  WHEN o.spot THEN 'spot' ELSE o.state END),
                             2) - 1
                    END,
                    o.ref)), '[]')
           FROM shown s LEFT JOIN own o ON o.rid = s.rid) AS bookings,
        (SELECT coalesce(json_agg(json_build_object(
                    'id', o.rid, 'name', o.name, 'state', o.state, 'spot', o.spot,
                    'gpus', o.gpus, 'start', o.r_start_ms, 'end', o.r_end_ms,
                    'labels', o.labels) ORDER BY o.ref), '[]')
           FROM own o) AS reservations
"""

# The caller's reservations waiting in the pool's queue (``reservations_pool_pending``).
_PENDING = f"""
    SELECT r.id AS rid, {_DETAILS}
      FROM reservations r
      LEFT JOIN kube_owners k ON k.reservation_id = r.id
     WHERE r.pool_id = %(pool)s AND r.state = 'pending'
       AND (%(all)s OR r.tenant_id = %(tenant)s)
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
            found = await _read(
                conn,
                _POOL,
                {"pool": pool_id, "tenant": tenant_id, "ahead": timelines.MIN_HORIZON_MS},
            )
            if not found:
                return None
            pool = found[0]
            now_ms = int(pool["now_ms"])
            horizon_ms = timelines.horizon(now_ms=now_ms, last_end_ms=pool["last_end_ms"])
            from_ms, to_ms = timelines.span(value, now_ms=now_ms, horizon_ms=horizon_ms)
            atoms = await _read(conn, _INVENTORY, {"pool": pool_id})
            who = {"pool": pool_id, "tenant": tenant_id, "all": everyone}
            (grid,) = await _read(
                conn,
                _BOOKINGS,
                {
                    **who,
                    "from": from_ms,
                    "to": to_ms,
                    "states": list(timelines.STATES),
                    "ended": list(timelines.ENDED),
                },
            )
            pending = await _read(conn, _PENDING, who)
        finally:
            await conn.execute("ROLLBACK")
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
        "nodes": timelines.nodes(atoms),
        "bookings": grid["bookings"],
        "states": list(timelines.STATES),
        "reservations": grid["reservations"],
        "pending": timelines.pending(pending),
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
