"""Running the pool-lease placer in tests: one loop per service (replica), stopped after.

A test that runs with either placer asks for ``placer_policy`` and ``wait_input`` so the same
body works with both: inline creates come back placed or pending at once; pool-lease creates
wait for their batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from bettercompute import supervising
from bettercompute.service.batching import PoolPlacer
from bettercompute.service.reservations import ReservationService
from bettercompute.store.database import Database

PLACERS = ("inline", "pool-lease")


def placer_policy(placer: str, **policy: Any) -> dict[str, Any]:
    """The pool policy for ``placer`` (inline is the default: nothing to say)."""
    return {**policy, "placer": "pool-lease"} if placer == "pool-lease" else dict(policy)


def wait_input(placer: str, body: Mapping[str, Any], *, timeout_ms: int = 20_000) -> dict[str, Any]:
    """``body`` with a ``wait`` when creates are queued, so the answer is the placed one."""
    return {**body, "wait": {"timeoutMs": timeout_ms}} if placer == "pool-lease" else dict(body)


@contextlib.asynccontextmanager
async def placers(
    db: Database,
    services: Sequence[ReservationService],
    *,
    placer: str = "pool-lease",
    renew_s: float = 0.2,
    lease_ttl: dt.timedelta = dt.timedelta(seconds=5),
) -> AsyncIterator[list[PoolPlacer]]:
    """A placer loop beside each service, as every replica runs one; cancelled at the end."""
    if placer != "pool-lease":
        yield []
        return
    loops = [
        PoolPlacer(db, signals=s.signals, renew_s=renew_s, lease_ttl=lease_ttl) for s in services
    ]
    tasks = [asyncio.create_task(p.run(), name=f"placer-{i}") for i, p in enumerate(loops)]
    try:
        yield loops
    finally:
        await supervising.cancel(tasks)
