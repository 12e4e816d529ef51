"""The service's loops stop when cancelled, even as they are woken (Python 3.11's
``asyncio.wait_for`` would swallow that cancellation and hang a shutdown)."""

import asyncio

from bettercompute.service.events import EventDelivery
from bettercompute.service.reconciling import Reconciler


async def _settle(task, delivery_wake):
    # Let the loop reach its idle wait, then wake it and cancel it in the same breath.
    for _ in range(50):
        await asyncio.sleep(0.01)
    delivery_wake.set()
    await asyncio.sleep(0)  # the inner Event.wait() completes; the outer task is not run yet
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2)
    return task in done


async def test_event_delivery_stops_when_cancelled_as_it_wakes(db):
    async def handler(event):
        pass

    delivery = EventDelivery(db, subscriber="x", handler=handler, poll_s=60)
    task = asyncio.create_task(delivery.run())
    stopped = await _settle(task, delivery._wake)
    if not stopped:
        task.cancel()
        await asyncio.wait({task}, timeout=2)
    assert stopped, "EventDelivery.run swallowed its cancellation and kept running"


async def test_reconciler_stops_when_cancelled_as_it_wakes(db):
    reconciler = Reconciler(db)
    task = asyncio.create_task(reconciler.run())
    stopped = await _settle(task, reconciler._wake)
    if not stopped:
        task.cancel()
        await asyncio.wait({task}, timeout=2)
    assert stopped, "Reconciler.run swallowed its cancellation and kept running"
