"""The PodResources client against the stand-in over a real unix socket: pods holding our
devices, grouped as the kubelet reports them, and every failure is "unreachable", never "free"."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from bettercompute.deviceplugin.podresources import KubeletUnreachable, PodResourcesClient
from tests.support.kubelet import PodResources

GPU = "bcd.dev/gpu"
SLOT = "bcd.dev/gpu.slot"


@pytest.fixture
async def pod_resources(short_dir: Path) -> AsyncIterator[PodResources]:
    server = PodResources(short_dir / "kubelet.sock")
    await server.start()
    yield server
    await server.stop()


async def test_pods_holding_any_of_the_devices_are_named_once(
    pod_resources: PodResources,
) -> None:
    pod_resources.holding(
        {
            "ml/trainer-0": {GPU: ["GPU-0", "GPU-1"]},
            "ml/trainer-1": {GPU: ["GPU-2"]},
            "batch/slots": {SLOT: ["GPU-0::0"]},
            "batch/same-id-other-resource": {"nvidia.com/gpu": ["GPU-1"]},
        }
    )
    client = PodResourcesClient(socket_path=pod_resources.socket)

    assert await client.holders(devices={GPU: ["GPU-1", "GPU-2"]}) == [
        "ml/trainer-0",
        "ml/trainer-1",
    ]
    assert await client.holders(devices={GPU: ["GPU-3"], SLOT: ["GPU-0::0"]}) == ["batch/slots"]
    assert await client.holders(devices={GPU: ["GPU-9"]}) == []


async def test_a_stopped_kubelet_is_unreachable_not_free(pod_resources: PodResources) -> None:
    client = PodResourcesClient(socket_path=pod_resources.socket, timeout_s=0.5)
    await pod_resources.stop()

    with pytest.raises(KubeletUnreachable, match="no socket"):
        await client.holders(devices={GPU: ["GPU-0"]})


class Refusing(PodResources):
    async def List(self, request: object, context: grpc.aio.ServicerContext) -> object:  # type: ignore[type-arg]
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")


async def test_a_refused_or_silent_kubelet_is_unreachable(short_dir: Path) -> None:
    refusing = Refusing(short_dir / "refusing.sock")
    await refusing.start()
    try:
        with pytest.raises(KubeletUnreachable, match="RESOURCE_EXHAUSTED rejected by rate limit"):
            await PodResourcesClient(socket_path=refusing.socket).holders(devices={GPU: ["x"]})
    finally:
        await refusing.stop()
    # A socket file nobody serves (a kubelet that died without cleaning up).
    stale = short_dir / "stale.sock"
    stale.write_bytes(b"")
    with pytest.raises(KubeletUnreachable, match="UNAVAILABLE"):
        await PodResourcesClient(socket_path=stale, timeout_s=0.5).holders(devices={GPU: ["x"]})
