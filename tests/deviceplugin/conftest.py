"""A whole node for the device-plugin tests: the real ``NodePlugin`` on short unix sockets, the
kubelet and PodResources stand-ins, a simulated inventory file, and in-memory versions of the two
ports to Kubernetes (the desired DeviceAllocation specs and the status reporter)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from bettercompute.deviceplugin.cgroups import Cgroups, lay_out_standin
from bettercompute.deviceplugin.devicefiles import DeviceFiles
from bettercompute.deviceplugin.inventory import (
    FileInventory,
    Gpu,
    Inventory,
    InventorySource,
    MigDevice,
    write_inventory_file,
)
from bettercompute.deviceplugin.podresources import PodResourcesClient
from bettercompute.deviceplugin.running import DraSetup, NodePlugin
from bettercompute.deviceplugin.signing import NodeKey
from tests.support.kubelet import Kubelet, Plugin, PodResources

NODE = "gpu-node-1"
GPU = "bcd.dev/gpu"
MIG = "bcd.dev/gpu.mig"
SLOT = "bcd.dev/gpu.slot"


def inventory(*, unhealthy: Sequence[str] = ()) -> Inventory:
    """Four whole GPUs in two NVLink pairs over two NUMA nodes, and one GPU split into MIG."""

    def gpu(index: int, numa: int, peers: tuple[str, ...] = (), **extra: Any) -> Gpu:
        uuid = f"GPU-{index}"
        return Gpu(
            uuid=uuid,
            index=index,
            model="H100",
            memory_mib=81559,
            numa_node=numa,
            nvlink_peers=peers,
            healthy=uuid not in unhealthy,
            **extra,
        )

    return Inventory(
        node_name=NODE,
        gpus=(
            gpu(0, 0, ("GPU-1",)),
            gpu(1, 0, ("GPU-0",)),
            gpu(2, 1, ("GPU-3",)),
            gpu(3, 1, ("GPU-2",)),
            gpu(
                4,
                1,
                mig=(
                    MigDevice(uuid="MIG-4a", profile="3g.40gb", parent_uuid="GPU-4"),
                    MigDevice(uuid="MIG-4b", profile="3g.40gb", parent_uuid="GPU-4"),
                ),
            ),
        ),
    )


def allocation_spec(
    allocation_id: str,
    devices: Sequence[str],
    *,
    device_class: str = "gpu",
    parents: Sequence[str] | None = None,
    binding: str = "kubernetes",
    release: bool = False,
    **overrides: Any,
) -> dict[str, Any]:
    """A DeviceAllocation ``spec`` as the operator writes it (docs/kubernetes.md)."""
    if parents is None:
        parents = [d.split("::")[0] for d in devices]
        if device_class == "mig":
            parents = ["GPU-4"] * len(devices)
    spec = {
        "allocationId": allocation_id,
        "nodeName": NODE,
        "reservationId": f"rsv_{allocation_id}",
        "tenantId": "acme",
        "class": device_class,
        "binding": binding,
        "deviceIds": list(devices),
        "parentGpus": list(parents),
        "until": 1_790_028_800_000,
        "release": release,
    }
    spec.update(overrides)
    return spec


class MemoryDesired:
    """The desired-allocations port, in memory: what the Kubernetes adapter would list."""

    def __init__(self) -> None:
        self.specs: dict[str, dict[str, Any]] = {}

    async def desired(self) -> list[dict[str, Any]]:
        return [dict(spec) for spec in self.specs.values()]


class MemoryReporter:
    """The status port, in memory: every status written, per allocation, in order."""

    def __init__(self) -> None:
        self.statuses: dict[str, list[dict[str, Any]]] = {}
        self._arrived = asyncio.Condition()

    async def report(self, *, allocation_id: str, status: Mapping[str, Any]) -> None:
        async with self._arrived:
            self.statuses.setdefault(allocation_id, []).append(dict(status))
            self._arrived.notify_all()

    def last(self, allocation_id: str) -> dict[str, Any] | None:
        found = self.statuses.get(allocation_id)
        return found[-1] if found else None

    def phases(self, allocation_id: str) -> list[str]:
        return [status["phase"] for status in self.statuses.get(allocation_id, [])]

    async def wait_phase(
        self, allocation_id: str, phase: str, *, within: float = 2.0
    ) -> dict[str, Any]:
        def reached() -> bool:
            last = self.last(allocation_id)
            return last is not None and last["phase"] == phase

        try:
            async with asyncio.timeout(within), self._arrived:
                await self._arrived.wait_for(reached)
        except TimeoutError:
            raise AssertionError(
                f"{allocation_id}: no {phase} report; reports: {self.phases(allocation_id)}"
            ) from None
        last = self.last(allocation_id)
        assert last is not None
        return last


class MemoryWarnings:
    """The pod-warnings port, in memory: every (pod, reason, message) the agent raised."""

    def __init__(self) -> None:
        self.raised: list[tuple[str, str, str]] = []

    async def warn(self, *, pod: str, reason: str, message: str) -> None:
        self.raised.append((pod, reason, message))


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder under /tmp with a short name: unix socket paths must stay under ~100 bytes."""
    path = Path(tempfile.mkdtemp(prefix="bcd", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Node:
    """One node under test and everything around it."""

    root: Path
    kubelet: Kubelet
    pod_resources: PodResources
    desired: MemoryDesired
    reporter: MemoryReporter
    key: NodeKey
    files: DeviceFiles
    inventory_file: Path
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    plugin: NodePlugin | None = None
    warnings: MemoryWarnings = field(default_factory=MemoryWarnings)

    @property
    def plugin_dir(self) -> Path:
        return self.root / "plugins"

    @property
    def cgroup_root(self) -> Path:
        """A folder laid out like the host's cgroup v2 root (``lay_out_standin``)."""
        return self.root / "cgroup"

    @property
    def slice_records(self) -> Path:
        return self.root / "slices"

    def cgroups(self) -> Cgroups | None:
        """The node's slices, as the agent sets them up: None where cgroup v2 is missing."""
        cgroups = Cgroups(self.cgroup_root, records=self.slice_records)
        return cgroups if cgroups.enforcement_problem() is None else None

    def file_source(self) -> FileInventory:
        return FileInventory(path=self.inventory_file, node_name=NODE)

    def make_plugin(
        self,
        *,
        pass_seconds: float = 0.05,
        inventory_source: InventorySource | None = None,
        dra: DraSetup | None = None,
    ) -> NodePlugin:
        """The node plugin over the inventory file (or ``inventory_source``, a wrapper of it);
        with ``dra``, its DRA plugin too."""
        self.registry = CollectorRegistry()  # a fresh one: a second plugin registers anew
        return NodePlugin(
            node_name=NODE,
            inventory_source=inventory_source or self.file_source(),
            desired=self.desired,
            reporter=self.reporter,
            key=self.key,
            files=self.files,
            registry=self.registry,
            plugin_dir=self.plugin_dir,
            pods=PodResourcesClient(socket_path=self.pod_resources.socket, timeout_s=1.0),
            pass_seconds=pass_seconds,
            inventory_interval_s=0.02,
            register_poll_seconds=0.05,
            cgroups=self.cgroups(),
            warnings=self.warnings,
            dra=dra,
        )

    def put(self, spec: dict[str, Any]) -> None:
        """Create or change a DeviceAllocation, and wake the agent as the adapter would."""
        self.desired.specs[spec["allocationId"]] = spec
        if self.plugin is not None:
            self.plugin.converger.wake()

    def release(self, allocation_id: str) -> None:
        self.put({**self.desired.specs[allocation_id], "release": True})

    def delete(self, allocation_id: str) -> None:
        del self.desired.specs[allocation_id]
        if self.plugin is not None:
            self.plugin.converger.wake()

    def set_inventory(self, value: Inventory) -> None:
        write_inventory_file(path=self.inventory_file, inventory=value)

    def stream(self, resource: str) -> Plugin:
        return self.kubelet.plugins[resource]

    def files_on_disk(self) -> list[str]:
        return sorted(
            str(p.relative_to(self.root))
            for p in self.root.rglob("*")
            if p.is_file()
            and not p.name.endswith(".sock")
            and p != self.inventory_file
            and not p.is_relative_to(self.cgroup_root)
            and not p.is_relative_to(self.slice_records)
        )


@pytest.fixture
async def kubelet_node(short_dir: Path) -> AsyncIterator[Node]:
    """The stand-ins running, the inventory written, no plugin yet (``running_node`` starts one)."""
    (short_dir / "plugins").mkdir()
    (short_dir / "pod-resources").mkdir()
    inventory_file = short_dir / "inventory.yaml"
    write_inventory_file(path=inventory_file, inventory=inventory())
    lay_out_standin(short_dir / "cgroup")
    node = Node(
        root=short_dir,
        kubelet=Kubelet(short_dir / "plugins"),
        pod_resources=PodResources(short_dir / "pod-resources" / "kubelet.sock"),
        desired=MemoryDesired(),
        reporter=MemoryReporter(),
        key=NodeKey.generate(),
        files=DeviceFiles(short_dir, cdi_dir=short_dir / "cdi", env_dir=short_dir / "env"),
        inventory_file=inventory_file,
    )
    await node.kubelet.start()
    await node.pod_resources.start()
    try:
        yield node
    finally:
        await node.kubelet.stop()
        await node.pod_resources.stop()


@pytest.fixture
async def running_node(kubelet_node: Node) -> AsyncIterator[Node]:
    """The node plugin running and registered for all three resources."""
    kubelet_node.plugin = kubelet_node.make_plugin()
    async with kubelet_node.plugin.running():
        await kubelet_node.kubelet.wait_registered([GPU, MIG, SLOT])
        yield kubelet_node
