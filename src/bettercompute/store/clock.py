"""Business time as the database tells it: ``compute_now()`` inside the caller's transaction.

Why one place: every rule that compares instants (the start, the end, a lease, a deadline)
must read the same clock, the one tests move with ``inventory.advance_clock``; it is stable for
a whole transaction. Conversions to and from epoch milliseconds are pure and live in
``core.durations``. Never reads the machine's clock.
"""

from __future__ import annotations

import datetime as dt

from bettercompute.store.database import Conn


async def current_time(conn: Conn) -> dt.datetime:
    row = await (await conn.execute("SELECT compute_now() AS now")).fetchone()
    assert row is not None
    now: dt.datetime = row["now"]
    return now
