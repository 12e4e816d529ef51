"""Rules of the guide that an outside review could change with the whole suite still passing.

Each test here fails when its rule is removed or changed (each was checked that way: the rule
broken by hand, the test seen failing, the rule restored). Against the real PostgreSQL of the
test session, through ``ReservationService`` as the API and the operator call it; business time
moves with ``inventory.advance_clock`` and the reconciler is driven by hand.
"""

from __future__ import annotations

import datetime as dt
import itertools
import time
from typing import Any

import psycopg.errors
import pytest

from bettercompute.core import answers, ports
from bettercompute.core.errors import ComputeError
from bettercompute.iam import policies
from bettercompute.service.reservations import ReservationService
from bettercompute.store import desired
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.store.test_admission import create_input
from tests.store.test_batching import lease_world
from tests.store.test_host_resources import HOST
from tests.store.test_host_resources import create as host_create
from tests.store.test_host_resources import world as host_world
from tests.store.test_lifecycle import (
    activate,
    advance,
    allocations,
    bookings,
    create,
    get,
    k8s_world,
    now,
    report,
    run,
)
from tests.store.test_lifecycle import world as lifecycle_world
from tests.support.placers import placers

HOUR = 3600.0


def types(view: dict[str, Any]) -> list[str]:
    return [c["type"] for c in view["conditions"]]


async def wake_ups(db: Database, rid: str, why: str) -> list[dt.datetime]:
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT due_at FROM work_queue WHERE reservation_id = %s AND why = %s"
                " ORDER BY due_at",
                (rid, why),
            )
        ).fetchall()
    return [r["due_at"] for r in rows]


# --- DevicesHeld: at most 24 hours ----------------------------------------------------------


async def test_a_release_the_node_never_confirms_ends_at_24_hours(
    db: Database, service: ReservationService
) -> None:
    """The guide: a release stuck past the end is carried in 5-minute steps "for at most 24
    hours"; then it ends (as ``AllocationReleased`` would end it): the allocation is released,
    its booking ends, ``DevicesHeld`` is gone and nothing wakes it again."""
    await k8s_world(db, source="system")
    view = await create(service, "held", count=8, duration="48h", binding="kubernetes")
    rid = view["id"]
    await activate(service, db, rid)
    [alloc] = await allocations(db, rid)
    await advance(db, 60)
    released = await service.release(caller(), {"tenantId": "acme", "reservationId": rid})
    assert "DevicesHeld" in types(released)
    assert await report(service, alloc, "releasing", pods=["default/train-0"])

    # A minute short of 24 hours the node still has not confirmed: still held and booked.
    await advance(db, 23 * HOUR + 50 * 60)
    await run(db)
    await advance(db, 9 * 60)
    await run(db)
    at = await now(db)
    assert "DevicesHeld" in types(await get(service, rid))
    assert [a["state"] for a in await allocations(db, rid)] == ["releasing"]
    assert all(b["end_at"] > at for b in await bookings(db, rid))
    # The next wake-up is the cap itself, not a step past it.
    [cap] = await wake_ups(db, rid, "devices-held")
    assert dt.timedelta(0) < cap - at <= dt.timedelta(minutes=1, seconds=5)

    await advance(db, 65)
    await run(db)
    done = await now(db)
    view = await get(service, rid)
    assert view["state"] == "released"
    assert "DevicesHeld" not in types(view)
    assert [a["state"] for a in await allocations(db, rid)] == ["released"]
    booked = await bookings(db, rid)
    assert booked
    assert all(b["end_at"] <= done for b in booked)
    assert await wake_ups(db, rid, "devices-held") == []
    # The node is told nothing more about it, and its devices book again.
    assert await desired.for_node(db, node_id=alloc["node_id"]) == []
    again = await create(service, "after", count=8)
    assert again["state"] == "placed"
    # A late confirmation changes nothing.
    assert not await report(service, alloc, "released")


