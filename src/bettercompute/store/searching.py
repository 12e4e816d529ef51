"""The read behind ``capacity.search``: the earliest windows a request would fit in its pool.

Why a module of its own: like a preview (``previewing``) it books and decides nothing, and
reads one consistent snapshot in a ``READ ONLY``, ``REPEATABLE READ`` transaction without the
pool lock; unlike a preview it reads every booking of the pool within the horizon once, and
``core.windows`` sweeps their boundaries.

What it must never do: write, lock or charge anything.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from bettercompute.core import durations, errors, hosts, placement, pools, windows
from bettercompute.store import clock, placing
from bettercompute.store import pools as pool_rows
from bettercompute.store.database import Database

# One row of arrays: the driver parses arrays in C, far faster than rows (one sort, in Python).
# epoch_ms() is written out: called 40,000 times, the function call alone doubles the query.
#: How far ahead the first, cheap look goes.
FIRST_LOOK_MS = 86_400_000

_BOOKINGS = """
    SELECT coalesce(array_agg(atom_id), '{}') AS atoms,
           coalesce(array_agg((extract(epoch FROM lower(during)) * 1000)::bigint), '{}')
             AS starts,
           coalesce(array_agg((extract(epoch FROM upper(during)) * 1000)::bigint), '{}')
             AS ends,
           coalesce(array_agg(host_node), '{}') AS host_nodes,
           coalesce(array_agg(host_vcpu), '{}') AS vcpus,
           coalesce(array_agg(host_memory_gib), '{}') AS memories,
           coalesce(array_agg(host_hugepages_1gi), '{}') AS hugepages
      FROM bookings WHERE pool_id = %s AND during && tstzrange(%s, %s)
"""


async def search(
    db: Database,
    *,
    tenant_id: str,
    request: Mapping[str, Any],
    duration_ms: int,
    from_ms: int | None,
    horizon_ms: int,
    limit: int,
) -> dict[str, Any]:
    """Up to ``limit`` windows, in start order, where a create of ``request`` would fit.

    Raises ``NOT_FOUND`` for a pool the tenant cannot see and ``INVALID_INPUT`` for a class or
    binding the pool does not serve, as a preview does.
    """
    pool_id = str(request["poolId"])
    async with db.connection() as conn, conn.transaction():
        await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        # The same host resources a create would book: the request's, or the pool's share.
        request, share = await pool_rows.resolved_request(
            conn, tenant_id=tenant_id, request=request
        )
        now = durations.to_ms(await clock.current_time(conn))
        first = max(now, from_ms if from_ms is not None else now)
        latest = first + horizon_ms
        if latest + duration_ms > durations.to_ms(dt.datetime.max.replace(tzinfo=dt.UTC)):
            raise errors.invalid_input("horizon", "the windows must end before the year 10000")
        snap = await placing.snapshot(
            conn,
            cache=db.inventory,
            pool_id=pool_id,
            start=durations.from_ms(first),
            end=durations.from_ms(first + 1),
            ignore_reservation="",
        )
        # Most searches find their windows soon: look one day ahead first, reading only the
        # bookings that can touch it, and read the whole horizon only when that is not enough.
        # (Windows found in the short look are the same the whole look finds first.)
        demand = pools.demand(request=request)
        # Could it fit at all, with the pool at rest? If not, no window will come of waiting.
        at_rest = placement.never_fits(snapshot=snap, demand=demand)
        never = None if at_rest is None else at_rest.message
        found: windows.Found | None = None
        for look in sorted({min(horizon_ms, FIRST_LOOK_MS), horizon_ms}):
            if never is not None:
                break
            arrays = await (
                await conn.execute(
                    _BOOKINGS,
                    (
                        pool_id,
                        durations.from_ms(first),
                        durations.from_ms(first + look + duration_ms),
                    ),
                )
            ).fetchone()
            assert arrays is not None  # an aggregate answers one row
            found = windows.earliest(
                nodes=snap.nodes,
                atoms=snap.atoms,
                bookings=windows.as_bookings(
                    arrays["atoms"],
                    arrays["starts"],
                    arrays["ends"],
                    arrays["host_nodes"],
                    arrays["vcpus"],
                    arrays["memories"],
                    arrays["hugepages"],
                ),
                demand=demand,
                from_ms=first,
                latest_start_ms=first + look,
                duration_ms=duration_ms,
                limit=limit,
            )
            if len(found.windows) >= limit or found.exhausted:
                break
    answer: dict[str, Any] = {
        "poolId": pool_id,
        "from": first,
        "horizonEnd": latest,
        "resources": hosts.booked(request),
        "hostShare": share,
    }
    if never is not None:
        return {**answer, "windows": [], "never": True, "message": never}
    assert found is not None  # at least one look
    message = f"{len(found.windows)} window(s) found"
    if found.exhausted:
        message += f"; stopped after {found.tried} candidate starts"
    elif not found.windows:
        message = "no window within the horizon"
    return {
        **answer,
        "windows": [
            {"start": w.start_ms, "end": w.end_ms, "nodeIds": list(w.node_ids)}
            for w in found.windows
        ],
        "never": False,
        "message": message,
    }
