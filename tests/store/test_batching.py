"""The pool-lease placer against a real PostgreSQL: creates queued, batches that place them,
``wait``, the pool's lease (takeover, fencing) and the batch's order (fairness, wholes)."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from typing import Any

import pytest

from bettercompute.core import states
from bettercompute.core.errors import ComputeError
from bettercompute.service.batching import PoolPlacer
from bettercompute.service.reservations import ReservationService
from bettercompute.store import batching, inventory
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.store.test_admission import create_input
from tests.support.placers import placers
from tests.support.world import World

LEASE = {"placer": "pool-lease"}


async def lease_world(db: Database, *, nodes: int = 2, gpus: int = 64, **policy: Any) -> World:
    return await (
        World(db)
        .tenant("acme")
        .tenant("globex")
        .tenant("root", root=True)
        .pool("pool_a", owner="acme", policy={**LEASE, **policy})
        .offer("pool_a", "globex")
        .nodes("pool_a", nodes)
        .quota("acme", "gpu:H100", gpus)
        .quota("globex", "gpu:H100", gpus)
        .build()
    )


async def rows(db: Database, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    async with db.connection() as conn:
        return await (await conn.execute(sql, params)).fetchall()


async def overlapping_bookings(db: Database) -> int:
    [row] = await rows(
        db,
        "SELECT count(*) AS n FROM bookings a JOIN bookings b ON a.atom_id = b.atom_id"
        " AND a.id < b.id AND a.during && b.during",
    )
    return int(row["n"])


async def test_a_create_is_queued_with_quota_charged(db: Database, service: ReservationService):
    await lease_world(db)
    view = await service.create(caller(), create_input())
    assert view["state"] == "pending"
    assert view["operation"]["state"] == "running"
    [queued] = view["conditions"]
    assert (queued["type"], queued["reason"]) == ("Queued", "PoolPlacer")
    assert await inventory.quota(db, tenant_id="acme", resource="gpu:H100") == (64, 4)
    events = await rows(db, "SELECT type, data FROM outbox ORDER BY id")
    assert events == [
        {
            "type": "reservation.queued",
            "data": {"state": "pending", "poolId": "pool_a", "reason": "PoolPlacer"},
        }
    ]
    # Nothing booked, and nothing for the reconciler but the pool's maxPending deadline: the
    # batch places it.
    assert await rows(db, "SELECT * FROM bookings") == []
    assert await rows(db, "SELECT why FROM work_queue") == [{"why": "max-pending"}]
    audited = await rows(
        db, "SELECT outcome FROM audit_log WHERE action = 'compute:reservations:create'"
    )
    assert audited == [{"outcome": "queued"}]


async def test_the_batch_places_what_is_queued(db: Database, service: ReservationService):
    await lease_world(db)
    views = [await service.create(caller(), create_input(idempotencyKey=f"k{i}")) for i in range(3)]
    placer = PoolPlacer(db, signals=service.signals)
    await placer.renew()
    assert set(placer.held) == {"pool_a"}
    batch = await placer.place("pool_a")
    assert sorted(batch.placed) == sorted(v["id"] for v in views)
    for v in views:
        got = await service.get(caller(), {"tenantId": "acme", "reservationId": v["id"]})
        assert got["state"] == "placed"
        assert got["operation"]["state"] == "succeeded"
        assert got["conditions"] == []
    assert await overlapping_bookings(db) == 0
    types = [r["type"] for r in await rows(db, "SELECT type FROM outbox ORDER BY id")]
    assert types.count("reservation.queued") == 3
    assert types.count("reservation.placed") == 3
    transitions = await rows(
        db, "SELECT context->>'to' AS t FROM audit_log WHERE action = 'transition' ORDER BY id"
    )
    assert [t["t"] for t in transitions].count("placed") == 3
    # Quota stays as transaction 2 charged it: the batch never charges.
    assert await inventory.quota(db, tenant_id="acme", resource="gpu:H100") == (64, 12)
    # Nothing left: the next batch is empty.
    assert (await placer.place("pool_a")).size == 0


async def test_what_does_not_fit_is_left_unschedulable_as_inline(
    db: Database, service: ReservationService
):
    await lease_world(db, nodes=1)  # 8 GPUs
    views = [await service.create(caller(), create_input(idempotencyKey=f"k{i}")) for i in range(3)]
    placer = PoolPlacer(db, signals=service.signals)
    await placer.renew()
    batch = await placer.place("pool_a")
    assert batch.placed == [views[0]["id"], views[1]["id"]]
    assert batch.pending == [views[2]["id"]]
    left = await service.get(caller(), {"tenantId": "acme", "reservationId": views[2]["id"]})
    assert left["state"] == "pending"
    assert left["operation"]["state"] == "pending"
    [cond] = left["conditions"]
    assert (cond["type"], cond["reason"]) == ("Unschedulable", "NoFit")
    # Retried in 30 s like any pending reservation (the reconciler hands the retry back to a
    # batch), and it kept its charge.
    assert len(await retries(db, left["id"])) == 1
    assert await inventory.quota(db, tenant_id="acme", resource="gpu:H100") == (64, 12)


async def test_wait_returns_as_soon_as_the_batch_placed_it(
    db: Database, service: ReservationService
):
    await lease_world(db)
    async with placers(db, [service]):
        await asyncio.sleep(0.3)  # the loop takes the lease
        started = time.monotonic()
        view = await service.create(caller(), {**create_input(), "wait": {"timeoutMs": 20_000}})
        took = time.monotonic() - started
    assert view["state"] == "placed"
    assert view["operation"]["state"] == "succeeded"
    # Woken by the batch, not by the 20 s timeout (nor by the 1 s back-off at its longest).
    assert took < 1.0, took


async def test_wait_times_out_with_the_reservation_still_queued(
    db: Database, service: ReservationService
):
    await lease_world(db)  # no placer runs
    started = time.monotonic()
    view = await service.create(caller(), {**create_input(), "wait": {"timeoutMs": 400}})
    took = time.monotonic() - started
    assert view["state"] == "pending"
    assert view["operation"]["state"] == "running"
    assert states.has_condition(view["conditions"], states.Condition.QUEUED)
    assert 0.4 <= took < 2.0, took


async def test_a_dead_holders_lease_is_taken_over_and_it_places_nothing(
    db: Database, service: ReservationService
):
    await lease_world(db)
    ttl = dt.timedelta(seconds=5)
    first = PoolPlacer(db, signals=service.signals, holder="placer_a", lease_ttl=ttl)
    second = PoolPlacer(db, signals=service.signals, holder="placer_b", lease_ttl=ttl)
    await first.renew()
    await second.renew()
    assert set(first.held) == {"pool_a"}
    assert second.held == {}  # the lease runs
    # The first holder dies: it renews no more. Once the lease expired, the second takes over.
    await inventory.advance_clock(db, seconds=6)
    await second.renew()
    assert second.held == {"pool_a": first.held["pool_a"] + 1}
    view = await service.create(caller(), create_input())
    # The dead holder's batch is fenced off: nothing placed, the lease counted lost.
    assert (await first.place("pool_a")).size == 0
    assert first.held == {}
    assert (await second.place("pool_a")).placed == [view["id"]]


async def test_a_stopped_holders_loop_hands_the_pool_to_another_replica(
    db: Database, make_service: Any
):
    await lease_world(db)
    one, two = make_service(), make_service()
    async with placers(db, [one]) as [loop_one]:
        await asyncio.sleep(0.3)
        assert set(loop_one.held) == {"pool_a"}
    # Stopped cleanly: its lease is given back, so the other replica needs no expiry.
    async with placers(db, [two]) as [loop_two]:
        view = await two.create(caller(), {**create_input(), "wait": {"timeoutMs": 10_000}})
        assert set(loop_two.held) == {"pool_a"}
    assert view["state"] == "placed"


async def test_a_killed_holder_is_replaced_within_the_lease(db: Database, make_service: Any):
    await lease_world(db)
    one, two = make_service(), make_service()
    ttl = dt.timedelta(seconds=1)
    async with placers(db, [one, two], lease_ttl=ttl) as loops:
        await asyncio.sleep(0.5)
        [holder] = [p for p in loops if p.held]
        other = loops[1 - loops.index(holder)]
        # Killed: its renewals stop and it never gives the lease back.
        holder.renew = _dead  # type: ignore[method-assign]
        holder.held.clear()
        view = await (two if other is loops[1] else one).create(
            caller(), {**create_input(), "wait": {"timeoutMs": 10_000}}
        )
        assert set(other.held) == {"pool_a"}
    assert view["state"] == "placed"


async def _dead() -> None:
    await asyncio.Event().wait()


async def test_two_replicas_never_place_a_reservation_twice(db: Database, make_service: Any):
    await lease_world(db, nodes=4, gpus=1000)  # 32 GPUs
    services = [make_service(), make_service()]

    async def one(i: int) -> dict[str, Any]:
        return await services[i % 2].create(
            caller(f"user{i % 5}"),
            create_input(
                idempotencyKey=f"many-{i}",
                devices=[{"class": "gpu", "count": 1 + i % 2}],
                wait={"timeoutMs": 20_000},
            ),
        )

    async with placers(db, services, lease_ttl=dt.timedelta(seconds=1)) as loops:
        views = await asyncio.gather(*(one(i) for i in range(60)))
        # Both loops renew and place while more is queued: only the holder places.
        for loop in loops:
            await loop.renew()
        assert sum(1 for loop in loops if loop.held) == 1
        for i in range(5):
            await services[0].create(caller(), create_input(idempotencyKey=f"late-{i}"))
        await asyncio.sleep(1.0)
    assert {v["operation"]["state"] for v in views} <= {"succeeded", "pending"}
    placed = await rows(
        db,
        "SELECT subject, count(*) AS n FROM outbox WHERE type = 'reservation.placed'"
        " GROUP BY subject",
    )
    assert placed
    assert all(r["n"] == 1 for r in placed)
    assert await overlapping_bookings(db) == 0
    [booked] = await rows(
        db,
        "SELECT count(*) AS n FROM bookings b JOIN reservations r ON r.id = b.reservation_id"
        " WHERE r.state = 'placed'",
    )
    [wanted] = await rows(
        db,
        "SELECT coalesce(sum((request->'devices'->0->>'count')::int), 0) AS n"
        " FROM reservations WHERE state = 'placed'",
    )
    assert booked["n"] == wanted["n"] <= 32


async def test_two_batches_at_once_place_each_reservation_once(
    db: Database, service: ReservationService
):
    await lease_world(db, nodes=4, gpus=1000)
    for i in range(20):
        await service.create(
            caller(), create_input(idempotencyKey=f"k{i}", devices=[{"class": "gpu", "count": 1}])
        )
    # Two batches of one pool at once (what a holder fenced too late would run): the pool lock
    # and the queued-state guard under it still place each reservation once.
    [epoch] = [
        r["epoch"]
        for r in await rows(db, "SELECT bc_pool_lease_take('pool_a', 'placer_a', '5s') AS epoch")
    ]
    results = await asyncio.gather(
        batching.place_batch(
            db, pool_id="pool_a", holder="placer_a", epoch=int(epoch), max_batch=256
        ),
        batching.place_batch(
            db, pool_id="pool_a", holder="placer_a", epoch=int(epoch), max_batch=256
        ),
        return_exceptions=True,
    )
    placed = [p for r in results if isinstance(r, batching.Batch) for p in r.placed]
    assert len(placed) == len(set(placed)) == 20
    assert await overlapping_bookings(db) == 0


async def test_one_tenants_flood_does_not_starve_anothers_request(db: Database, make_service: Any):
    await lease_world(db, maxBatch=4)
    service: ReservationService = make_service()
    for i in range(10):
        await service.create(
            caller(),
            create_input(idempotencyKey=f"flood-{i}", devices=[{"class": "gpu", "count": 1}]),
        )
    single = await service.create(
        caller("bob", "globex"),
        create_input(
            tenantId="globex", idempotencyKey="one", devices=[{"class": "gpu", "count": 1}]
        ),
    )
    placer = PoolPlacer(db, signals=service.signals)
    await placer.renew()
    first = await batching.place_batch(
        db, pool_id="pool_a", holder=placer.holder, epoch=placer.held["pool_a"], max_batch=4
    )
    assert single["id"] in first.placed
    assert len(first.placed) == 4


async def test_a_gang_is_placed_whole_or_not_at_all(db: Database, service: ReservationService):
    await lease_world(db, nodes=3)
    gang = await service.create(
        caller(),
        create_input(
            idempotencyKey="gang", devices=[{"class": "gpu", "count": 8}], gang={"size": 2}
        ),
    )
    too_big = await service.create(
        caller(),
        create_input(
            idempotencyKey="gang-2", devices=[{"class": "gpu", "count": 8}], gang={"size": 2}
        ),
    )
    placer = PoolPlacer(db, signals=service.signals)
    await placer.renew()
    batch = await placer.place("pool_a")
    assert batch.placed == [gang["id"]]
    assert batch.pending == [too_big["id"]]
    nodes = await rows(
        db,
        "SELECT count(DISTINCT a.node_id) AS nodes, count(*) AS atoms FROM bookings b"
        " JOIN atoms a ON a.id = b.atom_id WHERE b.reservation_id = %s",
        (gang["id"],),
    )
    assert nodes == [{"nodes": 2, "atoms": 16}]
    assert (
        await rows(db, "SELECT 1 FROM bookings WHERE reservation_id = %s", (too_big["id"],)) == []
    )


async def test_the_reconciler_leaves_a_queued_reservation_to_the_batch(
    db: Database, service: ReservationService
):
    from bettercompute.store import journal, reconciling

    await lease_world(db)
    view = await service.create(caller(), create_input())
    async with db.transaction() as conn:
        await journal.wake_pending(conn, pool_id="pool_a")  # freed capacity wakes pending ones
    await reconciling.reconcile_due(db)
    got = await service.get(caller(), {"tenantId": "acme", "reservationId": view["id"]})
    assert got["state"] == "pending"
    assert states.has_condition(got["conditions"], states.Condition.QUEUED)


async def test_a_regular_request_in_a_batch_preempts_spot_work_as_inline(
    db: Database, service: ReservationService
):
    await lease_world(db, nodes=1)  # 8 GPUs
    later = 4_000_000_000_000  # both in the same future window: neither has started
    spot = await service.create(
        caller(),
        create_input(
            idempotencyKey="spot", devices=[{"class": "gpu", "count": 8}], start=later, spot=True
        ),
    )
    placer = PoolPlacer(db, signals=service.signals)
    await placer.renew()
    assert (await placer.place("pool_a")).placed == [spot["id"]]
    regular = await service.create(
        caller(),
        create_input(idempotencyKey="regular", devices=[{"class": "gpu", "count": 4}], start=later),
    )
    assert (await placer.place("pool_a")).placed == [regular["id"]]
    requeued = await service.get(caller(), {"tenantId": "acme", "reservationId": spot["id"]})
    assert requeued["state"] == "pending"
    [cond] = requeued["conditions"]
    assert (cond["type"], cond["reason"]) == ("Unschedulable", "SpotPreempted")
    assert await overlapping_bookings(db) == 0


async def test_a_retry_in_a_batch_does_not_preempt_spot_work(
    db: Database, service: ReservationService
):
    # Preemption happens when a request is admitted (its first batch), never on a retry: the
    # same rule as the inline placer, whose retries the reconciler makes.
    from bettercompute.store import reconciling

    await lease_world(db, nodes=1)  # 8 GPUs
    later = 4_000_000_000_000
    big = await service.create(
        caller(),
        create_input(idempotencyKey="big", devices=[{"class": "gpu", "count": 8}], start=later),
    )
    placer = PoolPlacer(db, signals=service.signals)
    await placer.renew()
    assert (await placer.place("pool_a")).placed == [big["id"]]
    regular = await service.create(
        caller(),
        create_input(idempotencyKey="regular", devices=[{"class": "gpu", "count": 4}], start=later),
    )
    assert (await placer.place("pool_a")).pending == [regular["id"]]  # nothing to preempt
    # The big one goes, and spot work takes its place before the regular one is retried.
    await service.cancel(caller(), {"tenantId": "acme", "reservationId": big["id"]})
    spot = await service.create(
        caller(),
        create_input(
            idempotencyKey="spot", devices=[{"class": "gpu", "count": 8}], start=later, spot=True
        ),
    )
    assert (await placer.place("pool_a")).placed == [spot["id"]]
    await reconciling.reconcile_due(db)  # the freed capacity's retry: requeued for a batch
    assert await batching.has_queued(db, pool_id="pool_a")
    assert (await placer.place("pool_a")).pending == [regular["id"]]
    kept = await service.get(caller(), {"tenantId": "acme", "reservationId": spot["id"]})
    assert kept["state"] == "placed"
    assert not states.has_condition(kept["conditions"], states.Condition.PREEMPTED)
    assert await overlapping_bookings(db) == 0


async def test_quota_short_on_a_pool_lease_pool_queues_and_charges_nothing(
    db: Database, service: ReservationService
):
    await lease_world(db, gpus=6)
    first = await service.create(caller(), create_input(idempotencyKey="a"))
    assert first["state"] == "pending"
    with pytest.raises(ComputeError) as refused:
        await service.create(caller(), create_input(idempotencyKey="b"))
    assert refused.value.code == "QUOTA_EXCEEDED"
    assert await inventory.quota(db, tenant_id="acme", resource="gpu:H100") == (6, 4)
    queued = await rows(db, "SELECT id FROM reservations WHERE state = 'pending'")
    assert queued == [{"id": first["id"]}]
    drafts = await rows(db, "SELECT count(*) AS n FROM reservations WHERE state = 'draft'")
    assert drafts == [{"n": 1}]  # kept: the same key is decided again on retry


async def test_a_queued_reservation_cancelled_is_refunded_and_never_placed(
    db: Database, service: ReservationService
):
    await lease_world(db)
    view = await service.create(caller(), create_input())
    cancelled = await service.cancel(caller(), {"tenantId": "acme", "reservationId": view["id"]})
    assert cancelled["state"] == "cancelled"
    assert await inventory.quota(db, tenant_id="acme", resource="gpu:H100") == (64, 0)
    placer = PoolPlacer(db, signals=service.signals)
    await placer.renew()
    assert (await placer.place("pool_a")).size == 0
    assert await rows(db, "SELECT 1 FROM bookings") == []


async def test_a_waiting_create_is_woken_by_the_batch_not_by_its_next_poll(
    db: Database, service: ReservationService
):
    await lease_world(db)
    waiting = asyncio.create_task(
        service.create(caller(), {**create_input(), "wait": {"timeoutMs": 20_000}})
    )
    # By now its back-off has grown to a full second between reads (0.05 → 1 s).
    await asyncio.sleep(1.7)
    assert not waiting.done()
    placer = PoolPlacer(db, signals=service.signals)
    await placer.renew()
    assert len((await placer.place("pool_a")).placed) == 1
    placed_at = time.monotonic()
    view = await waiting
    assert view["state"] == "placed"
    assert time.monotonic() - placed_at < 0.3


async def test_a_waiting_create_left_pending_by_its_batch_returns_at_once(
    db: Database, service: ReservationService
):
    await lease_world(db, nodes=1)  # 8 GPUs
    placer = PoolPlacer(db, signals=service.signals)
    await placer.renew()
    await service.create(
        caller(), create_input(idempotencyKey="big", devices=[{"class": "gpu", "count": 8}])
    )
    assert len((await placer.place("pool_a")).placed) == 1
    waiting = asyncio.create_task(
        service.create(caller(), {**create_input(), "wait": {"timeoutMs": 20_000}})
    )
    await asyncio.sleep(1.7)  # its back-off is at a full second between reads
    assert not waiting.done()
    assert len((await placer.place("pool_a")).pending) == 1
    decided_at = time.monotonic()
    view = await waiting
    assert view["state"] == "pending"
    assert view["operation"]["state"] == "pending"  # no longer running: the wait is over
    assert time.monotonic() - decided_at < 0.3


async def _until(db: Database, check: Any, *, within_s: float = 5.0) -> None:
    """Poll ``check()`` (an async predicate) until true, or fail after ``within_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not await check():
        assert loop.time() < deadline, "not reached in time"
        await asyncio.sleep(0.05)


