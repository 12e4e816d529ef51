"""The node agent against the Kubernetes API stand-in: its settings for a test node and the
DeviceAllocation objects the operator would write. Shared by ``test_agent.py`` and
``tests/operator/test_node_agent.py``."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from bettercompute.deviceplugin.agent import AgentConfig
from bettercompute.deviceplugin.cgroups import lay_out_standin
from bettercompute.deviceplugin.devicefiles import DeviceFiles
from bettercompute.deviceplugin.inventory import write_inventory_file
from bettercompute.deviceplugin.signing import NodeKey
from tests.deviceplugin.conftest import NODE, MemoryDesired, MemoryReporter, Node, inventory
from tests.support.kubelet import Kubelet, PodResources
from tests.support.kubeobjects import DEVICEALLOCATIONS, GPUNODES
from tests.support.kubeserver import TOKEN, KubeApi

OPERATOR_NAMESPACE = "better-compute"
POOL_LABELS = {"bcd.dev/pool": "h100"}


@contextlib.asynccontextmanager
async def standing_node() -> AsyncIterator[Node]:
    """``kubelet_node`` for tests outside this folder: the kubelet and PodResources stand-ins on
    short socket paths and the simulated inventory file (its in-memory ports stay unused)."""
    root = Path(tempfile.mkdtemp(prefix="bcd", dir="/tmp"))
    (root / "plugins").mkdir()
    (root / "pod-resources").mkdir()
    write_inventory_file(path=root / "inventory.yaml", inventory=inventory())
    lay_out_standin(root / "cgroup")
    node = Node(
        root=root,
        kubelet=Kubelet(root / "plugins"),
        pod_resources=PodResources(root / "pod-resources" / "kubelet.sock"),
        desired=MemoryDesired(),
        reporter=MemoryReporter(),
        key=NodeKey.generate(),
        files=DeviceFiles(root, cdi_dir=root / "cdi", env_dir=root / "env"),
        inventory_file=root / "inventory.yaml",
    )
    await node.kubelet.start()
    await node.pod_resources.start()
    try:
        yield node
    finally:
        await node.kubelet.stop()
        await node.pod_resources.stop()
        shutil.rmtree(root, ignore_errors=True)


def agent_config(*, kube: KubeApi | None, node: Node, **overrides: Any) -> AgentConfig:
    """The agent of ``node`` (its stand-ins, inventory file and folders), fast timings, talking
    to ``kube`` (None: no API server named)."""
    settings: dict[str, Any] = {
        "node_name": NODE,
        "namespace": OPERATOR_NAMESPACE,
        "inventory_file": node.inventory_file,
        "plugin_dir": node.plugin_dir,
        "pod_resources_socket": node.pod_resources.socket,
        "cdi_dir": node.root / "cdi",
        "env_dir": node.root / "env",
        "node_key": node.root / "key" / "node-key.pem",
        "cgroup_root": node.cgroup_root,
        "slice_records": node.slice_records,
        "metrics_host": "127.0.0.1",
        "metrics_port": 0,
        "node_labels": POOL_LABELS,
        "api_server": None if kube is None else kube.url,
        "api_token": None if kube is None else TOKEN,
        "pass_seconds": 0.05,
        "inventory_interval_s": 0.02,
        "register_poll_seconds": 0.05,
        # Never the machine's own /etc/cdi: a GPU machine's real NVIDIA spec names GPU 0 by
        # index, which the simulated GPU-0 would match.
        "nvidia_cdi_dirs": (node.root / "nvidia-cdi",),
    }
    settings.update(overrides)
    return AgentConfig(**settings)


def device_allocation(
    spec: dict[str, Any], *, node: str = NODE, namespace: str = OPERATOR_NAMESPACE
) -> dict[str, Any]:
    """The DeviceAllocation the operator writes for ``spec`` (docs/kubernetes.md)."""
    return {
        "apiVersion": DEVICEALLOCATIONS.api_version,
        "kind": "DeviceAllocation",
        "metadata": {
            "name": spec["allocationId"].replace("_", "-").lower(),
            "namespace": namespace,
            "labels": {"bcd.dev/node": node, "bcd.dev/reservation": spec["reservationId"]},
        },
        "spec": spec,
    }


def phase_is(phase: str):
    return lambda o: bool(o) and (o.get("status") or {}).get("phase") == phase


def ready_condition(gpunode: dict[str, Any] | None) -> dict[str, Any]:
    for condition in ((gpunode or {}).get("status") or {}).get("conditions") or ():
        if condition["type"] == "Ready":
            return condition
    return {}


async def wait_gpunode(kube: KubeApi, predicate, *, name: str = NODE) -> dict[str, Any]:
    found = await kube.wait_for(GPUNODES, None, name, lambda o: bool(o) and predicate(o))
    assert found is not None
    return found


def key_file(node: Node) -> Path:
    return node.root / "key" / "node-key.pem"
