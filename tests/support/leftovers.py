"""No test's tasks outlive it.

Why it exists: every test runs in one session-wide event loop (the database pool is shared),
so a task a test started and did not end keeps running into the next test. A failed
``asyncio.gather`` leaves its other awaitables running; an orphaned create then charged the
next test's freshly written quota ("quota exceeded: vcpu … 0 left" with 10 configured). This
fixture notes the tasks alive when a test starts; when the test and its fixtures are done, it
gives the new ones a moment to finish, then cancels and awaits the rest and says which they
were, so a leak shows in the log instead of in another test's failure.

Only tasks running our own code (the product's or the tests') are touched: a library's tasks
(psycopg_pool's workers and scheduler, which a pool may start while a test runs; aiohttp's
connection handlers) belong to objects with their own lifetimes, and cancelling them broke
the pool they serve.

What it must never do: cancel a task that was alive before the test, or a library's task, or
hide a leak without saying so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

log = logging.getLogger(__name__)

#: The repository's root: a task whose coroutine was written here is ours.
ROOT = str(Path(__file__).resolve().parents[2])

#: How long the tasks a test left get to end on their own before they are cancelled.
GRACE_S = 0.5
#: How long cancelled tasks get to unwind (a cancelled request may still close a connection).
UNWIND_S = 5.0


def _ours(task: asyncio.Task[object]) -> bool:
    """Whether the task runs code of this repository (``src/`` or ``tests/``)."""
    code = getattr(task.get_coro(), "cr_code", None)
    where = str(getattr(code, "co_filename", ""))
    return where.startswith(ROOT) and "site-packages" not in where


def _described(task: asyncio.Task[object]) -> str:
    coro = task.get_coro()
    name = getattr(coro, "__qualname__", None) or repr(coro)
    return f"{task.get_name()} ({name})"


@pytest.fixture(autouse=True)
async def no_leftover_tasks() -> AsyncIterator[None]:
    before = set(asyncio.all_tasks())
    yield
    current = asyncio.current_task()

    def left() -> set[asyncio.Task[object]]:
        return {
            t
            for t in asyncio.all_tasks() - before
            if t is not current and not t.done() and _ours(t)
        }

    remaining = left()
    if not remaining:
        return
    await asyncio.wait(remaining, timeout=GRACE_S)
    remaining = left()
    if not remaining:
        return
    log.warning(
        "cancelling %d task(s) the test left running: %s",
        len(remaining),
        ", ".join(sorted(_described(t) for t in remaining)[:10]),
    )
    for task in remaining:
        task.cancel()
    await asyncio.wait(remaining, timeout=UNWIND_S)
