"""The earliest windows a request would fit in: ``capacity.search``.

Why it exists: "when is the earliest window for 8 H100s for 24 hours?" is the first question of
anyone booking ahead. The answer must be what a create would get at that moment, so each
candidate start is judged by the same placer (``placement``) as a create, on the pool as its
bookings leave it in that window, host resources and labels included.

How: a window can only open when a booking ends (or at ``from``), so the candidate starts are
``from`` and every booking end within the horizon: boundaries, never a clock grid. The starts
are swept in order while the bookings overlapping ``[start, start + duration)`` are kept
incrementally (they enter by start, leave by end), so the pool's bookings are read once; at
each candidate only the nodes whose bookings changed are judged again (a node's verdict
depends on its own bookings alone). It stops at ``limit`` windows or ``max_tries`` starts.

What it must never do: I/O or read a clock; book or decide anything.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace
from operator import itemgetter
from typing import NamedTuple

from bettercompute.core import placement

#: Placements one search may try before it answers with what it found.
MAX_TRIES = 2000


#: A booking as a plain tuple, in ``Booking``'s field order (what the store hands over).
Row = tuple[str, int, int, str | None, int, int, int]


class Booking(NamedTuple):
    """One device booking of the pool, as the search reads it (epoch ms). A tuple: a search
    reads tens of thousands, straight from the database's arrays."""

    atom_id: str
    start_ms: int
    end_ms: int
    #: What it books of its node's host (only the allocation's first device booking carries it).
    host_node: str | None = None
    vcpu: int = 0
    memory_gib: int = 0
    hugepages_1gi: int = 0


@dataclass(frozen=True)
class Window:
    start_ms: int
    end_ms: int
    node_ids: tuple[str, ...]


@dataclass(frozen=True)
class Found:
    windows: tuple[Window, ...]
    #: Candidate starts judged; ``exhausted``: stopped at ``max_tries`` before the horizon ended.
    tried: int
    exhausted: bool