async def _states(db: Database, ids: list[str]) -> dict[str, str]:
    found = await rows(db, "SELECT id, state FROM reservations WHERE id = ANY(%s)", (ids,))
    return {r["id"]: r["state"] for r in found}


async def test_freed_capacity_wakes_the_batch_and_it_places_fairly(
    db: Database, service: ReservationService
):
    from bettercompute.service.reconciling import Reconciler
    from bettercompute.supervising import cancel

    # One node (8 GPUs), and a batchMs long enough that only a notification wakes the placer
    # within the test: freed capacity must reach the batch at once, not at its next poll.
    await lease_world(db, nodes=1, batchMs=60_000)
    one_gpu = [{"class": "gpu", "count": 1}]
    reconciler = asyncio.create_task(Reconciler(db).run())
    try:
        async with placers(db, [service]):
            await asyncio.sleep(0.3)  # the loop takes the lease
            wait = {"timeoutMs": 10_000}
            small = await service.create(
                caller(),
                create_input(
                    idempotencyKey="small", devices=[{"class": "gpu", "count": 2}], wait=wait
                ),
            )
            rest = await service.create(
                caller(),
                create_input(
                    idempotencyKey="rest", devices=[{"class": "gpu", "count": 6}], wait=wait
                ),
            )
            assert {small["state"], rest["state"]} <= {"placed", "binding"}
            # The pool is full: acme's flood (oldest) and then globex's single request wait.
            flood = [
                (
                    await service.create(
                        caller(),
                        create_input(idempotencyKey=f"flood-{i}", devices=one_gpu, wait=wait),
                    )
                )["id"]
                for i in range(3)
            ]
            single = await service.create(
                caller("bob", "globex"),
                create_input(tenantId="globex", idempotencyKey="one", devices=one_gpu, wait=wait),
            )
            for rid in [*flood, single["id"]]:
                [row] = await rows(
                    db, "SELECT state, conditions FROM reservations WHERE id = %s", (rid,)
                )
                assert row["state"] == "pending"
                assert [c["reason"] for c in row["conditions"]] == ["NoFit"]
            # Two GPUs freed: one for acme's oldest and one for globex, in the batch's fair
            # order, however many older requests acme has waiting.
            await service.release(caller(), {"tenantId": "acme", "reservationId": small["id"]})

            async def two_placed() -> bool:
                got = await _states(db, [*flood, single["id"]])
                return sum(1 for s in got.values() if s != "pending") >= 2

            await _until(db, two_placed, within_s=3.0)
            got = await _states(db, [*flood, single["id"]])
            assert got[single["id"]] in ("placed", "binding")
            assert got[flood[0]] in ("placed", "binding")
            assert got[flood[1]] == got[flood[2]] == "pending"
    finally:
        await cancel([reconciler])


