"""``core.windows.earliest``: candidate starts at booking boundaries, judged by the placer with
the bookings overlapping each window, host resources included."""

from __future__ import annotations

from bettercompute.core import placement, windows


def node(name: str, **host: int) -> placement.Node:
    return placement.Node(id=name, name=name, ready=True, connected=True, labels={}, host=host)


def gpus(node_id: str, n: int) -> list[placement.Atom]:
    return [
        placement.Atom(
            id=f"{node_id}.g{i}",
            node_id=node_id,
            kind="gpu",
            device_id=f"{node_id}-GPU-{i}",
            parent_gpu=f"{node_id}-GPU-{i}",
            profile=None,
            numa_node=0,
            nvlink_domain=None,
            healthy=True,
        )
        for i in range(n)
    ]


def demand(count: int, **host: int) -> placement.Demand:
    return placement.Demand(devices=[placement.DeviceDemand("gpu", count)], host=host)


def test_windows_open_at_booking_ends_in_start_order() -> None:
    atoms = gpus("a", 2)
    bookings = [
        windows.Booking("a.g0", 0, 10),
        windows.Booking("a.g1", 5, 20),
        windows.Booking("a.g0", 30, 40),
    ]
    found = windows.earliest(
        nodes=[node("a")],
        atoms=atoms,
        bookings=bookings,
        demand=demand(2),
        from_ms=0,
        latest_start_ms=100,
        duration_ms=10,
        limit=5,
    )
    # 0, 10: a GPU is busy; 20: both free until 30; 40: free for good.
    assert [(w.start_ms, w.end_ms) for w in found.windows] == [(20, 30), (40, 50)]
    assert found.windows[0].node_ids == ("a",)
    assert (found.tried, found.exhausted) == (4, False)


def test_host_resources_in_use_hold_a_window_back_like_devices() -> None:
    bookings = [windows.Booking("a.g0", 0, 10, host_node="a", vcpu=8)]
    found = windows.earliest(
        nodes=[node("a", vcpu=10)],
        atoms=gpus("a", 8),
        bookings=bookings,
        demand=demand(1, vcpu=4),
        from_ms=0,
        latest_start_ms=100,
        duration_ms=5,
        limit=1,
    )
    # Seven GPUs are free at 0, but only 2 of the 10 CPUs.
    assert [w.start_ms for w in found.windows] == [10]


def test_it_stops_after_max_tries_and_says_so() -> None:
    bookings = [windows.Booking("a.g0", i * 10, i * 10 + 10) for i in range(50)]
    found = windows.earliest(
        nodes=[node("a")],
        atoms=gpus("a", 1),
        bookings=bookings,
        demand=demand(1),
        from_ms=0,
        latest_start_ms=10_000,
        duration_ms=5,
        limit=5,
        max_tries=7,
    )
    assert found.windows == ()
    assert (found.tried, found.exhausted) == (7, True)
