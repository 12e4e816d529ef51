"""The pool-lease placer's batch plan: which queued reservations a batch places, in what order.

Why it exists: a batch places many queued requests of one pool on one snapshot, so the order
decides who gets the capacity. The rules live here, pure, so they are tested as a table:

* **Fairness first.** Requests are taken in rounds by tenant: every tenant's oldest request,
  then every tenant's second oldest, and so on; within a round, first come first served (by
  requested start, then creation, then id). One tenant's flood cannot push another tenant's
  single request out of a batch or behind the flood. ``fair_order`` is that rule; the store
  selects a batch's members by the same rule, so a batch of ``maxBatch`` holds everybody's
  oldest requests before anybody's second.
* **Wholes.** A gang, an ``nvlink-all`` set, a whole node: each request is placed whole or not
  at all (``core.placement.place`` decides one request at a time).
* **Packing, without overtaking.** The batch is placed greedily in fair order. When something
  did not fit, the same requests are tried largest first; that order wins only when it places
  every request the fair order placed and more besides. So packing never overtakes an older
  request that fits: it only lets a later request fit as well.

What it must never do: I/O, or read a clock. The store reads the snapshot (inventory, the pool's
bookings in the batch's windows) and the queued requests, and applies the plan with guarded
statements.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bettercompute.core import hosts, placement


@dataclass(frozen=True)
class Booked:
    """A booking already in the pool: one atom for a window, and what it books of its host."""

    atom_id: str
    start: dt.datetime
    end: dt.datetime
    host_node: str | None = None
    host: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Queued:
    """A queued reservation and the window it would book if placed now."""

    reservation_id: str
    tenant_id: str
    #: First come first served: the requested start (its creation when it asked for none)…
    requested: dt.datetime
    #: …then its creation.
    created: dt.datetime
    start: dt.datetime
    end: dt.datetime
    demand: placement.Demand

    @property
    def size(self) -> int:
        """Atoms the request takes, all gang members together (a whole node counts big)."""
        per_member = sum(d.count for d in self.demand.devices)
        if self.demand.whole_node:
            per_member = max(per_member, 1_000)
        return per_member * self.demand.gang_size


@dataclass(frozen=True)
class Decision:
    queued: Queued
    outcome: placement.Outcome


def fair_order(queued: Sequence[Queued]) -> list[Queued]:
    """Rounds by tenant, first come first served within a round (see the module's rule)."""
    fifo = sorted(queued, key=lambda q: (q.requested, q.created, q.reservation_id))
    turns: dict[str, int] = defaultdict(int)
    ranked: list[tuple[int, int, Queued]] = []
    for position, q in enumerate(fifo):
        ranked.append((turns[q.tenant_id], position, q))
        turns[q.tenant_id] += 1
    return [q for _, _, q in sorted(ranked, key=lambda r: (r[0], r[1]))]


def plan(
    *,
    nodes: Sequence[placement.Node],
    atoms: Sequence[placement.Atom],
    booked: Sequence[Booked],
    queued: Sequence[Queued],
    index: placement.PoolIndex | None = None,
) -> list[Decision]:
    """One decision per queued request, in the order they were placed (fair order, or largest
    first when that places a strict superset; see the module's rule). ``index``: the pool's
    ``placement.PoolIndex`` of ``nodes`` and ``atoms`` when the caller keeps one."""
    if index is None or index.nodes is not nodes or index.atoms is not atoms:
        index = placement.PoolIndex(nodes, atoms)
    ordered = fair_order(queued)
    fair = _greedy(index, booked, ordered)
    if all(isinstance(d.outcome, placement.Placed) for d in fair):
        return fair
    largest = sorted(ordered, key=lambda q: -q.size)  # stable: fair order among equals
    packed = _greedy(index, booked, largest)
    placed_fair = _placed_ids(fair)
    placed_packed = _placed_ids(packed)
    if placed_packed > placed_fair:  # a strict superset: nobody older is overtaken
        return packed
    return fair


def _placed_ids(decisions: Sequence[Decision]) -> set[str]:
    return {d.queued.reservation_id for d in decisions if isinstance(d.outcome, placement.Placed)}


def _greedy(
    index: placement.PoolIndex, booked: Sequence[Booked], ordered: Sequence[Queued]
) -> list[Decision]:
    # The pool's bookings are gathered once per distinct window (a batch's requests mostly share
    # one); each request then adds only what this batch booked before it.
    before: dict[tuple[dt.datetime, dt.datetime], _Use] = {}
    taken: list[Booked] = []
    decisions: list[Decision] = []
    for q in ordered:
        window = (q.start, q.end)
        if window not in before:
            before[window] = _overlapping(booked, q.start, q.end, base=(frozenset(), {}))
        busy, host_busy = _overlapping(taken, q.start, q.end, base=before[window])
        snapshot = placement.Snapshot(
            nodes=index.nodes, atoms=index.atoms, busy=busy, host_busy=host_busy, index=index
        )
        outcome = placement.place(snapshot=snapshot, demand=q.demand)
        if isinstance(outcome, placement.Placed):
            taken.extend(_bookings(q, outcome))
        decisions.append(Decision(q, outcome))
    return decisions


# Busy atoms, and per node what its host books.
_Use = tuple[frozenset[str], dict[str, dict[str, int]]]


def _overlapping(
    booked: Sequence[Booked], start: dt.datetime, end: dt.datetime, *, base: _Use
) -> _Use:
    """``base`` and what the bookings that overlap [start, end) take: their atoms and host use
    (summed whether or not they overlap each other: never more generous than the truth, as the
    store's ``bc_busy_hosts``). ``base`` itself is left as it is."""
    busy, host = base
    added: set[str] = set()
    host_busy = dict(host)
    for b in booked:
        if b.start < end and start < b.end:
            added.add(b.atom_id)
            if b.host_node is not None:
                use = dict(host_busy.get(b.host_node) or dict.fromkeys(hosts.BOOKED, 0))
                for name in hosts.BOOKED:
                    use[name] += int(b.host.get(name, 0))
                host_busy[b.host_node] = use
    return (busy | added if added else busy), host_busy


def _bookings(q: Queued, outcome: placement.Placed) -> list[Booked]:
    """The bookings a placement adds; a member's host booking rides on its first atom."""
    out: list[Booked] = []
    host = {k: int(v) for k, v in q.demand.host.items() if v}
    for member in outcome.members:
        for i, atom_id in enumerate(member.atom_ids):
            first = i == 0 and bool(host)
            out.append(
                Booked(
                    atom_id=atom_id,
                    start=q.start,
                    end=q.end,
                    host_node=member.node_id if first else None,
                    host=host if first else {},
                )
            )
    return out
