"""The service loops against a real PostgreSQL: event delivery at least once, in order, and a
reconciler woken at once by freed capacity (not at the next 30-second retry)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from bettercompute.service.events import EventDelivery
from bettercompute.service.reconciling import Reconciler
from bettercompute.service.reservations import ReservationService
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.store.test_admission import acme, create_input


async def test_events_are_delivered_in_order_and_again_after_a_failure(
    db: Database, service: ReservationService
):
    await acme(db, gpus=64)
    for i in range(3):
        await service.create(caller(), create_input(idempotencyKey=f"e{i}"))
    seen: list[int] = []
    fail_on = {2}

    async def handler(event: dict[str, Any]) -> None:
        if event["id"] in fail_on:
            fail_on.clear()
            raise RuntimeError("subscriber crashed")
        seen.append(event["id"])

    delivery = EventDelivery(db, subscriber="test", handler=handler)
    with pytest.raises(RuntimeError):
        await delivery.deliver_pending()
    assert seen == [1]
    # The cursor did not move past the failed event: it comes again, then the rest.
    assert await delivery.deliver_pending() == 2
    assert seen == [1, 2, 3]
    assert await delivery.deliver_pending() == 0


async def test_delivery_loop_is_woken_by_new_events(db: Database, service: ReservationService):
    await acme(db)
    got: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def handler(event: dict[str, Any]) -> None:
        await got.put(event)

    delivery = EventDelivery(db, subscriber="live", handler=handler, poll_s=30)
    task = asyncio.create_task(delivery.run())
    try:
        await asyncio.sleep(0.3)  # the listener is connected
        view = await service.create(caller(), create_input())
        event = await asyncio.wait_for(got.get(), timeout=2)
        assert event["type"] == "reservation.placed"
        assert event["subject"] == f"reservation/{view['id']}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_freed_capacity_places_a_pending_reservation_at_once(
    db: Database, service: ReservationService
):
    await acme(db, gpus=64, nodes=1)
    big = await service.create(
        caller(), create_input(idempotencyKey="big", devices=[{"class": "gpu", "count": 8}])
    )
    waiting = await service.create(caller(), create_input(idempotencyKey="waiting"))
    assert big["state"] == "placed"
    assert waiting["state"] == "pending"
    reconciler = Reconciler(db)
    task = asyncio.create_task(reconciler.run())
    try:
        await asyncio.sleep(0.3)
        await service.release(caller(), {"tenantId": "acme", "reservationId": big["id"]})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3
        state = "pending"
        while loop.time() < deadline and state == "pending":
            await asyncio.sleep(0.05)
            state = (
                await service.get(caller(), {"tenantId": "acme", "reservationId": waiting["id"]})
            )["state"]
        # Placed, and (its window starting now) already handed to its node for binding.
        assert state in ("placed", "binding")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
