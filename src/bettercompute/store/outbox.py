"""Reading the outbox for delivery: the events after a subscriber's cursor, and the cursors.

Events are written by ``store/journal.py`` in the transaction whose change they report; this
module is the other end, used by ``service/events.py``. A cursor only moves forward, and only
after the subscriber handled the events before it, so delivery is at least once. Never writes
an event.
"""

from __future__ import annotations

from typing import Any

from bettercompute.store.database import Database


async def events_after(db: Database, *, after_id: int, limit: int = 500) -> list[dict[str, Any]]:
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT id, type, subject, data, epoch_ms(created_at) AS at FROM outbox"
                " WHERE id > %s ORDER BY id LIMIT %s",
                (after_id, limit),
            )
        ).fetchall()
    return rows


async def cursor(db: Database, *, subscriber: str) -> int:
    """The subscriber's cursor (the last event it handled), created at 0 the first time."""
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "INSERT INTO outbox_cursors (subscriber) VALUES (%s)"
                " ON CONFLICT (subscriber) DO UPDATE SET subscriber = excluded.subscriber"
                " RETURNING last_id",
                (subscriber,),
            )
        ).fetchone()
    return int(row["last_id"]) if row else 0


async def save_cursor(db: Database, *, subscriber: str, last_id: int) -> None:
    async with db.connection() as conn:
        await conn.execute(
            "UPDATE outbox_cursors SET last_id = greatest(last_id, %s) WHERE subscriber = %s",
            (last_id, subscriber),
        )


async def tenant_events_after(
    db: Database, *, tenant_id: str, after_id: int, limit: int = 200
) -> list[dict[str, Any]]:
    """The events about ``tenant_id``'s reservations after ``after_id``, oldest first: ``{id,
    type, reservationId, at, data}`` (what a watcher of that tenant may see, and no more)."""
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT o.id, o.type, r.id AS reservation_id, o.data, epoch_ms(o.created_at) AS at"
                "  FROM outbox o JOIN reservations r ON o.subject = 'reservation/' || r.id"
                " WHERE o.id > %s AND r.tenant_id = %s ORDER BY o.id LIMIT %s",
                (after_id, tenant_id, limit),
            )
        ).fetchall()
    return [
        {
            "id": int(r["id"]),
            "type": r["type"],
            "reservationId": r["reservation_id"],
            "at": int(r["at"]),
            "data": r["data"],
        }
        for r in rows
    ]


async def latest_id(db: Database) -> int:
    """The newest event's id (0 when there is none): where a watch from now starts."""
    async with db.connection() as conn:
        row = await (await conn.execute("SELECT coalesce(max(id), 0) AS n FROM outbox")).fetchone()
    return int(row["n"]) if row else 0
