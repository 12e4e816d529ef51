"""What a node should have now: its allocations to bind, keep and release.

Why: a node agent (the simulator's, later the device plugin's) converges on desired state. It
asks "what should node X hold?" and gets every allocation placed on X that is ``desired``
(bind it), ``bound`` or ``lost`` (keep it, or bind it again) or ``releasing`` (free it and say
so). Allocations still ``planned`` (their window has not started), ``failed`` or ``released``
are none of the node's business.

What it must never do: write. These are read-only queries; a node changes anything only
through ``reports.report``, which the service calls.
"""

from __future__ import annotations

from typing import Any

from bettercompute.core import hosts, pools
from bettercompute.store.database import Database

#: Allocation states a node acts on.
NODE_STATES = ("desired", "bound", "lost", "releasing")


async def for_node(db: Database, *, node_id: str) -> list[dict[str, Any]]:
    """The allocations of ``node_id`` in ``NODE_STATES``, oldest first.

    Each is ``{allocationId, reservationId, tenantId, state, binding, podAccess, class,
    deviceIds, parentGpus, until, reservationNamespace}``: ``podAccess`` is the pool's
    (``reservation`` unless the pool says ``shared``); ``parentGpus`` gives each device's
    physical GPU in ``deviceIds`` order (the same id for a whole GPU); ``until`` is epoch
    milliseconds; ``reservationNamespace`` is the namespace of the Reservation object that owns
    it (``None`` for one made through the API); ``limits`` is what it booked of its node's host
    (``core.hosts.limits``), ``None`` when it booked none; ``preemptAt`` is the notice deadline
    (epoch ms) of a spot reservation being preempted, else ``None``; ``kubernetesApi`` is how
    a ``kubernetes`` binding reaches pods, the pool's ``policy.kubernetes.api``
    (``devicePlugin`` or ``dra``), ``None`` for other bindings.
    """
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                """
                SELECT a.id, a.reservation_id, r.tenant_id, a.state,
                       r.request ->> 'binding' AS binding,
                       coalesce(p.policy ->> 'podAccess', 'reservation') AS pod_access,
                       p.policy AS pool_policy,
                       a.device_class, a.device_ids,
                       epoch_ms(a.until) AS until_ms, o.namespace AS reservation_namespace,
                       (SELECT (c ->> 'deadline')::bigint
                          FROM jsonb_array_elements(r.conditions) AS c
                         WHERE c ->> 'type' = 'Preempted' LIMIT 1) AS preempt_at,
                       a.host_vcpu, a.host_memory_gib, a.host_hugepages_1gi,
                       n.resources -> 'numaNodes' AS numa_nodes,
                       n.resources ->> 'isolatedCpus' AS isolated_cpus,
                       coalesce((p.policy -> 'hostReserve' ->> 'vcpu')::integer, 2)
                         AS reserve_vcpu,
                       (SELECT array_agg(DISTINCT t.numa_node) FILTER (
                                   WHERE t.numa_node IS NOT NULL)
                          FROM atoms t WHERE t.id = ANY(a.atom_ids)) AS device_numa,
                       (SELECT coalesce(jsonb_object_agg(t.device_id, t.parent_gpu), '{}')
                          FROM atoms t WHERE t.id = ANY(a.atom_ids)) AS parents
                  FROM allocations a JOIN reservations r ON r.id = a.reservation_id
                  JOIN pools p ON p.id = r.pool_id
                  JOIN nodes n ON n.id = a.node_id
                  LEFT JOIN kube_owners o ON o.reservation_id = r.id
                 WHERE a.node_id = %s AND a.state = ANY(%s)
                 ORDER BY a.created_at, a.id
                """,
                (node_id, list(NODE_STATES)),
            )
        ).fetchall()
    return [
        {
            "allocationId": row["id"],
            "reservationId": row["reservation_id"],
            "tenantId": row["tenant_id"],
            "state": row["state"],
            "binding": row["binding"],
            "podAccess": row["pod_access"],
            "class": row["device_class"],
            "deviceIds": list(row["device_ids"]),
            "parentGpus": [row["parents"].get(d, d) for d in row["device_ids"]],
            "until": int(row["until_ms"]),
            "reservationNamespace": row["reservation_namespace"],
            "preemptAt": row["preempt_at"],
            "kubernetesApi": (
                pools.kubernetes_api(row["pool_policy"]) if row["binding"] == "kubernetes" else None
            ),
            "limits": hosts.limits(
                vcpu=row["host_vcpu"],
                memory_gib=row["host_memory_gib"],
                hugepages_1gi=row["host_hugepages_1gi"],
                numa_nodes=row["numa_nodes"] if isinstance(row["numa_nodes"], list) else None,
                device_numa=set(row["device_numa"] or ()),
                reserve_vcpu=row["reserve_vcpu"],
                isolated_cpus=row["isolated_cpus"],
            ),
        }
        for row in rows
    ]


async def node_ids(db: Database) -> list[str]:
    """Every node the database knows, so a composition root can tell which it no longer runs
    (``dev`` marks those not ready and not connected)."""
    async with db.connection() as conn:
        rows = await (await conn.execute("SELECT id FROM nodes ORDER BY id")).fetchall()
    return [str(row["id"]) for row in rows]


async def nodes_of(db: Database, *, reservation_id: str) -> list[str]:
    """The nodes a reservation has allocations on, in any state."""
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT DISTINCT node_id FROM allocations WHERE reservation_id = %s"
                " ORDER BY node_id",
                (reservation_id,),
            )
        ).fetchall()
    return [str(row["node_id"]) for row in rows]
