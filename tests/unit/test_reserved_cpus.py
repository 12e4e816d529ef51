"""The host's reserved CPUs are its lowest non-isolated ones (``core.hosts``).

The guide: "a cpuset never includes the host's reserved CPUs, the lowest non-isolated,
``policy.hostReserve.vcpu`` (default 2)". An isolated CPU (``isolcpus``) runs nothing the
kernel schedules, so the host's own work could never use it as its reserve.
"""

from __future__ import annotations

from bettercompute.core import hosts

NUMA = [{"id": 0, "cpus": "0-7", "memoryGiB": 64}, {"id": 1, "cpus": "8-15", "memoryGiB": 64}]


def cpuset(*, isolated: str | None, reserve: int = 2, numa: int = 0) -> str:
    found = hosts.limits(
        vcpu=4,
        memory_gib=0,
        hugepages_1gi=0,
        numa_nodes=NUMA,
        device_numa={numa},
        reserve_vcpu=reserve,
        isolated_cpus=isolated,
    )
    assert found is not None
    return str(found["cpus"])


def test_without_isolated_cpus_the_lowest_are_reserved() -> None:
    assert cpuset(isolated=None) == "2-7"
    assert cpuset(isolated="") == "2-7"


def test_isolated_cpus_are_never_the_reserve() -> None:
    # CPUs 0-1 are isolated: the reserve is 2-3, and the isolated ones stay the workload's.
    assert cpuset(isolated="0-1") == "0-1,4-7"
    assert cpuset(isolated="0,2") == "0,2,4-7"
    assert cpuset(isolated="0-1", reserve=3) == "0-1,5-7"
    # The reserve may fall on another NUMA node than the devices'.
    assert cpuset(isolated="0-7", numa=1) == "10-15"


def test_an_unreadable_isolated_list_reads_as_none() -> None:
    assert cpuset(isolated="0-1,x") == "2-7"
    assert cpuset(isolated="0-99999") == "2-7"


def test_reserved_cpus() -> None:
    cpus = frozenset(range(8))
    assert hosts.reserved_cpus(cpus, isolated=frozenset({0, 1}), reserve_vcpu=2) == {2, 3}
    assert hosts.reserved_cpus(cpus, isolated=frozenset(), reserve_vcpu=0) == frozenset()
    assert hosts.reserved_cpus(cpus, isolated=cpus, reserve_vcpu=2) == frozenset()
