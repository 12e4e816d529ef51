"""Store-level lifecycle: placed → binding → active → released, and every way off that path.

Runs against the real PostgreSQL of the test session. Business time moves with
``inventory.advance_clock``; the reconciler is driven by hand with ``Reconciler.run_once``, and
node reports go through ``ReservationService.report`` exactly as a gateway would send them.
The rules alone (what is due in each state) are tables in ``tests/unit/test_lifecycle_rules.py``;
these tests keep what needs the database: the statements, the events, the wake-ups and races.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from typing import Any

import pytest

from bettercompute.core.durations import to_ms
from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.core.inventories import AtomSpec, NodeSpec
from bettercompute.service.reconciling import Reconciler
from bettercompute.service.reservations import ReservationService
from bettercompute.store import desired, inventory
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.support.world import World

H100 = "gpu:H100"
HOUR_MS = 3_600_000


# --- helpers ----------------------------------------------------------------------------------


async def world(
    db: Database,
    *,
    nodes: int = 2,
    gpus: int = 8,
    domains: int = 2,
    quota: int = 16,
    policy: dict[str, Any] | None = None,
    labels: dict[str, tuple[str, str]] | None = None,
) -> None:
    await (
        World(db)
        .tenant("acme")
        .pool("pool_a", owner="acme", policy=policy)
        .nodes("pool_a", nodes, gpus=gpus, domains=domains, labels=labels)
        .quota("acme", H100, quota)
        .build()
    )


async def create(
    service: ReservationService, key: str, *, count: int = 4, duration: str = "1h", **extra: Any
) -> dict[str, Any]:
    return await service.create(
        caller(),
        {
            "tenantId": "acme",
            "poolId": "pool_a",
            "devices": [{"class": "gpu", "count": count}],
            "duration": duration,
            "idempotencyKey": key,
            **extra,
        },
    )


async def get(service: ReservationService, rid: str) -> dict[str, Any]:
    return await service.get(caller(), {"tenantId": "acme", "reservationId": rid})


async def run(db: Database) -> int:
    return await Reconciler(db).run_once()


async def now(db: Database) -> dt.datetime:
    async with db.connection() as conn:
        row = await (await conn.execute("SELECT compute_now() AS now")).fetchone()
    assert row is not None
    at: dt.datetime = row["now"]
    return at


async def now_ms(db: Database) -> int:
    return to_ms(await now(db))


async def advance(db: Database, seconds: float) -> None:
    await inventory.advance_clock(db, seconds=seconds)


async def allocations(db: Database, rid: str) -> list[dict[str, Any]]:
    async with db.connection() as conn:
        return await (
            await conn.execute(
                "SELECT id, node_id, state, device_ids, report FROM allocations"
                " WHERE reservation_id = %s ORDER BY node_id",
                (rid,),
            )
        ).fetchall()


async def bookings(db: Database, rid: str) -> list[dict[str, Any]]:
    async with db.connection() as conn:
        return await (
            await conn.execute(
                "SELECT b.atom_id, a.device_id, lower(b.during) AS start_at,"
                "       upper(b.during) AS end_at, epoch_ms(lower(b.during)) AS start_ms,"
                "       epoch_ms(upper(b.during)) AS end_ms, b.allocation_id"
                "  FROM bookings b JOIN atoms a ON a.id = b.atom_id"
                " WHERE b.reservation_id = %s ORDER BY a.device_id",
                (rid,),
            )
        ).fetchall()


async def events(db: Database, rid: str) -> list[tuple[str, dict[str, Any]]]:
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT type, data FROM outbox WHERE subject = %s ORDER BY id",
                (f"reservation/{rid}",),
            )
        ).fetchall()
    return [(r["type"], r["data"]) for r in rows]


async def event_types(db: Database, rid: str) -> list[str]:
    return [t for t, _ in await events(db, rid)]


async def quota_used(db: Database) -> int:
    q = await inventory.quota(db, tenant_id="acme", resource=H100)
    assert q is not None
    return q[1]


def conditions(view: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["type"], c["reason"]) for c in view["conditions"]]


def condition(view: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [c for c in view["conditions"] if c["type"] == kind]
    assert len(found) == 1, view["conditions"]
    return found[0]


def cdi(devices: list[str]) -> list[str]:
    return [f"bcd.dev/gpu={d}" for d in devices]


async def report(
    service: ReservationService, alloc: dict[str, Any], kind: str, **details: Any
) -> bool:
    return await service.report(
        node_id=alloc["node_id"], allocation_id=alloc["id"], kind=kind, details=details
    )


async def report_bound(service: ReservationService, db: Database, rid: str) -> None:
    allocs = await allocations(db, rid)
    assert allocs
    for a in allocs:
        ok = await report(
            service,
            a,
            "bound",
            cdiDevices=cdi(a["device_ids"]),
            envFile=f"/run/bcd/allocations/{a['id']}.env",
        )
        assert ok, a


async def activate(service: ReservationService, db: Database, rid: str) -> dict[str, Any]:
    """From placed (window begun) to active: start the binding, bind, reconcile."""
    await run(db)
    assert (await get(service, rid))["state"] == "binding"
    await report_bound(service, db, rid)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "active", view
    return view


# --- 1. the happy path ------------------------------------------------------------------------


async def test_placed_binding_active(db: Database, service: ReservationService) -> None:
    await world(db)
    view = await create(service, "happy")
    rid = view["id"]
    assert view["state"] == "placed"
    assert view["binding"]["nodeIds"] == [view["binding"]["nodeId"]]
    assert "cdiDevices" not in view["binding"]
    assert view["during"]["start"] == pytest.approx(await now_ms(db), abs=5_000)
    allocs = await allocations(db, rid)
    assert [a["state"] for a in allocs] == ["planned"]
    assert len(allocs[0]["device_ids"]) == 4

    await run(db)
    view = await get(service, rid)
    assert view["state"] == "binding"
    allocs = await allocations(db, rid)
    assert [a["state"] for a in allocs] == ["desired"]
    assert view["operation"]["state"] == "succeeded"

    await report_bound(service, db, rid)
    # Bound but not yet reconciled: still binding.
    assert (await get(service, rid))["state"] == "binding"
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "active", view
    assert view["conditions"] == []
    alloc = (await allocations(db, rid))[0]
    assert alloc["state"] == "bound"
    assert view["binding"]["nodeId"] == alloc["node_id"]
    assert view["binding"]["allocationIds"] == [alloc["id"]]
    assert view["binding"]["cdiDevices"] == cdi(alloc["device_ids"])
    assert view["binding"]["envFile"] == f"/run/bcd/allocations/{alloc['id']}.env"

    types = await event_types(db, rid)
    assert types == ["reservation.placed", "reservation.binding", "reservation.active"]
    evs = dict(await events(db, rid))
    assert evs["reservation.binding"] == {"state": "binding", "poolId": "pool_a"}
    assert evs["reservation.active"] == {"state": "active", "poolId": "pool_a"}
    assert evs["reservation.placed"]["nodeIds"] == [alloc["node_id"]]
    assert evs["reservation.placed"]["end"] - evs["reservation.placed"]["start"] == HOUR_MS

    booked = await bookings(db, rid)
    assert sorted(b["device_id"] for b in booked) == sorted(alloc["device_ids"])
    assert {b["allocation_id"] for b in booked} == {alloc["id"]}
    assert {b["end_ms"] - b["start_ms"] for b in booked} == {HOUR_MS}

    # Nothing more is due: the reconciler is idle until the 15-minute recheck.
    assert await run(db) == 0
    assert (await get(service, rid))["version"] == view["version"]


# --- 2. a future start ------------------------------------------------------------------------


async def test_future_start_books_now_and_binds_at_start(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    start = await now_ms(db) + 2 * HOUR_MS
    view = await create(service, "future", start=start)
    rid = view["id"]
    assert view["state"] == "placed"
    assert view["during"] == {"start": start, "end": start + HOUR_MS}
    assert view["requestedStart"] == start
    booked = await bookings(db, rid)
    assert len(booked) == 4
    assert {b["start_ms"] for b in booked} == {start}

    # Before the start (and past start − 15 min) nothing changes.
    await run(db)
    await advance(db, 3600)
    await run(db)
    await advance(db, 3600 - 60)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "placed"
    assert [a["state"] for a in await allocations(db, rid)] == ["planned"]
    assert await event_types(db, rid) == ["reservation.placed"]

    await advance(db, 61)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "binding"
    assert [a["state"] for a in await allocations(db, rid)] == ["desired"]
    assert view["during"] == {"start": start, "end": start + HOUR_MS}
    assert await event_types(db, rid) == ["reservation.placed", "reservation.binding"]


# --- 3. bind timeout --------------------------------------------------------------------------


async def test_bind_timeout_replaces_twice_then_fails_and_refunds(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    view = await create(service, "timeout")
    rid = view["id"]
    end = view["during"]["end"]
    assert await quota_used(db) == 4
    await run(db)
    assert (await get(service, rid))["state"] == "binding"

    # Not yet: the deadline is 5 minutes after the binding began.
    await advance(db, 299)
    await run(db)
    assert (await get(service, rid))["state"] == "binding"

    for attempt in (1, 2):
        first_allocs = {a["id"] for a in await allocations(db, rid)}
        await advance(db, 2)
        await run(db)
        view = await get(service, rid)
        # Re-placed for what remains of the window; its new start was due at once, so the
        # same pass has already handed it to the node again.
        assert view["state"] in ("placed", "binding"), view
        assert view["during"]["end"] == end
        cond = condition(view, "BindTimeout")
        assert cond["reason"] == "NodeDidNotBind"
        assert f"attempt {attempt} of 3" in cond["message"]
        allocs = await allocations(db, rid)
        assert allocs
        assert {a["id"] for a in allocs}.isdisjoint(first_allocs)
        assert await quota_used(db) == 4
        types = await event_types(db, rid)
        assert types.count("reservation.placed") == attempt + 1
        await run(db)
        assert (await get(service, rid))["state"] == "binding"
        await advance(db, 299)
        await run(db)
        assert (await get(service, rid))["state"] == "binding"

    await advance(db, 2)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "failed", view
    assert conditions(view) == [("BindTimeout", "NodeDidNotBind")]
    assert "attempt 3 of 3" in view["conditions"][0]["message"]
    assert view["operation"]["state"] == "failed"
    assert view["operation"]["error"]["code"] == "CAPACITY_UNAVAILABLE"
    assert view["during"] is None
    assert await bookings(db, rid) == []
    assert await allocations(db, rid) == []
    assert await inventory.quota(db, tenant_id="acme", resource=H100) == (16, 0)
    evs = await events(db, rid)
    assert evs[-1] == (
        "reservation.failed",
        {"state": "failed", "poolId": "pool_a", "reason": "NodeDidNotBind"},
    )
    # Terminal: nothing more happens.
    await advance(db, 3600)
    await run(db)
    assert (await get(service, rid))["version"] == view["version"]


# --- 4. a refused binding ---------------------------------------------------------------------


async def test_failed_report_rejects_binding_and_replaces(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    rid = (await create(service, "refused"))["id"]
    await run(db)
    [alloc] = await allocations(db, rid)
    assert await report(service, alloc, "failed", reason="resources-exhausted")
    # Judged at once, not at the bind deadline.
    await run(db)
    view = await get(service, rid)
    assert view["state"] in ("placed", "binding")
    cond = condition(view, "BindTimeout")
    assert cond["reason"] == "NodeRejectedBinding"
    assert "attempt 1 of 3" in cond["message"]
    assert "resources-exhausted" in cond["message"]
    [again] = await allocations(db, rid)
    assert again["id"] != alloc["id"]
    assert await event_types(db, rid) == [
        "reservation.placed",
        "reservation.binding",
        "reservation.placed",
        "reservation.binding",
    ]
    # The old allocation is gone: a report on it is ignored.
    assert not await report(service, alloc, "bound")
    # The new one binds, and activation clears the BindTimeout condition.
    await report_bound(service, db, rid)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "active"
    assert view["conditions"] == []


# --- 5. a report from another node ------------------------------------------------------------


async def test_report_from_another_node_is_ignored(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    rid = (await create(service, "foreign"))["id"]
    await run(db)
    [alloc] = await allocations(db, rid)
    other = next(n for n in ("node_pool_a-node-00", "node_pool_a-node-01") if n != alloc["node_id"])
    before = await get(service, rid)
    for kind in ("bound", "failed", "released"):
        assert not await service.report(
            node_id=other, allocation_id=alloc["id"], kind=kind, details={}
        )
    assert not await service.report(
        node_id=alloc["node_id"], allocation_id="alloc_unknown", kind="bound", details={}
    )
    [same] = await allocations(db, rid)
    assert same["state"] == "desired"
    assert same["report"] is None
    await run(db)
    after = await get(service, rid)
    assert after["state"] == "binding"
    assert after["version"] == before["version"]
    with pytest.raises(ComputeError) as e:
        await report(service, alloc, "exploded")
    assert e.value.code == ErrorCode.INVALID_INPUT


# --- 6. an early report -----------------------------------------------------------------------


async def test_early_bound_report_is_judged_at_start(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    start = await now_ms(db) + 2 * HOUR_MS
    rid = (await create(service, "early", start=start))["id"]
    await report_bound(service, db, rid)
    [alloc] = await allocations(db, rid)
    assert alloc["state"] == "bound"
    await run(db)
    assert (await get(service, rid))["state"] == "placed"
    await advance(db, 2 * 3600 + 1)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "active", view
    assert view["binding"]["cdiDevices"] == cdi(alloc["device_ids"])
    assert await event_types(db, rid) == [
        "reservation.placed",
        "reservation.binding",
        "reservation.active",
    ]


# --- 7. a lost binding ------------------------------------------------------------------------


async def test_released_report_of_bound_allocation_degrades_until_bound_again(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    rid = (await create(service, "lost"))["id"]
    await activate(service, db, rid)
    [alloc] = await allocations(db, rid)
    assert await report(service, alloc, "released")
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "active"
    assert conditions(view) == [("Degraded", "BindingLost")]
    assert alloc["node_id"] in view["conditions"][0]["message"]
    assert [a["state"] for a in await allocations(db, rid)] == ["lost"]
    assert len(await bookings(db, rid)) == 4

    # Bound again: the condition clears.
    assert await report(service, alloc, "bound", cdiDevices=cdi(alloc["device_ids"]))
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "active"
    assert view["conditions"] == []
    assert view["binding"]["cdiDevices"] == cdi(alloc["device_ids"])


# --- 8. health and connectivity ---------------------------------------------------------------


async def test_unhealthy_atom_and_unreachable_node_only_raise_conditions(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    rid = (await create(service, "health"))["id"]
    await activate(service, db, rid)
    [alloc] = await allocations(db, rid)
    node, device = alloc["node_id"], alloc["device_ids"][0]

    await inventory.set_atom_health(db, node_id=node, device_id=device, healthy=False)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "active"
    assert conditions(view) == [("Degraded", "AtomUnhealthy")]
    assert device in view["conditions"][0]["message"]

    await inventory.set_node_status(db, node_id=node, connected=False)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "active"
    assert sorted(conditions(view)) == [
        ("Degraded", "AtomUnhealthy"),
        ("NodeUnreachable", "Unreachable"),
    ]
    assert node in condition(view, "NodeUnreachable")["message"]

    # That lost beats unhealthy, and that rechecks keep it active, are rules:
    # tests/unit/test_lifecycle_rules.py.

    # Everything heals: the conditions go.
    await inventory.set_atom_health(db, node_id=node, device_id=device, healthy=True)
    await inventory.set_node_status(db, node_id=node, connected=True)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "active"
    assert view["conditions"] == []


async def test_foreign_gpu_exposure_degrades_an_active_reservation_and_clears(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    rid = (await create(service, "exposed"))["id"]
    await activate(service, db, rid)
    [alloc] = await allocations(db, rid)
    node = alloc["node_id"]

    await set_foreign_exposure(db, node, "device plugin sockets nvidia-gpu.sock")
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "active"  # nothing is released
    assert conditions(view) == [("Degraded", "ForeignGpuExposure")]
    assert node in view["conditions"][0]["message"]
    assert len(await bookings(db, rid)) == 4

    # A lost binding is graver: it is the Degraded shown while both hold.
    assert await report(service, alloc, "released")
    await run(db)
    assert conditions(await get(service, rid)) == [("Degraded", "BindingLost")]
    assert await report(service, alloc, "bound", cdiDevices=cdi(alloc["device_ids"]))
    await run(db)
    assert conditions(await get(service, rid)) == [("Degraded", "ForeignGpuExposure")]

    await set_foreign_exposure(db, node, None)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "active"
    assert view["conditions"] == []


async def set_foreign_exposure(db: Database, node_id: str, exposure: str | None) -> None:
    """What the operator writes from the GPUNode's ForeignGpuExposure condition: the node as
    it is, with the condition's message."""
    await node_again(db, node_id, foreign_exposure=exposure)