def earliest(
    *,
    nodes: Sequence[placement.Node],
    atoms: Sequence[placement.Atom],
    bookings: Sequence[Row],
    demand: placement.Demand,
    from_ms: int,
    latest_start_ms: int,
    duration_ms: int,
    limit: int,
    max_tries: int = MAX_TRIES,
) -> Found:
    """Up to ``limit`` windows ``[start, start + duration)`` in start order, each the earliest
    at its boundary where ``demand`` fits, with ``from_ms <= start <= latest_start_ms``.

    Each node's verdict (could one member fit there?) is kept between candidate starts and
    judged again only on the nodes whose bookings in the window changed; the placer then
    chooses among the nodes that fit, exactly as a create would among them.
    """
    node_of = {a.id: a.node_id for a in atoms}
    atoms_of: dict[str, list[placement.Atom]] = {n.id: [] for n in nodes}
    for atom in atoms:
        if atom.node_id in atoms_of:
            atoms_of[atom.node_id].append(atom)
    member = replace(demand, gang_size=1)
    need = 0 if demand.whole_node else sum(d.count for d in demand.devices)
    starts = sorted({from_ms} | {b[2] for b in bookings if from_ms < b[2] <= latest_start_ms})
    by_start = sorted(bookings, key=itemgetter(1))  # already in start order: one pass
    entering = 0
    ending: list[tuple[int, int]] = []  # (end, index) of bookings in the active set
    active: dict[int, Row] = {}
    busy: dict[str, int] = {}  # atom -> how many active bookings hold it
    host: dict[str, dict[str, int]] = {}
    changed: set[str] = {n.id for n in nodes}
    fits: set[str] = set()
    windows: list[Window] = []
    tried = 0
    pool_index: placement.PoolIndex | None = None
    alone_index: dict[str, placement.PoolIndex] = {}
    for start in starts:
        end = start + duration_ms
        while entering < len(by_start) and by_start[entering][1] < end:
            booking = by_start[entering]
            if booking[2] > start:
                active[entering] = booking
                heapq.heappush(ending, (booking[2], entering))
                _count(busy, host, booking, +1)
                changed.add(node_of.get(booking[0], ""))
            entering += 1
        while ending and ending[0][0] <= start:
            _, index = heapq.heappop(ending)
            booking = active.pop(index)
            _count(busy, host, booking, -1)
            changed.add(node_of.get(booking[0], ""))
        if tried >= max_tries:
            return Found(windows=tuple(windows), tried=tried, exhausted=True)
        tried += 1
        taken = frozenset(busy)
        if demand.gang_size == 1 and len(changed) * 4 > len(nodes):
            # Most nodes changed (the first start): one placement over the pool answers.
            # One index for every start: the pool's nodes and atoms do not change meanwhile.
            pool_index = pool_index or placement.PoolIndex(nodes, atoms)
            whole = placement.Snapshot(
                nodes=nodes, atoms=atoms, busy=taken, host_busy=host, index=pool_index
            )
            outcome = placement.try_place(snapshot=whole, demand=demand)
            if isinstance(outcome, placement.Placed):
                windows.append(Window(start, end, tuple(m.node_id for m in outcome.members)))
                if len(windows) >= limit:
                    break
                continue  # the verdicts stay unknown (changed) until a start does not fit
            fits.clear()  # no node fits this start
            changed.clear()
            continue
        for node in nodes:
            if node.id not in changed:
                continue
            if need and sum(a.healthy and a.id not in taken for a in atoms_of[node.id]) < need:
                fits.discard(node.id)  # fewer usable devices than one member asks: no placement
                continue
            # Each node's own index, built the first time the node is judged.
            own = alone_index.get(node.id)
            if own is None:
                own = alone_index[node.id] = placement.PoolIndex((node,), atoms_of[node.id])
            alone = placement.Snapshot(
                nodes=own.nodes, atoms=own.atoms, busy=taken, host_busy=host, index=own
            )
            if isinstance(placement.try_place(snapshot=alone, demand=member), placement.Placed):
                fits.add(node.id)
            else:
                fits.discard(node.id)
        changed.clear()
        if len(fits) < demand.gang_size:
            continue
        # The whole pool, through its index: the nodes outside ``fits`` cannot hold a member, so
        # the placer chooses among exactly those, as a create would, without a new index for them.
        pool_index = pool_index or placement.PoolIndex(nodes, atoms)
        outcome = placement.try_place(
            snapshot=placement.Snapshot(
                nodes=nodes, atoms=atoms, busy=taken, host_busy=host, index=pool_index
            ),
            demand=demand,
        )
        if isinstance(outcome, placement.Placed):
            windows.append(Window(start, end, tuple(m.node_id for m in outcome.members)))
            if len(windows) >= limit:
                break
    return Found(windows=tuple(windows), tried=tried, exhausted=False)


def _count(busy: dict[str, int], host: dict[str, dict[str, int]], booking: Row, sign: int) -> None:
    atom, _, _, host_node, vcpu, memory, hugepages = booking
    held = busy.get(atom, 0) + sign
    if held:
        busy[atom] = held
    else:
        busy.pop(atom, None)
    if host_node is not None:
        use = host.setdefault(host_node, {"vcpu": 0, "memoryGiB": 0, "hugepages1Gi": 0})
        use["vcpu"] += sign * vcpu
        use["memoryGiB"] += sign * memory
        use["hugepages1Gi"] += sign * hugepages


def as_bookings(
    atoms: Sequence[str],
    starts: Sequence[int],
    ends: Sequence[int],
    host_nodes: Sequence[str | None],
    vcpus: Sequence[int],
    memories: Sequence[int],
    hugepages: Sequence[int],
) -> list[Row]:
    """Bookings from the parallel arrays the store reads them as (one row of arrays: parsed
    by the driver in C, zipped here in C)."""
    return list(zip(atoms, starts, ends, host_nodes, vcpus, memories, hugepages, strict=True))
