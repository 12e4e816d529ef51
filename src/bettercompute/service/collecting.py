"""The garbage collector's loop: a pass of ``store.collecting.collect`` every few minutes.

Why a loop of its own: what it removes (old refused drafts, denied reservations past their
retention, holds and claims of ended holders) is never urgent, so it runs on a slow schedule and
out of every request's way. Several replicas may run it at once: the store takes its rows
``SKIP LOCKED``. A database error never ends it: it logs, backs off and tries again. It never
decides policy and never touches the audit log.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

from bettercompute.core.errors import StoreError
from bettercompute.store import collecting
from bettercompute.store.database import Database

log = logging.getLogger(__name__)

#: Between passes.
INTERVAL_S = 300.0
#: The first wait after a failed pass; doubled after each failure, up to the interval.
RETRY_S = 5.0


class Collector:
    def __init__(
        self,
        db: Database,
        *,
        interval_s: float = INTERVAL_S,
        retry_s: float = RETRY_S,
        draft_age: dt.timedelta = collecting.DRAFT_AGE,
        denied_age: dt.timedelta = collecting.DENIED_AGE,
    ):
        self.db = db
        self.interval_s = interval_s
        self.retry_s = retry_s
        self.draft_age = draft_age
        self.denied_age = denied_age
        #: Passes completed and failed, for whoever watches the loop (tests, metrics).
        self.passes = 0
        self.failures = 0

    async def run_once(self) -> collecting.Collected:
        """One pass now; raises ``StoreError`` when the database fails."""
        done = await collecting.collect(
            self.db, draft_age=self.draft_age, denied_age=self.denied_age
        )
        self.passes += 1
        if done.total:
            log.info(
                "garbage collected %d drafts, %d denied reservations, %d extend holds and"
                " %d claims",
                done.drafts,
                done.denied,
                done.holds,
                done.claims,
            )
        return done

    async def run(self) -> None:
        """Forever: a pass, then the interval; after a failure, a growing back-off."""
        backoff = self.retry_s
        while True:
            try:
                await self.run_once()
            except StoreError as e:
                self.failures += 1
                log.warning("garbage collection failed, retrying in %.0f s: %s", backoff, e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.interval_s)
                continue
            backoff = self.retry_s
            await asyncio.sleep(self.interval_s)
