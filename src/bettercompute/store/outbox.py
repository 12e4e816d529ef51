"""Reading the outbox for delivery: the events after a subscriber's cursor, and the cursors.

Events are written by ``store/journal.py`` in the transaction whose change they report; this
module is the other end, used by ``service/events.py`` (in-process subscribers), the event
stream (``GET /api/compute/events/watch``) and, through :data:`SETTLED`, the webhook fan-out
of ``store/subscriptions.py``. A cursor only moves forward, and only after the subscriber
handled the events before it, so delivery is at least once.

Why :data:`FRONTIER`: an event's id is taken when its row is inserted, not when its
transaction commits, so a transaction holding id 5 may commit after one holding id 6. A reader
of ``id > cursor`` that moved past 6 in between would never see 5. Every read here therefore
stops at the frontier: the newest id whose transaction is older than the oldest transaction
still running (``xid < pg_snapshot_xmin(pg_current_snapshot())``, the ``xid`` column of
migration 0012). That transaction has ended, and so has every one that began before it, so an
id at or below the frontier can no longer appear later. Events at or below it that committed
(even from younger transactions) are read with it, so the cursor passes nothing it could see.

The trade-off: a transaction left open (a slow admission, a person's psql session) holds the
frontier back, delaying every event written after it began until it ends; it never loses one.
Finding the frontier walks the primary key back from the newest id to the first settled one,
so its cost grows with the events written while the oldest transaction has been open (measured
over 200,000 events: 0.2 ms with nothing open, 2 ms with 20,000 events behind an open
transaction; no other index is needed). What remains possible: a transaction that got
its transaction id before the oldest running one but inserts its event after that one did (its
event id is higher) settles first, and the frontier may then pass the still-open one's id.
Closing that needs ids handed out in commit order, which PostgreSQL's sequences do not give;
the window is a transaction's own statements between its first write and its event.

What it must never do: write an event, or read past the frontier.
"""

from __future__ import annotations

from typing import Any

from bettercompute.store.database import Database

#: The newest id that can no longer be overtaken, as an SQL expression: the newest event whose
#: transaction is older than the oldest one running. ``pg_current_snapshot()`` is the reading
#: statement's snapshot (read committed): the oldest transaction running when the read began.
FRONTIER = (
    "(SELECT coalesce(max(id), 0) FROM outbox WHERE xid < pg_snapshot_xmin(pg_current_snapshot()))"
)


async def events_after(db: Database, *, after_id: int, limit: int = 500) -> list[dict[str, Any]]:
    """The events after ``after_id`` up to the frontier, oldest first."""
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT id, type, subject, data, epoch_ms(created_at) AS at FROM outbox"
                f" WHERE id > %s AND id <= {FRONTIER} ORDER BY id LIMIT %s",
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
    """The events about ``tenant_id``'s reservations after ``after_id`` up to the frontier,
    oldest first: ``{id, type, reservationId, at, data}`` (what a watcher of that tenant may
    see, and no more)."""
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT o.id, o.type, r.id AS reservation_id, o.data, epoch_ms(o.created_at) AS at"
                "  FROM outbox o JOIN reservations r ON o.subject = 'reservation/' || r.id"
                f" WHERE o.id > %s AND o.id <= {FRONTIER} AND r.tenant_id = %s"
                " ORDER BY o.id LIMIT %s",
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
    """The frontier (0 when there is no event): where a watch from now starts. Not
    ``max(id)``: an event below that may still commit, and a watch from now shows it."""
    async with db.connection() as conn:
        row = await (await conn.execute(f"SELECT {FRONTIER} AS n")).fetchone()
    return int(row["n"]) if row else 0