async def retries(db: Database, rid: str) -> list[dt.datetime]:
    """When the reservation's retries are due (other wake-ups, such as its maxPending deadline,
    left out)."""
    found = await rows(
        db,
        "SELECT due_at FROM work_queue WHERE reservation_id = %s"
        " AND why IN ('retry', 'capacity-freed') ORDER BY due_at",
        (rid,),
    )
    return [r["due_at"] for r in found]


async def _pending_row(db: Database, rid: str) -> dict[str, Any]:
    [row] = await rows(
        db, "SELECT state, version, conditions FROM reservations WHERE id = %s", (rid,)
    )
    return row


async def _pending_events(db: Database, rid: str) -> int:
    [row] = await rows(
        db,
        "SELECT count(*) AS n FROM outbox WHERE type = 'reservation.pending' AND subject = %s",
        (f"reservation/{rid}",),
    )
    return int(row["n"])


async def test_a_retry_that_still_does_not_fit_is_left_as_it_is_and_tried_again_in_30_s(
    db: Database, service: ReservationService
):
    from bettercompute.store import reconciling

    await lease_world(db, nodes=1)  # 8 GPUs
    big = await service.create(
        caller(), create_input(idempotencyKey="big", devices=[{"class": "gpu", "count": 8}])
    )
    waiting = await service.create(caller(), create_input(idempotencyKey="waiting"))
    placer = PoolPlacer(db, signals=service.signals)
    await placer.renew()
    batch = await placer.place("pool_a")
    assert (batch.placed, batch.pending) == ([big["id"]], [waiting["id"]])
    before = await _pending_row(db, waiting["id"])
    assert [c["reason"] for c in before["conditions"]] == ["NoFit"]
    assert await _pending_events(db, waiting["id"]) == 1

    # Its retry is due: the reconciler hands it to the batch and changes nothing about it, nor
    # queues a wake-up of its own (the batch schedules the next retry).
    await inventory.advance_clock(db, seconds=31)
    await reconciling.reconcile_due(db)
    assert await rows(db, "SELECT reservation_id FROM batch_retries") == [
        {"reservation_id": waiting["id"]}
    ]
    assert await _pending_row(db, waiting["id"]) == before
    assert await retries(db, waiting["id"]) == []
    assert await batching.has_queued(db, pool_id="pool_a")

    # The batch tries it: still no room, for the same reason, so the row stays as it is (same
    # version, no second pending event) and the next retry is in 30 s.
    await placer.renew()  # the clock moved past the lease
    batch = await placer.place("pool_a")
    assert (batch.placed, batch.pending) == ([], [waiting["id"]])
    assert await _pending_row(db, waiting["id"]) == before
    assert await _pending_events(db, waiting["id"]) == 1
    assert await rows(db, "SELECT * FROM batch_retries") == []
    assert not await batching.has_queued(db, pool_id="pool_a")
    [clock] = await rows(db, "SELECT compute_now() AS now")
    [retry] = await retries(db, waiting["id"])
    assert 29 < (retry - clock["now"]).total_seconds() <= 30