async def node_again(db: Database, node_id: str, **changes: Any) -> None:
    """The node inventoried again as it is in the store, but for ``changes`` (``NodeSpec``
    fields), as its agent's next status would."""
    async with db.connection() as conn:
        row = await (await conn.execute("SELECT * FROM nodes WHERE id = %s", (node_id,))).fetchone()
        atoms = await (
            await conn.execute(
                "SELECT * FROM atoms WHERE node_id = %s AND NOT retired ORDER BY device_id",
                (node_id,),
            )
        ).fetchall()
    assert row is not None
    spec = NodeSpec(
        id=row["id"],
        name=row["name"],
        pool_id=row["pool_id"],
        atoms=[
            AtomSpec(
                device_id=a["device_id"],
                kind=a["kind"],
                parent_gpu=a["parent_gpu"],
                profile=a["profile"],
                numa_node=a["numa_node"],
                nvlink_domain=a["nvlink_domain"],
                healthy=a["healthy"],
            )
            for a in atoms
        ],
        labels={k: (v["value"], v["source"]) for k, v in row["labels"].items()},
        ready=row["ready"],
        connected=row["connected"],
        resources=row["resources"],
        foreign_exposure=row["foreign_exposure"],
    )
    await inventory.upsert_node(db, dataclasses.replace(spec, **changes))