async def test_a_release_whose_booking_cannot_be_carried_still_ends_at_24_hours(
    db: Database, service: ReservationService
) -> None:
    """A held booking is not carried over a booking that starts first; the release is still
    woken until the cap ends it, so its condition cannot show forever."""
    await k8s_world(db, source="system")
    view = await create(service, "held", count=8, duration="2h", binding="kubernetes")
    rid = view["id"]
    await activate(service, db, rid)
    await advance(db, 60)
    await service.release(caller(), {"tenantId": "acme", "reservationId": rid})
    # Another reservation books every device from just after the held step ends.
    step_end = max(b["end_ms"] for b in await bookings(db, rid))
    for key in ("next-1", "next-2"):
        later = await create(service, key, count=8, start=step_end + 1_000, duration="30h")
        assert later["state"] == "placed", later["conditions"]
    await advance(db, 10 * 60)
    await run(db)
    assert "DevicesHeld" in types(await get(service, rid))
    assert await wake_ups(db, rid, "devices-held")
    await advance(db, 24 * HOUR)
    for _ in range(2):
        await run(db)
    assert "DevicesHeld" not in types(await get(service, rid))
    assert [a["state"] for a in await allocations(db, rid)] == ["released"]


# --- wait: 50 ms → 1 s, and a repeated key waits too ---------------------------------------


async def test_wait_reads_back_off_from_50_ms_doubling_to_1_s(
    db: Database, service: ReservationService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guide: the server re-reads "backing off from 50 ms to 1 s". Nothing places the
    queued reservation (no placer runs), so every read is the back-off's. The service's own
    reads are timed where they happen (a spy that calls through, so every read is real): a
    count of pooled connections would also count whatever else the process does meanwhile.

    A pause never ends early (nothing commits a batch here), so each gap is at least its step;
    a loaded machine can only make it longer, which the upper bound allows for."""
    await lease_world(db)
    reads: list[float] = []
    real_view = service._view

    async def timed_view(rid: str) -> answers.Reservation:
        reads.append(time.monotonic())
        return await real_view(rid)

    monkeypatch.setattr(service, "_view", timed_view)
    view = await service.create(caller(), {**create_input(), "wait": {"timeoutMs": 5_000}})
    assert view["operation"]["state"] == "running"
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(reads)]
    steps = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]  # after the first read at 50 ms, doubled to 1 s
    assert len(gaps) >= len(steps), gaps
    for gap, step in zip(gaps, steps, strict=False):
        assert step * 0.95 <= gap <= step * 1.4 + 0.05, (step, gaps)
    assert all(gap <= 1.5 for gap in gaps), gaps  # never more than 1 s (plus scheduling)


async def test_a_repeated_key_waits_as_the_first_create_would(
    db: Database, service: ReservationService
) -> None:
    """The guide: after transaction 2 commits "(or a repeated key returns the stored
    reservation)", the server waits. A retry with the same key and a ``wait`` is answered
    placed once the batch placed it, not queued at once."""
    await lease_world(db)
    first = await service.create(caller(), create_input())
    assert first["operation"]["state"] == "running"
    async with placers(db, [service], renew_s=0.2):
        started = time.monotonic()
        again = await service.create(caller(), {**create_input(), "wait": {"timeoutMs": 20_000}})
        took = time.monotonic() - started
    assert again["id"] == first["id"]
    assert again["state"] == "placed", again["conditions"]
    assert again["operation"]["state"] == "succeeded"
    assert took < 10, took


# --- host CPUs: the reserve is the lowest non-isolated, and the guard counts it -------------


async def test_the_nodes_reserved_cpus_are_its_lowest_non_isolated(
    db: Database, service: ReservationService
) -> None:
    """The node's inventory lists its isolated CPUs; the host keeps its lowest two others, so a
    cpuset near NUMA node 0 is CPUs 0-31 less 4-5 (0-3 being isolated)."""
    await host_world(db, nodes=1, host={**HOST, "isolatedCpus": "0-3"}, quotas={"vcpu": 10_000})
    view = await host_create(service, "isolated", gpus=2, resources={"vcpu": 16})
    await activate(service, db, view["id"])
    [alloc] = await allocations(db, view["id"])
    [wanted] = await desired.for_node(db, node_id=alloc["node_id"])
    assert wanted["limits"]["cpus"] == "0-3,6-31"


async def test_the_database_guard_counts_the_hosts_reserved_cpus(
    db: Database, service: ReservationService
) -> None:
    """``bc_check_hosts`` is the last word on host CPUs: a host of 64 that keeps 2 gives 62,
    so 63 booked by hand around the placer is refused, and 62 is not."""
    await host_world(db, nodes=1, quotas={"vcpu": 10_000})
    view = await host_create(service, "first", resources={"vcpu": 40})
    [alloc] = await allocations(db, view["id"])

    async def book(vcpu: int) -> None:
        async with db.transaction() as conn:
            await conn.execute(
                "UPDATE bookings SET host_vcpu = %s WHERE allocation_id = %s AND host_vcpu > 0",
                (vcpu, alloc["id"]),
            )
            await conn.execute(
                "SELECT bc_check_hosts(pool_id, ARRAY[%s], lower(during), upper(during))"
                " FROM reservations WHERE id = %s",
                (alloc["node_id"], view["id"]),
            )

    with pytest.raises(psycopg.errors.ExclusionViolation, match="would give more than it has"):
        await book(63)
    await book(62)
    # The pool's own reserve counts, not the default's.
    async with db.connection() as conn:
        await conn.execute(
            'UPDATE pools SET policy = policy || \'{"hostReserve": {"vcpu": 10}}\''
            " WHERE id = 'pool_h'"
        )
    with pytest.raises(psycopg.errors.ExclusionViolation, match="would give more than it has"):
        await book(55)


# --- which action each operation is decided as -----------------------------------------------

_PERMIT_ALL = """
permit (principal, action, resource is Compute::Reservation)
when { principal.tenant == resource.tenant };
permit (principal, action == Compute::Action::"compute:reservations:read",
        resource is Compute::Tenant) when { principal in resource };
