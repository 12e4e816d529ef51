"""The install-time refusal: with ``--refuse-foreign`` (the chart's
``devicePlugin.refuseForeignExposure``) the node agent does not start where another path already
hands the node's GPUs to pods, and registers nothing with the kubelet; without it, it starts as
before. The whole agent runs against the API stand-in over HTTP and the kubelet stand-in, whose
device-plugins folder gets a real listening socket of "another vendor"."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from bettercompute.deviceplugin.agent import AgentError, started
from tests.deviceplugin import agents
from tests.deviceplugin.conftest import GPU, MIG, NODE, SLOT, Node
from tests.deviceplugin.test_agent_command import _flags, agent_process
from tests.support.kubeobjects import GPUNODES, Ref
from tests.support.kubeserver import KubeApi

NODES = Ref(group="", version="v1", plural="nodes", namespaced=False)
SLICES = Ref(group="resource.k8s.io", version="v1", plural="resourceslices", namespaced=False)


@pytest.fixture
def nvidia_socket(kubelet_node: Node) -> Iterator[str]:
    """NVIDIA's device plugin, still serving: its socket beside the kubelet's."""
    name = "nvidia-gpu.sock"
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(kubelet_node.plugin_dir / name))
    listening.listen()
    try:
        yield name
    finally:
        listening.close()
        (kubelet_node.plugin_dir / name).unlink(missing_ok=True)


async def _node_with(kube_api: KubeApi, **resources: str) -> None:
    kube_api.emulator.declare(NODES, kind="Node", status_subresource=True)
    await kube_api.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    body = {"status": {"capacity": dict(resources), "allocatable": dict(resources)}}
    await kube_api.patch(NODES, None, NODE, body, status=True)


async def test_another_plugins_socket_stops_the_start_before_anything_registers(
    kube_api: KubeApi, kubelet_node: Node, nvidia_socket: str
):
    config = agents.agent_config(kube=kube_api, node=kubelet_node, refuse_foreign_exposure=True)
    with pytest.raises(AgentError) as refused:
        async with started(config):
            pytest.fail("the agent started beside another device plugin")
    message = str(refused.value)
    assert message.startswith(
        "another path hands this node's GPUs to pods: device plugin sockets nvidia-gpu.sock; "
        "refusing to start (--refuse-foreign)"
    )
    assert "nvidia.com/gpu.deploy.device-plugin=false" in message
    assert "devicePlugin.refuseForeignExposure=false" in message
    assert kubelet_node.kubelet.registrations == []
    assert kube_api.stored(GPUNODES, None, NODE) is None


async def test_another_vendors_gpu_resource_on_the_node_stops_the_start(
    kube_api: KubeApi, kubelet_node: Node
):
    # NVIDIA's plugin on another path (its socket elsewhere), seen through the Node's status.
    await _node_with(kube_api, cpu="64", **{"nvidia.com/gpu": "8"})
    config = agents.agent_config(kube=kube_api, node=kubelet_node, refuse_foreign_exposure=True)
    with pytest.raises(AgentError, match=r"Node resources nvidia\.com/gpu=8; refusing to start"):
        async with started(config):
            pytest.fail("the agent started beside nvidia.com/gpu")
    assert kubelet_node.kubelet.registrations == []


async def test_a_gpu_dra_drivers_slice_for_this_node_stops_the_start(
    kube_api: KubeApi, kubelet_node: Node
):
    kube_api.emulator.declare(SLICES, kind="ResourceSlice")
    await kube_api.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "nvidia-slice"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": NODE, "pool": {"name": "p"}},
        }
    )
    config = agents.agent_config(kube=kube_api, node=kubelet_node, refuse_foreign_exposure=True)
    with pytest.raises(AgentError, match=r"gpu\.nvidia\.com \(nvidia-slice\); refusing"):
        async with started(config):
            pytest.fail("the agent started beside NVIDIA's DRA driver")


async def test_a_node_only_bcd_serves_starts_with_the_refusal_on(
    kube_api: KubeApi, kubelet_node: Node
):
    # Zero nvidia.com/gpu (the plugin gone, the kubelet's count left at 0) is no path.
    await _node_with(kube_api, cpu="64", **{"nvidia.com/gpu": "0"})
    config = agents.agent_config(kube=kube_api, node=kubelet_node, refuse_foreign_exposure=True)
    async with started(config):
        await kubelet_node.kubelet.wait_registered([GPU, MIG, SLOT])
        gpunode = await agents.wait_gpunode(kube_api, lambda o: bool(o.get("status")))
    [exposure] = [c for c in gpunode["status"]["conditions"] if c["type"] == "ForeignGpuExposure"]
    assert exposure["status"] == "False"


async def test_without_the_refusal_the_agent_starts_beside_it_and_says_so(
    kube_api: KubeApi, kubelet_node: Node, nvidia_socket: str
):
    config = agents.agent_config(kube=kube_api, node=kubelet_node)
    assert config.refuse_foreign_exposure is False  # the agent's own default: as before
    async with started(config):
        await kubelet_node.kubelet.wait_registered([GPU, MIG, SLOT])
        gpunode = await agents.wait_gpunode(kube_api, lambda o: bool(o.get("status")))
    [exposure] = [c for c in gpunode["status"]["conditions"] if c["type"] == "ForeignGpuExposure"]
    assert (exposure["status"], exposure["reason"]) == ("True", "ForeignPath")
    assert nvidia_socket in exposure["message"]


async def test_the_environment_turns_it_on_and_the_process_exits_1_with_one_line(
    kube_api: KubeApi, kubelet_node: Node, nvidia_socket: str
):
    # What the chart sets; exit status 1 is what makes the pod crash-loop with this message.
    config = agents.agent_config(kube=kube_api, node=kubelet_node, api_server=None)
    env = {"BCD_REFUSE_FOREIGN_EXPOSURE": "true", "KUBECONFIG": str(kube_api.kubeconfig)}
    async with agent_process(*_flags(config), env=env) as agent:
        assert await agent.finished() == 1
    errors = [line for line in agent.lines if line.startswith("Error: ")]
    assert len(errors) == 1, agent.output()
    assert errors[0].startswith(
        "Error: another path hands this node's GPUs to pods: device plugin sockets "
        "nvidia-gpu.sock; refusing to start"
    )
    assert not [line for line in agent.lines if "Traceback" in line], agent.output()
    assert kubelet_node.kubelet.registrations == []
