"""Taking a reservation's locks in the one order every transaction uses.

Lock order, in every transaction that takes more than one: the pool's advisory lock, then
reservation rows, then quota rows. Admission's transaction 2 is the one exception that locks its
own draft row first, which is safe because nothing else ever locks a draft row. Never decides
anything: it only locks and reads.
"""

from __future__ import annotations

from bettercompute.store import placing
from bettercompute.store.database import Conn, Row

_ROW = """
    SELECT r.*, lower(r.during) AS start_at, upper(r.during) AS end_at
      FROM reservations r WHERE r.id = %s FOR UPDATE
"""


async def pool_of(conn: Conn, reservation_id: str) -> str | None:
    row = await (
        await conn.execute("SELECT pool_id FROM reservations WHERE id = %s", (reservation_id,))
    ).fetchone()
    return None if row is None else str(row["pool_id"])


async def lock_reservation(conn: Conn, reservation_id: str, *, pool_lock: bool) -> Row | None:
    """Take the pool lock (when asked) and then the reservation's row lock."""
    if pool_lock:
        pool_id = await pool_of(conn, reservation_id)
        if pool_id is None:
            return None
        await placing.lock_pool(conn, pool_id)
    row: Row | None = await (await conn.execute(_ROW, (reservation_id,))).fetchone()
    return row
