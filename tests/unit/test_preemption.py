"""``core.preemption.choose``: the fewest spot reservations whose release lets the request
fit; not started before running, the latest created first; none when spot work cannot do."""

from __future__ import annotations

from bettercompute.core import placement, preemption


def pool(gpus: int) -> tuple[list[placement.Node], list[placement.Atom]]:
    node = placement.Node(id="n", name="n", ready=True, connected=True, labels={})
    atoms = [
        placement.Atom(
            id=f"g{i}",
            node_id="n",
            kind="gpu",
            device_id=f"GPU-{i}",
            parent_gpu=f"GPU-{i}",
            profile=None,
            numa_node=0,
            nvlink_domain=None,
            healthy=True,
        )
        for i in range(gpus)
    ]
    return [node], atoms


def spot(rid: str, atoms: set[str], *, started: bool = False, created: int = 0):
    return preemption.Candidate(rid, started, created, frozenset(atoms))


def choose(need: int, candidates, busy: set[str] = frozenset()):  # type: ignore[no-untyped-def]
    nodes, atoms = pool(8)
    return preemption.choose(
        snapshot=placement.Snapshot(nodes=nodes, atoms=atoms, busy=frozenset(busy)),
        demand=placement.Demand(devices=[placement.DeviceDemand("gpu", need)]),
        candidates=candidates,
    )


def test_not_started_and_latest_created_go_first_and_only_as_many_as_needed() -> None:
    running = spot("running", {"g0", "g1"}, started=True, created=1)
    old = spot("old", {"g2", "g3"}, created=2)
    new = spot("new", {"g4", "g5"}, created=3)
    chosen = choose(4, [running, old, new], busy={"g6", "g7"})
    assert [c.reservation_id for c in chosen or ()] == ["new", "old"]
    chosen = choose(2, [running, old, new], busy={"g6", "g7"})
    assert [c.reservation_id for c in chosen or ()] == ["new"]


def test_a_victim_the_rest_makes_unneeded_is_pruned() -> None:
    # The newest is preferred, but too small alone; with the big one it is not needed.
    small = spot("small", {"g0"}, created=9)
    big = spot("big", {"g1", "g2", "g3", "g4"}, created=1)
    chosen = choose(4, [small, big], busy={"g5", "g6", "g7"})
    assert [c.reservation_id for c in chosen or ()] == ["big"]


def test_none_when_all_spot_work_would_not_make_room() -> None:
    assert choose(8, [spot("s", {"g0"})], busy={"g1", "g2"}) is None
