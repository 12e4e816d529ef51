"""Quota: the refusal when a charge does not fit, and the refund when a reservation ends.

The charge itself is all-or-nothing inside admission's transaction 2 (``bc_admission_begin``
locks the tenant's quota rows and charges them in one statement); what was charged is kept on
the reservation (``quota_charge``) so that exactly that is refunded, once, by whoever ends it
(release, cancel, expiry, a failure). Never decides whether a request may be charged: the
quota rows do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.store.database import Conn, Database


def short_error(short: list[dict[str, Any]]) -> ComputeError:
    """``QUOTA_EXCEEDED`` naming each resource that was short and by how much."""
    words = ", ".join(
        f"{d['resource']} (asked {d['requested']}, {d['limit'] - d['used']} left of {d['limit']})"
        for d in short
    )
    return ComputeError(ErrorCode.QUOTA_EXCEEDED, f"quota exceeded: {words}", {"quota": short})


async def refund(conn: Conn, *, tenant_id: str, charge: Mapping[str, int] | None) -> None:
    if not charge:
        return
    resources = sorted(charge)
    await conn.execute(
        "UPDATE quotas q SET used = greatest(q.used - d.n, 0)"
        "  FROM unnest(%s::text[], %s::bigint[]) AS d(resource, n)"
        " WHERE q.tenant_id = %s AND q.resource = d.resource",
        (resources, [charge[r] for r in resources], tenant_id),
    )


async def of_tenant(db: Database, *, tenant_id: str) -> list[dict[str, Any]]:
    """The tenant's quota rows, by resource: ``{resource, limit, used}`` (none: no quota, which
    grants nothing)."""
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT resource, limit_, used FROM quotas WHERE tenant_id = %s ORDER BY resource",
                (tenant_id,),
            )
        ).fetchall()
    return [
        {"resource": r["resource"], "limit": int(r["limit_"]), "used": int(r["used"])} for r in rows
    ]


async def every_tenant(db: Database) -> list[dict[str, Any]]:
    """Every quota row: ``{tenantId, resource, limit, used}`` (for the metrics)."""
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT tenant_id, resource, limit_, used FROM quotas ORDER BY tenant_id, resource"
            )
        ).fetchall()
    return [
        {
            "tenantId": r["tenant_id"],
            "resource": r["resource"],
            "limit": int(r["limit_"]),
            "used": int(r["used"]),
        }
        for r in rows
    ]
