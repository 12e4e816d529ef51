"""Delivering outbox events to in-process subscribers, at least once.

Each subscriber has a cursor in ``outbox_cursors``; it advances only after the subscriber's
callback returned, so a crash re-delivers rather than loses. A ``compute_outbox``
notification wakes delivery at once (the operator projects changes within a second).

What it must never do: end on a store error. While the database is away it logs a WARNING when
the failure starts, waits a growing, jittered while (up to 5 s) and tries again. A handler that
raises anything else ends ``run``: the supervisor logs it at ERROR and restarts it, and the
event comes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from bettercompute import supervising
from bettercompute.core.errors import StoreError
from bettercompute.store import listening, outbox
from bettercompute.store.database import Database

log = logging.getLogger(__name__)

Event = dict[str, Any]
Handler = Callable[[Event], Awaitable[None]]


class EventDelivery:
    """Delivers every event after the subscriber's cursor to ``handler``, in order."""

    def __init__(self, db: Database, *, subscriber: str, handler: Handler, poll_s: float = 5.0):
        self.db = db
        self.subscriber = subscriber
        self.handler = handler
        self.poll_s = poll_s
        self._wake = asyncio.Event()

    async def deliver_pending(self) -> int:
        """Deliver what is waiting now; returns how many events were delivered."""
        last = saved = await outbox.cursor(self.db, subscriber=self.subscriber)
        count = 0
        try:
            while True:
                events = await outbox.events_after(self.db, after_id=last)
                if not events:
                    return count
                for event in events:
                    await self.handler(event)
                    last = event["id"]
                    count += 1
        finally:
            # Up to the last event handled, even when a handler fails: what failed comes again.
            if last != saved:
                await outbox.save_cursor(self.db, subscriber=self.subscriber, last_id=last)

    async def run(self) -> None:
        listener = asyncio.create_task(
            listening.wake_on(self.db, "compute_outbox", self._wake),
            name=f"events-{self.subscriber}",
        )
        backoff = supervising.Backoff()
        failing = ""
        try:
            while True:
                try:
                    await self.deliver_pending()
                except StoreError as e:
                    if str(e) != failing:
                        log.warning("event delivery to %s failed, retrying: %s", self.subscriber, e)
                    failing = str(e)
                    await backoff.wait()
                    continue
                if failing:
                    log.info("event delivery to %s succeeds again", self.subscriber)
                    failing = ""
                backoff.reset()
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.poll_s):
                        await self._wake.wait()
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
