"""No test's tasks outlive it.

Why it exists: every test runs in one session-wide event loop (the database pool is shared),
so a task a test started and did not end keeps running into the next test. A failed
``asyncio.gather`` leaves its other awaitables running; an orphaned create then charged the
next test's freshly written quota ("quota exceeded: vcpu … 0 left" with 10 configured). This
fixture notes the tasks alive when a test starts; when the test and its fixtures are done, it
gives the new ones a moment to finish, then cancels and awaits the rest and says which they
were, so a leak shows in the log instead of in another test's failure.

What it must never do: cancel a task that was alive before the test (the session's database
pool runs its own workers), or hide a leak without saying so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

log = logging.getLogger(__name__)

#: How long the tasks a test left get to end on their own before they are cancelled.
GRACE_S = 0.5
#: How long cancelled tasks get to unwind (a cancelled request may still close a connection).
UNWIND_S = 5.0


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
        return {t for t in asyncio.all_tasks() - before if t is not current and not t.done()}

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