async def test_a_retry_that_fails_for_a_new_reason_is_pending_again_without_a_second_event(
    db: Database, service: ReservationService
):
    from bettercompute.store import reconciling

    await lease_world(db, nodes=1)  # 8 GPUs
    await service.create(
        caller(), create_input(idempotencyKey="big", devices=[{"class": "gpu", "count": 8}])
    )
    waiting = await service.create(caller(), create_input(idempotencyKey="waiting"))
    placer = PoolPlacer(db, signals=service.signals)
    await placer.renew()
    assert (await placer.place("pool_a")).pending == [waiting["id"]]
    before = await _pending_row(db, waiting["id"])
    # The node goes not ready: the next try fails for another reason.
    [node] = await rows(db, "SELECT id FROM nodes")
    await inventory.set_node_status(db, node_id=node["id"], ready=False)
    await reconciling.reconcile_due(db)
    assert {"reservation_id": waiting["id"]} in await rows(
        db, "SELECT reservation_id FROM batch_retries"
    )
    batch = await placer.place("pool_a")
    assert waiting["id"] in batch.pending
    after = await _pending_row(db, waiting["id"])
    assert after["state"] == "pending"
    assert after["version"] == before["version"] + 1
    [cond] = after["conditions"]
    assert cond["reason"] == "NoFit"
    assert cond["message"] != before["conditions"][0]["message"]
    assert await _pending_events(db, waiting["id"]) == 1
    # Its next retry in 30 s, written with the pending mark (beside the first batch's, which
    # still waits: the node's change was reconciled, not that one).
    [clock] = await rows(db, "SELECT compute_now() AS now")
    due = await retries(db, waiting["id"])
    assert len(due) == 2
    assert all(0 < (at - clock["now"]).total_seconds() <= 30 for at in due)


