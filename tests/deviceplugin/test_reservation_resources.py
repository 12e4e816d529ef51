"""A reservation's own resource: in pod access ``reservation`` each kubernetes allocation is
advertised under ``spec.resourceName`` (``bcd.dev/rsv-…``) by an endpoint of its own, with only
its devices; the shared names never show them; the endpoint stays while pods hold the devices
after a release and goes once they let go. Through the kubelet and PodResources stand-ins'
real gRPC over unix sockets."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest

from tests.deviceplugin.conftest import GPU, Node, allocation_spec

MINE = "bcd.dev/rsv-aaaaaaaaaaaaaaaaaaaaaaaa"
THEIRS = "bcd.dev/rsv-bbbbbbbbbbbbbbbbbbbbbbbb"


async def _gone(path: Path, *, within_s: float = 3.0) -> bool:
    """Whether ``path`` is removed within ``within_s`` (the registrar polls every 50 ms here)."""
    for _ in range(int(within_s / 0.02)):
        if not await asyncio.to_thread(os.path.lexists, path):
            return True
        await asyncio.sleep(0.02)
    return False


async def test_each_reservation_gets_its_own_endpoint_with_only_its_devices(
    running_node: Node,
) -> None:
    node = running_node
    node.put(allocation_spec("alloc_mine", ["GPU-0", "GPU-1"], resourceName=MINE))
    node.put(allocation_spec("alloc_theirs", ["GPU-2"], resourceName=THEIRS))
    node.put(allocation_spec("alloc_shared", ["GPU-3"]))
    await node.kubelet.wait_registered([MINE, THEIRS], within=3.0)
    await node.stream(MINE).wait_devices({"GPU-0": "Healthy", "GPU-1": "Healthy"})
    await node.stream(THEIRS).wait_devices({"GPU-2": "Healthy"})
    # The shared name shows only the shared allocation: never a reservation's devices.
    await node.stream(GPU).wait_devices({"GPU-3": "Healthy"})
    endpoints = {r.resource_name: r.endpoint for _, r in node.kubelet.registrations}
    assert endpoints[MINE] == "bcd-rsv-aaaaaaaaaaaaaaaaaaaaaaaa.sock"
    assert endpoints[THEIRS] != endpoints[MINE]

    # Allocate through a reservation's endpoint hands out its devices, and only those.
    answer = await node.stream(MINE).allocate(["GPU-1"])
    assert [d.name for d in answer.cdi_devices] == ["bcd.dev/gpu=GPU-1"]
    assert answer.envs["BCD_ALLOCATION_ID"] == "alloc_mine"
    # Another reservation's GPU through mine, or mine through the shared name: refused.
    with pytest.raises(grpc.aio.AioRpcError, match="GPU-2"):
        await node.stream(MINE).allocate(["GPU-2"])
    with pytest.raises(grpc.aio.AioRpcError, match="GPU-0"):
        await node.stream(GPU).allocate(["GPU-0"])


async def test_a_released_reservation_keeps_its_endpoint_until_no_pod_holds_the_devices(
    running_node: Node,
) -> None:
    node = running_node
    node.put(allocation_spec("alloc_mine", ["GPU-0", "GPU-1"], resourceName=MINE))
    await node.kubelet.wait_registered([MINE], within=3.0)
    await node.stream(MINE).wait_devices({"GPU-0": "Healthy", "GPU-1": "Healthy"})
    socket = node.plugin_dir / "bcd-rsv-aaaaaaaaaaaaaaaaaaaaaaaa.sock"
    assert socket.exists()
    node.pod_resources.holding({"ml/trainer-0": {MINE: ["GPU-1"]}})

    node.release("alloc_mine")
    releasing = await node.reporter.wait_phase("alloc_mine", "Releasing")
    assert releasing["pods"] == ["ml/trainer-0"]
    await node.stream(MINE).wait_devices({})  # nothing new is handed out
    await asyncio.sleep(0.3)  # several registrar polls: the endpoint stays while held
    assert socket.exists()

    node.pod_resources.holding({})  # the pod let go
    await node.reporter.wait_phase("alloc_mine", "Released")
    assert await _gone(socket)


async def test_a_kubelet_restart_registers_every_reservation_endpoint_again(
    running_node: Node,
) -> None:
    node = running_node
    node.put(allocation_spec("alloc_mine", ["GPU-0"], resourceName=MINE))
    node.put(allocation_spec("alloc_theirs", ["GPU-2"], resourceName=THEIRS))
    await node.kubelet.wait_registered([MINE, THEIRS], within=3.0)
    before = asyncio.get_running_loop().time()
    await node.kubelet.restart()
    await node.kubelet.wait_registered([MINE, THEIRS, GPU], after=before, within=3.0)
    await node.stream(MINE).wait_devices({"GPU-0": "Healthy"})
    await node.stream(THEIRS).wait_devices({"GPU-2": "Healthy"})
