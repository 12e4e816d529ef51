"""The wake-ups between batches and waiting requests (``service.batching.Signals``): which batch
sends a waiter to the database and which hands it its view."""

from __future__ import annotations

import asyncio

from bettercompute.service.batching import Signals
from bettercompute.store import batching


async def test_a_batch_here_hands_its_views_to_the_requests_waiting_on_them() -> None:
    signals = Signals()
    with signals.watching("rsv_a") as handed_a, signals.watching("rsv_b") as handed_b:
        waiter = asyncio.create_task(signals.wait_placed("pool_a", within_s=5))
        await asyncio.sleep(0)
        signals.placed("pool_a", {"rsv_a": {"id": "rsv_a", "state": "placed"}})
        await asyncio.wait_for(waiter, 1)
        assert handed_a() == {"id": "rsv_a", "state": "placed"}
        assert handed_b() is None  # passed over: nothing to read either
        assert not signals.decided_elsewhere("rsv_b")
        assert signals.unnamed_batches("pool_a") == 0
    assert handed_a() is None  # let go with the last waiter


async def test_a_batch_elsewhere_sends_only_the_waiters_it_names_to_read() -> None:
    signals = Signals()
    with signals.watching("rsv_a"), signals.watching("rsv_b"):
        waiter = asyncio.create_task(signals.wait_placed("pool:a", within_s=5))
        await asyncio.sleep(0)
        # What store.batching sends: the pool (which may hold a colon), then the ids decided.
        signals.deliver("placed:pool:a:rsv_a,rsv_c")
        await asyncio.wait_for(waiter, 1)
        assert signals.decided_elsewhere("rsv_a")
        assert not signals.decided_elsewhere("rsv_a")  # asked once
        assert not signals.decided_elsewhere("rsv_b")  # not named: no read
        assert not signals.decided_elsewhere("rsv_c")  # nobody here waits on it
        assert signals.unnamed_batches("pool:a") == 0


async def test_a_batch_elsewhere_that_names_nothing_sends_every_waiter_to_read() -> None:
    signals = Signals()
    waiter = asyncio.create_task(signals.wait_placed("pool_a", within_s=5))
    await asyncio.sleep(0)
    signals.deliver("placed:pool_a")
    await asyncio.wait_for(waiter, 1)
    assert signals.unnamed_batches("pool_a") == 1
    assert signals.unnamed_batches("pool_b") == 0


def test_a_batchs_ids_are_split_over_notifications_that_fit() -> None:
    ids = [f"rsv_{n:052d}" for n in range(300)]
    payloads = batching.placed_payloads("pool_a", ids)
    assert len(payloads) > 1
    assert all(len(p.encode()) < 8000 for p in payloads)
    named: list[str] = []
    for payload in payloads:
        assert payload.startswith("placed:pool_a:")
        named += payload.removeprefix("placed:pool_a:").split(",")
    assert named == ids
    assert batching.placed_payloads("pool_a", []) == ["placed:pool_a:"]


async def test_the_echo_of_a_batch_here_is_ignored_while_this_process_holds_the_pool() -> None:
    signals = Signals()
    signals.holding(["pool_a"])
    with signals.watching("rsv_a"):
        waiter = asyncio.create_task(signals.wait_placed("pool_a", within_s=10))
        await asyncio.sleep(0)
        signals.deliver("placed:pool_a:rsv_a")  # our own batch's notification, come back
        await asyncio.sleep(0.05)
        assert not waiter.done()  # no wake-up: the batch already woke its waiters with views
        assert not signals.decided_elsewhere("rsv_a")
        waiter.cancel()

    # Once the lease is gone, a batch of the pool can only be another replica's.
    signals.holding([])
    with signals.watching("rsv_a"):
        waiter = asyncio.create_task(signals.wait_placed("pool_a", within_s=5))
        await asyncio.sleep(0)
        signals.deliver("placed:pool_a:rsv_a")
        await asyncio.wait_for(waiter, 1)
        assert signals.decided_elsewhere("rsv_a")


async def test_queued_wakes_the_placer_for_that_pool() -> None:
    signals = Signals()
    signals.deliver("queued:pool_a")
    assert signals.work.is_set()
    assert signals.take_queued() == {"pool_a"}
    assert not signals.work.is_set()
    assert signals.take_queued() == set()
