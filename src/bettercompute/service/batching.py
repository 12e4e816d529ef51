"""The pool-lease placer loop, and the wake-ups between creates, batches and waiting requests.

Why it exists: a create on a ``placer: pool-lease`` pool ends queued; somebody must place it.
Every replica runs a ``PoolPlacer`` beside its reconciler. For each such pool it tries to take
or renew the pool's lease (``store/batching.py``); the one replica that holds it places the
queued reservations in batches. A replica that dies stops renewing, and another takes the lease
over once it expires (``LEASE_TTL``, checked every ``RENEW_S``); a clean stop gives the leases
back at once.

When a batch runs (group commit): as soon as the holder is woken and no batch of the pool is
running. Requests queued while a batch runs make up the next one, so batches grow with the load
by themselves and an idle pool places a request at once. Wake-ups: a create queued in this
process (``Signals.queued``), a ``queued:<pool>`` notification from any replica, and the pool's
``batchMs``: without a wake-up the holder still looks for queued work that often, so a lost
notification costs at most that long. A full batch (``maxBatch``) is followed by the next at
once.

``Signals`` also carries the other direction: a committed batch (here, or
``placed:<pool>:<ids>`` from another replica) wakes the requests waiting on that pool
(``ReservationService._wait``), so a ``wait`` returns as soon as its reservation was placed
(or left pending). A batch of this process hands its waiters their views, so a waiter it did
not take reads nothing; a batch of another replica names what it decided, and only those
waiters read. Without that, every batch would cost one read per waiting request, however few
it decided. A notification without ids (from a replica of an earlier version) sends every
waiter of the pool to read. The notification of a batch of this process comes back to it too;
while this process holds the pool's lease it is that echo (no other replica can place the
pool) and is ignored.

What it must never do: end on a store error (it logs, waits and tries again, like the
reconciler), or place a pool whose lease it does not hold (the batch checks it, under the pool
lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

from bettercompute import supervising
from bettercompute.core import ids
from bettercompute.core.errors import StoreError
from bettercompute.store import batching, listening
from bettercompute.store.database import Database

log = logging.getLogger(__name__)

#: How long a lease lasts unless renewed: a dead holder's pools wait at most this long.
LEASE_TTL = dt.timedelta(seconds=5)
#: How often leases are renewed, and taken where they lapsed.
RENEW_S = 1.5
#: The notification channel: ``queued:<pool>`` wakes the holder, ``placed:<pool>`` the waiters.
CHANNEL = "compute_placer"


class Signals:
    """In-process wake-ups: queued work for the placer, committed batches for the waiters.

    One per service; the loop and the service share it. Only hints: everything is read again
    from the database after a wake-up.
    """

    def __init__(self) -> None:
        self.work = asyncio.Event()
        self._queued: set[str] = set()
        self._placed: dict[str, asyncio.Event] = {}
        # Reservation id -> how many requests here wait on it; and the views a batch of this
        # process handed over for them (taken by the waiter, so never more than are waited on).
        self._watched: dict[str, int] = {}
        self._views: dict[str, dict[str, Any]] = {}
        # Pool id -> batches of other replicas that did not say what they decided; the waited
        # on reservations another replica's batch decided (to read); the pools whose lease this
        # process's placer holds.
        self._unnamed: dict[str, int] = {}
        self._decided_elsewhere: set[str] = set()
        self._holding: frozenset[str] = frozenset()

    def queued(self, pool_id: str) -> None:
        """Something was queued in ``pool_id``: wake its holder (if it is this process)."""
        self._queued.add(pool_id)
        self.work.set()

    def take_queued(self) -> set[str]:
        """The pools woken since the last call."""
        woken, self._queued = self._queued, set()
        self.work.clear()
        return woken

    def placed(
        self,
        pool_id: str,
        views: Mapping[str, dict[str, Any]] | None = None,
        *,
        elsewhere: Collection[str] | None = None,
    ) -> None:
        """A batch of ``pool_id`` committed: wake whoever waits on the pool, handing over the
        ``views`` (reservation id -> view as committed) that somebody here waits for.

        A batch of another replica hands no views: ``elsewhere`` names what it decided, and
        those waiters read (``decided_elsewhere``)."""
        for rid, view in (views or {}).items():
            if rid in self._watched:
                self._views[rid] = view
        if elsewhere is not None:
            self._decided_elsewhere.update(rid for rid in elsewhere if rid in self._watched)
        event = self._placed.pop(pool_id, None)
        if event is not None:
            event.set()

    def unnamed_batches(self, pool_id: str) -> int:
        """How many batches of ``pool_id`` other replicas committed without saying what they
        decided (a waiter compares it before and after a wake-up: changed, it must read)."""
        return self._unnamed.get(pool_id, 0)

    def decided_elsewhere(self, reservation_id: str) -> bool:
        """Whether another replica's batch decided ``reservation_id`` since last asked."""
        if reservation_id in self._decided_elsewhere:
            self._decided_elsewhere.discard(reservation_id)
            return True
        return False

    def holding(self, pool_ids: Iterable[str]) -> None:
        """The pools whose lease this process's placer now holds."""
        self._holding = frozenset(pool_ids)

    @contextlib.contextmanager
    def watching(self, reservation_id: str) -> Iterator[Callable[[], dict[str, Any] | None]]:
        """While a request waits on ``reservation_id``: what a batch here handed over for it
        (``None`` when nothing was, and the waiter reads it itself)."""
        self._watched[reservation_id] = self._watched.get(reservation_id, 0) + 1

        def handed() -> dict[str, Any] | None:
            return self._views.get(reservation_id)

        try:
            yield handed
        finally:
            left = self._watched.pop(reservation_id) - 1
            if left:
                self._watched[reservation_id] = left
            else:
                self._views.pop(reservation_id, None)
                self._decided_elsewhere.discard(reservation_id)

    async def wait_placed(self, pool_id: str, *, within_s: float) -> None:
        """Until the pool's next batch commits, or ``within_s`` seconds."""
        event = self._placed.setdefault(pool_id, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, within_s)):
                await event.wait()

    def deliver(self, payload: str) -> None:
        """A notification on ``CHANNEL``: ``queued:<pool>``, or ``placed:<pool>:<id>,…``."""
        what, _, rest = payload.partition(":")
        if what == "queued":
            self.queued(rest)
        elif what == "placed":
            pool_id, named, ids = rest.rpartition(":")
            if not named:  # no ids: a replica that does not say what it decided
                pool_id, ids = rest, ""
            if pool_id in self._holding:
                # While this process holds the lease, a batch of the pool can only be its own,
                # already handed over with its views.
                return
            if named:
                self.placed(pool_id, elsewhere=[rid for rid in ids.split(",") if rid])
            else:
                self._unnamed[pool_id] = self._unnamed.get(pool_id, 0) + 1
                self.placed(pool_id)


