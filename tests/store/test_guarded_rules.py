"""Rules of the guide that an outside review could change with the whole suite still passing.

Each test here fails when its rule is removed or changed (each was checked that way: the rule
broken by hand, the test seen failing, the rule restored). Against the real PostgreSQL of the
test session, through ``ReservationService`` as the API and the operator call it; business time
moves with ``inventory.advance_clock`` and the reconciler is driven by hand.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import time
from typing import Any

import psycopg.errors
import pytest

from bettercompute.core import answers, attestation, ports
from bettercompute.core.errors import ComputeError
from bettercompute.core.pools import CAP_DEVICES_LIMITS
from bettercompute.iam import policies
from bettercompute.service.reservations import ReservationService
from bettercompute.store import desired, inventory, placing, usage
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.store.test_admission import acme, create_input
from tests.store.test_attestation import REJECTED, Node
from tests.store.test_batching import lease_world
from tests.store.test_extend import extend_input
from tests.store.test_host_resources import CAPABLE, HOST
from tests.store.test_host_resources import create as host_create
from tests.store.test_host_resources import world as host_world
from tests.store.test_lifecycle import (
    activate,
    advance,
    allocations,
    bookings,
    cdi,
    create,
    events,
    get,
    k8s_world,
    node_again,
    now,
    now_ms,
    report,
    run,
)
from tests.store.test_lifecycle import world as lifecycle_world
from tests.support import nodecerts
from tests.support.placers import placers
from tests.support.world import World

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


# --- attested bindings: node leases are exempt ----------------------------------------------


def _attested(db: Database) -> ReservationService:
    """The service as the operator and ``dev`` run it: reports count only when signed."""
    return ReservationService(
        db=db,
        policy=policies.CedarPolicyEngine.from_text(policies.DEFAULT_POLICIES),
        budget=DatabaseBudget(db),
        root_tenant_id="root",
        attestation=nodecerts.TRUST,
    )


async def test_a_node_lease_binds_without_a_signed_report(db: Database) -> None:
    """The guide: "Node leases (``binding: 'node'``) are exempt": metal binds them after its
    deploy workflow verified the machine, so their bound report carries no node signature and
    still counts, while a hold's unsigned report in the same pool does not."""
    attested = _attested(db)
    await lifecycle_world(db, policy={"tenantRoot": True})
    lease = await create(attested, "metal", count=8, binding="node", node={"profileId": "u"})
    hold = await create(attested, "hold", count=8)
    await run(db)
    for view in (lease, hold):
        assert (await get(attested, view["id"]))["state"] == "binding"
    for view in (lease, hold):
        [alloc] = await allocations(db, view["id"])
        await report(attested, alloc, "bound", cdiDevices=cdi(alloc["device_ids"]))
    await run(db)
    assert (await get(attested, lease["id"]))["state"] == "active"
    assert not [t for t, _ in await events(db, lease["id"]) if t == REJECTED]
    # The control: attestation is on, and the hold's unsigned report was refused.
    assert (await get(attested, hold["id"]))["state"] == "binding"
    [rejected] = [d for t, d in await events(db, hold["id"]) if t == REJECTED]
    assert rejected["reason"] == attestation.UNSIGNED


# --- a lost binding keeps billing -----------------------------------------------------------


async def test_a_binding_marked_lost_is_still_billed(db: Database) -> None:
    """The guide's attested bindings: a report rejected while active marks the binding lost
    ("``Degraded`` with ``BindingLost``, and billing keeps the real binding"). A forged report
    can neither start nor stop billing: the ledger's row stays open through the lost spell."""
    attested = _attested(db)
    await lifecycle_world(db, nodes=1)
    rid = (await create(attested, "lost", count=4, duration="8h"))["id"]
    await run(db)
    [alloc] = await allocations(db, rid)
    node = Node(alloc["node_id"])
    genuine = await report(
        attested,
        alloc,
        "bound",
        cdiDevices=cdi(alloc["device_ids"]),
        signature=node.signed(alloc, rid, await now_ms(db)),
    )
    assert genuine
    await run(db)
    assert (await get(attested, rid))["state"] == "active"
    await advance(db, 600)
    # A relayed report without the node's signature: refused, and the binding is lost.
    assert not await report(attested, alloc, "bound", cdiDevices=["bcd.dev/gpu=elsewhere"])
    await run(db)
    view = await get(attested, rid)
    assert [(c["type"], c["reason"]) for c in view["conditions"]] == [("Degraded", "BindingLost")]
    assert [a["state"] for a in await allocations(db, rid)] == ["lost"]
    await advance(db, 600)
    billed = await usage.report(
        db, tenant_id="acme", from_ms=0, to_ms=await now_ms(db) + 1, by=None
    )
    # 4 GPUs for the 20 minutes since the bound report, the lost 10 included.
    assert sum(b.gpu_seconds for b in billed) == pytest.approx(4 * 1200, abs=4 * 10)


# --- extend: a refusal after the allow clears only its own staged change ---------------------


