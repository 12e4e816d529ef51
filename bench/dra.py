"""How fast a bound DRA allocation reaches the real API server's ResourceSlice, and how fast
``NodePrepareResources`` answers, beside the device plugin's figures from the same run.

The real ``NodePlugin`` with DRA on runs against the gRPC kubelet stand-ins (device plugin,
PodResources and DRA: ``tests/support/``) and in-memory versions of its DeviceAllocation ports;
its ResourceSlice publisher and its claim reader talk to the real kube-apiserver of the tests'
control plane (built from Kubernetes' Go modules, started here on loopback, as the admin).

- **bound → slice published**: each of ``--binds`` rounds puts one ``kubernetesApi: dra``
  DeviceAllocation (one whole GPU) in the desired list and wakes the agent, and measures until
  the publisher's write of a slice listing the GPU has been accepted by the API server (its
  CDI spec written, fsynced and the Bound report signed on the way); then releases it.
- **NodePrepareResources round trip**: a ResourceClaim allocated one bound GPU (written as the
  scheduler writes it, through ``/status``) is prepared and unprepared ``--prepares`` times by
  the DRA kubelet stand-in; each prepare reads the claim from the API server (the unprepare
  forgot it) and writes the claim's CDI spec.
- Then ``bench/deviceplugin.py``'s two figures (bound → ListAndWatch, Allocate), with
  ``--dp-binds`` and ``--dp-allocates``, so both paths are measured on the same machine in the
  same minute.

    .venv/bin/python bench/dra.py [--binds 200] [--prepares 500]

Targets: bound → slice published p99 ≤ 250 ms; prepare round trip p99 ≤ 50 ms.
"""

from __future__ import annotations

import sys
from pathlib import Path

# As bench/deviceplugin.py: this folder off sys.path (bench/http.py would shadow http), the
# repository root on (the stand-ins live in the tests package).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import importlib.util  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from prometheus_client import CollectorRegistry  # noqa: E402
from tests.controlplane import build  # noqa: E402
from tests.controlplane.cluster import ControlPlane  # noqa: E402
from tests.support.drakubelet import Claim, DraKubelet  # noqa: E402
from tests.support.kubelet import Kubelet, PodResources  # noqa: E402

from bettercompute.deviceplugin import draserving  # noqa: E402
from bettercompute.deviceplugin.devicefiles import DeviceFiles  # noqa: E402
from bettercompute.deviceplugin.draslices import SlicePublisher  # noqa: E402
from bettercompute.deviceplugin.inventory import (  # noqa: E402
    FileInventory,
    Gpu,
    Inventory,
    write_inventory_file,
)
from bettercompute.deviceplugin.podresources import PodResourcesClient  # noqa: E402
from bettercompute.deviceplugin.running import DraSetup, NodePlugin  # noqa: E402
from bettercompute.deviceplugin.signing import NodeKey  # noqa: E402
from bettercompute.kube import dra  # noqa: E402
from bettercompute.kube.client import KubeClient, kube_config  # noqa: E402


