"""This node's ResourceSlices (``draslices``): which devices are published, with which
attributes, in how many slices, and how a publisher continues the pool's generation, without a
server (the real API server and scheduler read them in tests/controlplane/test_real_dra.py)."""

from __future__ import annotations

from typing import Any

from bettercompute.deviceplugin import draslices
from bettercompute.deviceplugin.allocations import Allocations
from bettercompute.deviceplugin.devicefiles import Allocation
from bettercompute.kube import dra
from bettercompute.kube.allocations import parse_spec
from tests.deviceplugin.conftest import NODE, allocation_spec, inventory


def _allocation(allocation_id: str, devices: list[str], **kwargs: Any) -> Allocation:
    return Allocation.from_spec(parse_spec(allocation_spec(allocation_id, devices, **kwargs)))


def _dra(allocation_id: str, devices: list[str], **kwargs: Any) -> Allocation:
    return _allocation(
        allocation_id,
        devices,
        kubernetesApi="dra",
        reservationNamespace="ml",
        **kwargs,
    )


def _published(allocations: Allocations) -> list[dict[str, Any]]:
    return draslices.devices(draslices.published(allocations.all()), allocations.inventory)


def test_only_bound_dra_devices_are_published_and_a_release_takes_them_out_at_once() -> None:
    allocations = Allocations()
    allocations.set_inventory(inventory())
    claimed = _dra("alloc_a", ["GPU-1", "GPU-0"])
    plugin = _allocation("alloc_b", ["GPU-2"])  # the device plugin's: never in a slice
    hold = _allocation("alloc_c", ["GPU-3"], binding="hold")
    for allocation in (claimed, plugin, hold):
        allocations.start_binding(allocation)
    assert _published(allocations) == []  # binding: files not written yet
    for allocation in (claimed, plugin, hold):
        allocations.mark_bound(allocation.allocation_id)
    assert [d["name"] for d in _published(allocations)] == ["gpu-0", "gpu-1"]
    allocations.start_release("alloc_a", since_ms=1)
    assert _published(allocations) == []


def test_each_device_carries_what_a_claim_selects_on() -> None:
    allocations = Allocations()
    allocations.set_inventory(inventory())
    allocations.start_binding(_dra("alloc_a", ["GPU-0"]))
    allocations.start_binding(_dra("alloc_m", ["MIG-4a"], device_class="mig"))
    allocations.mark_bound("alloc_a")
    allocations.mark_bound("alloc_m")
    by_name = {d["name"]: d for d in _published(allocations)}
    gpu, gpu_model = by_name["gpu-0"], inventory().gpus[0]
    assert gpu["attributes"] == {
        "uuid": {"string": "GPU-0"},
        "class": {"string": "gpu"},
        "reservation": {"string": "rsv_alloc_a"},
        "namespace": {"string": "ml"},
        "productName": {"string": gpu_model.model},
        "numaNode": {"int": gpu_model.numa_node},
        "nvlinkDomain": gpu["attributes"]["nvlinkDomain"],
    }
    assert gpu["capacity"] == {"memory": {"value": f"{gpu_model.memory_mib}Mi"}}
    mig = by_name["mig-4a"]
    assert mig["attributes"]["migProfile"] == {"string": "3g.40gb"}
    assert mig["attributes"]["parentUuid"] == {"string": "GPU-4"}
    assert mig["capacity"] == {"memory": {"value": f"{40 * 1024}Mi"}}


def test_a_device_without_a_namespace_is_published_without_one() -> None:
    """A reservation made through the HTTP API has no Reservation object: its devices carry no
    namespace, so no claim the admission policy admits can select them."""
    allocations = Allocations()
    allocations.set_inventory(inventory())
    allocations.start_binding(_allocation("alloc_a", ["GPU-0"], kubernetesApi="dra"))
    allocations.mark_bound("alloc_a")
    (device,) = _published(allocations)
    assert "namespace" not in device["attributes"]


def test_a_pool_of_more_than_128_devices_spans_slices_of_one_generation() -> None:
    devices = [{"name": f"dev-{i:03d}"} for i in range(300)]
    made = draslices.slices(node_name=NODE, generation=7, published_devices=devices)
    assert [s["metadata"]["name"] for s in made] == [
        dra.slice_name(NODE),
        f"{dra.slice_name(NODE)}-1",
        f"{dra.slice_name(NODE)}-2",
    ]
    assert [len(s["spec"]["devices"]) for s in made] == [128, 128, 44]
    for s in made:
        assert s["spec"]["pool"] == {"name": NODE, "generation": 7, "resourceSliceCount": 3}
        assert s["spec"]["nodeName"] == NODE
        assert s["spec"]["driver"] == dra.DRIVER
    (empty,) = draslices.slices(node_name=NODE, generation=1, published_devices=[])
    assert empty["spec"]["devices"] == []


def test_device_names_are_dns_labels_that_never_collide_with_hashed_ones() -> None:
    assert dra.device_name("GPU-8f3c2a1e-0000-1111-2222-333344445555") == (
        "gpu-8f3c2a1e-0000-1111-2222-333344445555"
    )
    assert dra.device_name("GPU-ab::3") == "gpu-ab-slot-3"
    long = "GPU-" + "a" * 80
    assert dra.device_name(long).startswith("dev-")
    assert len(dra.device_name(long)) == 24
    assert dra.device_name("dev-1") != "dev-1"  # a real id never looks like a hashed name
