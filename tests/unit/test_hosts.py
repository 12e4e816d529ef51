"""The host-resource rules: a request's GPUs' worth, the pool's share, the floor, the quota
excess, an allocation's limits, and cpulists read within bounds (fuzzed)."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bettercompute.core import hosts


def request(*devices: tuple[str, int], **extra: object) -> dict[str, object]:
    return {
        "devices": [{"class": c, "count": n} for c, n in devices],
        "binding": "hold",
        **extra,
    }


@pytest.mark.parametrize(
    ("devices", "mode", "replicas", "worth"),
    [
        ([("gpu", 2)], "exclusive", 1, Fraction(2)),
        ([("mig", 7)], "mig", 1, Fraction(1)),
        ([("mig", 1)], "mig", 1, Fraction(1, 7)),
        ([("slot", 2)], "timeslice", 1, Fraction(1, 2)),  # 4 slots per GPU by default
        ([("slot", 5)], "mps", 1, Fraction(1, 2)),  # 10 for MPS
        ([("slot", 3)], "timeslice", 6, Fraction(1, 2)),  # the pool's replicas
    ],
)
def test_a_requests_worth_in_gpus(
    devices: list[tuple[str, int]], mode: str, replicas: int, worth: Fraction
) -> None:
    asked = request(*devices)["devices"]
    assert hosts.gpu_equivalent(asked, sharing_mode=mode, replicas=replicas) == worth  # type: ignore[arg-type]


def test_the_share_is_per_gpu_times_worth_rounded_down_and_is_the_floor() -> None:
    share_of = {"vcpu": 7, "memoryGiB": 64}
    resolved, share = hosts.resolve(
        request(("mig", 3)), sharing_mode="mig", replicas=1, per_gpu=None, hosts=share_of
    )
    # 3/7 of a GPU: 3 CPUs (21/7) and 27 GiB (192/7 = 27.4, rounded down).
    assert share == {"vcpu": 3, "memoryGiB": 27}
    assert resolved["resources"] == {"vcpu": 3, "memoryGiB": 27, "hugepages1Gi": 0}
    above, _ = hosts.resolve(
        request(("gpu", 1), resources={"vcpu": 1, "memoryGiB": 100}),
        sharing_mode="exclusive",
        replicas=1,
        per_gpu={"hugepages1Gi": 2},
        hosts=share_of,
    )
    assert above["resources"] == {"vcpu": 7, "memoryGiB": 100, "hugepages1Gi": 2}


def test_no_share_and_no_resources_leaves_the_request_as_it_came() -> None:
    asked = request(("gpu", 1))
    resolved, share = hosts.resolve(
        asked, sharing_mode="exclusive", replicas=1, per_gpu=None, hosts={}
    )
    assert (resolved, share) == (asked, {})
    node, share = hosts.resolve(
        request(("gpu", 1), binding="node"),
        sharing_mode="exclusive",
        replicas=1,
        per_gpu={"vcpu": 4},
        hosts={},
    )
    assert "resources" not in node
    assert share == {}


def test_quota_is_charged_above_the_share_over_the_gang_with_huge_pages_as_memory() -> None:
    booked = request(
        ("gpu", 1), resources={"vcpu": 10, "memoryGiB": 64, "hugepages1Gi": 8}, gang={"size": 3}
    )
    excess = hosts.quota_excess(booked, host_share={"vcpu": 7, "memoryGiB": 64})
    assert excess == {"vcpu": 9, "memoryGiB": 24}
    assert hosts.quota_excess(booked, host_share={"vcpu": 10, "memoryGiB": 72}) == {}


def test_limits_put_the_cpuset_near_the_devices_and_never_on_reserved_cpus() -> None:
    numa = [
        {"id": 0, "cpus": "0-7", "memoryGiB": 64},
        {"id": 1, "cpus": "8-15", "memoryGiB": 64},
    ]
    near = hosts.limits(
        vcpu=6,
        memory_gib=32,
        hugepages_1gi=1,
        numa_nodes=numa,
        device_numa={0},
        reserve_vcpu=2,
    )
    assert near == {
        "cpuMillis": 6000,
        "memoryBytes": 32 * 2**30,
        "hugepages1Gi": 1,
        "cpus": "2-7",
        "mems": "0",
    }
    # Too many CPUs or too much memory for the devices' NUMA node: no cpuset, limits only.
    far = hosts.limits(
        vcpu=7, memory_gib=65, hugepages_1gi=0, numa_nodes=numa, device_numa={0}, reserve_vcpu=2
    )
    assert far == {"cpuMillis": 7000, "memoryBytes": 65 * 2**30, "hugepages1Gi": 0}
    assert (
        hosts.limits(
            vcpu=0, memory_gib=0, hugepages_1gi=0, numa_nodes=numa, device_numa={0}, reserve_vcpu=2
        )
        is None
    )


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}),
        ("  5\n", {5}),
        ("8191", {8191}),
        ("8192", set()),  # past the highest id
        ("3-1", set()),
        ("1,,2", set()),
        ("-1", set()),
        ("a", set()),
        ("٣", set()),  # a digit to str.isdigit, not to a cpulist
        ("1" * 10, set()),
        (",".join(["1"] * 4097), set()),  # too many parts
        ("0-1" + " " * 40_000, set()),  # too long
        ("", set()),
        (None, set()),
    ],
)
def test_cpulists_are_read_within_bounds(text: str | None, cpus: set[int]) -> None:
    assert hosts.parse_cpulist(text) == cpus


@given(st.text(max_size=300))
def test_any_text_reads_as_a_bounded_cpu_set_and_never_raises(text: str) -> None:
    cpus = hosts.parse_cpulist(text)
    assert all(0 <= c <= hosts.CPULIST_MAX_ID for c in cpus)


@given(st.sets(st.integers(min_value=0, max_value=hosts.CPULIST_MAX_ID), max_size=200))
def test_a_formatted_cpu_set_reads_back_as_itself(cpus: set[int]) -> None:
    assert hosts.parse_cpulist(hosts.format_cpulist(cpus)) == cpus


@given(
    st.lists(
        st.tuples(st.integers(0, 9000), st.integers(0, 9000)).map(lambda t: f"{t[0]}-{t[1]}"),
        max_size=50,
    )
)
def test_ranges_read_as_their_cpus_or_as_empty_when_out_of_bounds(parts: list[str]) -> None:
    cpus = hosts.parse_cpulist(",".join(parts))
    expected: set[int] = set()
    for part in parts:
        low, high = (int(x) for x in part.split("-"))
        if high < low or high > hosts.CPULIST_MAX_ID:
            expected = set()
            break
        expected.update(range(low, high + 1))
    assert cpus == expected
