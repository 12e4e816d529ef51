"""Which spot reservations a regular request may preempt so that it fits.

Why it exists: spot work runs on capacity nobody else needs right now, and gives it back when a
regular request needs it. The choice must be the smallest set whose release makes the request
fit, must prefer work that has not started (nothing is interrupted), then the latest created
(the newest spot work goes first), and must never touch a regular reservation. Pure, so the
rule is tested by itself; the store applies it under the pool lock, in the same transaction as
the preemptor's placement, so two preemptors never pick the same victims.

What it must never do: I/O, read a clock, or choose a reservation that is not spot (the caller
passes spot reservations only, and each candidate says it is one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bettercompute.core import placement


@dataclass(frozen=True)
class Candidate:
    """A spot reservation booked in the window: its atoms and what it books of each host."""

    reservation_id: str
    started: bool
    created_ms: int
    atom_ids: frozenset[str]
    host: Mapping[str, Mapping[str, int]] = field(default_factory=dict)


def choose(
    *,
    snapshot: placement.Snapshot,
    demand: placement.Demand,
    candidates: Sequence[Candidate],
) -> list[Candidate] | None:
    """The smallest set of ``candidates`` (found greedily, then pruned) whose bookings, once
    gone, let ``demand`` fit; ``None`` when even all of them would not do. ``snapshot`` is the
    pool in the window *without* the candidates' bookings (busy atoms and hosts' use of every
    other reservation): those not chosen are added back.

    Order of preference: not started first, then the latest created, then the id."""
    ordered = sorted(candidates, key=lambda c: (c.started, -c.created_ms, c.reservation_id))
    chosen: list[Candidate] = []
    for candidate in ordered:
        chosen.append(candidate)
        if _fits(snapshot, demand, ordered, chosen):
            break
    else:
        return None
    # Prune: the last one added was needed; drop any earlier one the rest can do without,
    # the least preferred first.
    for candidate in list(reversed(chosen[:-1])):
        rest = [c for c in chosen if c is not candidate]
        if _fits(snapshot, demand, ordered, rest):
            chosen = rest
    return chosen


def _fits(
    snapshot: placement.Snapshot,
    demand: placement.Demand,
    candidates: Sequence[Candidate],
    gone: Sequence[Candidate],
) -> bool:
    gone_ids = {c.reservation_id for c in gone}
    kept = [c for c in candidates if c.reservation_id not in gone_ids]
    busy = snapshot.busy.union(*(c.atom_ids for c in kept))
    host = {node: dict(use) for node, use in snapshot.host_busy.items()}
    for other in kept:
        for node, use in other.host.items():
            mine = host.setdefault(node, {})
            for name, amount in use.items():
                mine[name] = mine.get(name, 0) + amount
    with_kept = placement.Snapshot(
        nodes=snapshot.nodes, atoms=snapshot.atoms, busy=busy, host_busy=host, index=snapshot.index
    )
    return isinstance(placement.try_place(snapshot=with_kept, demand=demand), placement.Placed)
