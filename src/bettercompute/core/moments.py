"""Moments as Kubernetes objects write them (RFC 3339 strings) and as we store them (epoch ms).

Why it exists: a Reservation's ``spec.start`` and ``spec.until`` are RFC 3339 times, as every
Kubernetes time is, while the core, the HTTP API and the database count epoch milliseconds.
The conversion both ways, and the form printer columns show (``2026-12-24T08:00:00Z``),
live here so the operator and the kubectl plugin read and write them alike.

Pure: no clock, no I/O. Never guesses a time zone: a time without one is refused.
"""

from __future__ import annotations

import datetime as dt
import re

#: What a Kubernetes API server's ``format: date-time`` and our CRD rules take.
RFC3339 = re.compile(
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?"
    r"([Zz]|[+-][0-9]{2}:[0-9]{2})$"
)
EXAMPLE = "2026-12-24T08:00:00Z"
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class MomentError(ValueError):
    """A time that cannot be read; the message says why, for the caller to show."""


def parse_ms(text: str) -> int:
    """Epoch milliseconds of an RFC 3339 time (``2026-12-24T08:00:00Z``, ``…+01:00``)."""
    if not RFC3339.match(text):
        raise MomentError(f"must be an RFC 3339 time with a zone, such as '{EXAMPLE}'")
    # fromisoformat reads at most microseconds: nanoseconds are cut, not rounded.
    head, _, rest = text.partition(".")
    if rest:
        digits = re.match(r"[0-9]+", rest)
        assert digits is not None
        text = f"{head}.{digits.group()[:6]}{rest[digits.end() :]}"
    try:
        moment = dt.datetime.fromisoformat(text.upper().replace("Z", "+00:00"))
    except ValueError as e:
        raise MomentError(f"is not a valid date or time ({e})") from None
    return (moment - _EPOCH) // dt.timedelta(milliseconds=1)


def rfc3339(ms: int, *, exact: bool = False) -> str:
    """``ms`` as RFC 3339 in UTC, to the second (what ``kubectl`` and ``date -u -Is`` show);
    ``exact`` keeps the milliseconds when there are any, so ``parse_ms`` gives ``ms`` back."""
    moment = _EPOCH + dt.timedelta(milliseconds=ms)
    if exact and ms % 1000:
        return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def shown(ms: int) -> str:
    """``ms`` as a printer column shows it: ``2026-12-24T08:00:00Z``, RFC 3339 in UTC to the
    second, as every time people read is shown (a string: a date column would show a future
    time as ``<invalid>``)."""
    return rfc3339(ms)


def readable_message(message: str) -> str:
    """A condition message as people read it. The guide makes ``ConfirmationRequired``'s
    message the deadline in epoch milliseconds, and it stays so where programs read it (the
    API, ``status.conditions``); a table shows it as ``deadline 2026-12-24T08:30:00Z``. Any
    other message is returned as it is."""
    text = message.strip()
    if text.isascii() and text.isdigit() and len(text) == 13:
        return f"deadline {rfc3339(int(text))}"
    return message


def relative(ms: int, *, now_ms: int) -> str:
    """How far ``ms`` is from ``now_ms``, as people say it: ``in 3h``, ``12m ago``, ``now``."""
    delta_s = (ms - now_ms) // 1000
    size = abs(delta_s)
    if size < 60:
        return "now"
    for unit, seconds in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if size >= seconds:
            amount = f"{size // seconds}{unit}"
            break
    return f"in {amount}" if delta_s > 0 else f"{amount} ago"