def _device_plugin_bench() -> Any:
    """``bench/deviceplugin.py`` as a module (a script folder is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_deviceplugin", _HERE / "deviceplugin.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DP = _device_plugin_bench()
NODE = DP.NODE
GPUS = DP.GPUS
NS = "bench"


def dra_spec(allocation_id: str, device: str) -> dict[str, Any]:
    return {
        **DP.spec(allocation_id, "gpu", [device]),
        "kubernetesApi": "dra",
        "reservationNamespace": NS,
    }


async def until(condition: Any, *, within: float = 10.0, step: float = 0.0005) -> None:
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110 - in-process state, polled finely
            await asyncio.sleep(step)


async def dra_bench(plane: ControlPlane, *, binds: int, prepares: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="bcd", dir="/tmp"))
    config, _ = kube_config(kubeconfig=plane.admin_kubeconfig(), environ={})
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
        drakubelet = DraKubelet(root / "registry")
        await kubelet.start()
        await pod_resources.start()
        await drakubelet.start()
        plane.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        async with KubeClient(config) as client:
            desired, reports = DP.Desired(), DP.Reports()
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
                dra=DraSetup(
                    reader=draserving.KubeClaimReader(client),
                    plugins_dir=root / "kplugins",
                    registry_dir=root / "registry",
                    checkpoint=root / "dra-claims.json",
                ),
            )
            publisher = SlicePublisher(client=client, node_name=NODE, registry=registry)
            async with plugin.running():
                await drakubelet.wait_registered(dra.DRIVER, within=10)
                publishing = asyncio.create_task(publisher.run(allocations=plugin.allocations))
                try:
                    await until(lambda: publisher.generation is not None)

                    def listed() -> set[str]:
                        return {d["name"] for d in publisher._written or ()}

                    latencies = []
                    for n in range(binds):
                        allocation_id = f"alloc_{n}"
                        device = f"GPU-{n % GPUS}"
                        started = time.monotonic()
                        desired.specs[allocation_id] = dra_spec(allocation_id, device)
                        plugin.converger.wake()
                        await until(lambda d=device: dra.device_name(d) in listed())
                        latencies.append(time.monotonic() - started)
                        desired.specs[allocation_id]["release"] = True
                        plugin.converger.wake()
                        await reports.wait_phase(allocation_id, "Released")
                        del desired.specs[allocation_id]
                        await until(lambda: not listed())
                    print(f"DRA bound -> slice published      {DP.percentiles(latencies)}")

                    desired.specs["alloc_held"] = dra_spec("alloc_held", "GPU-0")
                    plugin.converger.wake()
                    await reports.wait_phase("alloc_held", "Bound")
                    claim = await make_claim(plane, "GPU-0")
                    calls = []
                    for _ in range(prepares):
                        began = time.perf_counter()
                        answer = (await drakubelet.prepare([claim]))[claim.uid]
                        calls.append(time.perf_counter() - began)
                        assert answer.error == "", answer.error
                        await drakubelet.unprepare([claim])
                    print(f"DRA NodePrepareResources (kubelet) {DP.percentiles(calls)}")
                finally:
                    publishing.cancel()
        await drakubelet.stop()
        await kubelet.stop()
        await pod_resources.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def make_claim(plane: ControlPlane, device: str) -> Claim:
    """A claim allocated ``device`` from this node's pool, as the scheduler writes it."""
    path = f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims"
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "bench", "namespace": NS},
        "spec": {
            "devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": "any"}}]}
        },
    }
    made = await asyncio.to_thread(plane.request, "POST", path, body)
    made["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpus",
                        "driver": dra.DRIVER,
                        "pool": NODE,
                        "device": dra.device_name(device),
                    }
                ]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
                ]
            },
        }
    }
    await asyncio.to_thread(plane.request, "PUT", f"{path}/bench/status", made)
    return Claim(namespace=NS, name="bench", uid=made["metadata"]["uid"])


async def bench(*, binds: int, prepares: int, dp_binds: int, dp_allocates: int) -> None:
    print("starting the control plane (etcd, kube-apiserver) on loopback ...", flush=True)
    with ControlPlane.running(binary=build.build(quiet=True)) as plane:
        await dra_bench(plane, binds=binds, prepares=prepares)
    await DP.bench(binds=dp_binds, allocates=dp_allocates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binds", type=int, default=200)
    parser.add_argument("--prepares", type=int, default=500)
    parser.add_argument("--dp-binds", type=int, default=200)
    parser.add_argument("--dp-allocates", type=int, default=1000)
    args = parser.parse_args()
    asyncio.run(
        bench(
            binds=args.binds,
            prepares=args.prepares,
            dp_binds=args.dp_binds,
            dp_allocates=args.dp_allocates,
        )
    )


if __name__ == "__main__":
    main()
