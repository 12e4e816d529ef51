"""What the kubelet sees: exact device lists as allocations bind and release, Allocate,
GetPreferredAllocation, PreStartContainer and health, through the kubelet stand-in's real gRPC
connections to the running node plugin."""

from __future__ import annotations

import grpc
import pytest

from bettercompute.deviceplugin import devicefiles
from tests.deviceplugin.conftest import GPU, MIG, SLOT, Node, allocation_spec, inventory


async def test_each_resource_advertises_exactly_its_bound_kubernetes_devices(
    running_node: Node,
) -> None:
    node = running_node
    node.put(allocation_spec("alloc_gpu", ["GPU-0", "GPU-1"]))
    await node.reporter.wait_phase("alloc_gpu", "Bound")
    await node.stream(GPU).wait_devices({"GPU-0": "Healthy", "GPU-1": "Healthy"})

    node.put(allocation_spec("alloc_mig", ["MIG-4a"], device_class="mig"))
    node.put(allocation_spec("alloc_slot", ["GPU-2::0", "GPU-2::1"], device_class="slot"))
    node.put(allocation_spec("alloc_hold", ["GPU-3"], binding="hold"))
    await node.reporter.wait_phase("alloc_hold", "Bound")
    await node.stream(MIG).wait_devices({"MIG-4a": "Healthy"})
    await node.stream(SLOT).wait_devices({"GPU-2::0": "Healthy", "GPU-2::1": "Healthy"})
    # A hold is bound (files written) but never reaches the kubelet.
    await node.stream(GPU).wait_devices({"GPU-0": "Healthy", "GPU-1": "Healthy"})
    assert "GPU-3" not in {d for _, m in node.stream(GPU).messages for d in _ids(m)}

    # NUMA topology comes from the inventory: GPU-0/1 on node 0, GPU-2 (the slots) on node 1.
    gpu_list = node.stream(GPU).messages[-1][1]
    assert {d.ID: [n.ID for n in d.topology.nodes] for d in gpu_list.devices} == {
        "GPU-0": [0],
        "GPU-1": [0],
    }
    slot_list = node.stream(SLOT).messages[-1][1]
    assert {d.topology.nodes[0].ID for d in slot_list.devices} == {1}

    node.release("alloc_gpu")  # no pod holds them: released at once
    await node.stream(GPU).wait_devices({})
    await node.reporter.wait_phase("alloc_gpu", "Released")
    await node.stream(MIG).wait_devices({"MIG-4a": "Healthy"})

    node.delete("alloc_slot")  # vanished without a release: released all the same
    await node.stream(SLOT).wait_devices({})
    await node.reporter.wait_phase("alloc_slot", "Released")

    # Every message the kubelet got was a complete list with unique ids.
    for resource in (GPU, MIG, SLOT):
        for _, message in node.stream(resource).messages:
            assert len(_ids(message)) == len(set(_ids(message)))


def _ids(message: object) -> list[str]:
    return [device.ID for device in message.devices]  # type: ignore[attr-defined]


async def test_allocate_answers_cdi_devices_envs_and_annotations(running_node: Node) -> None:
    node = running_node
    node.put(allocation_spec("alloc_gpu", ["GPU-0", "GPU-1"]))
    node.put(allocation_spec("alloc_mig", ["MIG-4a", "MIG-4b"], device_class="mig"))
    node.put(allocation_spec("alloc_slot", ["GPU-2::0", "GPU-2::1"], device_class="slot"))
    await node.stream(SLOT).wait_devices({"GPU-2::0": "Healthy", "GPU-2::1": "Healthy"})
    await node.stream(MIG).wait_devices({"MIG-4a": "Healthy", "MIG-4b": "Healthy"})

    gpu = await node.stream(GPU).allocate(["GPU-1"])
    assert [d.name for d in gpu.cdi_devices] == ["bcd.dev/gpu=GPU-1"]
    assert dict(gpu.envs) == {
        "BCD_ALLOCATION_ID": "alloc_gpu",
        "BCD_RESERVATION_ID": "rsv_alloc_gpu",
        "NVIDIA_VISIBLE_DEVICES": "GPU-1",  # only the container's GPU, not the whole allocation
    }
    assert dict(gpu.annotations) == {
        devicefiles.ANNOTATION_ALLOCATION: "alloc_gpu",
        devicefiles.ANNOTATION_RESERVATION: "rsv_alloc_gpu",
    }
    mig = await node.stream(MIG).allocate(["MIG-4b", "MIG-4a"])
    assert mig.envs["NVIDIA_VISIBLE_DEVICES"] == "MIG-4b,MIG-4a"
    assert [d.name for d in mig.cdi_devices] == ["bcd.dev/gpu=MIG-4b", "bcd.dev/gpu=MIG-4a"]
    slot = await node.stream(SLOT).allocate(["GPU-2::1", "GPU-2::0"])
    assert slot.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-2"  # slots share their physical GPU
    await node.stream(SLOT).pre_start(["GPU-2::1"])  # bound: the container may start

    assert node.plugin is not None
    histogram = node.registry.get_sample_value(
        "bettercompute_node_allocate_duration_seconds_count", {"resource": GPU}
    )
    assert histogram == 1.0
    assert (
        node.registry.get_sample_value("bettercompute_node_advertised_devices", {"resource": SLOT})
        == 2.0
    )
    assert node.registry.get_sample_value("bettercompute_node_allocations", {"phase": "bound"}) == 3


