"""The rules of ``cgroups`` that need no running node: cpulists read within bounds (fuzzed),
limits as cgroup files and as the CDI annotation, slice names."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bettercompute.core.ids import cgroup_slice
from bettercompute.deviceplugin.cgroups import (
    MAX_CPU_ID,
    MAX_CPULIST_BYTES,
    HostLimits,
    parse_cpulist,
)


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("0", {0}),
        ("0-3,8", {0, 1, 2, 3, 8}),
        (" 1 , 4-5 ", {1, 4, 5}),
        ("", set()),
        ("8191", {8191}),
    ],
)
def test_a_cpulist_reads_as_its_ids(text: str, ids: set[int]) -> None:
    assert parse_cpulist(text) == ids


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("8192", "above 8191"),
        ("0-99999", "above 8191"),
        ("3-1", "backwards"),
        ("1,,2", "is not an id"),
        ("a", "is not an id"),
        ("-1", "is not an id"),
        ("0-", "is not an id"),
        ("1" * 6, "is not an id"),
        (",".join(["0"] * 4097), "more than 4096 parts"),
        ("0," * (MAX_CPULIST_BYTES // 2 + 1), "longer than"),
    ],
)
def test_a_bad_or_oversized_cpulist_is_refused(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_cpulist(text)


@given(st.text(max_size=200))
def test_any_text_reads_as_bounded_ids_or_a_value_error(text: str) -> None:
    try:
        ids = parse_cpulist(text)
    except ValueError:
        return
    assert all(0 <= i <= MAX_CPU_ID for i in ids)


@given(st.lists(st.tuples(st.integers(0, MAX_CPU_ID), st.integers(0, 64)), max_size=50))
def test_written_ranges_read_back(ranges: list[tuple[int, int]]) -> None:
    parts = [f"{low}-{min(low + span, MAX_CPU_ID)}" for low, span in ranges]
    expected = {i for low, span in ranges for i in range(low, min(low + span, MAX_CPU_ID) + 1)}
    assert parse_cpulist(",".join(parts)) == expected


def test_limits_become_cgroup_files_and_round_trip_through_the_annotation() -> None:
    limits = HostLimits(cpu_millis=250, memory_bytes=1 << 30, hugepages_1gi=3, cpus="0-1", mems="0")
    assert limits.cgroup_files() == {
        "cpu.max": "25000 100000",
        "memory.max": str(1 << 30),
        "cpuset.cpus": "0-1",
        "cpuset.mems": "0",
    }
    assert limits.hugetlb_bytes == 3 << 30
    assert HostLimits.from_document(limits.document()) == limits
    for bad in ({"cpuMillis": "1"}, {"cpus": "x"}, {"other": 1}, [], {"cpuMillis": -1}):
        with pytest.raises(ValueError, match=r"limits|not an integer|not a"):
            HostLimits.from_document(bad)


def test_a_slice_name_keeps_only_letters_digits_and_underscores() -> None:
    assert cgroup_slice("alloc_01k9") == "bcd-alloc-alloc_01k9.slice"
    # systemd reads '-' as nesting; '/' and '.' could leave the root.
    assert cgroup_slice("alloc-a/../b") == "bcd-alloc-alloc_a____b.slice"
    with pytest.raises(ValueError, match="allocation id is needed"):
        cgroup_slice("")
