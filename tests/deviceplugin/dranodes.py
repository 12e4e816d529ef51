"""A node with its DRA plugin for the ``test_dra_*`` tests: the real ``NodePlugin`` with DRA on,
the DRA kubelet stand-in on its registry folder, and ResourceClaims in the Kubernetes API
stand-in, read by the agent's own ``KubeClaimReader`` over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bettercompute.deviceplugin import draserving
from bettercompute.deviceplugin.inventory import InventorySource
from bettercompute.deviceplugin.running import DraSetup
from bettercompute.kube import dra
from bettercompute.kube.client import KubeClient, kube_config
from tests.deviceplugin.conftest import NODE, Node, allocation_spec
from tests.support.drakubelet import Claim, DraKubelet
from tests.support.kubeobjects import NAMESPACES, Ref
from tests.support.kubeserver import TOKEN, KubeApi

RESOURCE_CLAIMS = Ref(
    group="resource.k8s.io", version="v1", plural="resourceclaims", namespaced=True
)


def dra_spec(
    allocation_id: str, devices: Sequence[str], *, namespace: str = "ml", **overrides: Any
) -> dict[str, Any]:
    """A ``kubernetesApi: dra`` DeviceAllocation spec of a Reservation in ``namespace``."""
    return allocation_spec(
        allocation_id,
        devices,
        kubernetesApi="dra",
        reservationNamespace=namespace,
        **overrides,
    )


@dataclass
class DraNode:
    node: Node
    kube: KubeApi
    kubelet: DraKubelet
    client: KubeClient

    @property
    def checkpoint(self) -> Path:
        return self.node.root / "state" / "dra-claims.json"

    def setup(self) -> DraSetup:
        return DraSetup(
            reader=draserving.KubeClaimReader(self.client),
            plugins_dir=self.node.root / "kplugins",
            registry_dir=self.node.root / "registry",
            checkpoint=self.checkpoint,
        )

    @contextlib.asynccontextmanager
    async def agent(
        self, *, inventory_source: InventorySource | None = None
    ) -> AsyncIterator[Node]:
        """The node plugin running with DRA on, registered with the DRA kubelet."""
        self.node.plugin = self.node.make_plugin(
            dra=self.setup(), inventory_source=inventory_source
        )
        before = self.kubelet.accepted()
        async with self.node.plugin.running():
            await self.kubelet.wait_registered(dra.DRIVER, after=before)
            yield self.node
        self.node.plugin = None

    async def claim(
        self,
        namespace: str,
        name: str,
        devices: Sequence[str] = (),
        *,
        pool: str = NODE,
        driver: str = dra.DRIVER,
        allocated: bool = True,
        request: str = "gpus",
    ) -> Claim:
        """A ResourceClaim in the API, allocated (as the scheduler writes it) ``devices``
        (device ids, named in the slice by ``kube.dra.device_name``) from ``pool``."""
        if await self.kube.get(NAMESPACES, None, namespace) is None:
            await self.kube.create(
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
            )
        body: dict[str, Any] = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"namespace": namespace, "name": name},
            "spec": {
                "devices": {
                    "requests": [{"name": "gpus", "exactly": {"deviceClassName": dra.DEVICE_CLASS}}]
                }
            },
        }
        created = await self.kube.create(body)
        if allocated:
            results = [
                {"request": request, "driver": driver, "pool": pool, "device": dra.device_name(d)}
                for d in devices
            ]
            await self.kube.patch(
                RESOURCE_CLAIMS,
                namespace,
                name,
                {"status": {"allocation": {"devices": {"results": results}}}},
                status=True,
            )
        return Claim(namespace=namespace, name=name, uid=created["metadata"]["uid"])


async def wait_report(
    node: Node,
    allocation_id: str,
    predicate: Callable[[dict[str, Any]], bool],
    *,
    within: float = 3.0,
) -> dict[str, Any]:
    """The allocation's last report once ``predicate`` holds for it."""
    async with asyncio.timeout(within):
        while True:
            last = node.reporter.last(allocation_id)
            if last is not None and predicate(last):
                return last
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def dra_node(node: Node, kube: KubeApi, *, speaks: Sequence[str] = ("v1", "v1beta1")):
    """``node`` (the kubelet stand-ins running) with the DRA kubelet and a client of ``kube``;
    ResourceClaims declared in the stand-in with their status subresource."""
    kube.emulator.declare(RESOURCE_CLAIMS, kind="ResourceClaim", status_subresource=True)
    kubelet = DraKubelet(node.root / "registry", speaks=tuple(speaks))
    config, _ = kube_config(api_server=kube.url, api_token=TOKEN)
    await kubelet.start()
    try:
        async with KubeClient(config) as client:
            yield DraNode(node=node, kube=kube, kubelet=kubelet, client=client)
    finally:
        await kubelet.stop()