@pytest.mark.parametrize(
    ("resource", "ids", "named"),
    [
        (GPU, ["GPU-3"], "GPU-3"),  # a real GPU of the node, bound to nothing
        (GPU, ["GPU-0", "GPU-9"], "GPU-9"),  # one foreign id spoils the request
        (MIG, ["GPU-0"], "GPU-0"),  # bound, but under another resource
        (GPU, ["GPU-2"], "GPU-2"),  # a hold's GPU is not the kubelet's to hand out
    ],
)
async def test_allocate_refuses_ids_not_bound_here_and_names_them(
    running_node: Node, resource: str, ids: list[str], named: str
) -> None:
    node = running_node
    node.put(allocation_spec("alloc_gpu", ["GPU-0", "GPU-1"]))
    node.put(allocation_spec("alloc_hold", ["GPU-2"], binding="hold"))
    await node.reporter.wait_phase("alloc_hold", "Bound")
    await node.stream(GPU).wait_devices({"GPU-0": "Healthy", "GPU-1": "Healthy"})

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await node.stream(resource).allocate(ids)

    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert named in (refused.value.details() or "")
    assert resource in (refused.value.details() or "")


async def test_a_released_allocations_devices_are_refused_and_its_containers_may_not_restart(
    running_node: Node,
) -> None:
    node = running_node
    node.put(allocation_spec("alloc_gpu", ["GPU-0"]))
    await node.stream(GPU).wait_devices({"GPU-0": "Healthy"})
    node.pod_resources.holding({"ml/trainer-0": {GPU: ["GPU-0"]}})
    node.release("alloc_gpu")
    await node.reporter.wait_phase("alloc_gpu", "Releasing")

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await node.stream(GPU).allocate(["GPU-0"])
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "GPU-0" in (refused.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as restart:
        await node.stream(GPU).pre_start(["GPU-0"])
    assert restart.value.code() is grpc.StatusCode.FAILED_PRECONDITION


async def test_preferred_allocation_stays_in_one_allocation_and_nvlink_domain(
    running_node: Node,
) -> None:
    node = running_node
    # GPU-0/1 and GPU-2/3 are the two NVLink pairs; the allocations cut across them.
    node.put(allocation_spec("alloc_a", ["GPU-0", "GPU-2", "GPU-3"]))
    node.put(allocation_spec("alloc_b", ["GPU-1"]))
    await node.stream(GPU).wait_devices({f"GPU-{i}": "Healthy" for i in range(4)})
    everything = ["GPU-0", "GPU-1", "GPU-2", "GPU-3"]

    assert sorted(await node.stream(GPU).preferred(available=everything, size=2)) == [
        "GPU-2",
        "GPU-3",
    ]
    # The container already has GPU-0 (from alloc_a): stay in alloc_a, not NVLink-mate GPU-1.
    assert await node.stream(GPU).preferred(
        available=everything, must_include=["GPU-0"], size=2
    ) == ["GPU-0", "GPU-2"]
    assert await node.stream(GPU).preferred(available=everything, size=1) == ["GPU-1"]


async def test_an_unhealthy_gpu_is_advertised_unhealthy_until_it_recovers(
    running_node: Node,
) -> None:
    node = running_node
    node.put(allocation_spec("alloc_gpu", ["GPU-0", "GPU-1"]))
    node.put(allocation_spec("alloc_mig", ["MIG-4a"], device_class="mig"))
    await node.stream(GPU).wait_devices({"GPU-0": "Healthy", "GPU-1": "Healthy"})
    await node.stream(MIG).wait_devices({"MIG-4a": "Healthy"})

    node.set_inventory(inventory(unhealthy=["GPU-1", "GPU-4"]))
    await node.stream(GPU).wait_devices({"GPU-0": "Healthy", "GPU-1": "Unhealthy"})
    await node.stream(MIG).wait_devices({"MIG-4a": "Unhealthy"})  # its parent GPU is sick

    node.set_inventory(inventory())
    await node.stream(GPU).wait_devices({"GPU-0": "Healthy", "GPU-1": "Healthy"})
    await node.stream(MIG).wait_devices({"MIG-4a": "Healthy"})
    assert node.reporter.phases("alloc_gpu") == ["Bound"]  # health is not a binding change
