"""Reading reservations back as the guide's reservation object.

One column list and one row → object function, so ``get``, ``list``, ``create`` and every
operation answer with exactly the same shape. ``DevicesHeld`` is computed here from the
allocations still releasing, never stored (the guide: "computed by get and list, not stored").
"""

from __future__ import annotations

from typing import Any

from bettercompute.core import ids, states
from bettercompute.store.database import Conn, Database, Row

COLUMNS = """
    r.id, r.tenant_id, r.pool_id, r.state, r.request, r.owner_identity_id, r.idempotency_key,
    r.conditions, r.binding, r.failure, r.version, r.release_reason, r.host_share,
    epoch_ms(lower(r.during)) AS start_ms, epoch_ms(upper(r.during)) AS end_ms,
    epoch_ms(r.requested_start) AS requested_start_ms,
    epoch_ms(r.lease_expires_at) AS lease_expires_ms,
    epoch_ms(r.created_at) AS created_ms, epoch_ms(r.updated_at) AS updated_ms,
    (SELECT p.policy ->> 'podAccess' FROM pools p WHERE p.id = r.pool_id) AS pod_access,
    CASE WHEN r.state IN ('released', 'releasing') THEN (
        SELECT jsonb_agg(jsonb_build_object(
                   'nodeId', a.node_id, 'allocationId', a.id,
                   'since', epoch_ms(a.releasing_since), 'pods', a.report -> 'pods')
               ORDER BY a.node_id)
          FROM allocations a
         WHERE a.reservation_id = r.id AND a.state = 'releasing'
           AND r.request ->> 'binding' = 'kubernetes'
    ) END AS held
"""


def to_view(row: Row) -> dict[str, Any]:
    """The reservation object of the guide, from a row selected with ``COLUMNS``."""
    state = states.State(row["state"])
    conditions = list(row["conditions"] or [])
    if row.get("held"):
        conditions.append(_devices_held(row["held"]))
    view: dict[str, Any] = {
        "id": row["id"],
        "tenantId": row["tenant_id"],
        "poolId": row["pool_id"],
        "state": state.value,
        "request": row["request"],
        "during": (
            {"start": row["start_ms"], "end": row["end_ms"]}
            if row["start_ms"] is not None
            else None
        ),
        "ownerIdentityId": row["owner_identity_id"],
        "idempotencyKey": row["idempotency_key"],
        "conditions": conditions,
        "binding": row["binding"],
        "operation": states.operation(
            reservation_id=row["id"],
            state=state,
            conditions=conditions,
            failure_message=(row["failure"] or {}).get("message"),
        ),
        "version": row["version"],
        "createdAt": row["created_ms"],
        "updatedAt": row["updated_ms"],
    }
    if row["requested_start_ms"] is not None:
        view["requestedStart"] = row["requested_start_ms"]
    if row["lease_expires_ms"] is not None:
        view["leaseExpiresAt"] = row["lease_expires_ms"]
    if row["release_reason"]:
        view["releaseReason"] = row["release_reason"]
    if row["host_share"] is not None:
        view["hostShare"] = row["host_share"]
    if (row["request"] or {}).get("binding") == "kubernetes" and row["pod_access"] != "shared":
        # Only this reservation's labelled pods can ask for it (pod access ``reservation``).
        view["resourceName"] = ids.reservation_resource_name(row["id"])
    return view


def _devices_held(held: list[dict[str, Any]]) -> dict[str, Any]:
    nodes = sorted({h["nodeId"] for h in held})
    pods = sorted({p for h in held for p in (h.get("pods") or [])})
    since = min(h["since"] for h in held if h.get("since") is not None) if held else None
    message = f"pods on {', '.join(nodes)} still hold its devices"
    if pods:
        message += f": {', '.join(pods)}"
    return {
        "type": states.Condition.DEVICES_HELD.value,
        "reason": states.Reason.PODS_HOLD_DEVICES.value,
        "message": message,
        "since": since,
        "nodes": nodes,
        "pods": pods,
    }


async def read(conn: Conn, reservation_id: str) -> Row | None:
    cur = await conn.execute(
        f"SELECT {COLUMNS} FROM reservations r WHERE r.id = %s", (reservation_id,)
    )
    return await cur.fetchone()


async def get(db: Database, reservation_id: str) -> dict[str, Any] | None:
    async with db.connection() as conn:
        row = await read(conn, reservation_id)
    return None if row is None else to_view(row)
