"""The whole node agent (``agent.started``: the Kubernetes adapter, the GPUNode publisher, the
``NodePlugin`` and the HTTP probes) against the Kubernetes API stand-in over HTTP and the
kubelet and PodResources stand-ins over gRPC. DeviceAllocations are written directly, as the
operator would write them; ``tests/operator/test_node_agent.py`` runs the real operator."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from bettercompute.deviceplugin import signing
from bettercompute.deviceplugin.agent import Agent, started
from bettercompute.kube import allocations
from tests.deviceplugin import agents
from tests.deviceplugin.agents import OPERATOR_NAMESPACE as NS
from tests.deviceplugin.conftest import GPU, MIG, NODE, SLOT, Node, allocation_spec, inventory
from tests.support.kubeobjects import DEVICEALLOCATIONS
from tests.support.kubeserver import KubeApi


@pytest.fixture
async def agent(kube_api: KubeApi, kubelet_node: Node) -> AsyncIterator[Agent]:
    async with started(agents.agent_config(kube=kube_api, node=kubelet_node)) as running:
        await kubelet_node.kubelet.wait_registered([GPU, MIG, SLOT])
        yield running


async def _until(condition: Callable[[], bool], *, within: float = 2.0) -> None:
    """Poll ``condition`` (files, log lines: nothing to wait on) until it holds."""
    async with asyncio.timeout(within):
        while True:
            if condition():
                return
            await asyncio.sleep(0.01)


async def _until_ready(agent: Agent) -> None:
    await _until(lambda: agent.not_ready() is None)
    answer = await _get(agent, "/readyz")
    assert (answer.status_code, answer.text) == (200, "ready\n")


async def _get(agent: Agent, path: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=agent.url, timeout=5) as client:
        return await client.get(path)


async def test_the_gpunode_is_created_with_the_inventory_and_ready(kube_api: KubeApi, agent: Agent):
    gpunode = await agents.wait_gpunode(kube_api, lambda o: bool(o.get("status")))
    assert gpunode["metadata"]["labels"] == agents.POOL_LABELS
    assert gpunode["spec"] == {}
    status = gpunode["status"]
    assert status["gpus"] == 5
    assert status["capabilities"] == ["binding.kubernetes", "devices.limits"]
    assert status["heartbeatTime"].endswith("Z")
    gpus = status["inventory"]["gpus"]
    assert [g["uuid"] for g in gpus] == ["GPU-0", "GPU-1", "GPU-2", "GPU-3", "GPU-4"]
    assert gpus[0] == {
        "uuid": "GPU-0",
        "index": 0,
        "model": "H100",
        "memoryMiB": 81559,
        "numaNode": 0,
        "nvlinkDomain": f"{NODE}-nvl0",
        "healthy": True,
        "mig": [],
    }
    # Two NVLink pairs; GPU-4 has no NVLink and carries the MIG instances.
    assert [g["nvlinkDomain"] for g in gpus] == [
        f"{NODE}-nvl0",
        f"{NODE}-nvl0",
        f"{NODE}-nvl1",
        f"{NODE}-nvl1",
        None,
    ]
    assert gpus[4]["mig"] == [
        {"uuid": "MIG-4a", "profile": "3g.40gb", "healthy": True},
        {"uuid": "MIG-4b", "profile": "3g.40gb", "healthy": True},
    ]
    assert status["inventory"]["numaNodes"] == [{"id": 0}, {"id": 1}]
    assert "host" not in status["inventory"]  # the simulated inventory names no host size
    ready = agents.ready_condition(gpunode)
    assert (ready["status"], ready["reason"]) == ("True", "AgentRunning")


async def test_a_gpu_turning_unhealthy_and_back_shows_on_the_gpunode(
    kube_api: KubeApi, kubelet_node: Node, agent: Agent
):
    def health(o):
        return [g["healthy"] for g in o["status"]["inventory"]["gpus"]]

    await agents.wait_gpunode(kube_api, lambda o: bool(o.get("status")))
    kubelet_node.set_inventory(inventory(unhealthy=["GPU-2"]))
    await agents.wait_gpunode(kube_api, lambda o: health(o) == [True, True, False, True, True])
    kubelet_node.set_inventory(inventory())
    await agents.wait_gpunode(kube_api, lambda o: all(health(o)))


async def test_a_device_allocation_is_bound_advertised_and_reported_signed(
    kube_api: KubeApi, kubelet_node: Node, agent: Agent
):
    # Another node's object, even one whose spec names this node, is not this node's:
    # only the label selector keeps it out.
    other = allocation_spec("alloc_other", ["GPU-2"])
    await kube_api.create(agents.device_allocation(other, node="gpu-node-2"))
    spec = allocation_spec("alloc_a1", ["GPU-0", "GPU-1"])
    await kube_api.create(agents.device_allocation(spec))

    bound = await kube_api.wait_for(DEVICEALLOCATIONS, NS, "alloc-a1", agents.phase_is("Bound"))
    status = bound["status"]
    assert status["nodeName"] == NODE
    assert status["cdiDevices"] == ["bcd.dev/gpu=GPU-0", "bcd.dev/gpu=GPU-1"]
    assert status["envFile"] == str(kubelet_node.root / "env" / "alloc_a1.env")
    assert "since" not in status  # written as null: the merge patch leaves it out
    public_key = signing.NodeKey.load(agents.key_file(kubelet_node)).public_key
    signed = signing.verify(signature=status["signature"], public_key=public_key)
    assert (signed["allocationId"], signed["phase"]) == ("alloc_a1", "Bound")
    assert signed["cdiDevices"] == status["cdiDevices"]

    await kubelet_node.stream(GPU).wait_devices({"GPU-0": "Healthy", "GPU-1": "Healthy"})
    assert (kubelet_node.root / "cdi" / "bcd-alloc_a1.json").is_file()
    assert (kubelet_node.root / "env" / "alloc_a1.env").is_file()
    assert [s["allocationId"] for s in await agent.objects.desired()] == ["alloc_a1"]
    assert "status" not in kube_api.stored(DEVICEALLOCATIONS, NS, "alloc-other")


async def test_release_waits_for_the_pod_holding_the_devices(
    kube_api: KubeApi, kubelet_node: Node, agent: Agent
):
    spec = allocation_spec("alloc_r1", ["GPU-2", "GPU-3"])
    await kube_api.create(agents.device_allocation(spec))
    await kube_api.wait_for(DEVICEALLOCATIONS, NS, "alloc-r1", agents.phase_is("Bound"))
    await kubelet_node.stream(GPU).wait_devices({"GPU-2": "Healthy", "GPU-3": "Healthy"})

    kubelet_node.pod_resources.holding({"ml/trainer-0": {GPU: ["GPU-3"]}})
    await kube_api.patch(DEVICEALLOCATIONS, NS, "alloc-r1", {"spec": {"release": True}})
    releasing = await kube_api.wait_for(
        DEVICEALLOCATIONS, NS, "alloc-r1", agents.phase_is("Releasing")
    )
    assert releasing["status"]["pods"] == ["ml/trainer-0"]
    assert isinstance(releasing["status"]["since"], int)
    assert "envFile" not in releasing["status"]
    await kubelet_node.stream(GPU).wait_devices({})  # no longer advertised at once
    assert (kubelet_node.root / "cdi" / "bcd-alloc_r1.json").is_file()  # still held

    kubelet_node.pod_resources.holding({})
    released = await kube_api.wait_for(
        DEVICEALLOCATIONS, NS, "alloc-r1", agents.phase_is("Released")
    )
    assert released["status"]["pods"] == []
    assert kubelet_node.files_on_disk() == ["key/node-key.pem"]


async def test_an_object_deleted_while_bound_is_released_and_its_report_dropped(
    kube_api: KubeApi, kubelet_node: Node, agent: Agent, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="bettercompute.deviceplugin.watching")
    spec = allocation_spec("alloc_d1", ["GPU-0"], binding="hold")
    await kube_api.create(agents.device_allocation(spec))
    await kube_api.wait_for(DEVICEALLOCATIONS, NS, "alloc-d1", agents.phase_is("Bound"))
    await kube_api.delete(DEVICEALLOCATIONS, NS, "alloc-d1")
    # Vanished from the list: released (a hold has no pods to wait for) and its files removed.
    # Its Released report finds no object, which is not an error.
    await _until(lambda: kubelet_node.files_on_disk() == ["key/node-key.pem"])
    await _until(lambda: "object alloc-d1 is gone" in caplog.text)
    assert not [t for t in agent.tasks if t.done()]


async def test_metrics_and_probes(kube_api: KubeApi, kubelet_node: Node, agent: Agent):
    assert (await _get(agent, "/healthz")).status_code == 200
    await _until_ready(agent)
    spec = allocation_spec("alloc_m1", ["GPU-0", "GPU-1"])
    await kube_api.create(agents.device_allocation(spec))
    await kubelet_node.stream(GPU).wait_devices({"GPU-0": "Healthy", "GPU-1": "Healthy"})
    metrics = await _get(agent, "/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    lines = metrics.text.splitlines()
    assert 'bettercompute_node_advertised_devices{resource="bcd.dev/gpu"} 2.0' in lines
    assert 'bettercompute_node_advertised_devices{resource="bcd.dev/gpu.mig"} 0.0' in lines
    assert 'bettercompute_node_allocations{phase="bound"} 1.0' in lines
    assert any(
        line.startswith("bettercompute_node_gpunode_published_timestamp_seconds ") for line in lines
    )
    # One prefix with the operator's, a build label, and no _created series.
    assert any(line.startswith('bettercompute_build_info{version="') for line in lines)
    assert "bettercompute_node_gpunode_publish_failures_total 0.0" in lines
    assert not [line for line in lines if "_created" in line]
    assert not [line for line in lines if line.startswith("bcd_")]

    # A kubelet that restarts forgets the plugin: not ready until registered again.
    await kubelet_node.kubelet.stop()
    answer = await _get(agent, "/readyz")
    assert answer.status_code == 503
    assert "not registered with the kubelet for bcd.dev/gpu" in answer.text
    await kubelet_node.kubelet.start()
    await kubelet_node.kubelet.wait_registered([GPU, MIG, SLOT])
    await _until_ready(agent)


def _condition(gpunode: dict, kind: str) -> dict:
    return next(c for c in gpunode["status"]["conditions"] if c["type"] == kind)


async def test_a_node_that_enforces_limits_advertises_devices_limits(
    kube_api: KubeApi, agent: Agent
) -> None:
    gpunode = await agents.wait_gpunode(kube_api, lambda o: bool(o.get("status")))
    assert "devices.limits" in gpunode["status"]["capabilities"]
    enforced = _condition(gpunode, "HostLimitsEnforced")
    assert (enforced["status"], enforced["reason"]) == ("True", "CgroupV2")


async def test_without_cgroup_v2_the_node_does_not_advertise_devices_limits_and_says_why(
    kube_api: KubeApi, kubelet_node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    (kubelet_node.cgroup_root / "cgroup.controllers").unlink()  # a cgroup v1 host
    caplog.set_level(logging.WARNING, logger="bettercompute.deviceplugin.agent")
    config = agents.agent_config(kube=kube_api, node=kubelet_node)
    async with started(config):
        gpunode = await agents.wait_gpunode(kube_api, lambda o: bool(o.get("status")))
    assert gpunode["status"]["capabilities"] == ["binding.kubernetes"]
    condition = _condition(gpunode, "HostLimitsEnforced")
    assert (condition["status"], condition["reason"]) == ("False", "NotEnforced")
    assert condition["message"].startswith(f"no cgroup v2 at {kubelet_node.cgroup_root}")
    assert any(
        "devices.limits is not advertised: no cgroup v2" in r.getMessage() for r in caplog.records
    )
    assert _condition(gpunode, "Ready")["status"] == "True"


async def test_a_hold_with_limits_is_bound_in_its_slice_through_the_api(
    kube_api: KubeApi, kubelet_node: Node, agent: Agent
) -> None:
    # Through the API stand-in, which checks the spec and the node's status against the CRD.
    limits = {"cpuMillis": 2000, "memoryBytes": 1 << 30, "hugepages1Gi": 0, "cpus": "0-1"}
    spec = allocation_spec("alloc_l1", ["GPU-0"], binding="hold", limits=limits)
    await kube_api.create(agents.device_allocation(spec))
    bound = await kube_api.wait_for(DEVICEALLOCATIONS, NS, "alloc-l1", agents.phase_is("Bound"))
    assert bound["status"]["cgroupParent"] == "bcd-alloc-alloc_l1.slice"
    folder = kubelet_node.cgroup_root / "bcd-alloc-alloc_l1.slice"
    assert (folder / "cpu.max").read_text() == "200000 100000\n"
    assert (folder / "cpuset.cpus").read_text() == "0-1\n"
    # What the operator passes on to the control plane.
    assert allocations.report(bound["status"]) == (
        "bound",
        {
            "cdiDevices": ["bcd.dev/gpu=GPU-0"],
            "envFile": str(kubelet_node.root / "env" / "alloc_l1.env"),
            "cgroupParent": "bcd-alloc-alloc_l1.slice",
            "signature": bound["status"]["signature"],
        },
    )
