"""The pure readers of the CLI (durations, times, query paths) and how times are shown.
No server, no clock."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bettercompute.cli import output, parsing
from bettercompute.cli.parsing import ParseError

NOW = 1_790_000_000_000  # 2026-09-21T14:13:20Z
HOUR = 3_600_000
UTC = dt.UTC
PARIS_SUMMER = dt.timezone(dt.timedelta(hours=2))


@pytest.mark.parametrize(
    ("text", "ms"),
    [("8h", 8 * HOUR), ("90m", 90 * 60_000), ("2h30m", 2.5 * HOUR), ("1d", 24 * HOUR),
     (" 45s ", 45_000), ("1500ms", 1500)],
)  # fmt: skip
def test_durations_with_units(text: str, ms: float):
    assert parsing.parse_duration(text) == ms


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("8", "'8' has no unit"),
        ("8 hours", "cannot read '8 hours'"),
        ("30m2h", "largest to smallest"),
        ("0h", "longer than zero"),
        ("400d", "at most 366 days"),
        ("", "must not be empty"),
    ],
)
def test_bad_durations_say_why(text: str, says: str):
    with pytest.raises(ParseError, match=says) as info:
        parsing.parse_duration(text)
    assert "8h" in str(info.value) or "2h30m" in str(info.value)  # and what to write instead


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("+12h", NOW + 12 * HOUR),
        ("+2h30m", NOW + 2.5 * HOUR),
        ("now", NOW),
        ("1790028800000", 1_790_028_800_000),
        ("2026-09-21T14:13:20Z", NOW),
        ("2026-09-21T14:13:20.500+00:00", NOW + 500),
        ("2026-09-21T16:13:20+02:00", NOW),
        ("2026-09-21 14:13:20", NOW),  # no offset: read in the given zone (UTC here)
        ("2026-09-22", 1_790_035_200_000),
    ],
)
def test_times(text: str, ms: float):
    assert parsing.parse_time(text, now_ms=NOW, local=UTC) == ms


def test_a_time_without_offset_is_local_time():
    assert parsing.parse_time("2026-09-21T16:13:20", now_ms=0, local=PARIS_SUMMER) == NOW


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("monday", "cannot read 'monday'"),
        ("+12", "has no unit"),
        ("+", "must not be empty"),
        ("1790000000", "looks like epoch seconds"),
        ("99999999999999999", "outside the years"),
        ("", "must not be empty"),
        ("-2h", "cannot read"),
    ],
)
def test_bad_times_say_why(text: str, says: str):
    with pytest.raises(ParseError, match=says):
        parsing.parse_time(text, now_ms=NOW, local=UTC)


@given(st.integers(min_value=1, max_value=366 * 24 * HOUR))
def test_format_duration_reads_back_to_the_second(ms: int):
    shown = parsing.format_duration(ms)
    assert not shown.endswith("ms")
    if ms < 500:
        assert shown == "<1s"
    else:
        assert parsing.parse_duration(shown) == (ms + 500) // 1000 * 1000


@given(st.integers(min_value=0, max_value=parsing.LARGEST_EPOCH_MS))
def test_format_time_reads_back_to_the_second(ms: int):
    shown = parsing.format_time(ms)
    assert shown.endswith("Z")
    assert parsing.parse_time(shown, now_ms=0) == ms - ms % 1000


def test_format_time_of_nothing():
    assert parsing.format_time(None) == "-"
    assert parsing.format_time(NOW) == "2026-09-21T14:13:20Z"


@pytest.mark.parametrize(
    ("path", "steps"),
    [
        ("binding", ["binding"]),
        ("during.end", ["during", "end"]),
        ("conditions[0].type", ["conditions", 0, "type"]),
        ("conditions.0.type", ["conditions", 0, "type"]),
        ("[1]", [1]),
        ("a[0][2]", ["a", 0, 2]),
    ],
)
def test_query_paths(path: str, steps: list[str | int]):
    assert parsing.parse_query(path) == steps


@pytest.mark.parametrize("path", ["", ".binding", "during.", "a..b", "a[x]", "a[0"])
def test_bad_query_paths(path: str):
    with pytest.raises(ParseError):
        parsing.parse_query(path)


VIEW = {
    "id": "rsv_1",
    "during": {"start": 1, "end": 2},
    "binding": None,
    "conditions": [{"type": "Queued"}],
}


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("id", "rsv_1"),
        ("during.end", 2),
        ("during", {"start": 1, "end": 2}),
        ("binding", None),
        ("conditions[0].type", "Queued"),
    ],
)
def test_lookup(path: str, value: object):
    assert parsing.lookup(VIEW, parsing.parse_query(path)) == value


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("state", "no field 'state' in the answer (its fields: binding, conditions, during, id)"),
        ("during.middle", "no field 'middle' in during"),
        ("binding.nodeId", "binding is null, so it has no 'nodeId'"),
        ("conditions.type", "conditions is a list: give an index such as conditions[0]"),
        ("conditions[3]", "conditions has 1 item(s); there is no [3]"),
        ("id.x", "id is str"),
    ],
)
def test_lookup_says_where_the_path_ends(path: str, says: str):
    with pytest.raises(ParseError) as info:
        parsing.lookup(VIEW, parsing.parse_query(path))
    assert says in str(info.value)


def test_a_window_shows_its_length_to_the_second():
    during = {"start": NOW, "end": NOW + 12 * HOUR + 9_962}
    assert output.describe_window(during) == (
        "2026-09-21T14:13:20Z → 2026-09-22T02:13:29Z (12h10s)"
    )
    assert output.describe_window(None) == "-"


@pytest.mark.parametrize(
    "call",
    [
        lambda: parsing.parse_duration("١٢h"),
        lambda: parsing.parse_duration("１２h"),
        lambda: parsing.parse_time("١٧٩٠٠٠٠٠٠٠٠٠٠", now_ms=NOW),
        lambda: parsing.parse_time("+١٢h", now_ms=NOW),
        lambda: parsing.parse_query("conditions[٠].type"),
    ],
    ids=["arabic-duration", "fullwidth-duration", "arabic-epoch", "arabic-offset", "arabic-index"],
)
def test_only_ascii_digits_are_numbers(call: Callable[[], object]) -> None:
    # Python's int() and str.isdigit() read other scripts' digits; the CLI must not.
    with pytest.raises(ParseError):
        call()