class PoolPlacer:
    """The loop: hold the leases it can, place the queued reservations of the pools it holds."""

    def __init__(
        self,
        db: Database,
        *,
        signals: Signals,
        holder: str | None = None,
        lease_ttl: dt.timedelta = LEASE_TTL,
        renew_s: float = RENEW_S,
    ) -> None:
        self.db = db
        self.signals = signals
        self.holder = holder or ids.new_id("placer")
        self.lease_ttl = lease_ttl
        self.renew_s = renew_s
        #: Pool id -> the epoch of its lease, for the pools this loop holds.
        self.held: dict[str, int] = {}
        self._pools: dict[str, batching.LeasePool] = {}
        self._due: dict[str, float] = {}  # pool id -> when to look for queued work next

    async def renew(self) -> None:
        """Take or renew the lease of every pool-lease pool; forget the pools lost."""
        self._pools = {p.id: p for p in await batching.lease_pools(self.db)}
        for pool_id in list(self.held):
            if pool_id not in self._pools:
                del self.held[pool_id]
        for pool_id in self._pools:
            epoch = await batching.take_lease(
                self.db, pool_id=pool_id, holder=self.holder, ttl=self.lease_ttl
            )
            if epoch is None:
                self.held.pop(pool_id, None)
            else:
                if pool_id not in self.held:
                    log.info("placer %s holds the lease of pool %s", self.holder, pool_id)
                    self._due[pool_id] = 0.0  # look at once: work may have waited for us
                self.held[pool_id] = epoch
        self.signals.holding(self.held)

    async def place(self, pool_id: str) -> batching.Batch:
        """One batch of a held pool, and the next at once while batches come back full."""
        pool = self._pools[pool_id]
        total = batching.Batch()
        while pool_id in self.held:
            try:
                batch = await batching.place_batch(
                    self.db,
                    pool_id=pool_id,
                    holder=self.holder,
                    epoch=self.held[pool_id],
                    max_batch=pool.max_batch,
                )
            except batching.LeaseLost:
                log.info("placer %s lost the lease of pool %s", self.holder, pool_id)
                self.held.pop(pool_id, None)
                self.signals.holding(self.held)
                break
            total.placed.extend(batch.placed)
            total.pending.extend(batch.pending)
            if batch.size:
                self.signals.placed(pool_id, batch.views)
            if batch.size < pool.max_batch:
                break
        return total

    async def run_once(self, *, now: float) -> float:
        """Renew when due, place what is due; returns seconds until something is due again."""
        woken = self.signals.take_queued()
        for pool_id in self.held:
            pool = self._pools[pool_id]
            if pool_id in woken or now >= self._due.get(pool_id, 0.0):
                self._due[pool_id] = now + pool.batch_ms / 1000
                if pool_id in woken or await batching.has_queued(self.db, pool_id=pool_id):
                    await self.place(pool_id)
        due = [self._due[p] for p in self.held if p in self._due]
        return max(0.0, min(due) - now) if due else self.renew_s

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        listener = asyncio.create_task(
            listening.payloads(self.db, CHANNEL, self.signals.deliver), name="placer-listen"
        )
        backoff = supervising.Backoff()
        failing = ""
        renew_at = 0.0
        try:
            while True:
                try:
                    if loop.time() >= renew_at:
                        await self.renew()
                        renew_at = loop.time() + self.renew_s
                    wait = await self.run_once(now=loop.time())
                except StoreError as e:
                    if str(e) != failing:
                        log.warning("placer pass failed, retrying: %s", e)
                    failing = str(e)
                    await backoff.wait()
                    continue
                if failing:
                    log.info("placer passes succeed again")
                    failing = ""
                backoff.reset()
                wait = min(wait, max(0.0, renew_at - loop.time()))
                if self.signals.work.is_set():
                    continue
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self.signals.work.wait()
        finally:
            self.signals.holding(())
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
            if self.held:
                # A clean stop: hand the pools over now rather than at the lease's expiry.
                with contextlib.suppress(StoreError):
                    await batching.give_back_leases(self.db, holder=self.holder)
