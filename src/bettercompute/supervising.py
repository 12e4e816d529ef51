"""Long-running tasks of a process, started and stopped as a group.

Why a module of its own: every composition root (the dev stack, the operator, the node agent)
runs a few loops side by side; each must log the one that stops on an error instead of letting
it vanish, and cancel them all, waiting, when the process stops.

Depends on nothing of ours, so every package may use it; it must never hold logic of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from typing import Any

log = logging.getLogger(__name__)


def task(coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
    """``coro`` as a named task whose failure is logged as soon as it happens."""
    started = asyncio.create_task(coro, name=name)

    def report(done: asyncio.Task[None]) -> None:
        if not done.cancelled() and done.exception() is not None:
            log.error("%s stopped", name, exc_info=done.exception())

    started.add_done_callback(report)
    return started


async def cancel(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel every task and wait until all have ended."""
    pending = list(tasks)
    for each in pending:
        each.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