async def test_freed_capacity_requeues_the_pools_waiting_retries_together(
    db: Database, service: ReservationService
):
    from bettercompute.store import journal, reconciling

    await lease_world(db, nodes=1)  # 8 GPUs
    await service.create(
        caller(), create_input(idempotencyKey="big", devices=[{"class": "gpu", "count": 8}])
    )
    waiting = [
        await service.create(caller(), create_input(idempotencyKey=f"w{i}")) for i in range(3)
    ]
    placer = PoolPlacer(db, signals=service.signals)
    await placer.renew()
    assert len((await placer.place("pool_a")).pending) == 3
    queued_late = await service.create(caller(), create_input(idempotencyKey="late"))
    async with db.transaction() as conn:
        await journal.wake_pending(conn, pool_id="pool_a")
    # Reconciling the first requeues every due retry of the pool in the same transaction, so
    # the batch it wakes sees them all at once; the queued one is the batch's already.
    async with db.transaction() as conn:
        await reconciling.reconcile(conn, waiting[0]["id"])
    requeued = await rows(db, "SELECT reservation_id FROM batch_retries ORDER BY reservation_id")
    assert requeued == [{"reservation_id": rid} for rid in sorted(w["id"] for w in waiting)]
    # The others' due wake-ups were taken with them, as the reconciler takes its own.
    assert await retries(db, waiting[1]["id"]) == await retries(db, waiting[2]["id"])
    [clock] = await rows(db, "SELECT compute_now() AS now")
    for w in waiting[1:]:
        assert all(at > clock["now"] for at in await retries(db, w["id"]))
    got = await _pending_row(db, queued_late["id"])
    assert states.has_condition(got["conditions"], states.Condition.QUEUED)
