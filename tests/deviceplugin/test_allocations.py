"""The node's allocation set and the pure rules the gRPC methods wrap: what is advertised in
each phase, ownership, the version waiters, inventory checks and the preferred-allocation
choice, without any socket."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bettercompute.deviceplugin.allocations import (
    RESOURCE_BY_NAME,
    AdvertisedDevice,
    Allocations,
    Phase,
    inventory_problems,
)
from bettercompute.deviceplugin.devicefiles import Allocation
from bettercompute.deviceplugin.serving import Refused, allocate_container, preferred_devices
from bettercompute.kube.allocations import parse_spec
from tests.deviceplugin.conftest import allocation_spec, inventory

GPU = RESOURCE_BY_NAME["bcd.dev/gpu"]
SLOT = RESOURCE_BY_NAME["bcd.dev/gpu.slot"]


def _allocation(allocation_id: str, devices: list[str], **kwargs: object) -> Allocation:
    return Allocation.from_spec(parse_spec(allocation_spec(allocation_id, devices, **kwargs)))  # type: ignore[arg-type]


def _ids(allocations: Allocations, resource: object) -> list[str]:
    return [d.device_id for d in allocations.advertised(resource)]  # type: ignore[arg-type]


def test_only_bound_kubernetes_devices_are_advertised_and_release_hides_them_at_once() -> None:
    allocations = Allocations()
    allocations.set_inventory(inventory())
    a = _allocation("alloc_a", ["GPU-1", "GPU-0"])
    allocations.start_binding(a)
    assert _ids(allocations, GPU) == []  # files not written yet
    allocations.mark_bound("alloc_a")
    assert _ids(allocations, GPU) == ["GPU-0", "GPU-1"]
    allocations.start_binding(_allocation("alloc_h", ["GPU-2"], binding="hold"))
    allocations.mark_bound("alloc_h")
    assert _ids(allocations, GPU) == ["GPU-0", "GPU-1"]
    assert _ids(allocations, SLOT) == []

    allocations.start_release("alloc_a", since_ms=5)
    assert _ids(allocations, GPU) == []
    assert allocations.owner_of("GPU-0") is not None  # still owned while releasing
    successor = _allocation("alloc_next", ["GPU-0"])
    assert [c.owner_phase for c in allocations.conflicts(successor)] == [Phase.RELEASING]
    assert allocations.conflicts(a) == []  # an allocation never conflicts with itself
    allocations.mark_released("alloc_a")
    assert allocations.owner_of("GPU-0") is None
    assert allocations.count(Phase.RELEASED) == 1
    allocations.forget("alloc_a")
    assert allocations.get("alloc_a") is None


def test_a_second_owner_is_refused() -> None:
    allocations = Allocations()
    allocations.start_binding(_allocation("alloc_a", ["GPU-0"]))
    other = _allocation("alloc_b", ["GPU-1", "GPU-0"])
    assert [(c.device_id, c.owner) for c in allocations.conflicts(other)] == [("GPU-0", "alloc_a")]
    with pytest.raises(ValueError, match="owned elsewhere"):
        allocations.start_binding(other)


async def test_waiters_wake_on_every_change_and_not_before() -> None:
    allocations = Allocations()
    seen = allocations.version
    waiter = asyncio.create_task(allocations.wait_changed(after=seen))
    await asyncio.sleep(0)
    assert not waiter.done()
    allocations.set_inventory(inventory())
    assert await asyncio.wait_for(waiter, 1) == seen + 1
    allocations.set_inventory(inventory())  # the same inventory is no change
    assert allocations.version == seen + 1


def test_allocate_waits_for_the_files_of_a_binding_allocation() -> None:
    allocations = Allocations()
    allocations.start_binding(_allocation("alloc_a", ["GPU-0"]))
    with pytest.raises(Refused) as refused:
        allocate_container(allocations, GPU, ["GPU-0"])
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    allocations.mark_bound("alloc_a")
    assert allocate_container(allocations, GPU, ["GPU-0"]).envs["BCD_ALLOCATION_ID"] == "alloc_a"
    with pytest.raises(Refused, match="no device ids"):
        allocate_container(allocations, GPU, [])


@pytest.mark.parametrize(
    ("devices", "kwargs", "problem"),
    [
        (["GPU-9"], {}, "GPU GPU-9 is not in this node's inventory"),
        (["GPU-0"], {"parents": ["GPU-1"]}, "given parent GPU-1"),
        (["MIG-4a"], {"device_class": "mig", "parents": ["GPU-0"]}, "belongs to GPU-4"),
        (["GPU-0:3"], {"device_class": "slot", "parents": ["GPU-0:3"]}, "is not '<parent"),
        (["GPU-9::0"], {"device_class": "slot"}, "GPU GPU-9 is not in"),
        (["GPU-0::x"], {"device_class": "slot"}, "is not '<parent"),
    ],
)
def test_inventory_problems_name_the_device(
    devices: list[str], kwargs: dict[str, object], problem: str
) -> None:
    found = inventory_problems(
        inventory=inventory(), allocation=_allocation("a", devices, **kwargs)
    )
    assert len(found) == 1
    assert problem in found[0]


def test_devices_of_the_inventory_have_no_problems() -> None:
    for devices, kwargs in [
        (["GPU-0", "GPU-3"], {}),
        (["MIG-4a", "MIG-4b"], {"device_class": "mig"}),
        (["GPU-1::0", "GPU-1::7"], {"device_class": "slot"}),
    ]:
        allocation = _allocation("a", devices, **kwargs)
        assert inventory_problems(inventory=inventory(), allocation=allocation) == []


def _device(device_id: str, allocation: str, domain: str | None, index: int) -> AdvertisedDevice:
    return AdvertisedDevice(
        device_id=device_id,
        healthy=True,
        numa_node=0,
        allocation_id=allocation,
        parent_gpu=device_id.split("::")[0],
        nvlink_domain=domain,
        gpu_index=index,
    )


# alloc_a: four GPUs over two NVLink domains (2 + 2); alloc_b: three GPUs in one domain;
# alloc_c: two slots on each of two GPUs without NVLink.
DEVICES = [
    _device("a0", "alloc_a", "n-nvl0", 0),
    _device("a1", "alloc_a", "n-nvl0", 1),
    _device("a2", "alloc_a", "n-nvl1", 2),
    _device("a3", "alloc_a", "n-nvl1", 3),
    _device("b4", "alloc_b", "n-nvl2", 4),
    _device("b5", "alloc_b", "n-nvl2", 5),
    _device("b6", "alloc_b", "n-nvl2", 6),
    _device("G7::1", "alloc_c", None, 7),
    _device("G7::0", "alloc_c", None, 7),
    _device("G8::0", "alloc_c", None, 8),
    _device("G8::1", "alloc_c", None, 8),
]
ALL = [d.device_id for d in DEVICES]


@pytest.mark.parametrize(
    ("available", "must_include", "size", "expected"),
    [
        # The smallest group that fits, in the smallest allocation: an NVLink pair of alloc_a.
        (ALL[:7], [], 2, ["a0", "a1"]),
        # Three: alloc_b's domain holds exactly three.
        (ALL[:7], [], 3, ["b4", "b5", "b6"]),
        # Four fit in no domain: stay inside alloc_a, both of its pairs.
        (ALL[:7], [], 4, ["a0", "a1", "a2", "a3"]),
        # must_include first, then its own domain.
        (ALL[:7], ["a2"], 2, ["a2", "a3"]),
        # must_include's domain is used up: its allocation before any other.
        (["a0", "a1", "a2", "b4", "b5"], ["a2"], 3, ["a2", "a0", "a1"]),
        # Slots pack onto one GPU.
        (ALL[7:], [], 2, ["G7::0", "G7::1"]),
        # Too few available: everything there is, must_include kept.
        (["a0", "b4"], ["a0"], 3, ["a0", "b4"]),
        # must_include alone fills the request.
        (ALL, ["b6", "a1"], 2, ["b6", "a1"]),
        # Ids this node does not advertise come last.
        (["zz", "a3"], [], 2, ["a3", "zz"]),
    ],
)
def test_preferred_allocation(
    available: list[str], must_include: list[str], size: int, expected: list[str]
) -> None:
    chosen = preferred_devices(
        devices=DEVICES, available=available, must_include=must_include, size=size
    )
    assert chosen == expected
