"""Foreign GPU exposure: the node agent notices another path that hands its GPUs to pods (another
device plugin's socket, another vendor's GPU resource on its Node, a DRA GPU driver's
ResourceSlice) and says so in its GPUNode's ``ForeignGpuExposure`` condition, which clears once
the path is gone. The publisher runs against the API stand-in over HTTP; sockets are real unix
sockets in a temporary device-plugins directory."""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from bettercompute.deviceplugin.foreign import (
    ForeignExposure,
    describe,
    foreign_resources,
    foreign_slices,
    foreign_sockets,
)
from bettercompute.deviceplugin.publishing import NodePublisher
from bettercompute.kube.client import KubeClient, read_kubeconfig
from tests.deviceplugin.conftest import NODE, inventory
from tests.support.kubeobjects import GPUNODES, Ref
from tests.support.kubeserver import KubeApi

NODES = Ref(group="", version="v1", plural="nodes", namespaced=False)
SLICES = Ref(group="resource.k8s.io", version="v1", plural="resourceslices", namespaced=False)


@pytest.fixture
async def client(kube_api: KubeApi) -> AsyncIterator[KubeClient]:
    config, _ = read_kubeconfig(kube_api.kubeconfig)
    async with KubeClient(config) as opened:
        yield opened


class PluginDir:
    """A device-plugins directory with real listening unix sockets in it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.listening: dict[str, socket.socket] = {}

    def listen(self, name: str) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(self.path / name))
        s.listen()
        self.listening[name] = s

    def stop(self, name: str) -> None:
        self.listening.pop(name).close()
        (self.path / name).unlink()


@pytest.fixture
def plugins(tmp_path: Path) -> Iterator[PluginDir]:
    # A short path: a unix socket's path is limited to about 100 bytes.
    folder = Path(tempfile.mkdtemp(prefix="bcdf", dir="/tmp"))
    made = PluginDir(folder)
    try:
        yield made
    finally:
        for s in made.listening.values():
            s.close()
        shutil.rmtree(folder, ignore_errors=True)


def node(**resources: str) -> dict:  # type: ignore[type-arg]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE},
        "status": {"capacity": dict(resources), "allocatable": dict(resources)},
    }


async def set_resources(kube_api: KubeApi, **resources: str) -> None:
    """What the kubelet writes in the Node's status: capacity and allocatable."""
    counts = dict(resources)
    body = {"status": {"capacity": counts, "allocatable": counts}}
    await kube_api.patch(NODES, None, NODE, body, status=True)


def resource_slice(name: str, *, driver: str, node_name: str = NODE) -> dict:  # type: ignore[type-arg]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {"driver": driver, "nodeName": node_name, "pool": {"name": "p"}},
    }


# --- the signs, one by one ---------------------------------------------------------------------


def test_only_sockets_of_other_plugins_count(plugins: PluginDir):
    for ours in ("kubelet.sock", "bcd-gpu.sock", "bcd-gpu-mig.sock"):
        plugins.listen(ours)
    (plugins.path / "nvidia-gpu.sock").write_text("a plain file is not a plugin")
    assert foreign_sockets(plugins.path) == []
    plugins.listen("nvidia.sock")
    plugins.listen("amd-gpu.sock")
    assert foreign_sockets(plugins.path) == ["amd-gpu.sock", "nvidia.sock"]
    assert foreign_sockets(plugins.path / "missing") == []


def test_only_non_zero_gpu_resources_of_other_vendors_count():
    assert foreign_resources(None) == []
    assert foreign_resources(node(cpu="64", **{"bcd.dev/gpu": "8"})) == []
    assert foreign_resources(node(**{"nvidia.com/gpu": "0"})) == []
    found = foreign_resources(node(**{"nvidia.com/gpu": "8", "amd.com/gpu": "2"}))
    assert found == ["amd.com/gpu=2", "nvidia.com/gpu=8"]
    assert foreign_resources(node(**{"nvidia.com/mig-1g.10gb": "7"})) == [
        "nvidia.com/mig-1g.10gb=7"
    ]


def test_only_gpu_driver_slices_of_this_node_count():
    slices = [
        resource_slice("gpu-a", driver="gpu.nvidia.com"),
        resource_slice("other-node", driver="gpu.nvidia.com", node_name="n9"),
        resource_slice("nic", driver="dra.net"),
    ]
    assert foreign_slices(slices, node_name=NODE) == ["gpu.nvidia.com (gpu-a)"]


def test_the_message_names_every_path_or_there_is_none():
    assert describe(sockets=[], resources=[], slices=[]) is None
    message = describe(sockets=["nvidia.sock"], resources=["nvidia.com/gpu=8"], slices=[])
    assert message is not None
    assert "nvidia.sock" in message
    assert "nvidia.com/gpu=8" in message


# --- the condition on the GPUNode ---------------------------------------------------------------


def exposure_condition(kube_api: KubeApi) -> dict:  # type: ignore[type-arg]
    status = kube_api.stored(GPUNODES, None, NODE)["status"]
    [condition] = [c for c in status["conditions"] if c["type"] == "ForeignGpuExposure"]
    return condition  # type: ignore[no-any-return]


async def test_foreign_exposure_is_raised_for_each_path_and_cleared_when_gone(
    kube_api: KubeApi, client: KubeClient, plugins: PluginDir
):
    kube_api.emulator.declare(NODES, kind="Node", status_subresource=True)
    kube_api.emulator.declare(SLICES, kind="ResourceSlice")
    await kube_api.create(node())
    await set_resources(kube_api, cpu="64")
    publisher = NodePublisher(
        client=client,
        node_name=NODE,
        registry=CollectorRegistry(),
        foreign=ForeignExposure(client=client, node_name=NODE, plugin_dir=plugins.path),
    )
    await publisher.connect()
    await publisher.publish(inventory())
    clear = exposure_condition(kube_api)
    assert (clear["status"], clear["reason"]) == ("False", "OnlyBcd")

    # NVIDIA's device plugin left running on the node: its socket and its resource.
    plugins.listen("nvidia-gpu.sock")
    await set_resources(kube_api, **{"nvidia.com/gpu": "8"})
    await publisher.publish(inventory())
    raised = exposure_condition(kube_api)
    assert (raised["status"], raised["reason"]) == ("True", "ForeignPath")
    assert "nvidia-gpu.sock" in raised["message"]
    assert "nvidia.com/gpu=8" in raised["message"]

    # Turned off: the socket gone, the resource at zero; a DRA driver still publishes the GPUs.
    plugins.stop("nvidia-gpu.sock")
    await set_resources(kube_api, **{"nvidia.com/gpu": "0"})
    await kube_api.create(resource_slice("gpu-slice", driver="gpu.nvidia.com"))
    await publisher.publish(inventory())
    raised = exposure_condition(kube_api)
    assert raised["status"] == "True"
    assert raised["message"].endswith("DRA ResourceSlices gpu.nvidia.com (gpu-slice)")

    await kube_api.delete(SLICES, None, "gpu-slice")
    await publisher.publish(inventory())
    assert exposure_condition(kube_api)["status"] == "False"


async def test_a_cluster_without_resourceslices_still_checks_the_rest(
    kube_api: KubeApi, client: KubeClient, plugins: PluginDir
):
    # No ResourceSlice API (the stand-in answers 404, as an older cluster does).
    plugins.listen("other.sock")
    exposure = ForeignExposure(client=client, node_name=NODE, plugin_dir=plugins.path)
    assert (await exposure.check() or "").endswith("device plugin sockets other.sock")
    assert (await exposure.check() or "").endswith("device plugin sockets other.sock")
