"""Times and durations for ``kubectl bcd``: what options take, what objects carry, what tables
show.

Why it exists: a Reservation's times are RFC 3339 strings (``spec.start``, ``spec.until``,
``status.startTime``), its durations strings like ``8h`` (``spec.duration``,
``spec.extendBy``), and people read them best as ``2026-12-24T08:00:00Z (in 3h)``. Reading an
option, normalising it for the API and showing a time live here once, so every command agrees;
the rules are the core's (``core.moments`` for times, ``core.durations`` for durations), the
ones the operator applies to the same strings.

Pure: the clock is passed in; no I/O. Never guesses a time zone: a time without one is refused.
"""

from __future__ import annotations

import datetime as dt

from bettercompute.core import durations, moments

EXAMPLE = moments.EXAMPLE


class TimeError(ValueError):
    """A time or duration that cannot be read; the message says why (without the option)."""


def parse_duration(text: str) -> tuple[str, int]:
    """(the duration as sent to the API, its milliseconds): ``'8h'`` stays ``'8h'``."""
    cleaned = text.strip()
    if cleaned.isascii() and cleaned.isdigit():
        # The CRD refuses a bare number: say which unit before the API server does.
        raise TimeError(f"cannot read {text!r}: give a unit, such as {cleaned}m or {cleaned}h")
    try:
        return cleaned, durations.parse_duration_ms(cleaned)
    except durations.DurationError as e:
        raise TimeError(str(e)) from None


def parse_moment(text: str) -> dt.datetime:
    """An RFC 3339 time with a zone (``2026-12-24T08:00:00Z``, ``…+01:00``), in UTC."""
    try:
        return durations.from_ms(moments.parse_ms(text.strip()))
    except moments.MomentError as e:
        raise TimeError(f"cannot read {text!r}: {e}") from None


def parse_when(text: str, *, now: dt.datetime) -> dt.datetime:
    """An RFC 3339 time, or ``+DURATION`` from ``now`` (``+2h``, ``+1d12h``)."""
    cleaned = text.strip()
    if cleaned.startswith("+"):
        _, ms = parse_duration(cleaned[1:])
        return now.astimezone(dt.UTC) + dt.timedelta(milliseconds=ms)
    return parse_moment(cleaned)


def rfc3339(moment: dt.datetime) -> str:
    """``moment`` as the API takes it: UTC, ``Z``, to the second unless it has milliseconds."""
    utc = moment.astimezone(dt.UTC)
    if utc.microsecond // 1000:
        return utc.strftime("%Y-%m-%dT%H:%M:%S.") + f"{utc.microsecond // 1000:03d}Z"
    return utc.strftime("%Y-%m-%dT%H:%M:%SZ")


def read(value: object) -> dt.datetime | None:
    """A time an object carries: RFC 3339 text, or epoch ms (older fields); else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return durations.from_ms(value)
    if isinstance(value, str) and value:
        try:
            return parse_moment(value)
        except TimeError:
            return None
    return None


def short(moment: dt.datetime) -> str:
    """``2026-12-24T08:00:00Z``: RFC 3339 in UTC (as the Reservation's columns show it)."""
    return moments.shown(durations.to_ms(moment))


def relative(moment: dt.datetime, *, now: dt.datetime) -> str:
    """How far ``moment`` is from ``now`` as people say it: ``in 3h``, ``12m ago``, ``now``."""
    return moments.relative(durations.to_ms(moment), now_ms=durations.to_ms(now))


def shown(value: object, *, now: dt.datetime) -> str:
    """A time as a table shows it: ``2026-12-24T08:00:00Z (in 3h)``; ``-`` when there is none."""
    moment = read(value)
    if moment is None:
        return "-" if value in (None, "") else str(value)
    return f"{short(moment)} ({relative(moment, now=now)})"
