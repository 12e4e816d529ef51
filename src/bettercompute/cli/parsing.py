"""Readers for what people type on the command line: durations, times and query paths.

Why here and pure: ``--for 8h``, ``--start +2h``, ``--until 2026-09-28T09:00Z`` and
``--query during.end`` are read the same way by several commands, and each rule needs a table of
tests that runs without a server. Every reader raises ``ParseError`` with a message that says
what was wrong and what to write instead; the commands turn it into a usage error naming the
option.

What this module must never do: read the clock (``now_ms`` is passed in), touch the network, or
accept a value the server would read differently (durations go through ``core.durations``).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from typing import Any

from bettercompute.core import durations

#: Epoch milliseconds below this (1973-03-03) are almost surely epoch seconds typed by mistake.
SMALLEST_EPOCH_MS = 100_000_000_000
#: The largest time the server accepts (9999-12-31T23:59:59.999Z).
LARGEST_EPOCH_MS = 253_402_300_799_999

TIME_FORMS = "+2h (from now), an ISO 8601 time such as 2026-09-28T09:00:00Z, or epoch milliseconds"


class ParseError(ValueError):
    """A value that cannot be read; the message is for the person who typed it.

    ``option`` names the flag at fault when the reader knows it (``--gpus``), so the command
    can report the error against that flag.
    """

    def __init__(self, message: str, *, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


def parse_duration(text: str) -> int:
    """A duration with units ('8h', '90m', '2h30m', '1d') in milliseconds.

    Stricter than the API on one point: a bare number is refused, because on a command line
    ``--for 8`` means eight hours to a person and eight milliseconds to the server.
    """
    value = text.strip()
    if value.isascii() and value.isdigit():
        raise ParseError(f"{text!r} has no unit: write a duration such as 8h, 90m or 2h30m")
    try:
        return durations.parse_duration_ms(value)
    except durations.DurationError as e:
        message = str(e)
        if "such as" not in message:
            message += " (write a duration such as 8h, 90m or 2h30m)"
        raise ParseError(message) from None


def parse_time(text: str, *, now_ms: int, local: dt.tzinfo | None = None) -> int:
    """A point in time as epoch milliseconds.

    Accepts ``+DURATION`` relative to ``now_ms`` (``+2h``, ``+1d12h``), ``now``, an ISO 8601
    date or time (without an offset it is read in ``local``, the machine's zone when ``None``),
    or epoch milliseconds.
    """
    value = text.strip()
    if not value:
        raise ParseError(f"must not be empty: give {TIME_FORMS}")
    if value == "now":
        return now_ms
    if value.startswith("+"):
        return _bounded(now_ms + parse_duration(value[1:]), text)
    if value.isascii() and value.isdigit():
        ms = int(value)
        if ms < SMALLEST_EPOCH_MS:
            raise ParseError(
                f"{text!r} looks like epoch seconds: give epoch milliseconds ({value}000)"
                " or an ISO 8601 time"
            )
        return _bounded(ms, text)
    try:
        moment = dt.datetime.fromisoformat(value)
    except ValueError:
        raise ParseError(f"cannot read {text!r}: give {TIME_FORMS}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=local) if local is not None else moment.astimezone()
    return _bounded(int(moment.timestamp() * 1000), text)


def _bounded(ms: int, text: str) -> int:
    if not 0 <= ms <= LARGEST_EPOCH_MS:
        raise ParseError(f"{text!r} is outside the years 1970 to 9999")
    return ms


def format_time(ms: int | None) -> str:
    """Epoch milliseconds as an ISO 8601 UTC time to the second, or ``-`` when unknown."""
    if ms is None:
        return "-"
    moment = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


def format_duration(ms: int) -> str:
    """Milliseconds as people write them: ``8h``, ``2h30m``, ``1d4h`` (to the second)."""
    return durations.human(ms)


# --- query paths ---------------------------------------------------------------------------

_SEGMENT = re.compile(r"([^.\[\]]+)|\[([0-9]+)\]")


def parse_query(path: str) -> list[str | int]:
    """``during.end``, ``conditions[0].type`` or ``conditions.0.type`` as a list of steps."""
    text = path.strip()
    if not text:
        raise ParseError("must not be empty: give a field such as binding or during.end")
    steps: list[str | int] = []
    pos = 0
    while pos < len(text):
        if text[pos] == "." and steps:
            pos += 1
        match = _SEGMENT.match(text, pos)
        if match is None:
            raise ParseError(
                f"cannot read {path!r} at position {pos + 1}:"
                " write fields joined by dots, such as during.end or conditions[0].type"
            )
        name, index = match.groups()
        if index is not None:
            steps.append(int(index))
        elif name.isascii() and name.isdigit():
            steps.append(int(name))
        else:
            steps.append(name)
        pos = match.end()
    return steps


def lookup(data: Any, steps: Sequence[str | int]) -> Any:
    """The value at ``steps`` inside ``data``, or ``ParseError`` saying where the path ends."""
    value = data
    walked: list[str] = []
    for step in steps:
        where = ".".join(walked) or "the answer"
        if isinstance(value, dict):
            if not isinstance(step, str) or step not in value:
                known = ", ".join(sorted(str(k) for k in value)) or "none"
                raise ParseError(f"no field {step!r} in {where} (its fields: {known})")
            value = value[step]
        elif isinstance(value, list):
            if not isinstance(step, int):
                raise ParseError(f"{where} is a list: give an index such as {where}[0]")
            if step >= len(value):
                raise ParseError(f"{where} has {len(value)} item(s); there is no [{step}]")
            value = value[step]
        else:
            shown = "null" if value is None else type(value).__name__
            raise ParseError(f"{where} is {shown}, so it has no {step!r}")
        walked.append(str(step))
    return value
