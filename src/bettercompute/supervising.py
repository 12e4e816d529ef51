"""Long-running tasks of a process, kept alive and stopped as a group; and the signals that
stop the process.

Why a module of its own: every composition root (the dev stack, the operator, the node agent)
runs a few loops side by side and must stop them all, waiting, when the process stops; and the
dev stack and the operator stop the same way on SIGINT/SIGTERM.

The policy (docs/operations.md says it for people):

* ``restarting``: a loop that must never end. When it raises (anything but cancellation), the
  exception is logged at ERROR with its traceback, so a programming error stays visible, and
  the loop is started again after a back-off (0.5 s doubling to 10 s, with jitter; back to
  0.5 s after a run of a minute). One failing loop never ends the process. Loops are expected
  to handle the store's outages themselves (WARNING, back-off, retry): an ERROR here means a
  bug or something nobody foresaw.
* ``task``: a task whose end is news the composition root waits for (kopf stopping, a renewed
  certificate that must restart the process). Its failure is logged as soon as it happens.
* ``Signals``: the first SIGINT/SIGTERM asks for a graceful stop; a second one, or the grace
  period running out, runs the ``force`` callbacks (stop what must not outlive the process,
  such as the dev stack's PostgreSQL) and ends the process at once.

Depends on nothing of ours, so every package may use it; it must never hold logic of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import sys
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

log = logging.getLogger(__name__)

#: A restarted loop that ran this long is considered healthy again: its back-off starts over.
HEALTHY_RUN_S = 60.0


class Backoff:
    """Growing waits with jitter between retries: ``first_s`` doubling up to ``max_s``.

    Each wait is drawn from the upper half of the current step, so replicas (or the loops of one
    process) that failed together do not retry in lockstep.
    """

    def __init__(self, *, first_s: float = 0.2, max_s: float = 5.0):
        self.first_s = first_s
        self.max_s = max_s
        self._failures = 0

    def next_delay(self) -> float:
        step = min(self.max_s, self.first_s * 2 ** min(self._failures, 30))
        self._failures += 1
        return random.uniform(step / 2, step)

    async def wait(self) -> None:
        await asyncio.sleep(self.next_delay())

    def reset(self) -> None:
        self._failures = 0


def task(coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
    """``coro`` as a named task whose failure is logged as soon as it happens."""
    started = asyncio.create_task(coro, name=name)

    def report(done: asyncio.Task[None]) -> None:
        if not done.cancelled() and done.exception() is not None:
            log.error("%s stopped", name, exc_info=done.exception())

    started.add_done_callback(report)
    return started


def restarting(
    run: Callable[[], Coroutine[Any, Any, None]],
    *,
    name: str,
    backoff: Backoff | None = None,
) -> asyncio.Task[None]:
    """A task running ``run()`` again whenever it ends, until cancelled (see the module doc)."""
    return asyncio.create_task(
        _keep_running(run, name=name, backoff=backoff or Backoff(first_s=0.5, max_s=10.0)),
        name=name,
    )


async def _keep_running(
    run: Callable[[], Coroutine[Any, Any, None]], *, name: str, backoff: Backoff
) -> None:
    loop = asyncio.get_running_loop()
    while True:
        began = loop.time()
        try:
            await run()
        except Exception:
            outcome = "failed"
            log.exception("%s failed; restarting it", name)
        else:
            outcome = "returned"
            log.error("%s returned, which it never should; restarting it", name)
        if loop.time() - began >= HEALTHY_RUN_S:
            backoff.reset()
        delay = backoff.next_delay()
        log.info("%s %s; restarting in %.1f s", name, outcome, delay)
        await asyncio.sleep(delay)


#: How long ``cancel`` waits before it cancels a task that is still running again.
CANCEL_AGAIN_S = 0.5


async def cancel(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel every task and wait until all have ended.

    Why again and again: on Python 3.11 a cancellation that lands just as an awaited database
    call completes can be lost inside ``asyncio.wait_for`` (psycopg waits with it), and the
    loop then goes back to its sleep as if nothing happened; seen with the garbage collector's
    hour-long sleep holding ``dev`` open at shutdown. A task still running after
    ``CANCEL_AGAIN_S`` is cancelled once more.
    """
    every = list(tasks)
    pending = {t for t in every if not t.done()}
    while pending:
        for each in pending:
            each.cancel()
        _, pending = await asyncio.wait(pending, timeout=CANCEL_AGAIN_S)
    for each in every:
        if not each.cancelled():
            each.exception()  # retrieved: a failure was logged where it happened


class Signals:
    """SIGINT and SIGTERM for a process that stops gracefully, or at once when pressed.

    The first signal sets ``stop``: the process stops its parts in order. A second signal, or
    ``grace_s`` passing after the first, runs every ``force`` callback (each must be quick and
    synchronous) and ends the process with ``os._exit(exit_code)``: nothing else is awaited.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, *, grace_s: float = 3.0, exit_code: int = 130):
        self.grace_s = grace_s
        self.exit_code = exit_code
        self.stop = asyncio.Event()
        self._force: list[Callable[[], None]] = []
        self._deadline: asyncio.TimerHandle | None = None

    def on_force(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` before a forced exit (callbacks run newest first)."""
        self._force.insert(0, callback)

    def install(self) -> None:
        """Take SIGINT and SIGTERM on the running loop (again, after a library took them)."""
        loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self._received, sig)

    def remove(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            loop.remove_signal_handler(sig)
        if self._deadline is not None:
            self._deadline.cancel()

    def _received(self, sig: signal.Signals) -> None:
        if self.stop.is_set():
            self.force(f"{sig.name} again")
            return
        log.info("%s received: stopping (again to stop at once)", sig.name)
        self.stop.set()
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(
            self.grace_s, self.force, f"still stopping after {self.grace_s:g} s"
        )

    def force(self, why: str) -> None:
        """Run the force callbacks and end the process now."""
        log.warning("%s: stopping at once", why)
        for callback in self._force:
            try:
                callback()
            except Exception:
                log.exception("while forcing the stop")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe must not stop it
                stream.flush()
        os._exit(self.exit_code)
