"""Spot preemption inside admission's transaction 2: free spot work for a regular request.

Why here: the choice (``core.preemption``) must see the pool as the preemptor's placement does,
and the victims must be handled in the same transaction, under the same pool lock, so two
preemptors never pick the same victims and a victim is never half preempted.

What happens to a victim: one that has not started is unbooked and waits ``pending`` with
``Unschedulable/SpotPreempted`` (its quota stays charged, as any pending reservation's; it is
woken when capacity frees), event ``reservation.preempted``. One that runs keeps its devices
until a notice deadline (``policy.spot.noticeSeconds``, default 120 s): its window is cut to
the deadline, it shows ``Preempted/SpotPreempted``, event ``reservation.preempting``, and at
the deadline the reconciler releases it with reason ``preempted`` (a ``kubernetes`` binding's
pods then hold the devices under ``DevicesHeld`` as after any release).

What it must never do: touch a regular reservation, or one already being preempted.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from bettercompute.core import durations, moments, placement, preemption, states
from bettercompute.store import journal, placing
from bettercompute.store.caching import InventoryCache
from bettercompute.store.database import Conn, jsonb

#: Every booking of the pool in the window, marked when it is a spot reservation that may be
#: preempted (not regular, not already preempted).
_BOOKED = """
    SELECT b.atom_id, b.reservation_id, b.host_node, b.host_vcpu, b.host_memory_gib,
           b.host_hugepages_1gi, epoch_ms(r.created_at) AS created_ms,
           lower(r.during) <= %(now)s AS started,
           coalesce(r.request ->> 'spot', 'false') = 'true'
             AND r.state IN ('placed', 'binding', 'active')
             AND NOT r.conditions @> '[{"type": "Preempted"}]' AS candidate
      FROM bookings b JOIN reservations r ON r.id = b.reservation_id
     WHERE b.pool_id = %(pool)s AND b.during && tstzrange(%(start)s, %(end)s)
       AND b.reservation_id <> %(rid)s
"""


async def preempt(
    conn: Conn,
    *,
    cache: InventoryCache | None,
    pool_id: str,
    reservation_id: str,
    demand: placement.Demand,
    start: dt.datetime,
    end: dt.datetime,
    now: dt.datetime,
    notice: dt.timedelta,
) -> tuple[placement.Placed, placement.Snapshot, dt.datetime, dt.datetime] | None:
    """Preempt the fewest spot reservations that let ``demand`` fit, and place it: its window
    starts at the victims' notice deadline when one of them runs. ``None`` (nothing changed)
    when no set of spot work would make it fit. The caller holds the pool lock."""
    rows = await (
        await conn.execute(
            _BOOKED,
            {"now": now, "pool": pool_id, "start": start, "end": end, "rid": reservation_id},
        )
    ).fetchall()
    if not any(r["candidate"] for r in rows):
        return None
    others: set[str] = set()
    host_others: dict[str, dict[str, int]] = {}
    found: dict[str, dict[str, Any]] = {}
    for row in rows:
        if not row["candidate"]:
            others.add(row["atom_id"])
            _add_host(host_others, row)
            continue
        entry = found.setdefault(
            row["reservation_id"],
            {"started": row["started"], "created": row["created_ms"], "atoms": set(), "host": {}},
        )
        entry["atoms"].add(row["atom_id"])
        _add_host(entry["host"], row)
    base = await placing.snapshot(
        conn, cache=cache, pool_id=pool_id, start=start, end=end, ignore_reservation=reservation_id
    )
    rest = placement.Snapshot(
        nodes=base.nodes,
        atoms=base.atoms,
        busy=frozenset(others),
        host_busy=host_others,
        index=base.index,
    )
    victims = preemption.choose(
        snapshot=rest,
        demand=demand,
        candidates=[
            preemption.Candidate(
                reservation_id=rid,
                started=bool(v["started"]),
                created_ms=int(v["created"]),
                atom_ids=frozenset(v["atoms"]),
                host=v["host"],
            )
            for rid, v in found.items()
        ],
    )
    if victims is None:
        return None
    deadline = now + notice
    running = [v.reservation_id for v in victims if v.started]
    # The preemptor's window: now, or from the deadline when running work must end first.
    begins = max(start, deadline) if running else start
    ends = begins + (end - start)
    try:
        async with conn.transaction():  # a savepoint: all the victims, or none of them
            for victim in victims:
                if victim.started:
                    await _give_notice(
                        conn, victim.reservation_id, pool_id, reservation_id, deadline, now
                    )
                else:
                    await _requeue(conn, victim.reservation_id, pool_id, reservation_id, now)
            snap = await placing.snapshot(
                conn,
                cache=cache,
                pool_id=pool_id,
                start=begins,
                end=ends,
                ignore_reservation=reservation_id,
            )
            outcome = placement.try_place(snapshot=snap, demand=demand)
            if not isinstance(outcome, placement.Placed):
                # Its later window is taken by other work: preempting would not help it.
                raise _NoRoom
    except _NoRoom:
        return None
    return outcome, snap, begins, ends


class _NoRoom(Exception):
    """Rolls the victims' changes back (the savepoint) when the preemptor still cannot fit."""


