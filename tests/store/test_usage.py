"""The usage ledger and budgets on what was used, against the real PostgreSQL of the session.

Business time moves with ``inventory.advance_clock``; the wall clock moves a little too while a
test runs, so billed seconds are compared to within a few seconds per device. Every figure
here would differ under the old ledger (requested hours of every reservation created).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from bettercompute.core import hosts
from bettercompute.core import usage as core_usage
from bettercompute.service.reservations import ReservationService
from bettercompute.store import inventory, usage
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.store.test_admission import expect
from tests.store.test_extend import extend_input
from tests.store.test_lifecycle import (
    K8S_LABEL,
    activate,
    allocations,
    create,
    get,
    now,
    now_ms,
    report,
    run,
)
from tests.support.world import World

#: Seconds of wall-clock drift tolerated per device while a test runs.
SLACK = 10.0


async def world(
    db: Database,
    *,
    on_budget_exceeded: str | None = None,
    policy: dict[str, Any] | None = None,
    labels: dict[str, tuple[str, str]] | None = None,
    budget: float | None = None,
) -> None:
    """Pool ``pool_a`` of two 8-GPU nodes, owned by acme, whose offer row says what a spent
    budget does."""
    await (
        World(db)
        .tenant("acme")
        .tenant("globex")
        .tenant("root", root=True)
        .pool("pool_a", owner="acme", policy=policy)
        .offer("pool_a", "acme", on_budget_exceeded=on_budget_exceeded)
        .nodes("pool_a", 2, gpus=8, labels=labels)
        .quota("acme", "gpu:H100", 16)
        .build()
    )
    if budget is not None:
        await inventory.set_budget(db, tenant_id="acme", gpu_hours=budget, window_seconds=86_400)


async def billed(db: Database, *, by: core_usage.By | None = None) -> list[usage.Billed]:
    end = await now_ms(db) + 1
    return await usage.report(db, tenant_id="acme", from_ms=0, to_ms=end, by=by)


async def equivalent_seconds(db: Database) -> float:
    return sum(b.gpu_equivalent_seconds for b in await billed(db))


async def release(service: ReservationService, rid: str) -> dict[str, Any]:
    return await service.release(caller(), {"tenantId": "acme", "reservationId": rid})


# --- the ledger ---------------------------------------------------------------------------------


async def test_bound_to_release_bills_what_was_used(db: Database, service: ReservationService):
    await world(db)
    rid = (await create(service, "r", count=4, duration="8h"))["id"]
    await activate(service, db, rid)
    await inventory.advance_clock(db, seconds=600)
    await release(service, rid)
    [row] = await billed(db)
    assert row.gpu_equivalent_seconds == pytest.approx(4 * 600, abs=4 * SLACK)
    assert row.gpu_seconds == pytest.approx(row.gpu_equivalent_seconds)
    # Released: nothing more is billed however long after.
    await inventory.advance_clock(db, seconds=3600)
    assert await equivalent_seconds(db) == pytest.approx(row.gpu_equivalent_seconds)


async def test_never_bound_bills_nothing(db: Database, service: ReservationService):
    await world(db)
    rid = (await create(service, "r", count=4, duration="1h"))["id"]
    await run(db)
    assert (await get(service, rid))["state"] == "binding"
    await inventory.advance_clock(db, seconds=1200)
    await release(service, rid)
    assert await billed(db) == []
    assert await billed(db, by="pool") == []


async def test_devices_held_by_pods_past_the_end_are_not_billed(
    db: Database, service: ReservationService
):
    await world(db, policy={"kubernetes": True}, labels={K8S_LABEL: ("true", "system")})
    view = await create(service, "k8s", count=2, duration="1h", binding="kubernetes")
    rid = view["id"]
    await activate(service, db, rid)
    # Past the end: the reconciler ends it, but pods still hold the devices.
    await inventory.advance_clock(db, seconds=3600 + 120)
    await run(db)
    [alloc] = await allocations(db, rid)
    assert alloc["state"] == "releasing"
    assert await report(service, alloc, "releasing", pods=["default/train-0"])
    await inventory.advance_clock(db, seconds=240)
    await run(db)
    used = await equivalent_seconds(db)
    end_s = view["during"]["end"] / 1000
    # Billed from bound (at most a few seconds after the start) to the end, not a second more.
    assert used <= 2 * 3600 + 0.01
    assert used == pytest.approx(2 * 3600, abs=2 * SLACK)
    assert (await now(db)).timestamp() > end_s + 300


async def test_extend_bills_up_to_the_new_end(db: Database, service: ReservationService):
    await world(db)
    rid = (await create(service, "r", count=2, duration="1h"))["id"]
    await activate(service, db, rid)
    done = await service.extend(caller(), extend_input(rid, "x", by="1h"))
    assert done["extended"]
    await inventory.advance_clock(db, seconds=3 * 3600)
    await run(db)
    assert await equivalent_seconds(db) == pytest.approx(2 * 7200, abs=2 * SLACK)


async def test_renew_moves_where_billing_stops(db: Database, service: ReservationService):
    await world(db)
    rid = (await create(service, "lease", count=1, duration="8h", leaseSeconds=600))["id"]
    await activate(service, db, rid)
    await inventory.advance_clock(db, seconds=300)
    await service.renew(caller(), {"tenantId": "acme", "reservationId": rid})
    # Lapses 900 s after the start now; the reconciler comes late, billing does not run on.
    await inventory.advance_clock(db, seconds=1500)
    await run(db)
    assert (await get(service, rid))["state"] == "released"
    assert await equivalent_seconds(db) == pytest.approx(900, abs=SLACK)


async def test_a_node_lease_is_not_billed_for_an_unhealthy_gpu(
    db: Database, service: ReservationService
):
    await world(db, policy={"tenantRoot": True})
    view = await create(service, "metal", count=8, binding="node", node={"profileId": "u"})
    rid = view["id"]
    await activate(service, db, rid)
    [alloc] = await allocations(db, rid)
    sick = sorted(alloc["device_ids"])[0]
    await inventory.advance_clock(db, seconds=600)
    await inventory.set_atom_health(db, node_id=alloc["node_id"], device_id=sick, healthy=False)
    await run(db)  # the health change wakes the reconciler: the lease says it is not billed
    shown = {c["type"]: c for c in (await get(service, rid))["conditions"]}
    assert shown["UnhealthyAtoms"]["reason"] == "NotBilled"
    assert sick in shown["UnhealthyAtoms"]["message"]
    await inventory.advance_clock(db, seconds=600)
    await inventory.set_atom_health(db, node_id=alloc["node_id"], device_id=sick, healthy=True)
    await run(db)
    shown = {c["type"]: c for c in (await get(service, rid))["conditions"]}
    assert "UnhealthyAtoms" not in shown
    await inventory.advance_clock(db, seconds=600)
    await release(service, rid)
    assert await equivalent_seconds(db) == pytest.approx(8 * 1800 - 600, abs=8 * SLACK)
    async with db.connection() as conn:
        changes = await (
            await conn.execute("SELECT healthy FROM atom_health_changes ORDER BY id")
        ).fetchall()
    assert [c["healthy"] for c in changes] == [False, True]


async def test_a_held_gpu_stays_billed_while_unhealthy(db: Database, service: ReservationService):
    # Only node leases are spared: a hold keeps its booking, and its bill, while degraded.
    await world(db)
    rid = (await create(service, "r", count=1, duration="8h"))["id"]
    await activate(service, db, rid)
    [alloc] = await allocations(db, rid)
    await inventory.set_atom_health(
        db, node_id=alloc["node_id"], device_id=alloc["device_ids"][0], healthy=False
    )
    await inventory.advance_clock(db, seconds=600)
    await release(service, rid)
    assert await equivalent_seconds(db) == pytest.approx(600, abs=SLACK)


async def test_report_buckets_by_pool_project_and_day(db: Database, service: ReservationService):
    await world(db)
    # Start 5 minutes before a UTC midnight, so 10 minutes of use fall in two days.
    at = await now(db)
    midnight = dt.datetime.combine(at.date() + dt.timedelta(days=1), dt.time(), tzinfo=dt.UTC)
    await inventory.advance_clock(db, seconds=(midnight - at).total_seconds() - 300)
    a = (await create(service, "a", count=1, duration="8h", projectId="vision"))["id"]
    b = (await create(service, "b", count=2, duration="8h"))["id"]
    for rid in (a, b):
        await activate(service, db, rid)
    await inventory.advance_clock(db, seconds=600)
    for rid in (a, b):
        await release(service, rid)
    total = await equivalent_seconds(db)
    assert total == pytest.approx(3 * 600, abs=3 * SLACK)
    [pool] = await billed(db, by="pool")
    assert (pool.key, pool.gpu_equivalent_seconds) == ("pool_a", pytest.approx(total))
    projects = {p.key: p.gpu_equivalent_seconds for p in await billed(db, by="project")}
    assert projects == {
        None: pytest.approx(2 * 600, abs=2 * SLACK),
        "vision": pytest.approx(600, abs=SLACK),
    }
    days = await billed(db, by="day")
    assert [int(d.key or 0) for d in days] == [
        int((midnight - dt.timedelta(days=1)).timestamp() * 1000),
        int(midnight.timestamp() * 1000),
    ]
    assert sum(d.gpu_equivalent_seconds for d in days) == pytest.approx(total)
    assert days[1].gpu_equivalent_seconds == pytest.approx(3 * 300, abs=3 * SLACK)


async def test_a_report_window_cuts_the_intervals(db: Database, service: ReservationService):
    await world(db)
    rid = (await create(service, "r", count=1, duration="8h"))["id"]
    await activate(service, db, rid)
    start = await now_ms(db)
    await inventory.advance_clock(db, seconds=1000)
    # Still running: the open interval is billed up to now, and cut at the report's bounds.
    rows = await usage.report(
        db, tenant_id="acme", from_ms=start + 100_000, to_ms=start + 400_000, by=None
    )
    assert [r.gpu_equivalent_seconds for r in rows] == [pytest.approx(300, abs=0.01)]


@pytest.mark.parametrize(
    ("kind", "sharing", "replicas"),
    [
        ("gpu", "exclusive", 1),
        ("mig", "mig", 1),
        ("slot", "timeslice", 1),
        ("slot", "mps", 1),
        ("slot", "timeslice", 3),
        ("slot", "mps", 16),
    ],
)
async def test_the_ledger_weighs_devices_as_the_core_does(
    db: Database, kind: str, sharing: str, replicas: int
):
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT bc_device_worth(%s, %s, %s) AS worth", (kind, sharing, replicas)
            )
        ).fetchone()
    assert row is not None
    expected = hosts.device_worth(kind, sharing_mode=sharing, replicas=replicas)
    assert float(row["worth"]) == pytest.approx(float(expected), rel=1e-12)


# --- budgets on use -----------------------------------------------------------------------------


async def test_a_reservation_released_early_frees_its_budget(
    db: Database, service: ReservationService
):
    await world(db, on_budget_exceeded="stop-new", budget=40)
    first = (await create(service, "a", count=4, duration="8h"))["id"]  # 32 GPU-hours booked
    await activate(service, db, first)
    await inventory.advance_clock(db, seconds=60)
    await release(service, first)
    # Used about 4 GPU-minutes, not 32 GPU-hours: another 32 fit in 40.
    second = await create(service, "b", count=4, duration="8h")
    assert second["state"] == "placed"


async def test_stop_new_refuses_a_create_but_allows_an_extend(
    db: Database, service: ReservationService
):
    await world(db, on_budget_exceeded="stop-new", budget=40)
    rid = (await create(service, "a", count=4, duration="8h"))["id"]
    err = await expect("SPEND_LIMIT_REACHED", create(service, "b", count=4, duration="8h"))
    assert isinstance(err.details["resetsAt"], int)
    assert "32.000 booked" in err.message
    done = await service.extend(caller(), extend_input(rid, "x", by="8h"))
    assert done["extended"]
    assert (await get(service, rid))["state"] == "placed"


async def test_drain_refuses_creates_and_extends_and_ends_nothing(
    db: Database, service: ReservationService
):
    await world(db, on_budget_exceeded="drain", budget=40)
    rid = (await create(service, "a", count=4, duration="8h"))["id"]
    await activate(service, db, rid)
    await expect("SPEND_LIMIT_REACHED", create(service, "b", count=4, duration="8h"))
    err = await expect(
        "SPEND_LIMIT_REACHED", service.extend(caller(), extend_input(rid, "x", by="8h"))
    )
    assert isinstance(err.details["resetsAt"], int)
    # A renew adds no hours (the window stays), and nothing running is ended.
    view = await get(service, rid)
    assert view["state"] == "active"
    assert view["during"]["end"] - view["during"]["start"] == 8 * 3_600_000
