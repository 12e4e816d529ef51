"""Durations are read from ASCII digits only (issue 10, finding 6): Python's ``\\d``,
``str.isdigit`` and ``int`` accept other scripts' digits, which must be refused like any other
unreadable duration, and answered as ``INVALID_INPUT`` naming the field."""

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
