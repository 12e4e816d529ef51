"""Placement inside a transaction: lock the pool, read a snapshot, decide purely, apply.

The kueue habit: the decision is ``core.placement.place`` over a copy; only then do we write,
with guarded statements. The pool's advisory lock serialises placements of one pool, so a
snapshot cannot go stale under us; the ``EXCLUDE`` constraint on bookings is the last word
anyway (a node moved between pools mid-flight would be caught there, and answered as no-fit).
Called by admission (transaction 2) and by the reconciler (retries, re-placement, repair).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

import psycopg.errors

from bettercompute.core import ids, placement, pools
from bettercompute.store.database import Conn

_NODES = "SELECT id, name, ready, connected, labels FROM nodes WHERE pool_id = %s"
_ATOMS = """
    SELECT a.id, a.node_id, a.kind, a.device_id, a.parent_gpu, a.profile, a.numa_node,
           a.nvlink_domain, a.healthy
      FROM atoms a JOIN nodes n ON n.id = a.node_id
     WHERE n.pool_id = %s AND NOT a.retired AND (a.kind = ANY(%s) OR %s)
"""
_BUSY = """
    SELECT DISTINCT b.atom_id
      FROM bookings b JOIN atoms a ON a.id = b.atom_id JOIN nodes n ON n.id = a.node_id
     WHERE n.pool_id = %s AND b.during && tstzrange(%s, %s) AND b.reservation_id <> %s
"""


async def lock_pool(conn: Conn, pool_id: str) -> None:
    """The pool lock: every transaction that books in a pool takes it first."""
    await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (pool_id,))


async def snapshot(
    conn: Conn,
    *,
    pool_id: str,
    kinds: list[str],
    start: dt.datetime,
    end: dt.datetime,
    ignore_reservation: str,
    whole_node: bool = False,
) -> placement.Snapshot:
    nodes = [
        placement.Node(
            id=r["id"],
            name=r["name"],
            ready=r["ready"],
            connected=r["connected"],
            labels=system_labels(r["labels"]),
        )
        for r in await (await conn.execute(_NODES, (pool_id,))).fetchall()
    ]
    atoms = [
        placement.Atom(
            id=r["id"],
            node_id=r["node_id"],
            kind=r["kind"],
            device_id=r["device_id"],
            parent_gpu=r["parent_gpu"],
            profile=r["profile"],
            numa_node=r["numa_node"],
            nvlink_domain=r["nvlink_domain"],
            healthy=r["healthy"],
        )
        for r in await (await conn.execute(_ATOMS, (pool_id, kinds, whole_node))).fetchall()
    ]
    busy_rows = await (
        await conn.execute(_BUSY, (pool_id, start, end, ignore_reservation))
    ).fetchall()
    return placement.Snapshot(
        nodes=nodes, atoms=atoms, busy=frozenset(r["atom_id"] for r in busy_rows)
    )


def system_labels(labels: Mapping[str, Any]) -> dict[str, str]:
    """Only labels whose source is ``system`` count for capacity (an operator cannot forge a
    capability by labelling a node)."""
    out: dict[str, str] = {}
    for key, entry in (labels or {}).items():
        if isinstance(entry, dict) and entry.get("source") == "system":
            out[key] = str(entry.get("value", ""))
    return out


async def place(
    conn: Conn,
    *,
    reservation_id: str,
    pool_id: str,
    request: Mapping[str, Any],
    start: dt.datetime,
    end: dt.datetime,
) -> placement.Outcome:
    """Place and book ``request`` for [start, end) in one pool; the caller's transaction commits.

    On ``Placed`` the bookings and one ``planned`` allocation per node are written. A booking
    refused by the ``EXCLUDE`` constraint (the snapshot went stale despite the lock) is answered
    as a no-fit, so the reservation waits and is retried rather than failing.
    """
    demand = pools.demand(request=request)
    await lock_pool(conn, pool_id)
    snap = await snapshot(
        conn,
        pool_id=pool_id,
        kinds=sorted({d.device_class for d in demand.devices}),
        start=start,
        end=end,
        ignore_reservation=reservation_id,
        whole_node=demand.whole_node,
    )
    outcome = placement.place(snapshot=snap, demand=demand)
    if isinstance(outcome, placement.NoFit):
        return outcome
    by_id = {a.id: a for a in snap.atoms}
    try:
        async with conn.transaction():  # a savepoint: a refused booking undoes only this
            await _book(conn, reservation_id, outcome, by_id, start, end)
    except psycopg.errors.ExclusionViolation:
        return placement.NoFit(
            message="a concurrent booking took the devices; retrying", rejected={"capacity": 1}
        )
    return outcome


async def _book(
    conn: Conn,
    reservation_id: str,
    outcome: placement.Placed,
    by_id: Mapping[str, placement.Atom],
    start: dt.datetime,
    end: dt.datetime,
) -> None:
    alloc_ids: list[str] = []
    node_ids: list[str] = []
    classes: list[str] = []
    devices: list[str] = []  # per allocation, comma-joined: arrays of arrays must be rectangular
    atoms: list[str] = []
    booking_atoms: list[str] = []
    booking_allocs: list[str] = []
    for member in outcome.members:
        alloc = ids.new_id("alloc")
        member_atoms = [by_id[a] for a in member.atom_ids]
        alloc_ids.append(alloc)
        node_ids.append(member.node_id)
        classes.append(member_atoms[0].kind)
        devices.append(",".join(a.device_id for a in member_atoms))
        atoms.append(",".join(a.id for a in member_atoms))
        booking_atoms.extend(member.atom_ids)
        booking_allocs.extend([alloc] * len(member.atom_ids))
    await conn.execute(
        """
        INSERT INTO allocations (id, reservation_id, node_id, device_class, device_ids, atom_ids,
                                 until)
        SELECT a.id, %s, a.node, a.class, string_to_array(a.devices, ','),
               string_to_array(a.atoms, ','), %s
          FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[])
               AS a(id, node, class, devices, atoms)
        """,
        (reservation_id, end, alloc_ids, node_ids, classes, devices, atoms),
    )
    await conn.execute(
        """
        INSERT INTO bookings (atom_id, reservation_id, allocation_id, during)
        SELECT b.atom, %s, b.alloc, tstzrange(%s, %s)
          FROM unnest(%s::text[], %s::text[]) AS b(atom, alloc)
        """,
        (reservation_id, start, end, booking_atoms, booking_allocs),
    )


async def unbook(conn: Conn, *, reservation_id: str) -> None:
    """Drop every booking and allocation of a reservation (re-placement, cancel, failure)."""
    await conn.execute("DELETE FROM bookings WHERE reservation_id = %s", (reservation_id,))
    await conn.execute("DELETE FROM allocations WHERE reservation_id = %s", (reservation_id,))
