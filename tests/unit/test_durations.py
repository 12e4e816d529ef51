"""Durations are read from ASCII digits only (issue 10, finding 6): Python's ``\\d``,
``str.isdigit`` and ``int`` accept other scripts' digits, which must be refused like any other
unreadable duration, and answered as ``INVALID_INPUT`` naming the field. And durations are shown
to people with units (``30m``, ``2d3h``), never as milliseconds (issue 31)."""

from __future__ import annotations

import pytest

from bettercompute.core import durations, requests
from bettercompute.core.errors import ComputeError

# Arabic-Indic, Devanagari, full-width and superscript digits: all isdigit(), none ASCII.
NOT_ASCII = ["١٢h", "١٢", "१२h", "１２h", "12h３０m", "²h", "٣٠٠٠٠ms"]


@pytest.mark.parametrize("text", NOT_ASCII)
def test_durations_with_digits_other_than_ascii_are_refused(text: str):
    with pytest.raises(durations.DurationError, match="cannot read"):
        durations.parse_duration_ms(text)


@pytest.mark.parametrize("text", NOT_ASCII)
def test_a_create_or_extend_with_such_a_duration_names_the_field(text: str):
    create = {
        "tenantId": "acme",
        "poolId": "pool",
        "devices": [{"class": "gpu", "count": 1}],
        "duration": text,
        "idempotencyKey": "k",
    }
    with pytest.raises(ComputeError) as info:
        requests.parse(requests.CreateInput, create)
    assert info.value.details["field"] == "duration"
    extend = {"tenantId": "acme", "reservationId": "rsv_1", "by": text, "idempotencyKey": "k"}
    with pytest.raises(ComputeError) as info:
        requests.parse(requests.ExtendInput, extend)
    assert info.value.details["field"] == "by"


@pytest.mark.parametrize(
    ("text", "ms"), [("12h", 43_200_000), ("90", 90), ("1d2h3m4s5ms", 93_784_005)]
)
def test_ascii_durations_still_read(text: str, ms: int):
    assert durations.parse_duration_ms(text) == ms


@pytest.mark.parametrize(
    ("ms", "shown"),
    [
        (30 * 60_000, "30m"),
        (8 * 3_600_000, "8h"),
        (2 * 86_400_000 + 3 * 3_600_000, "2d3h"),
        (3_600_000 + 5_000, "1h5s"),
        (12 * 3_600_000 + 9_962, "12h10s"),
        (1_800_000, "30m"),
        (400, "<1s"),
        (0, "0s"),
    ],
)
def test_human_durations_have_units_and_no_milliseconds(ms: int, shown: str) -> None:
    assert durations.human(ms) == shown


def test_human_text_reads_the_apis_forms() -> None:
    assert durations.human_text("28800000ms") == "8h"
    assert durations.human_text(1_800_000) == "30m"
    assert durations.human_text("soon") is None