# --- 9. the end -------------------------------------------------------------------------------


async def test_end_reached_releases_as_expired(db: Database, service: ReservationService) -> None:
    await world(db)
    view = await create(service, "end")
    rid = view["id"]
    start, end = view["during"]["start"], view["during"]["end"]
    await activate(service, db, rid)
    assert await quota_used(db) == 4

    await advance(db, 3600 - 10)
    await run(db)
    assert (await get(service, rid))["state"] == "active"
    await advance(db, 11)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "released", view
    assert view["releaseReason"] == "expired"
    assert view["during"] == {"start": start, "end": end}
    assert view["operation"]["state"] == "succeeded"
    assert await quota_used(db) == 0
    assert (await events(db, rid))[-1] == (
        "reservation.released",
        {"state": "released", "poolId": "pool_a", "reason": "expired"},
    )
    booked = await bookings(db, rid)
    assert len(booked) == 4
    assert {b["end_ms"] for b in booked} == {end}
    assert [a["state"] for a in await allocations(db, rid)] == ["releasing"]


# --- 10. leases -------------------------------------------------------------------------------


async def test_lease_renew_and_lapse(db: Database, service: ReservationService) -> None:
    await world(db)
    view = await create(service, "lease", duration="8h", leaseSeconds=600)
    rid = view["id"]
    created = await now_ms(db)
    assert view["leaseExpiresAt"] == pytest.approx(created + 600_000, abs=5_000)
    end = view["during"]["end"]
    await activate(service, db, rid)

    await advance(db, 500)
    renewed = await service.renew(caller(), {"tenantId": "acme", "reservationId": rid})
    at = await now_ms(db)
    assert renewed["leaseExpiresAt"] == pytest.approx(at + 600_000, abs=5_000)
    assert renewed["leaseExpiresAt"] > view["leaseExpiresAt"] + 400_000
    assert renewed["during"]["end"] == end  # during untouched

    # Past the original lease: still active.
    await advance(db, 200)
    await run(db)
    assert (await get(service, rid))["state"] == "active"

    await advance(db, 401)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "released"
    assert view["releaseReason"] == "lease-lapsed"
    assert view["during"]["end"] == pytest.approx(await now_ms(db), abs=5_000)
    assert view["during"]["end"] < end
    assert (await events(db, rid))[-1][1]["reason"] == "lease-lapsed"
    assert await quota_used(db) == 0

    # Terminal: renewing is INVALID_STATE.
    with pytest.raises(ComputeError) as e:
        await service.renew(caller(), {"tenantId": "acme", "reservationId": rid})
    assert e.value.code == ErrorCode.INVALID_STATE


