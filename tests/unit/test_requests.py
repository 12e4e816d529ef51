"""The pure request layer: durations, normalisation, the request hash, draft ids, errors."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bettercompute.core import durations, ids, requests
from bettercompute.core.errors import ComputeError


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("8h", 28_800_000),
        ("90m", 5_400_000),
        ("2h30m", 9_000_000),
        ("1d", 86_400_000),
        ("45s", 45_000),
        ("1500ms", 1_500),
        ("28800000ms", 28_800_000),
        ("1h0m30s", 3_630_000),
        (7_200_000, 7_200_000),
        ("7200000", 7_200_000),
    ],
)
def test_durations_read_as_people_write_them(text: Any, ms: int):
    assert durations.parse_duration_ms(text) == ms


@pytest.mark.parametrize(
    "bad", ["", "8", "0h", "30m2h", "1h1h", "8 hours", "h", -5, 0, True, 1.5, None, "367d"]
)
def test_bad_durations_are_refused_with_a_reason(bad: Any):
    if bad == "8":  # a bare number is milliseconds: 8 ms is a valid, if short, duration
        assert durations.parse_duration_ms(bad) == 8
        return
    with pytest.raises(durations.DurationError) as info:
        durations.parse_duration_ms(bad)
    assert str(info.value)


@given(d=st.integers(0, 300), h=st.integers(0, 23), m=st.integers(0, 59), s=st.integers(0, 59))
def test_composed_durations_add_up(d: int, h: int, m: int, s: int):
    parts = [(d, "d"), (h, "h"), (m, "m"), (s, "s")]
    text = "".join(f"{n}{u}" for n, u in parts if n)
    total = ((d * 24 + h) * 60 + m) * 60_000 + s * 1000
    if not text:
        return
    assert durations.parse_duration_ms(text) == total
    assert durations.parse_duration_ms(durations.format_ms(total)) == total


def test_hours_are_rounded_to_three_decimals():
    assert durations.hours(5_400_000) == 1.5
    assert durations.hours(1) == 0.0
    assert durations.hours(3_601_000) == 1.0
    assert durations.hours(3_604_000) == 1.001


def base(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "tenantId": "acme",
        "poolId": "pool_a",
        "devices": [{"class": "gpu", "count": 4, "topology": "nvlink-all"}],
        "duration": "2h",
        "idempotencyKey": "k1",
    }
    body.update(overrides)
    return body


def normal(body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    value = requests.parse(requests.CreateInput, body)
    request = requests.normalized_request(value)
    return request, requests.request_hash(value.tenantId, request)


def test_two_writings_of_one_request_hash_alike():
    a, ha = normal(base())
    b, hb = normal(
        base(
            duration=7_200_000,
            binding="hold",
            spot=False,
            idempotencyKey="other",
            wait={"timeoutMs": 5000},
        )
    )
    c, hc = normal(
        base(devices=[{"class": "gpu", "count": 4, "topology": "nvlink-all"}], duration="120m")
    )
    assert a == b == c
    assert ha == hb == hc
    assert a == {
        "poolId": "pool_a",
        "devices": [{"class": "gpu", "count": 4, "topology": "nvlink-all"}],
        "duration": "7200000ms",
        "binding": "hold",
    }


@pytest.mark.parametrize(
    "change",
    [
        {"duration": "3h"},
        {"poolId": "pool_b"},
        {"tenantId": "globex"},
        {"devices": [{"class": "gpu", "count": 4}]},
        {"binding": "kubernetes"},
        {"spot": True},
        {"leaseSeconds": 600},
        {"start": 1_790_000_000_000},
        {"gang": {"size": 2}},
        {"projectId": "p1"},
        {"resources": {"vcpu": 4}},
    ],
)
def test_every_real_difference_changes_the_hash(change: dict[str, Any]):
    _, before = normal(base())
    _, after = normal(base(**change))
    assert before != after


def test_topology_any_and_gang_of_one_are_defaults():
    a, _ = normal(base(devices=[{"class": "gpu", "count": 2}]))
    b, _ = normal(base(devices=[{"class": "gpu", "count": 2, "topology": "any"}], gang={"size": 1}))
    assert a == b


def test_wait_is_capped_at_thirty_seconds():
    value = requests.parse(requests.CreateInput, base(wait={"timeoutMs": 120_000}))
    assert value.wait is not None
    assert value.wait.timeoutMs == 30_000


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        (base(extra=1), "extra", "unknown field"),
        (base(devices=[]), "devices", "at least 1"),
        (base(devices=[{"class": "tpu", "count": 1}]), "devices[0].class", "gpu"),
        (base(devices=[{"class": "gpu", "count": 0}]), "devices[0].count", "greater"),
        (base(devices=[{"class": "gpu", "count": "4"}]), "devices[0].count", "integer"),
        (
            base(devices=[{"class": "mig", "count": 1, "profile": "big"}]),
            "devices[0].profile",
            "pattern",
        ),
        (
            base(devices=[{"class": "slot", "count": 1, "topology": "nvlink-all"}]),
            "devices[0]",
            "only for whole GPUs",
        ),
        (base(duration="forever"), "duration", "cannot read"),
        (base(leaseSeconds=10), "leaseSeconds", "greater"),
        (base(binding="node"), "body", "profileId"),
        (base(node={"profileId": "x"}), "body", "only for binding 'node'"),
        (base(binding="node", node={"profileId": "x"}, spot=True), "body", "cannot be spot"),
        (base(tenantId="a b"), "tenantId", "pattern"),
        ({k: v for k, v in base().items() if k != "idempotencyKey"}, "idempotencyKey", "required"),
    ],
)
def test_invalid_input_names_the_field_and_reason(body: dict[str, Any], field: str, words: str):
    with pytest.raises(ComputeError) as info:
        requests.parse(requests.CreateInput, body)
    err = info.value
    assert err.code == "INVALID_INPUT"
    assert err.details["field"] == field
    assert words.lower() in err.message.lower()


def test_a_body_that_is_not_an_object_is_invalid_input():
    with pytest.raises(ComputeError) as info:
        requests.parse(requests.CreateInput, ["not", "an", "object"])
    assert info.value.details["field"] == "body"


def test_extend_needs_exactly_one_of_until_and_by():
    ok = {"tenantId": "acme", "reservationId": "rsv_x", "idempotencyKey": "e"}
    assert requests.parse(requests.ExtendInput, {**ok, "by": "4h"}).by == 14_400_000
    for bad in ({}, {"by": "1h", "until": 5}):
        with pytest.raises(ComputeError):
            requests.parse(requests.ExtendInput, {**ok, **bad})


def test_draft_ids_are_deterministic_per_tenant_identity_and_key():
    a = ids.draft_id("acme", "alice", "k")
    assert a == ids.draft_id("acme", "alice", "k")
    assert a.startswith("rsv_")
    assert a == a.lower()
    assert "=" not in a
    assert len(a) == 4 + 52  # unpadded base32 of 32 bytes
    assert a != ids.draft_id("acme", "bob", "k")
    assert a != ids.draft_id("globex", "alice", "k")
    # No separator can be forged: moving characters between parts changes the id.
    assert ids.draft_id("a:b", "c", "k") != ids.draft_id("a", "b:c", "k")
    assert ids.draft_id("ab", "c", "k") != ids.draft_id("a", "bc", "k")


def test_new_ids_sort_by_time():
    early = ids.new_id("alloc", now_ms=1_000, entropy=b"\xff" * 10)
    late = ids.new_id("alloc", now_ms=1_001, entropy=b"\x00" * 10)
    assert early < late
    assert early.startswith("alloc_")
    assert len(early) == len("alloc_") + 26