def _add_host(into: dict[str, dict[str, int]], row: Mapping[str, Any]) -> None:
    node = row["host_node"]
    if node is None:
        return
    use = into.setdefault(node, {"vcpu": 0, "memoryGiB": 0, "hugepages1Gi": 0})
    use["vcpu"] += int(row["host_vcpu"])
    use["memoryGiB"] += int(row["host_memory_gib"])
    use["hugepages1Gi"] += int(row["host_hugepages_1gi"])


async def _requeue(conn: Conn, rid: str, pool_id: str, by: str, now: dt.datetime) -> None:
    """A spot reservation that has not started: unbooked, pending until capacity frees."""
    await placing.unbook(conn, reservation_id=rid)
    sql, params = placing.mark_pending_statement(
        reservation_id=rid,
        pool_id=pool_id,
        message=f"preempted by {by} before it started: waits for capacity",
        now=now,
        first=False,
        reason=states.Reason.SPOT_PREEMPTED,
    )
    await conn.execute(sql, params)
    await journal.emit(
        conn,
        "reservation.preempted",
        reservation_id=rid,
        data={"state": "pending", "poolId": pool_id, "preemptedBy": by},
    )


async def _give_notice(
    conn: Conn, rid: str, pool_id: str, by: str, deadline: dt.datetime, now: dt.datetime
) -> None:
    """A running spot reservation: its window now ends at ``deadline``, where it is released
    with reason ``preempted``."""
    await conn.execute(
        "UPDATE bookings SET during = tstzrange(lower(during), %s)"
        " WHERE reservation_id = %s AND upper(during) > %s",
        (deadline, rid, deadline),
    )
    await conn.execute(
        "UPDATE allocations SET until = %s, updated_at = compute_now()"
        " WHERE reservation_id = %s AND until > %s",
        (deadline, rid, deadline),
    )
    condition = states.condition(
        states.Condition.PREEMPTED,
        states.Reason.SPOT_PREEMPTED,
        f"preempted by {by}: released at {moments.rfc3339(durations.to_ms(deadline))}",
        at_ms=durations.to_ms(now),
        deadline=durations.to_ms(deadline),
    )
    await conn.execute(
        "UPDATE reservations SET during = tstzrange(lower(during), %s),"
        " conditions = conditions || %s, version = version + 1, updated_at = compute_now()"
        " WHERE id = %s",
        (deadline, jsonb([condition]), rid),
    )
    await journal.wake(conn, reservation_id=rid, at=deadline, why="preempted")
    await journal.emit(
        conn,
        "reservation.preempting",
        reservation_id=rid,
        data={
            "state": "active",
            "poolId": pool_id,
            "preemptedBy": by,
            "deadline": durations.to_ms(deadline),
        },
    )
