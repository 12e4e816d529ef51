"""The earliest windows a request would fit in: ``capacity.search``.

Why it exists: "when is the earliest window for 8 H100s for 24 hours?" is the first question of
anyone booking ahead. The answer must be what a create would get at that moment, so each
candidate start is judged by the same placer (``placement``) as a create, on the pool as its
bookings leave it in that window, host resources and labels included.

How: a window can only open when a booking ends (or at ``from``), so the candidate starts are
``from`` and every booking end within the horizon: boundaries, never a clock grid. The starts
are swept in order while the bookings overlapping ``[start, start + duration)`` are kept
incrementally (they enter by start, leave by end), so the pool's bookings are read once and
each candidate costs one placement. It stops at ``limit`` windows or ``max_tries`` placements.

What it must never do: I/O or read a clock; book or decide anything.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bettercompute.core import placement

#: Placements one search may try before it answers with what it found.
MAX_TRIES = 2000


@dataclass(frozen=True)
class Booking:
    """One device booking of the pool, as the search reads it (epoch ms)."""

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
    bookings: Sequence[Booking],
    demand: placement.Demand,
    from_ms: int,
    latest_start_ms: int,
    duration_ms: int,
    limit: int,
    max_tries: int = MAX_TRIES,
) -> Found:
    """Up to ``limit`` windows ``[start, start + duration)`` in start order, each the earliest
    at its boundary where ``demand`` fits, with ``from_ms <= start <= latest_start_ms``."""
    starts = sorted(
        {from_ms} | {b.end_ms for b in bookings if from_ms < b.end_ms <= latest_start_ms}
    )
    by_start = sorted(bookings, key=lambda b: b.start_ms)
    entering = 0
    ending: list[tuple[int, int]] = []  # (end, index) of bookings in the active set
    active: dict[int, Booking] = {}
    busy: dict[str, int] = {}  # atom -> how many active bookings hold it
    host: dict[str, dict[str, int]] = {}
    windows: list[Window] = []
    tried = 0
    for start in starts:
        end = start + duration_ms
        while entering < len(by_start) and by_start[entering].start_ms < end:
            booking = by_start[entering]
            if booking.end_ms > start:
                active[entering] = booking
                heapq.heappush(ending, (booking.end_ms, entering))
                _count(busy, host, booking, +1)
            entering += 1
        while ending and ending[0][0] <= start:
            _, index = heapq.heappop(ending)
            _count(busy, host, active.pop(index), -1)
        if tried >= max_tries:
            return Found(windows=tuple(windows), tried=tried, exhausted=True)
        tried += 1
        outcome = placement.try_place(
            snapshot=placement.Snapshot(
                nodes=nodes,
                atoms=atoms,
                busy=frozenset(busy),
                host_busy=host,
            ),
            demand=demand,
        )
        if isinstance(outcome, placement.Placed):
            windows.append(Window(start, end, tuple(m.node_id for m in outcome.members)))
            if len(windows) >= limit:
                break
    return Found(windows=tuple(windows), tried=tried, exhausted=False)


def _count(
    busy: dict[str, int], host: dict[str, dict[str, int]], booking: Booking, sign: int
) -> None:
    held = busy.get(booking.atom_id, 0) + sign
    if held:
        busy[booking.atom_id] = held
    else:
        busy.pop(booking.atom_id, None)
    if booking.host_node is not None:
        use = host.setdefault(booking.host_node, {"vcpu": 0, "memoryGiB": 0, "hugepages1Gi": 0})
        use["vcpu"] += sign * booking.vcpu
        use["memoryGiB"] += sign * booking.memory_gib
        use["hugepages1Gi"] += sign * booking.hugepages_1gi


def as_bookings(rows: Sequence[Mapping[str, object]]) -> list[Booking]:
    """Rows of ``atom_id, start_ms, end_ms, host_node, host_vcpu, host_memory_gib,
    host_hugepages_1gi`` as bookings."""
    return [
        Booking(
            atom_id=str(r["atom_id"]),
            start_ms=int(str(r["start_ms"])),
            end_ms=int(str(r["end_ms"])),
            host_node=None if r["host_node"] is None else str(r["host_node"]),
            vcpu=int(str(r["host_vcpu"])),
            memory_gib=int(str(r["host_memory_gib"])),
            hugepages_1gi=int(str(r["host_hugepages_1gi"])),
        )
        for r in rows
    ]
