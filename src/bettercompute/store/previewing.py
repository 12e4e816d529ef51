"""The read behind ``capacity.preview``: would a request fit in its pool, and where?

Why a module of its own: the guide's preview "answers whether a request would fit and where (no
booking, no decision)". It reads the same placement snapshot as admission
(``placing.snapshot``) and runs the same pure placer, so a preview that fits is a create that
fits at that moment, but it goes through none of admission's writes.

What it must never do: write, lock or charge anything. Everything runs in one ``READ ONLY``
transaction at ``REPEATABLE READ`` (so the pool, the clock, the busy atoms and the inventory are
read from one consistent snapshot, and the database itself refuses a write), and it never takes
the pool lock, so a preview can never hold up a create.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from bettercompute.core import durations, errors, hosts, placement, pools
from bettercompute.store import clock, placing
from bettercompute.store import pools as pool_rows
from bettercompute.store.database import Database

#: Matches no reservation id: a preview books nothing, so nothing of its own is ignored.
_NO_RESERVATION = ""


async def preview(
    db: Database, *, tenant_id: str, request: Mapping[str, Any], duration_ms: int
) -> dict[str, Any]:
    """The placer's answer for a normalised ``request`` of ``tenant_id``, booking nothing.

    Raises ``NOT_FOUND`` for a pool the tenant cannot see and ``INVALID_INPUT`` for a class or
    binding the pool does not serve (``core.pools.check_request``, the order of transaction 1).
    The window starts now, or at the request's ``start`` when that is later, as admission's.
    """
    pool_id = str(request["poolId"])
    async with db.connection() as conn, conn.transaction():
        await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        # The same host resources a create would book: the request's, or the pool's share.
        request, share = await pool_rows.resolved_request(
            conn, tenant_id=tenant_id, request=request
        )
        now = await clock.current_time(conn)
        start = now
        if request.get("start") is not None:
            start = max(now, durations.from_ms(int(request["start"])))
        try:
            end = start + dt.timedelta(milliseconds=duration_ms)
        except OverflowError:
            raise errors.invalid_input(
                "start", "the window must end before the year 10000"
            ) from None
        snap = await placing.snapshot(
            conn,
            cache=db.inventory,
            pool_id=pool_id,
            start=start,
            end=end,
            ignore_reservation=_NO_RESERVATION,
        )
    outcome = placement.place(snapshot=snap, demand=pools.demand(request=request))
    answer: dict[str, Any] = {
        "poolId": pool_id,
        "during": {"start": durations.to_ms(start), "end": durations.to_ms(end)},
        # What each node of it would book of its host, and how much of that is the share.
        "resources": hosts.booked(request),
        "hostShare": share,
    }
    if isinstance(outcome, placement.NoFit):
        return {
            "fits": False,
            **answer,
            "nodeIds": [],
            "devices": [],
            "message": outcome.message,
            "rejected": dict(outcome.rejected),
            # No node could hold it even with every device free: waiting will not help.
            "never": outcome.never,
        }
    device_of = {a.id: a.device_id for a in snap.atoms}
    return {
        "fits": True,
        **answer,
        "nodeIds": [m.node_id for m in outcome.members],
        "devices": [
            {"nodeId": m.node_id, "deviceIds": [device_of[a] for a in m.atom_ids]}
            for m in outcome.members
        ],
        "message": "fits",
        "rejected": {},
        "never": False,
    }
