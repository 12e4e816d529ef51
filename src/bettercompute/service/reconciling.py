"""The reconciler loop: take due wake-ups from the work queue and reconcile them.

Several replicas may run it: the queue is taken ``FOR UPDATE SKIP LOCKED``. It sleeps until the
next wake-up is due, and a ``compute_work`` notification (any new wake-up) cuts the sleep short,
so freed capacity reaches pending reservations at once. It never decides policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from bettercompute.store import listening, reconciling
from bettercompute.store.database import Database, StoreError

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
            listening.wake_on(self.db.dsn, "compute_work", self._wake), name="reconciler-listen"
        )
        try:
            while True:
                try:
                    await self.run_once()
                except StoreError as e:
                    log.warning("reconciler pass failed, retrying: %s", e)
                due = await reconciling.next_due_in(self.db)
                timeout = MAX_IDLE_S if due is None else min(MAX_IDLE_S, due)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await self._wake.wait()
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
