"""Placement inside a transaction: lock the pool, read a snapshot, decide purely, apply.

The kueue habit: the decision is ``core.placement.place`` over a copy; only then do we write,
with guarded statements. The pool's advisory lock serialises placements of one pool, so the
snapshot cannot go stale under us; the ``EXCLUDE`` constraint on bookings is the last word
anyway: a violation aborts the caller's transaction, which is retried from the start.

Why a cache: a pool's nodes and atoms change rarely and are most of a snapshot. They are kept
per pool in ``InventoryCache`` under the pool's ``inventory_version`` (bumped in the same
transaction as any node or atom change), so a placement reads only the version and the atoms
busy in its window. Called by admission (transaction 2) and by the reconciler.

The placed and pending marks are here too, each one statement (``bc_mark_placed``,
``bc_mark_pending``) built in one place: admission sends it inside its pipelined script, the
reconciler executes it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Mapping
from typing import Any

from bettercompute.core import ids, placement, pools, states
from bettercompute.core.durations import to_ms
from bettercompute.store.caching import Inventory, InventoryCache
from bettercompute.store.database import Conn, jsonb

# A node's bookable host rows: vcpu less the CPUs the host keeps for itself (the pool's
# ``policy.hostReserve.vcpu``, default 2), the others as they are.
_NODES = """
    SELECT n.id, n.name, n.ready, n.connected, n.labels,
           (SELECT coalesce(jsonb_object_agg(h.resource, CASE WHEN h.resource = 'vcpu'
                        THEN greatest(h.capacity - coalesce(
                                 (p.policy -> 'hostReserve' ->> 'vcpu')::integer, 2), 0)
                        ELSE h.capacity END), '{}')
              FROM host_resources h WHERE h.node_id = n.id) AS host
      FROM nodes n JOIN pools p ON p.id = n.pool_id
     WHERE n.pool_id = %s ORDER BY n.id
"""
_ATOMS = """
    SELECT a.id, a.node_id, a.kind, a.device_id, a.parent_gpu, a.profile, a.numa_node,
           a.nvlink_domain, a.healthy
      FROM atoms a JOIN nodes n ON n.id = a.node_id
     WHERE n.pool_id = %s AND NOT a.retired ORDER BY a.id
