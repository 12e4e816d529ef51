"""Taking a reservation's locks in the one order every transaction uses.

Lock order, in every transaction that takes more than one:

1. the tenant's budget lock (``bc_budget_lock_check``: admission's and extend's transaction 2,
   only when the built-in budget is checked);
2. the pool's advisory lock;
3. reservation rows;
4. quota rows.

Admission's transaction 2 is the one exception that locks its own draft's rows (the idempotency
row and the draft) first, which is safe because nothing waits on a draft's rows while holding
one of the locks above. The garbage collector (``store/collecting.py``) takes every row it
removes ``SKIP LOCKED`` (a reservation, then its extend hold, then its authorization row, as
extend does), so it never waits on a request.
No transaction takes the budget lock after the pool lock, so budget and pool locks never
deadlock. Holder locks (``store/holding.py``) are session locks each process takes once on its
own connection; no transaction waits on one. Never decides anything: it only locks and reads.
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
