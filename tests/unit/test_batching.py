"""The batch plan's rules as a table: rounds by tenant, first come first served, and packing
that never overtakes an older request that fits."""

from __future__ import annotations

import dataclasses
import datetime as dt
import random

from bettercompute.core import batching, placement
from tests.unit.test_placement import SnapshotBuilder, gpu

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def queued(
    rid: str, *, tenant: str = "acme", at: int = 0, count: int = 1, topology: str = "any"
) -> batching.Queued:
    return batching.Queued(
        reservation_id=rid,
        tenant_id=tenant,
        requested=T0 + dt.timedelta(seconds=at),
        created=T0 + dt.timedelta(seconds=at),
        start=T0,
        end=T0 + dt.timedelta(hours=1),
        demand=placement.Demand(devices=(gpu(count, topology),)),
    )


def test_fair_order_takes_rounds_by_tenant_first_come_first_served_within() -> None:
    flood = [queued(f"a{i}", at=i) for i in range(4)]
    late = queued("b0", tenant="globex", at=10)
    other = queued("c0", tenant="initech", at=2)
    order = [q.reservation_id for q in batching.fair_order([*flood, late, other])]
    assert order == ["a0", "c0", "b0", "a1", "a2", "a3"]


def test_the_requested_start_comes_before_creation() -> None:
    later = dataclasses.replace(queued("x", at=0), requested=T0 + dt.timedelta(days=1))
    sooner = queued("y", at=5)
    assert [q.reservation_id for q in batching.fair_order([later, sooner])] == ["y", "x"]


def test_the_batch_sees_its_own_bookings() -> None:
    snap = SnapshotBuilder().node("n0", gpus=4).build()
    plan = batching.plan(
        nodes=snap.nodes,
        atoms=snap.atoms,
        booked=[batching.Booked("n0.g0", T0, T0 + dt.timedelta(hours=2))],
        queued=[queued("r0", count=2), queued("r1", at=1, count=2)],
    )
    outcomes = {d.queued.reservation_id: d.outcome for d in plan}
    assert isinstance(outcomes["r0"], placement.Placed)
    assert isinstance(outcomes["r1"], placement.NoFit)  # 3 free, 2 taken by r0


def test_largest_first_wins_only_when_it_places_everyone_fair_order_did_and_more() -> None:
    # n0 has 4 GPUs, n1 3, n2 1. In fair order r0 (2) takes n1 (best fit), r1 (3) n0, and
    # r3 (2) finds no node with two free. Largest first, r1 takes n1 whole and both pairs fit
    # on n0: a strict superset, so it wins; r2 (three NVLink GPUs) fits neither way.
    snap = SnapshotBuilder().node("n0", gpus=4).node("n1", gpus=3).node("n2", gpus=1).build()
    qs = [
        queued("r0", at=0, count=2),
        queued("r1", at=1, count=3),
        queued("r2", at=2, count=3, topology="nvlink-all"),
        queued("r3", at=3, count=2),
    ]
    plan = batching.plan(nodes=snap.nodes, atoms=snap.atoms, booked=[], queued=qs)
    placed = {d.queued.reservation_id for d in plan if isinstance(d.outcome, placement.Placed)}
    assert placed == {"r0", "r1", "r3"}


def test_packing_never_overtakes_an_older_request_that_fits() -> None:
    # Largest first would place r1 (4) instead of r0 (1): no more placed, and r0 is older.
    snap = SnapshotBuilder().node("n0", gpus=4).build()
    qs = [queued("r0", at=0, count=1), queued("r1", at=1, count=4)]
    plan = batching.plan(nodes=snap.nodes, atoms=snap.atoms, booked=[], queued=qs)
    placed = [d.queued.reservation_id for d in plan if isinstance(d.outcome, placement.Placed)]
    assert placed == ["r0"]


def _naive_plan(
    index: placement.PoolIndex, booked: list[batching.Booked], ordered: list[batching.Queued]
) -> list[batching.Decision]:
    """The greedy pass as it was: every request's snapshot summed from every booking so far."""
    taken = list(booked)
    out: list[batching.Decision] = []
    for q in ordered:
        busy = {b.atom_id for b in taken if b.start < q.end and q.start < b.end}
        host: dict[str, dict[str, int]] = {}
        for b in taken:
            if b.start < q.end and q.start < b.end and b.host_node is not None:
                use = host.setdefault(b.host_node, {"vcpu": 0, "memoryGiB": 0, "hugepages1Gi": 0})
                for name in use:
                    use[name] += int(b.host.get(name, 0))
        snapshot = placement.Snapshot(
            nodes=index.nodes, atoms=index.atoms, busy=frozenset(busy), host_busy=host
        )
        outcome = placement.place(snapshot=snapshot, demand=q.demand)
        if isinstance(outcome, placement.Placed):
            host_use = {k: v for k, v in q.demand.host.items() if v}
            for member in outcome.members:
                taken += [
                    batching.Booked(
                        a,
                        q.start,
                        q.end,
                        member.node_id if i == 0 and host_use else None,
                        host_use if i == 0 else {},
                    )
                    for i, a in enumerate(member.atom_ids)
                ]
        out.append(batching.Decision(q, outcome))
    return out


def test_the_greedy_pass_sees_the_pools_bookings_and_the_batchs_own_per_window() -> None:
    # Windows that overlap in part, host use, bookings of the pool before the batch: the plan
    # (one gathering of the pool's bookings per window) decides as summing every booking did.
    for seed in range(40):
        rng = random.Random(seed)
        builder = SnapshotBuilder()
        for n in range(6):
            builder.node(f"n{n}", domains=[2, 2])
        snap = builder.build()
        nodes = tuple(replace_host(node) for node in snap.nodes)
        index = placement.PoolIndex(nodes, tuple(snap.atoms))
        hour = dt.timedelta(hours=1)
        booked = [
            batching.Booked(
                atom.id,
                T0 + rng.randint(0, 3) * hour,
                T0 + rng.randint(4, 6) * hour,
                atom.node_id if rng.random() < 0.5 else None,
                {"vcpu": rng.choice((8, 30))},
            )
            for atom in index.atoms
            if rng.random() < 0.4
        ]
        ordered = []
        for k in range(10):
            start = T0 + rng.randint(0, 5) * hour
            q = dataclasses.replace(
                queued(f"q{k}", at=k, count=rng.randint(1, 3)),
                start=start,
                end=start + rng.randint(1, 3) * hour,
            )
            if rng.random() < 0.5:
                q = dataclasses.replace(
                    q, demand=dataclasses.replace(q.demand, host={"vcpu": rng.choice((8, 30))})
                )
            ordered.append(q)
        ordered = batching.fair_order(ordered)
        got = batching._greedy(index, booked, ordered)
        assert got == _naive_plan(index, booked, ordered), f"seed {seed}"


def replace_host(node: placement.Node) -> placement.Node:
    return dataclasses.replace(node, host={"vcpu": 64, "memoryGiB": 512})
