"""How fast a bound allocation reaches the kubelet, and how fast Allocate answers.

The real ``NodePlugin`` (converger, three gRPC servers on unix sockets, registration) runs
against the kubelet and PodResources stand-ins of ``tests/support/kubelet.py`` and in-memory
versions of its two Kubernetes ports. Each of ``--binds`` rounds puts one DeviceAllocation (one
time-slice slot) into the desired list and wakes the agent, as the Kubernetes adapter does, and
measures until the kubelet stand-in receives the ListAndWatch message that lists the slot (the
CDI spec and env file are written, fsynced and the Bound report signed on the way). The
allocation is then released, and the release completes before the next round. Then ``--allocates``
Allocate calls for bound devices are timed from the kubelet's side.

    .venv/bin/python bench/deviceplugin.py [--binds 500] [--allocates 2000]

Target: bound → ListAndWatch p99 ≤ 50 ms.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Python puts this script's folder first on sys.path, where bench/http.py would shadow the
# standard library's http package; the stand-ins live in the tests package, importable from the
# repository root. So: the folder off, the root on.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Mapping  # noqa: E402
from typing import Any  # noqa: E402

from prometheus_client import CollectorRegistry  # noqa: E402
from tests.support.kubelet import Kubelet, PodResources  # noqa: E402

from bettercompute.deviceplugin.devicefiles import DeviceFiles  # noqa: E402
from bettercompute.deviceplugin.inventory import (  # noqa: E402
    FileInventory,
    Gpu,
    Inventory,
    write_inventory_file,
)
from bettercompute.deviceplugin.podresources import PodResourcesClient  # noqa: E402
from bettercompute.deviceplugin.running import NodePlugin  # noqa: E402
from bettercompute.deviceplugin.signing import NodeKey  # noqa: E402

NODE = "bench-node"
GPUS = 8
SLOT = "bcd.dev/gpu.slot"
GPU = "bcd.dev/gpu"


class Desired:
    def __init__(self) -> None:
        self.specs: dict[str, dict[str, Any]] = {}

    async def desired(self) -> list[dict[str, Any]]:
        return list(self.specs.values())


class Reports:
    def __init__(self) -> None:
        self.phases: dict[str, str] = {}
        self._arrived = asyncio.Condition()

    async def report(self, *, allocation_id: str, status: Mapping[str, Any]) -> None:
        async with self._arrived:
            self.phases[allocation_id] = status["phase"]
            self._arrived.notify_all()

    async def wait_phase(self, allocation_id: str, phase: str) -> None:
        async with asyncio.timeout(5), self._arrived:
            await self._arrived.wait_for(lambda: self.phases.get(allocation_id) == phase)


def spec(allocation_id: str, device_class: str, devices: list[str]) -> dict[str, Any]:
    return {
        "allocationId": allocation_id,
        "nodeName": NODE,
        "reservationId": f"rsv_{allocation_id}",
        "tenantId": "bench",
        "class": device_class,
        "binding": "kubernetes",
        "deviceIds": devices,
        "parentGpus": [d.split("::")[0] for d in devices],
        "until": 1_790_028_800_000,
        "release": False,
    }


def percentiles(samples: list[float]) -> str:
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return (
        f"p50 {cuts[49] * 1000:7.2f} ms   p99 {cuts[98] * 1000:7.2f} ms   "
        f"max {max(samples) * 1000:7.2f} ms   (n={len(samples)})"
    )


async def bench(*, binds: int, allocates: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="bcd", dir="/tmp"))
    try:
        (root / "plugins").mkdir()
        inventory_file = root / "inventory.yaml"
        gpus = tuple(
            Gpu(uuid=f"GPU-{i}", index=i, model="H100", memory_mib=81559, numa_node=i // 4)
            for i in range(GPUS)
        )
        write_inventory_file(path=inventory_file, inventory=Inventory(node_name=NODE, gpus=gpus))
        kubelet = Kubelet(root / "plugins")
        pod_resources = PodResources(root / "pod-resources.sock")
        await kubelet.start()
        await pod_resources.start()
        desired = Desired()
        reports = Reports()
        registry = CollectorRegistry()
        plugin = NodePlugin(
            node_name=NODE,
            inventory_source=FileInventory(path=inventory_file, node_name=NODE),
            desired=desired,
            reporter=reports,
            key=NodeKey.generate(),
            files=DeviceFiles(root, cdi_dir=root / "cdi", env_dir=root / "env"),
            registry=registry,
            plugin_dir=root / "plugins",
            pods=PodResourcesClient(socket_path=pod_resources.socket),
        )
        async with plugin.running():
            await kubelet.wait_registered([GPU, SLOT], within=5)
            slots = kubelet.plugins[SLOT]
            await slots.wait_devices({})

            latencies = []
            for n in range(binds):
                allocation_id = f"alloc_{n}"
                device = f"GPU-{n % GPUS}::{n}"
                received_before = len(slots.messages)
                started = time.monotonic()
                desired.specs[allocation_id] = spec(allocation_id, "slot", [device])
                plugin.converger.wake()
                await slots.wait_for(lambda latest, d=device: d in latest, within=5)
                arrival = next(t for t, m in slots.messages[received_before:] if m.devices)
                latencies.append(arrival - started)
                desired.specs[allocation_id]["release"] = True
                plugin.converger.wake()
                await slots.wait_for(lambda latest: not latest, within=5)
                # The release finishes (PodResources asked, files removed) before the next
                # bind, so each bind is timed on its own.
                await reports.wait_phase(allocation_id, "Released")
                del desired.specs[allocation_id]
            print(f"bound -> ListAndWatch received   {percentiles(latencies)}")

            desired.specs["alloc_gpus"] = spec("alloc_gpus", "gpu", [g.uuid for g in gpus])
            plugin.converger.wake()
            await kubelet.plugins[GPU].wait_for(lambda latest: len(latest) == GPUS, within=5)
            calls = []
            for n in range(allocates):
                started = time.perf_counter()
                await kubelet.plugins[GPU].allocate([f"GPU-{n % GPUS}", f"GPU-{(n + 1) % GPUS}"])
                calls.append(time.perf_counter() - started)
            print(f"Allocate round trip (kubelet)   {percentiles(calls)}")
            total = registry.get_sample_value(
                "bcd_deviceplugin_allocate_seconds_sum", {"resource": GPU}
            )
            count = registry.get_sample_value(
                "bcd_deviceplugin_allocate_seconds_count", {"resource": GPU}
            )
            if total is not None and count:
                print(f"Allocate in the plugin (mean)   {total / count * 1e6:7.1f} µs")
        await kubelet.stop()
        await pod_resources.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binds", type=int, default=500)
    parser.add_argument("--allocates", type=int, default=2000)
    args = parser.parse_args()
    asyncio.run(bench(binds=args.binds, allocates=args.allocates))


if __name__ == "__main__":
    main()