async def staged(db: Database, rid: str) -> tuple[Any, list[str]]:
    """The reservation's pending change (authorization row) and the holds of its extend slot."""
    async with db.connection() as conn:
        row = await (
            await conn.execute("SELECT pending FROM authz_resources WHERE id = %s", (rid,))
        ).fetchone()
        holds = await (
            await conn.execute("SELECT hold FROM extend_holds WHERE reservation_id = %s", (rid,))
        ).fetchall()
    assert row is not None
    return row["pending"], [h["hold"] for h in holds]


class _Interleaved:
    """The real Cedar engine, with a second replica's extend let in while the first one's
    decision is out (our own policy boundary, as ``CountingPolicy``): the first decision moves
    business time past the hold's 60 seconds and starts ``second``, which takes the slot and
    stages its change, then waits in its own decision until ``go`` is set."""

    def __init__(self, db: Database, rid: str) -> None:
        self.inner = policies.CedarPolicyEngine.from_text(policies.DEFAULT_POLICIES)
        self.db = db
        self.rid = rid
        self.second: Any = None
        self.start_second: Any = None
        self.go = asyncio.Event()

    async def decide(self, request: ports.DecisionRequest) -> ports.Decision:
        if request.action == ports.EXTEND and self.second is None:
            _, first = await staged(self.db, self.rid)
            await inventory.advance_clock(self.db, seconds=61)  # the first hold is stale now
            self.second = asyncio.create_task(self.start_second())
            for _ in range(500):  # until the second extend staged its change
                pending, holds = await staged(self.db, self.rid)
                if pending is not None and holds and holds != first:
                    break
                await asyncio.sleep(0.01)
        elif request.action == ports.EXTEND:
            await self.go.wait()
        return await self.inner.decide(request)


async def test_an_extend_refused_after_its_allow_clears_only_its_own_staged_change(
    db: Database, make_service: Any
) -> None:
    """The guide: "a refusal, an abandon or a budget refusal clears the pending change only
    when the hold is its own". Extend A is allowed, but while it was decided its hold went
    stale and extend B (another replica) took the slot and staged its own change; A's commit
    is then refused (CONFLICT) and A's clean-up must leave B's staged change, which B then
    applies."""
    await acme(db)
    plain = make_service()
    view = await plain.create(caller(), create_input(duration="2h"))
    rid = view["id"]
    policy = _Interleaved(db, rid)
    service: ReservationService = make_service(policy)
    policy.start_second = lambda: service.extend(caller(), extend_input(rid, "b", by="3h"))

    with pytest.raises(ComputeError) as info:
        await service.extend(caller(), extend_input(rid, "a", by="1h"))
    assert info.value.code == "CONFLICT"
    assert info.value.details["reason"] == "extend-in-flight"
    # B's change is still staged, under B's hold: the only hold of the slot.
    pending, holds = await staged(db, rid)
    assert pending is not None
    assert pending["until"] == view["during"]["end"] + 3 * 3_600_000
    assert holds == [pending["hold"]]

    policy.go.set()
    answer = await policy.second
    assert answer["extended"] is True
    assert answer["reservation"]["during"]["end"] == view["during"]["end"] + 3 * 3_600_000
    assert await staged(db, rid) == (None, [])


# --- extend: the pool lock first ------------------------------------------------------------


async def test_extend_takes_the_pool_lock_before_the_reservations_row(
    db: Database, service: ReservationService
) -> None:
    """The guide: "The completing transaction takes the pool lock first (bb6da07), so an
    extend of a gang and a batch commit cannot deadlock on each other's bookings". A batch
    holds the pool lock and then locks the rows it books around (a preemption locks the
    reservations it cuts back): while the batch holds the pool lock, the extend's transaction 2
    waits for it and holds no row of the reservation yet, so the batch gets the row at once,
    and the extend goes on when the batch commits."""
    await acme(db)
    view = await service.create(caller(), create_input(duration="2h"))
    rid = view["id"]
    async with db.transaction(within_s=10) as batch:
        await placing.lock_pool(batch, "pool_a")
        extending = asyncio.create_task(
            service.extend(caller(), extend_input(rid, "pool-first", by="1h"))
        )
        waiting = 0
        for _ in range(150):
            async with db.connection() as conn:
                row = await (
                    await conn.execute(
                        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname ="
                        " current_database() AND wait_event_type = 'Lock'"
                        " AND wait_event = 'advisory'"
                    )
                ).fetchone()
            assert row is not None
            waiting = row["n"]
            if waiting or extending.done():
                break
            await asyncio.sleep(0.01)
        # The extend's commit waits for the pool lock the batch holds ...
        assert waiting == 1
        assert not extending.done()
        # ... holding no lock on the reservation's row meanwhile.
        locked = await (
            await batch.execute(
                "SELECT id FROM reservations WHERE id = %s FOR UPDATE NOWAIT", (rid,)
            )
        ).fetchone()
        assert locked is not None
    answer = await extending
    assert answer["extended"] is True
    assert answer["reservation"]["during"]["end"] == view["during"]["end"] + 3_600_000


# --- devices.limits: on re-place, repair and preview, and re-read at commit -----------------


