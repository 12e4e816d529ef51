"""``better-compute watch``: reservations followed as they move, in a table that updates in place.

Why a module of its own: the loop (poll, render, notice a change, survive a blip) is separate
from the command's options, and is driven by an injectable sleep so it ends when told to.

On a terminal the table is redrawn in place (rich ``Live``); written to a file or a pipe, a new
table is printed only when something changed, headed by the time, so a log of a watch reads as
the history of the reservations. A failed poll (the server restarting) is shown and retried at
the next tick; the first poll's failure ends the command, as any other command's would.

What it must never do: change anything (it only reads), or spin: one poll per interval.
"""

from __future__ import annotations

import datetime as dt
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.text import Text

from bettercompute.cli import client, output

if TYPE_CHECKING:  # pydantic, which the base install (the CLI alone) lacks
    from bettercompute.core import answers

Poll = Callable[[], dict[str, Any]]
T = TypeVar("T")


def _stamp() -> str:
    """When the table was drawn, in RFC 3339 as every time people read."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _fingerprint(answer: dict[str, Any]) -> list[tuple[Any, ...]]:
    """What a change means to a reader: an id, its state, its window."""
    return [
        (item.get("id"), item.get("state"), str(item.get("during")), item.get("version"))
        for item in answer.get("items") or []
    ]


def follow(
    poll: Poll,
    *,
    console: Console,
    every_s: float,
    stop_after_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Poll and show until Ctrl-C (or ``stop_after_s``); answers how many polls were shown."""
    started = time.monotonic()
    first = poll()  # a failure here is the command's failure
    shown = 1

    def done() -> bool:
        return stop_after_s is not None and time.monotonic() - started >= stop_after_s

    def view(answer: dict[str, Any], problem: str | None) -> RenderableType:
        footer = f"{_stamp()} · every {every_s:g}s · Ctrl-C to stop"
        parts: list[RenderableType] = [_table(answer)]
        if problem:
            parts.append(Text(f"could not refresh ({problem}); trying again", style="yellow"))
        parts.append(Text(footer, style="dim"))
        return Group(*parts)

    answer, problem = first, None
    try:
        if console.is_terminal:
            with Live(view(answer, None), console=console, auto_refresh=False) as live:
                while not done():
                    sleep(every_s)
                    answer, problem = _poll(poll, answer)
                    live.update(view(answer, problem), refresh=True)
                    shown += 1
        else:
            console.print(Text(f"— {_stamp()}", style="dim"))
            console.print(_table(answer))
            last = _fingerprint(answer)
            while not done():
                sleep(every_s)
                answer, problem = _poll(poll, answer)
                if problem:
                    console.print(Text(f"— {_stamp()} could not refresh ({problem})"))
                    continue
                if _fingerprint(answer) != last:
                    last = _fingerprint(answer)
                    console.print(Text(f"— {_stamp()}", style="dim"))
                    console.print(_table(answer))
                    shown += 1
    except KeyboardInterrupt:
        pass
    return shown


def bounded(stream: Iterator[T], *, ends: float) -> Iterator[T]:
    """``stream``'s items until the monotonic time ``ends``, even while it is silent: it is
    read in a thread of its own (a blocking socket read cannot be given a deadline), and an
    error it raises is raised here."""
    box: queue.Queue[tuple[str, Any]] = queue.Queue()

    def pump() -> None:
        try:
            for item in stream:
                box.put(("item", item))
            box.put(("end", None))
        except BaseException as e:  # handed to the reader, who raises it
            box.put(("error", e))

    threading.Thread(target=pump, name="watch-events", daemon=True).start()
    while (left := ends - time.monotonic()) > 0:
        try:
            kind, value = box.get(timeout=left)
        except queue.Empty:
            return
        if kind == "end":
            return
        if kind == "error":
            raise value
        yield value


def _table(answer: dict[str, Any]) -> RenderableType:
    # A list answer, or one reservation's get wrapped as one: the list's table either way.
    return output.reservation_list(cast("answers.ReservationList", answer))


def _poll(poll: Poll, last: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    try:
        return poll(), None
    except client.Failure as e:
        return last, e.message