"""


def _forbidding(action: str) -> policies.CedarPolicyEngine:
    return policies.CedarPolicyEngine.from_text(
        _PERMIT_ALL
        + f'forbid (principal, action == Compute::Action::"{action}", resource)'
        + " when { resource is Compute::Reservation };"
    )


async def _outcomes(service: ReservationService, rid: str) -> dict[str, str]:
    ref = {"tenantId": "acme", "reservationId": rid}
    found: dict[str, str] = {}
    calls = {
        "get": lambda: service.get(caller(), ref),
        "renew": lambda: service.renew(caller(), ref),
        "cancel": lambda: service.cancel(caller(), ref),
        "release": lambda: service.release(caller(), ref),
    }
    for name, call in calls.items():
        try:
            await call()
            found[name] = "ok"
        except ComputeError as e:
            found[name] = e.code.value
    return found


@pytest.mark.parametrize(
    ("forbidden", "expected"),
    [
        # get is read: forbidden, the reservation is hidden from every operation.
        (
            ports.READ,
            {"get": "NOT_FOUND", "renew": "ok", "cancel": "ok", "release": "ok"},
        ),
        # renew is extend: refused; release and cancel stay allowed.
        (
            ports.EXTEND,
            {"get": "ok", "renew": "ACCESS_DENIED", "cancel": "ok", "release": "ok"},
        ),
        # release and cancel are both release.
        (
            ports.RELEASE,
            {"get": "ok", "renew": "ok", "cancel": "ACCESS_DENIED", "release": "ACCESS_DENIED"},
        ),
    ],
)
async def test_each_operation_is_decided_as_its_action(
    db: Database, make_service: Any, forbidden: str, expected: dict[str, str]
) -> None:
    await lifecycle_world(db)
    allowed = make_service(policies.CedarPolicyEngine.from_text(_PERMIT_ALL))
    view = await create(allowed, "leased", count=2, leaseSeconds=600)
    service = make_service(_forbidding(forbidden))
    assert await _outcomes(service, view["id"]) == expected
