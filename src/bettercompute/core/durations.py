"""Durations as people write them ('8h', '90m', '2h30m') and as we store them (milliseconds).

Normalisation is what makes ``'2h'`` and ``7200000`` the same request, so it lives in one place.
Pure: no clock, no I/O.
"""

from __future__ import annotations

import datetime as dt
import re

MS_PER_UNIT = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1_000, "ms": 1}

# Units must appear largest first and at most once ('2h30m', not '30m2h' or '1h1h').
# ASCII digits only: Python's ``\d``, ``str.isdigit`` and ``int`` also read other scripts'
# digits ('١٢h'), which no client means and no log reader expects.
_PART = re.compile(r"([0-9]{1,12})(ms|d|h|m|s)")
_DIGITS = re.compile(r"[0-9]{1,15}")
_ORDER = ["d", "h", "m", "s", "ms"]

#: The longest window one request may ask for; longer is almost certainly a typo.
MAX_DURATION_MS = 366 * MS_PER_UNIT["d"]


class DurationError(ValueError):
    """A duration that cannot be read; the message says why, for the caller to show."""


def parse_duration_ms(value: object) -> int:
    """Read a duration as an integer of milliseconds or a string like '2h30m' or '28800000ms'.

    Returns a positive number of milliseconds no larger than ``MAX_DURATION_MS``.
    """
    if isinstance(value, bool):
        raise DurationError("must be a duration such as '8h', '90m', '2h30m' or milliseconds")
    if isinstance(value, int):
        ms = value
    elif isinstance(value, str):
        ms = _parse_text(value.strip())
    else:
        raise DurationError("must be a duration such as '8h', '90m', '2h30m' or milliseconds")
    if ms <= 0:
        raise DurationError("must be longer than zero")
    if ms > MAX_DURATION_MS:
        raise DurationError("must be at most 366 days")
    return ms


def _parse_text(text: str) -> int:
    if not text:
        raise DurationError("must not be empty")
    if _DIGITS.fullmatch(text):
        return int(text)
    pos = 0
    total = 0
    last_rank = -1
    while pos < len(text):
        match = _PART.match(text, pos)
        if match is None:
            raise DurationError(
                f"cannot read {text!r}: use numbers with units d, h, m, s or ms, such as '2h30m'"
            )
        number, unit = match.groups()
        rank = _ORDER.index(unit)
        if rank <= last_rank:
            raise DurationError(f"cannot read {text!r}: units must go from largest to smallest")
        last_rank = rank
        total += int(number) * MS_PER_UNIT[unit]
        pos = match.end()
    return total


def format_ms(ms: int) -> str:
    """The stored form of a duration, as the guide shows it: ``'28800000ms'``."""
    return f"{ms}ms"


def human(ms: int) -> str:
    """A duration as people read it: ``30m``, ``8h``, ``2d3h``, ``1h5s`` (never ``…ms``).

    Units largest first, zero parts left out, rounded to the second: milliseconds matter to
    no one reading a window of hours (``12h10s``, not ``12h9s962ms``). Shorter than half a
    second but not zero reads ``<1s``, so nothing real shows as nothing.
    """
    if ms <= 0:
        return "0s"
    rest = (ms + 500) // 1000 * 1000
    if rest == 0:
        return "<1s"
    parts: list[str] = []
    for unit in ("d", "h", "m", "s"):
        size = MS_PER_UNIT[unit]
        if rest >= size:
            parts.append(f"{rest // size}{unit}")
            rest %= size
    return "".join(parts)


def human_text(value: object) -> str | None:
    """``human`` of a duration as the API writes one (``'28800000ms'``, ``'8h'``, or an
    integer of milliseconds), or ``None`` when ``value`` is not one."""
    try:
        return human(parse_duration_ms(value))
    except DurationError:
        return None


def hours(ms: int) -> float:
    """Hours to three decimals, the precision policies see (``durationHours``)."""
    return round(ms / MS_PER_UNIT["h"], 3)


# Business time is whole milliseconds since the epoch (``compute_now()`` truncates to them), so
# instants cross the API, the conditions and the events as integers; these convert exactly.
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def from_ms(ms: int) -> dt.datetime:
    return _EPOCH + dt.timedelta(milliseconds=ms)


def to_ms(at: dt.datetime) -> int:
    """Epoch milliseconds, exactly (no float): business time is in whole milliseconds."""
    return (at - _EPOCH) // dt.timedelta(milliseconds=1)