def _pool_h(db: Database, *, capable: int, uncapable: int) -> World:
    """Pool ``pool_h`` (hosts with CPUs and memory, so every GPU books its host share): its
    first ``capable`` nodes advertise ``devices.limits`` (the system label), the others not."""
    world = World(db).tenant("acme").pool("pool_h", owner="acme")
    if capable:
        world = world.nodes("pool_h", capable, gpus=8, host=HOST, labels=CAPABLE)
    if uncapable:
        world = world.nodes("pool_h", uncapable, gpus=8, host=HOST, labels={})
    return world.quota("acme", "gpu:H100", 1000)


async def _node_ids(db: Database) -> list[str]:
    async with db.connection() as conn:
        rows = await (await conn.execute("SELECT id FROM nodes ORDER BY id")).fetchall()
    return [r["id"] for r in rows]


async def test_a_pending_retry_places_only_on_a_node_that_enforces_limits(
    db: Database, service: ReservationService
) -> None:
    """Re-placing a pending reservation needs ``bc.dev/cap.devices.limits`` as a create does:
    its 30-second retries leave it pending on a node without it, and the first retry after the
    node's agent advertises it places it."""
    await _pool_h(db, capable=0, uncapable=1).build()
    view = await host_create(service, "retried")
    assert view["state"] == "pending"
    for _ in range(3):
        await advance(db, 31)
        await run(db)
        again = await get(service, view["id"])
        assert again["state"] == "pending", again
        assert f"needs label {CAP_DEVICES_LIMITS}=*" in again["conditions"][0]["message"]
    [node] = await _node_ids(db)
    await node_again(db, node, labels=CAPABLE)
    await advance(db, 31)
    await run(db)
    assert (await get(service, view["id"]))["state"] in ("placed", "binding")


async def test_a_repair_moves_a_booking_only_to_a_node_that_enforces_limits(
    db: Database, service: ReservationService
) -> None:
    """Repairing a booking that went bad before its start re-places it under the same rule:
    with the only other node not advertising ``devices.limits``, the repair fails
    (``BookingRepairFailed``) instead of moving the hold onto a node that would run it
    unbounded."""
    await _pool_h(db, capable=1, uncapable=1).build()
    capable, _other = await _node_ids(db)
    start = await now_ms(db) + 2 * 3_600_000
    view = await host_create(service, "repaired", start=start)
    assert view["state"] == "placed"
    [alloc] = await allocations(db, view["id"])
    assert alloc["node_id"] == capable
    await inventory.set_node_status(db, node_id=capable, ready=False)
    await advance(db, 2 * 3600 - 15 * 60)
    await run(db)
    after = await get(service, view["id"])
    assert after["state"] == "pending", after
    [unschedulable] = after["conditions"]
    assert unschedulable["reason"] == "BookingRepairFailed"
    assert f"needs label {CAP_DEVICES_LIMITS}=*" in unschedulable["message"]
    assert await allocations(db, view["id"]) == []


async def test_a_preview_needs_a_node_that_enforces_limits(
    db: Database, service: ReservationService
) -> None:
    """``capacity.preview`` rejects a node without the capability with filter ``labels``, as
    the create it describes would, and fits once the node advertises it."""
    await _pool_h(db, capable=0, uncapable=1).build()
    body = {
        "tenantId": "acme",
        "poolId": "pool_h",
        "duration": "1h",
        "devices": [{"class": "gpu", "count": 1}],
    }
    refused = await service.preview(caller(), body)
    assert refused["fits"] is False
    assert refused["rejected"] == {"labels": 1}
    [node] = await _node_ids(db)
    await node_again(db, node, labels=CAPABLE)
    assert (await service.preview(caller(), body))["fits"] is True


class _Downgrading:
    """The real Cedar engine; while the second create is decided (between its transaction 1
    and 2), the node's agent comes back without ``devices.limits`` (a downgraded daemon)."""

    def __init__(self, db: Database, node: str) -> None:
        self.inner = policies.CedarPolicyEngine.from_text(policies.DEFAULT_POLICIES)
        self.db = db
        self.node = node
        self.creates = 0

    async def decide(self, request: ports.DecisionRequest) -> ports.Decision:
        if request.action == ports.CREATE:
            self.creates += 1
            if self.creates == 2:
                await node_again(self.db, self.node, labels={})
        return await self.inner.decide(request)


async def test_the_capability_is_read_again_when_the_placement_commits(
    db: Database, make_service: Any
) -> None:
    """The placer reads the node's labels under the pool lock in the transaction that books:
    a daemon downgraded after the first placement (which the placer's inventory cache still
    holds) and before the second commits is caught, and the second waits pending."""
    await _pool_h(db, capable=1, uncapable=0).build()
    [node] = await _node_ids(db)
    service: ReservationService = make_service(_Downgrading(db, node))
    first = await host_create(service, "before")
    assert first["state"] == "placed"
    second = await host_create(service, "after")
    assert second["state"] == "pending", second
    assert f"needs label {CAP_DEVICES_LIMITS}=*" in second["conditions"][0]["message"]