"""


async def lock_pool(conn: Conn, pool_id: str) -> None:
    """The pool lock: every transaction that books in a pool takes it first."""
    await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (pool_id,))


async def _inventory(conn: Conn, pool_id: str, version: int) -> Inventory:
    nodes = tuple(
        placement.Node(
            id=r["id"],
            name=r["name"],
            ready=r["ready"],
            connected=r["connected"],
            labels=system_labels(r["labels"]),
            host={str(k): int(v) for k, v in (r["host"] or {}).items()},
        )
        for r in await (await conn.execute(_NODES, (pool_id,))).fetchall()
    )
    atoms = tuple(
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
        for r in await (await conn.execute(_ATOMS, (pool_id,))).fetchall()
    )
    return Inventory(version=version, nodes=nodes, atoms=atoms)


async def snapshot(
    conn: Conn,
    *,
    cache: InventoryCache | None,
    pool_id: str,
    start: dt.datetime,
    end: dt.datetime,
    ignore_reservation: str,
) -> placement.Snapshot:
    row = await (
        await conn.execute(
            "SELECT b.*, bc_busy_hosts(%s, %s, %s, %s) AS host_busy"
            " FROM bc_busy_atoms(%s, %s, %s, %s) b",
            (pool_id, start, end, ignore_reservation) * 2,
        )
    ).fetchone()
    if row is None:
        return placement.Snapshot(nodes=(), atoms=(), busy=frozenset())
    return await snapshot_from(
        conn,
        cache=cache,
        pool_id=pool_id,
        version=int(row["inventory_version"]),
        busy=row["busy"],
        host_busy=row["host_busy"],
    )


async def snapshot_from(
    conn: Conn,
    *,
    cache: InventoryCache | None,
    pool_id: str,
    version: int,
    busy: list[str],
    host_busy: Mapping[str, list[int]] | None = None,
) -> placement.Snapshot:
    """A snapshot from the dynamic part already read (``bc_busy_atoms``, ``bc_busy_hosts``)
    and the inventory."""
    inventory = cache.get(pool_id, version) if cache is not None else None
    if inventory is None:
        # Read under the pool lock after the version: an inventory change bumps the version in
        # its own transaction, so what we read belongs to this version or a later one, and a
        # later one is read again on the next placement.
        inventory = await _inventory(conn, pool_id, version)
        if cache is not None:
            cache.put(pool_id, inventory)
    return placement.Snapshot(
        nodes=inventory.nodes,
        atoms=inventory.atoms,
        busy=frozenset(busy),
        host_busy=_HostUse(host_busy or {}),
        index=inventory.index,
    )


def atoms_by_id(snap: placement.Snapshot) -> Mapping[str, placement.Atom]:
    """The snapshot's atoms by id: kept by the inventory's index, so a booking does not index a
    pool of thousands of atoms to name the few it books."""
    index = snap.index
    if index is not None and index.atoms is snap.atoms:
        return index.atom_of
    return {a.id: a for a in snap.atoms}


class _HostUse(Mapping[str, Mapping[str, int]]):
    """Per node, what other reservations book of its host, from ``{node: [vcpu, memoryGiB,
    hugepages1Gi]}`` as ``bc_busy_hosts`` sums it. Read lazily: a placement looks at the host
    of the few nodes it screens one by one, not of every node booked in the window."""

    def __init__(self, sums: Mapping[str, list[int]]) -> None:
        self._sums = sums

    def __getitem__(self, node: str) -> Mapping[str, int]:
        v, m, h = self._sums[node]
        return {"vcpu": int(v), "memoryGiB": int(m), "hugepages1Gi": int(h)}

    def __iter__(self) -> Iterator[str]:
        return iter(self._sums)

    def __len__(self) -> int:
        return len(self._sums)


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
    cache: InventoryCache | None = None,
    reservation_id: str,
    pool_id: str,
    request: Mapping[str, Any],
    start: dt.datetime,
    end: dt.datetime,
) -> placement.Outcome:
    """Place and book ``request`` for [start, end) in one pool; the caller's transaction commits.

    On ``Placed`` the bookings and one ``planned`` allocation per node are written (without
    waiting for the answers: in pipeline mode they travel with the rest of the transaction).
    """
    demand = pools.demand(request=request)
    await lock_pool(conn, pool_id)
    snap = await snapshot(
        conn,
        cache=cache,
        pool_id=pool_id,
        start=start,
        end=end,
        ignore_reservation=reservation_id,
    )
    outcome = placement.place(snapshot=snap, demand=demand)
    if isinstance(outcome, placement.Placed):
        await book(
            conn,
            reservation_id=reservation_id,
            pool_id=pool_id,
            outcome=outcome,
            atom_of=atoms_by_id(snap),
            start=start,
            end=end,
            host=demand.host,
        )
    return outcome


def book_statement(
    *,
    reservation_id: str,
    pool_id: str,
    outcome: placement.Placed,
    atom_of: Mapping[str, placement.Atom],
    start: dt.datetime,
    end: dt.datetime,
    host: Mapping[str, int] | None = None,
) -> tuple[str, tuple[Any, ...]]:
    """The statement that writes the bookings and one ``planned`` allocation per node, and
    with ``host`` (what each member books of its node's host) the guarded host booking.
    ``atom_of``: the snapshot's atoms by id (``atoms_by_id``)."""
    by_id = atom_of
    alloc_ids: list[str] = []
    devices: list[str] = []  # per allocation, comma-joined: arrays of arrays must be rectangular
    atom_lists: list[str] = []
    booking_atoms: list[str] = []
    booking_allocs: list[str] = []
    for member in outcome.members:
        alloc = ids.new_id("alloc")
        alloc_ids.append(alloc)
        devices.append(",".join(by_id[a].device_id for a in member.atom_ids))
        atom_lists.append(",".join(member.atom_ids))
        booking_atoms.extend(member.atom_ids)
        booking_allocs.extend([alloc] * len(member.atom_ids))
    sql = "SELECT bc_book(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
    params: tuple[Any, ...] = (
        reservation_id,
        pool_id,
        start,
        end,
        alloc_ids,
        [m.node_id for m in outcome.members],
        [by_id[m.atom_ids[0]].kind for m in outcome.members],
        devices,
        atom_lists,
        booking_atoms,
        booking_allocs,
    )
    if host and any(host.values()):
        # The same statement books each member's share of its host and checks the nodes.
        members = len(alloc_ids)
        sql = "SELECT bc_book(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
        params += (
            [int(host.get("vcpu", 0))] * members,
            [int(host.get("memoryGiB", 0))] * members,
            [int(host.get("hugepages1Gi", 0))] * members,
        )
    return sql, params


async def book(
    conn: Conn,
    *,
    reservation_id: str,
    pool_id: str,
    outcome: placement.Placed,
    atom_of: Mapping[str, placement.Atom],
    start: dt.datetime,
    end: dt.datetime,
    host: Mapping[str, int] | None = None,
) -> None:
    """Write the bookings and one ``planned`` allocation per node, with what each books of its
    host (``bc_book``)."""
    sql, params = book_statement(
        reservation_id=reservation_id,
        pool_id=pool_id,
        outcome=outcome,
        atom_of=atom_of,
        start=start,
        end=end,
        host=host,
    )
    await conn.execute(sql, params)


async def unbook(conn: Conn, *, reservation_id: str) -> None:
    """Drop every booking and allocation of a reservation (re-placement, cancel, failure)."""
    await conn.execute("DELETE FROM bookings WHERE reservation_id = %s", (reservation_id,))
    await conn.execute("DELETE FROM allocations WHERE reservation_id = %s", (reservation_id,))


def mark_placed_statement(
    *,
    reservation_id: str,
    pool_id: str,
    outcome: placement.Placed,
    start: dt.datetime,
    end: dt.datetime,
    lease: dt.datetime | None,
    now: dt.datetime,
    event: str = "reservation.placed",
    quota_charge: Mapping[str, int] | None = None,
) -> tuple[str, tuple[Any, ...]]:
    """The statement that marks the reservation ``placed`` on ``outcome``: window, binding,
    wake-ups, event (and the quota charge, at admission)."""
    return (
        "SELECT bc_mark_placed(%s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (
            reservation_id,
            pool_id,
            start,
            end,
            lease,
            now,
            [m.node_id for m in outcome.members],
            event,
            jsonb(dict(quota_charge)) if quota_charge is not None else None,
        ),
    )


def mark_pending_statement(
    *,
    reservation_id: str,
    pool_id: str,
    message: str,
    now: dt.datetime,
    first: bool,
    reason: str = states.Reason.NO_FIT,
    quota_charge: Mapping[str, int] | None = None,
) -> tuple[str, tuple[Any, ...]]:
    """The statement that marks the reservation ``pending`` with ``Unschedulable``, retried in
    30 s (sooner when capacity is freed); the ``pending`` event only the ``first`` time."""
    cond = states.condition(states.Condition.UNSCHEDULABLE, reason, message, at_ms=to_ms(now))
    return (
        "SELECT bc_mark_pending(%s, %s, %s, %s, %s, %s, %s)",
        (
            reservation_id,
            pool_id,
            jsonb(cond),
            str(reason),
            now,
            first,
            jsonb(dict(quota_charge)) if quota_charge is not None else None,
        ),
    )
