"""Read-only queries for get and list; they never lock and never write."""

from __future__ import annotations

from typing import Any

from bettercompute.store import views
from bettercompute.store.database import Database


async def list_reservations(
    db: Database,
    *,
    tenant_id: str,
    owner_identity_id: str | None,
    state: str | None,
    pool_id: str | None,
    limit: int,
    cursor: str | None,
) -> tuple[list[dict[str, Any]], str | None]:
    """Newest first, drafts skipped; ``cursor`` is the last id of the previous page."""
    where = ["r.tenant_id = %s", "r.state <> 'draft'"]
    params: list[Any] = [tenant_id]
    if owner_identity_id is not None:
        where.append("r.owner_identity_id = %s")
        params.append(owner_identity_id)
    if state is not None:
        where.append("r.state = %s")
        params.append(state)
    if pool_id is not None:
        where.append("r.pool_id = %s")
        params.append(pool_id)
    if cursor is not None:
        where.append(
            "(r.created_at, r.id) < (SELECT c.created_at, c.id FROM reservations c"
            " WHERE c.id = %s AND c.tenant_id = %s)"
        )
        params += [cursor, tenant_id]
    params.append(limit + 1)
    sql = (
        f"SELECT {views.COLUMNS} FROM reservations r WHERE {' AND '.join(where)}"
        " ORDER BY r.created_at DESC, r.id DESC LIMIT %s"
    )
    async with db.connection() as conn:
        rows = await (await conn.execute(sql, params)).fetchall()
    items = [views.to_view(r) for r in rows[:limit]]
    next_cursor = items[-1]["id"] if len(rows) > limit else None
    return items, next_cursor


async def authz_row(db: Database, reservation_id: str) -> dict[str, Any] | None:
    """What a read/release/extend decision sees of a reservation (and its pool)."""
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT a.tenant_id, a.owner_identity_id, a.attributes, r.state, r.pool_id,"
                "       p.owner_tenant_id, p.region, p.gpu_model"
                "  FROM authz_resources a JOIN reservations r ON r.id = a.id"
                "  JOIN pools p ON p.id = r.pool_id WHERE a.id = %s",
                (reservation_id,),
            )
        ).fetchone()
    return row


async def root_tenant(db: Database) -> str | None:
    """The root tenant's id, whose members pass every tenant pre-check, if there is one."""
    async with db.connection() as conn:
        row = await (await conn.execute("SELECT id FROM tenants WHERE is_root")).fetchone()
    return None if row is None else str(row["id"])


async def ids_starting(
    db: Database, *, tenant_id: str, owner: str, text: str, limit: int = 6
) -> list[str]:
    """Reservation ids of the tenant (drafts left out) equal to ``text``, or starting with it
    and owned by ``owner``, the exact one first: what a short id given by a person can mean.
    Only the caller's own are read by their start, so an ambiguity never shows others' ids."""
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT id FROM reservations WHERE tenant_id = %s AND state <> 'draft'"
                " AND (id = %s OR (owner_identity_id = %s AND left(id, length(%s)) = %s))"
                " ORDER BY id = %s DESC, id LIMIT %s",
                (tenant_id, text, owner, text, text, text, limit),
            )
        ).fetchall()
    return [str(r["id"]) for r in rows]