async def test_renew_without_lease_is_invalid_state(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    view = await create(service, "no-lease")
    assert "leaseExpiresAt" not in view
    with pytest.raises(ComputeError) as e:
        await service.renew(caller(), {"tenantId": "acme", "reservationId": view["id"]})
    assert e.value.code == ErrorCode.INVALID_STATE
    assert (await get(service, view["id"]))["version"] == view["version"]


# --- 11. release wakes the pending ------------------------------------------------------------


async def test_release_truncates_and_wakes_pending(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, gpus=8)
    a = await create(service, "big", count=8, duration="8h")
    rid = a["id"]
    await activate(service, db, rid)
    b = await create(service, "waiting", count=4)
    assert b["state"] == "pending"
    assert conditions(b) == [("Unschedulable", "NoFit")]
    assert b["operation"]["state"] == "pending"
    assert "0 of 1 nodes fit" in b["conditions"][0]["message"]
    assert await quota_used(db) == 12  # a pending reservation keeps its charge

    await advance(db, 600)
    released = await service.release(caller(), {"tenantId": "acme", "reservationId": rid})
    at = await now(db)
    assert released["state"] == "released"
    assert released["releaseReason"] == "release"
    assert released["during"]["end"] == pytest.approx(to_ms(at), abs=5_000)
    booked = await bookings(db, rid)
    assert len(booked) == 8
    assert all(b["end_at"] <= at for b in booked)
    assert all(b["end_at"] > at - dt.timedelta(seconds=5) for b in booked)
    assert (await events(db, rid))[-1] == (
        "reservation.released",
        {"state": "released", "poolId": "pool_a", "reason": "release"},
    )
    assert await quota_used(db) == 4

    # At once, not at the 30-second retry.
    await run(db)
    view = await get(service, b["id"])
    assert view["state"] in ("placed", "binding"), view
    assert view["conditions"] == []
    assert "reservation.placed" in await event_types(db, b["id"])
    assert view["during"]["start"] == pytest.approx(to_ms(at), abs=5_000)


# --- 12. pending that fails -------------------------------------------------------------------


async def test_pending_fails_after_max_pending(db: Database, service: ReservationService) -> None:
    await world(db, nodes=1, gpus=8, policy={"maxPending": "1h"})
    rid = (await create(service, "never-fits", count=16))["id"]
    view = await get(service, rid)
    assert view["state"] == "pending"
    assert await quota_used(db) == 16

    await advance(db, 3000)
    await run(db)
    assert (await get(service, rid))["state"] == "pending"

    await advance(db, 601)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "failed", view
    assert conditions(view) == [("Unschedulable", "MaxPendingExceeded")]
    assert view["operation"]["state"] == "failed"
    assert view["operation"]["error"]["code"] == "CAPACITY_UNAVAILABLE"
    assert await quota_used(db) == 0
    assert (await events(db, rid))[-1] == (
        "reservation.failed",
        {"state": "failed", "poolId": "pool_a", "reason": "MaxPendingExceeded"},
    )


async def test_a_queued_reservation_fails_after_max_pending_with_no_placer_running(
    db: Database, service: ReservationService
) -> None:
    # A pool-lease pool whose placer runs nowhere: the reservation stays Queued, and the
    # pool's maxPending still ends it (a wake-up written when it was queued).
    await world(db, nodes=1, gpus=8, policy={"placer": "pool-lease", "maxPending": "1h"})
    rid = (await create(service, "queued-forever", count=2))["id"]
    view = await get(service, rid)
    assert view["state"] == "pending"
    assert conditions(view) == [("Queued", "PoolPlacer")]
    assert await quota_used(db) == 2

    await advance(db, 3599)  # a second short of maxPending: still waiting
    await run(db)
    assert (await get(service, rid))["state"] == "pending"

    await advance(db, 1)
    assert await run(db) >= 1
    view = await get(service, rid)
    assert view["state"] == "failed", view
    assert conditions(view) == [("Unschedulable", "MaxPendingExceeded")]
    assert await quota_used(db) == 0
    assert (await events(db, rid))[-1] == (
        "reservation.failed",
        {"state": "failed", "poolId": "pool_a", "reason": "MaxPendingExceeded"},
    )


async def test_pending_fails_when_pool_archived(db: Database, service: ReservationService) -> None:
    await world(db, nodes=1, gpus=8)
    rid = (await create(service, "archived", count=16))["id"]
    assert (await get(service, rid))["state"] == "pending"
    await inventory.upsert_pool(
        db,
        pool_id="pool_a",
        owner_tenant_id="acme",
        region="eu-west-1",
        gpu_model="H100",
        archived=True,
    )
    await run(db)  # woken at once by the archive
    view = await get(service, rid)
    assert view["state"] == "failed", view
    assert conditions(view) == [("Unschedulable", "PoolGone")]
    assert view["operation"]["error"]["code"] == "CAPACITY_UNAVAILABLE"
    assert await quota_used(db) == 0


async def test_pending_fails_when_offer_withdrawn(
    db: Database, service: ReservationService
) -> None:
    await (
        World(db)
        .tenant("acme")
        .tenant("lender")
        .pool("pool_a", owner="lender")
        .offer("pool_a", "acme")
        .nodes("pool_a", 1, gpus=8)
        .quota("acme", H100, 16)
        .build()
    )
    rid = (await create(service, "offered", count=16))["id"]
    assert (await get(service, rid))["state"] == "pending"
    await inventory.set_offer(db, pool_id="pool_a", tenant_id="acme", offered=False)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "failed", view
    assert conditions(view) == [("Unschedulable", "PoolGone")]
    assert await quota_used(db) == 0


# --- 13. cancel and release before the start --------------------------------------------------


async def test_cancel_placed_deletes_bookings_and_refunds(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    start = await now_ms(db) + HOUR_MS
    rid = (await create(service, "cancel-me", start=start))["id"]
    assert len(await bookings(db, rid)) == 4
    assert await quota_used(db) == 4
    view = await service.cancel(caller(), {"tenantId": "acme", "reservationId": rid})
    assert view["state"] == "cancelled"
    assert view["during"] is None
    assert "releaseReason" not in view
    assert view["operation"]["state"] == "failed"
    assert view["operation"]["error"]["code"] == "INVALID_STATE"
    assert await bookings(db, rid) == []
    assert await allocations(db, rid) == []
    assert await quota_used(db) == 0
    assert (await events(db, rid))[-1] == (
        "reservation.cancelled",
        {"state": "cancelled", "poolId": "pool_a"},
    )
    # The start comes and goes: nothing happens to a cancelled reservation.
    await advance(db, 3600 + 1)
    await run(db)
    assert (await get(service, rid))["version"] == view["version"]


async def test_cancel_active_is_invalid_state(db: Database, service: ReservationService) -> None:
    await world(db)
    rid = (await create(service, "running"))["id"]
    before = await activate(service, db, rid)
    with pytest.raises(ComputeError) as e:
        await service.cancel(caller(), {"tenantId": "acme", "reservationId": rid})
    assert e.value.code == ErrorCode.INVALID_STATE
    after = await get(service, rid)
    assert after["state"] == "active"
    assert after["version"] == before["version"]
    assert await quota_used(db) == 4


async def test_release_pending_cancels_and_release_terminal_changes_nothing(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, gpus=8)
    rid = (await create(service, "pending", count=16))["id"]
    assert (await get(service, rid))["state"] == "pending"
    assert await quota_used(db) == 16
    view = await service.release(caller(), {"tenantId": "acme", "reservationId": rid})
    assert view["state"] == "cancelled"
    assert await quota_used(db) == 0
    assert await event_types(db, rid) == ["reservation.pending", "reservation.cancelled"]

    again = await service.release(caller(), {"tenantId": "acme", "reservationId": rid})
    assert again == view
    assert await quota_used(db) == 0
    assert await event_types(db, rid) == ["reservation.pending", "reservation.cancelled"]
    with pytest.raises(ComputeError) as e:
        await service.cancel(caller(), {"tenantId": "acme", "reservationId": rid})
    assert e.value.code == ErrorCode.INVALID_STATE

    # A released one is left as it is, too (quota is not refunded twice).
    other = (await create(service, "released", count=4))["id"]
    await activate(service, db, other)
    await advance(db, 60)
    first = await service.release(caller(), {"tenantId": "acme", "reservationId": other})
    assert first["state"] == "released"
    assert await quota_used(db) == 0
    # Who ended them is audited.
    async with db.connection() as conn:
        audit = await (
            await conn.execute(
                "SELECT resource_id, actor, outcome, context FROM audit_log"
                " WHERE action = 'lifecycle' ORDER BY id"
            )
        ).fetchall()
    assert audit == [
        {
            "resource_id": rid,
            "actor": "alice",
            "outcome": "cancelled",
            "context": {"reason": "release"},
        },
        {
            "resource_id": other,
            "actor": "alice",
            "outcome": "released",
            "context": {"reason": "release"},
        },
    ]
    await advance(db, 60)
    second = await service.release(caller(), {"tenantId": "acme", "reservationId": other})
    assert second == first
    assert await quota_used(db) == 0
    assert (await event_types(db, other)).count("reservation.released") == 1


# --- 14. kubernetes ---------------------------------------------------------------------------

K8S_LABEL = "bc.dev/cap.binding.kubernetes"


async def k8s_world(db: Database, *, source: str | None) -> None:
    labels = {K8S_LABEL: ("true", source)} if source else None
    await world(db, policy={"kubernetes": True}, labels=labels)


@pytest.mark.parametrize("source", [None, "operator"])
async def test_kubernetes_needs_the_system_label(
    db: Database, service: ReservationService, source: str | None
) -> None:
    await k8s_world(db, source=source)
    view = await create(service, "k8s", binding="kubernetes")
    assert view["state"] == "pending"
    cond = condition(view, "Unschedulable")
    assert cond["reason"] == "NoFit"
    assert K8S_LABEL in cond["message"]
    await advance(db, 31)
    await run(db)
    assert (await get(service, view["id"]))["state"] == "pending"


@pytest.mark.parametrize(("pod_access", "named"), [(None, True), ("shared", False)])
async def test_a_kubernetes_reservation_is_advertised_under_its_own_name_unless_shared(
    db: Database, service: ReservationService, pod_access: str | None, named: bool
) -> None:
    policy: dict[str, Any] = {"kubernetes": True}
    if pod_access:
        policy["podAccess"] = pod_access
    await world(db, policy=policy, labels={K8S_LABEL: ("true", "system")})
    view = await create(service, "k8s", binding="kubernetes")
    rid = view["id"]
    expected = "bcd.dev/rsv-" + rid.removeprefix("rsv_")[:24] if named else None
    assert view.get("resourceName") == expected
    await activate(service, db, rid)
    [alloc] = await allocations(db, rid)
    [wanted] = await desired.for_node(db, node_id=alloc["node_id"])
    assert wanted["podAccess"] == (pod_access or "reservation")
    assert (await get(service, rid)).get("resourceName") == expected
    hold = await create(service, "plain-hold")
    assert "resourceName" not in hold


async def test_kubernetes_release_holds_devices_until_node_confirms(
    db: Database, service: ReservationService
) -> None:
    await k8s_world(db, source="system")
    view = await create(service, "k8s", binding="kubernetes")
    rid = view["id"]
    assert view["state"] == "placed", view["conditions"]
    end = view["during"]["end"]
    view = await activate(service, db, rid)
    [alloc] = await allocations(db, rid)
    assert view["binding"]["cdiDevices"] == cdi(alloc["device_ids"])

    await advance(db, 600)
    released = await service.release(caller(), {"tenantId": "acme", "reservationId": rid})
    at = await now(db)
    assert released["state"] == "released"
    assert released["releaseReason"] == "release"
    assert released["during"]["end"] == pytest.approx(to_ms(at), abs=5_000)
    held = condition(released, "DevicesHeld")
    assert held["reason"] == "PodsHoldDevices"
    assert held["nodes"] == [alloc["node_id"]]
    assert held["since"] == pytest.approx(to_ms(at), abs=5_000)
    assert await quota_used(db) == 0
    # The booking is carried past now (pods may still use the devices), but not to the end.
    booked = await bookings(db, rid)
    assert len(booked) == 4
    assert all(b["end_at"] > at for b in booked)
    assert all(b["end_ms"] < end for b in booked)

    assert await report(service, alloc, "releasing", pods=["default/train-0"])
    view = await get(service, rid)
    held = condition(view, "DevicesHeld")
    assert held["pods"] == ["default/train-0"]
    assert "default/train-0" in held["message"]

    # Not confirmed within the step: carried another 5 minutes.
    await advance(db, 300)
    await run(db)
    later = await now(db)
    assert all(b["end_at"] > later for b in await bookings(db, rid))
    assert condition(await get(service, rid), "DevicesHeld")

    await advance(db, 60)
    assert await report(service, alloc, "released")
    done = await now(db)
    view = await get(service, rid)
    assert view["state"] == "released"
    assert [c["type"] for c in view["conditions"]] == []
    booked = await bookings(db, rid)
    assert len(booked) == 4
    assert all(b["end_at"] <= done for b in booked)
    assert all(b["end_at"] > done - dt.timedelta(seconds=5) for b in booked)
    assert [a["state"] for a in await allocations(db, rid)] == ["released"]
    # A late, repeated report is ignored.
    assert not await report(service, alloc, "released")


# --- 15. repair before the start --------------------------------------------------------------


async def test_repair_moves_a_bad_booking_before_the_start(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    start = await now_ms(db) + 2 * HOUR_MS
    view = await create(service, "repair", start=start)
    rid = view["id"]
    [alloc] = await allocations(db, rid)
    bad = alloc["device_ids"][0]
    await inventory.set_atom_health(db, node_id=alloc["node_id"], device_id=bad, healthy=False)
    await advance(db, 2 * 3600 - 15 * 60)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "placed", view
    assert view["during"] == {"start": start, "end": start + HOUR_MS}
    assert "reservation.repaired" in await event_types(db, rid)
    [moved] = await allocations(db, rid)
    assert moved["id"] != alloc["id"]
    assert bad not in moved["device_ids"]
    booked = await bookings(db, rid)
    assert len(booked) == 4
    assert bad not in {b["device_id"] for b in booked}
    assert {b["start_ms"] for b in booked} == {start}
    assert await quota_used(db) == 4

    # And it starts as usual.
    await advance(db, 15 * 60 + 1)
    await run(db)
    assert (await get(service, rid))["state"] == "binding"


async def test_repair_that_does_not_fit_waits_pending(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, gpus=8, domains=1)
    start = await now_ms(db) + 2 * HOUR_MS
    rid = (await create(service, "no-room", count=8, start=start))["id"]
    [alloc] = await allocations(db, rid)
    await inventory.set_atom_health(
        db, node_id=alloc["node_id"], device_id=alloc["device_ids"][3], healthy=False
    )
    await advance(db, 2 * 3600 - 15 * 60)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "pending", view
    cond = condition(view, "Unschedulable")
    assert cond["reason"] == "BookingRepairFailed"
    assert "0 of 1 nodes fit" in cond["message"]
    assert view["during"] is None
    assert view["operation"]["state"] == "pending"
    assert await bookings(db, rid) == []
    assert await quota_used(db) == 8  # pending keeps its charge
    assert (await events(db, rid))[-1] == (
        "reservation.pending",
        {"state": "pending", "poolId": "pool_a", "reason": "BookingRepairFailed"},
    )
    # Its 30-second retry still finds no room: the reason stays the booking that went bad.
    await advance(db, 31)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "pending"
    assert condition(view, "Unschedulable")["reason"] == "BookingRepairFailed"
    # Healed before the start: the retry places it again on its requested window.
    await inventory.set_atom_health(
        db, node_id=alloc["node_id"], device_id=alloc["device_ids"][3], healthy=True
    )
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "placed", view
    assert view["during"] == {"start": start, "end": start + HOUR_MS}


# --- 16. extend -------------------------------------------------------------------------------


async def extend(service: ReservationService, rid: str, key: str, **how: Any) -> dict[str, Any]:
    return await service.extend(
        caller(), {"tenantId": "acme", "reservationId": rid, "idempotencyKey": key, **how}
    )


async def test_extend_by_moves_the_end_once_per_key(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    view = await create(service, "ext")
    rid = view["id"]
    start, end = view["during"]["start"], view["during"]["end"]
    await activate(service, db, rid)

    answer = await extend(service, rid, "ext-1", by="4h")
    assert answer["extended"] is True
    assert "availableUntil" not in answer
    new_end = end + 4 * HOUR_MS
    assert answer["reservation"]["during"] == {"start": start, "end": new_end}
    assert answer["reservation"]["state"] == "active"
    assert {b["end_ms"] for b in await bookings(db, rid)} == {new_end}
    assert (await events(db, rid))[-1] == (
        "reservation.extended",
        {"state": "active", "poolId": "pool_a", "end": new_end, "previousEnd": end},
    )

    again = await extend(service, rid, "ext-1", by="4h")
    assert again["extended"] is True
    assert again["reservation"]["during"]["end"] == new_end
    assert {b["end_ms"] for b in await bookings(db, rid)} == {new_end}
    assert (await event_types(db, rid)).count("reservation.extended") == 1

    # The same key for another change is a conflict.
    with pytest.raises(ComputeError) as e:
        await extend(service, rid, "ext-1", by="1h")
    assert e.value.code == ErrorCode.CONFLICT

    # An until already reached: extended false, nothing changes.
    reached = await extend(service, rid, "ext-2", until=new_end - HOUR_MS)
    assert reached["extended"] is False
    assert reached["reservation"]["during"]["end"] == new_end
    # The old end is no longer the end: the reservation stays active past it.
    await advance(db, 3600 + 1)
    await run(db)
    assert (await get(service, rid))["state"] == "active"
    await advance(db, 4 * 3600)
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "released"
    assert view["releaseReason"] == "expired"


async def test_extend_blocked_by_the_next_booking(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, gpus=4, domains=1)
    a = await create(service, "first", count=4, start=await now_ms(db) + 60_000)
    a_end = a["during"]["end"]
    b = await create(service, "second", count=4, start=a_end)
    assert b["state"] == "placed", b
    assert b["during"]["start"] == a_end
    await advance(db, 61)
    await activate(service, db, a["id"])

    answer = await extend(service, a["id"], "ext-a", by="2h")
    assert answer["extended"] is False
    assert answer["availableUntil"] == a_end
    assert answer["reservation"]["during"]["end"] == a_end
    assert {x["end_ms"] for x in await bookings(db, a["id"])} == {a_end}
    assert "reservation.extended" not in await event_types(db, a["id"])
    # The refusal left no hold behind: a smaller extend is not "in flight" afterwards.
    async with db.connection() as conn:
        holds = await (await conn.execute("SELECT * FROM extend_holds")).fetchall()
        pending = await (
            await conn.execute("SELECT pending FROM authz_resources WHERE id = %s", (a["id"],))
        ).fetchone()
    assert holds == []
    assert pending == {"pending": None}
    # Not remembered: the same key is decided again (and still does not fit).
    retry = await extend(service, a["id"], "ext-a", by="2h")
    assert retry["extended"] is False
    assert retry["availableUntil"] == a_end


async def test_concurrent_extends_never_overlap(db: Database, service: ReservationService) -> None:
    await world(db)
    view = await create(service, "race")
    rid = view["id"]
    end = view["during"]["end"]
    await activate(service, db, rid)

    async def attempt(key: str) -> dict[str, Any] | ComputeError:
        try:
            return await extend(service, rid, key, by="1h")
        except ComputeError as e:
            return e

    results = await asyncio.gather(*(attempt(f"race-{i}") for i in range(4)))
    succeeded = [r for r in results if isinstance(r, dict) and r["extended"]]
    refused = [r for r in results if isinstance(r, ComputeError)]
    assert len(succeeded) + len(refused) == len(results), results
    assert succeeded
    for e in refused:
        assert e.code == ErrorCode.CONFLICT
        assert e.details["reason"] == "extend-in-flight"
        assert e.details["retryAfterSeconds"] == 60
    new_end = end + len(succeeded) * HOUR_MS
    view = await get(service, rid)
    assert view["during"]["end"] == new_end
    booked = await bookings(db, rid)
    assert len(booked) == 4
    assert {b["end_ms"] for b in booked} == {new_end}
    assert (await event_types(db, rid)).count("reservation.extended") == len(succeeded)
    async with db.connection() as conn:
        holds = await (await conn.execute("SELECT * FROM extend_holds")).fetchall()
        overlaps = await (
            await conn.execute(
                "SELECT count(*) AS n FROM bookings x JOIN bookings y"
                " ON x.atom_id = y.atom_id AND x.id < y.id AND x.during && y.during"
            )
        ).fetchone()
    assert holds == []
    assert overlaps == {"n": 0}


async def test_back_to_back_at_the_announced_end_of_a_window_that_began_now(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, gpus=4, domains=1)
    # Business time is whole milliseconds, so a window that began "now" ends exactly at its
    # announced end, and another can be booked from that instant.
    a = await create(service, "a", count=4)
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT upper(during) AS e FROM reservations WHERE id = %s", (a["id"],)
            )
        ).fetchone()
    assert row is not None
    assert row["e"].microsecond % 1000 == 0
    placed = dict(await events(db, a["id"]))["reservation.placed"]
    assert placed["end"] == a["during"]["end"]
    b = await create(service, "b", count=4, start=a["during"]["end"])
    assert b["state"] == "placed", b["conditions"]


async def test_a_lapsed_lease_cannot_be_renewed(db: Database, service: ReservationService) -> None:
    await world(db)
    view = await service.create(
        caller(),
        {
            "tenantId": "acme",
            "poolId": "pool_a",
            "devices": [{"class": "gpu", "count": 1}],
            "duration": "8h",
            "leaseSeconds": 600,
            "idempotencyKey": "lease",
        },
    )
    await inventory.advance_clock(db, seconds=601)
    with pytest.raises(ComputeError) as info:
        await service.renew(caller(), {"tenantId": "acme", "reservationId": view["id"]})
    assert info.value.code == "INVALID_STATE"
    assert "lapsed" in info.value.message


async def test_node_lease_books_whole_nodes_and_gets_no_second_placement(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=2, gpus=8, quota=16, policy={"tenantRoot": True})
    view = await create(
        service,
        "metal",
        count=8,
        duration="8h",
        binding="node",
        node={"profileId": "ubuntu-24.04"},
    )
    assert view["state"] == "placed"
    [alloc] = await allocations(db, view["id"])
    assert len(alloc["device_ids"]) == 8  # every atom of the node
    await run(db)
    assert (await get(service, view["id"]))["state"] == "binding"
    # Metal has two hours to deploy; nothing after five minutes.
    await advance(db, 6 * 60)
    await run(db)
    assert (await get(service, view["id"]))["state"] == "binding"
    await advance(db, 2 * 3600)
    await run(db)
    failed = await get(service, view["id"])
    assert failed["state"] == "failed"
    assert condition(failed, "BindTimeout")["reason"] == "NodeDidNotBind"
    assert await quota_used(db) == 0


async def test_pods_of_another_namespace_degrade_an_active_kubernetes_reservation(
    db: Database, service: ReservationService
) -> None:
    """The node's bound report names the pods holding the devices and the intruders among them
    (pods outside the Reservation's namespace): shown in ``binding.pods`` and as
    ``Degraded/PodOutsideNamespace`` until a report without them; nothing is released."""
    await k8s_world(db, source="system")
    rid = (await create(service, "k8s", binding="kubernetes"))["id"]
    await activate(service, db, rid)
    [alloc] = await allocations(db, rid)
    devices = cdi(alloc["device_ids"])

    pods = ["ml/trainer-0", "other/thief"]
    assert await report(service, alloc, "bound", cdiDevices=devices, pods=pods)
    await run(db)
    view = await get(service, rid)
    assert view["binding"]["pods"] == pods
    assert conditions(view) == []

    assert await report(
        service, alloc, "bound", cdiDevices=devices, pods=pods, intruders=["other/thief"]
    )
    await run(db)
    view = await get(service, rid)
    assert view["state"] == "active"
    assert conditions(view) == [("Degraded", "PodOutsideNamespace")]
    assert f"{alloc['node_id']}: other/thief" in view["conditions"][0]["message"]
    assert len(await bookings(db, rid)) == 4

    assert await report(service, alloc, "bound", cdiDevices=devices, pods=["ml/trainer-0"])
    await run(db)
    view = await get(service, rid)
    assert conditions(view) == []
    assert view["binding"]["pods"] == ["ml/trainer-0"]


async def test_a_hold_cannot_be_said_to_have_intruders(
    db: Database, service: ReservationService
) -> None:
    """Only the kubelet's pods hold devices: ``intruders`` on a hold's report is dropped."""
    await world(db)
    rid = (await create(service, "hold"))["id"]
    await activate(service, db, rid)
    [alloc] = await allocations(db, rid)
    assert await report(
        service, alloc, "bound", cdiDevices=cdi(alloc["device_ids"]), intruders=["x/y"]
    )
    await run(db)
    assert conditions(await get(service, rid)) == []


async def test_a_unique_start_of_an_id_names_the_reservation(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    first = await create(service, "a", count=1)
    second = await create(service, "b", count=1)
    # ULIDs made in the same moment share their start: find where they differ.
    common = 0
    while first["id"][common] == second["id"][common]:
        common += 1
    short = first["id"][: max(common + 1, 8)]
    assert (await get(service, short))["id"] == first["id"]
    with pytest.raises(ComputeError) as ambiguous:
        await get(service, first["id"][:common])  # shared by both
    if common >= 8:
        assert ambiguous.value.code is ErrorCode.INVALID_INPUT
        assert first["id"] in ambiguous.value.message
        assert second["id"] in ambiguous.value.message
    # Another identity of the tenant cannot use a start of alice's ids.
    with pytest.raises(ComputeError) as hidden:
        await service.get(caller("bob"), {"tenantId": "acme", "reservationId": short})
    assert hidden.value.code is ErrorCode.NOT_FOUND
