"""The reconciler loop: take due wake-ups from the work queue and reconcile them.

Several replicas may run it: the queue is taken ``FOR UPDATE SKIP LOCKED``. It sleeps until the
next wake-up is due, and a ``compute_work`` notification (any new wake-up) cuts the sleep short,
so freed capacity reaches pending reservations at once. It never decides policy.

What it must never do: end on a store error. While the database is away every pass fails; it
logs a WARNING when the failure starts (and when it changes), waits a growing, jittered while
(up to 5 s) and tries again, and says so when a pass succeeds again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from bettercompute import supervising
from bettercompute.core.errors import StoreError
from bettercompute.store import listening, reconciling
from bettercompute.store.database import Database

log = logging.getLogger(__name__)

#: The longest sleep between passes, whatever the queue says (a missed notification heals).
MAX_IDLE_S = 5.0


class Reconciler:
    def __init__(self, db: Database, *, batch: int = 50):
        self.db = db
        self.batch = batch
        self._wake = asyncio.Event()

    async def run_once(self) -> int:
        """Reconcile everything due now; returns how many reservations were reconciled."""
        total = 0
        while True:
            done = await reconciling.reconcile_due(self.db, limit=self.batch)
            total += done
            if done < self.batch:
                return total

    async def run(self) -> None:
        listener = asyncio.create_task(
            listening.wake_on(self.db, "compute_work", self._wake), name="reconciler-listen"
        )
        backoff = supervising.Backoff()
        failing = ""
        try:
            while True:
                # Cleared before the pass, never after it: a wake-up inserted while the pass
                # or the read of the next due moment runs is still seen by the wait below.
                # (Cleared after them, one that came in between was lost, and the loop slept
                # up to MAX_IDLE_S with a node's report due: binds took 5 s now and then.)
                self._wake.clear()
                try:
                    await self.run_once()
                    due = await reconciling.next_due_in(self.db)
                except StoreError as e:
                    if str(e) != failing:
                        log.warning("reconciler pass failed, retrying: %s", e)
                    failing = str(e)
                    await backoff.wait()
                    continue
                if failing:
                    log.info("reconciler passes succeed again")
                    failing = ""
                backoff.reset()
                timeout = MAX_IDLE_S if due is None else min(MAX_IDLE_S, due)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await self._wake.wait()
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
