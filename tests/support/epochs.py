"""What an epoch-millisecond time or a millisecond duration looks like in text people read.

Why it exists: every user-facing time is RFC 3339 and every duration shown to people has units
(``30m``, ``8h``, ``2d3h``); the API keeps its epoch milliseconds and ``'28800000ms'`` durations
for programs. Tests of each human surface (CLI tables and errors, kubectl tables, conditions and
events, MCP text) grep their output with ``found``, so a raw number that slips into one fails.

What it must never do: match what is not such a number (an id's digits, a port, a count), or
be loosened to let a surface pass: a surface the guide fixes otherwise is a named exception in
the test that reads it, with the reason.
"""

from __future__ import annotations

import re

#: 13-digit numbers from 1.5e12 to 5e12 (2017 to 2128 in epoch ms), not part of a longer run
#: of digits or of a word (an id, a UUID).
EPOCH_MS = re.compile(
    r"(?<![\w.-])(?:1[5-9]|[2-4][0-9])[0-9]{11}(?![\w.])|(?<![\w.-])5000000000000(?![\w.])"
)
#: A duration written in milliseconds, as the API stores it (``1800000ms``, or ``1800000 ms``).
MS_DURATION = re.compile(r"(?<![\w.-])[0-9]{4,} ?ms\b")


def found(text: str) -> list[str]:
    """Every epoch-millisecond time and millisecond duration in ``text``."""
    return [m.group(0) for m in EPOCH_MS.finditer(text)] + [
        m.group(0) for m in MS_DURATION.finditer(text)
    ]
