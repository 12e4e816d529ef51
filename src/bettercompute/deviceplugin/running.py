"""The node agent put together: converger, device-plugin servers, DRA plugin, registration.

Why it exists: the pieces depend on each other in one order that is easy to get wrong. The
allocations must be rebuilt (one successful converger pass over the desired list and the files
on disk) before any server registers, so the kubelet's first ListAndWatch message is already the
full list after a restart, rather than an empty list followed by the real one. Then the
converger, the inventory watch and the registrar run side by side until cancelled. With DRA on
(``DraSetup``) the DRA plugin (``draserving``) and its plugin-watcher registration
(``draregistering``) start only after that rebuild too: a restarted kubelet prepares its claims
again at once, and a claim asked before the node knows its allocations would be refused.

The DaemonSet's entry point (the Kubernetes adapter, which implements the two ports of
``converging``) builds a ``NodePlugin`` and runs it; the tests and ``bench/deviceplugin.py`` run
the same object against kubelet stand-ins.

What it must never do: decide anything itself: it wires and orders; the rules live in
``converging``, ``allocations`` and ``serving``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from bettercompute.deviceplugin import (
    converging,
    draregistering,
    draserving,
    inventory,
    serving,
    signing,
)
from bettercompute.deviceplugin.allocations import RESOURCES, Allocations
from bettercompute.deviceplugin.cgroups import Cgroups
from bettercompute.deviceplugin.converging import Converger, DesiredAllocations, StatusReporter
from bettercompute.deviceplugin.devicefiles import DeviceFiles
from bettercompute.deviceplugin.draclaims import CheckpointError, ClaimFiles, PreparedClaims
from bettercompute.deviceplugin.draregistering import DraRegistrar
from bettercompute.deviceplugin.draserving import ClaimReader, DraServer, Preparer
from bettercompute.deviceplugin.metrics import DevicePluginMetrics
from bettercompute.deviceplugin.podresources import PodHolders, PodResourcesClient
from bettercompute.deviceplugin.registering import Registrar
from bettercompute.deviceplugin.serving import PluginServer

log = logging.getLogger(__name__)
#: How long after an Allocate the converger asks PodResources who holds what.
ALLOCATE_SETTLE_S = 0.3


@dataclasses.dataclass(frozen=True)
class DraSetup:
    """What the DRA plugin needs: how to read a claim, the kubelet's folders, and where its
    checkpoint of prepared claims lives (None: in memory only, for tests)."""

    reader: ClaimReader
    plugins_dir: Path = draserving.KUBELET_PLUGINS_DIR
    registry_dir: Path = draregistering.KUBELET_REGISTRY_DIR
    checkpoint: Path | None = None


class NodePlugin:
    """Everything the node runs for the kubelet, over one ``Allocations``."""

    def __init__(
        self,
        *,
        node_name: str,
        inventory_source: inventory.InventorySource,
        desired: DesiredAllocations,
        reporter: StatusReporter,
        key: signing.NodeKey,
        files: DeviceFiles,
        registry: CollectorRegistry,
        plugin_dir: Path = serving.DEVICE_PLUGIN_DIR,
        pods: PodHolders | None = None,
        pass_seconds: float = converging.PASS_SECONDS,
        inventory_interval_s: float = 5.0,
        register_poll_seconds: float = 0.1,
        retry_on: tuple[type[Exception], ...] = (OSError,),
        certificate: Callable[[], str | None] | None = None,
        cgroups: Cgroups | None = None,
        no_limits_reason: str = "this node does not enforce host limits",
        warnings: converging.PodWarnings | None = None,
        dra: DraSetup | None = None,
    ) -> None:
        self.allocations = Allocations()
        #: DRA (None: off): the claims prepared here, their service and its registration.
        #: Loading the checkpoint may raise ``draclaims.CheckpointError``.
        self.claims: PreparedClaims | None = None
        self.dra_registrar: DraRegistrar | None = None
        self.claim_files = ClaimFiles(files.cdi_dir)
        if dra is not None:
            self.claims = PreparedClaims.load(dra.checkpoint)
            preparer = Preparer(
                node_name=node_name,
                allocations=self.allocations,
                claims=self.claims,
                reader=dra.reader,
                files=self.claim_files,
                changed=lambda: self.converger.wake(),
            )
            self.dra_registrar = DraRegistrar(
                server=DraServer(preparer=preparer, path=draserving.socket_path(dra.plugins_dir)),
                registry_dir=dra.registry_dir,
                poll_seconds=register_poll_seconds,
            )
        self.metrics = DevicePluginMetrics(registry=registry, allocations=self.allocations)
        self.servers = [
            PluginServer(
                resource=resource,
                allocations=self.allocations,
                plugin_dir=plugin_dir,
                metrics=self.metrics,
                allocated=self._allocated,
            )
            for resource in RESOURCES
        ]
        self.registrar = Registrar(
            servers=self.servers,
            plugin_dir=plugin_dir,
            poll_seconds=register_poll_seconds,
            own_resources=self.allocations.own_resources,
            make_server=lambda resource: PluginServer(
                resource=resource,
                allocations=self.allocations,
                plugin_dir=plugin_dir,
                metrics=self.metrics,
                allocated=self._allocated,
            ),
        )
        self.converger = Converger(
            node_name=node_name,
            allocations=self.allocations,
            files=files,
            inventory_source=inventory_source,
            pods=pods if pods is not None else PodResourcesClient(),
            desired=desired,
            reporter=reporter,
            key=key,
            certificate=certificate,
            pass_seconds=pass_seconds,
            retry_on=retry_on,
            cgroups=cgroups,
            no_limits_reason=no_limits_reason,
            warnings=warnings,
            claims=self.claims,
        )
        self.inventory_interval_s = inventory_interval_s
        self._retryable: tuple[type[Exception], ...] = (*retry_on, inventory.InventoryError)
        #: Set once the allocations are rebuilt and the servers may register.
        self.rebuilt = asyncio.Event()

    def _allocated(self) -> None:
        # The kubelet records which pod got the devices once Allocate has answered: look a
        # moment later, not at once.
        asyncio.get_running_loop().call_later(ALLOCATE_SETTLE_S, self.converger.wake)

    async def run(self) -> None:
        """Rebuild, then converge, watch the inventory and stay registered, until cancelled."""
        while True:
            try:
                await self.converger.sync_once()
                break
            except self._retryable as e:
                log.warning("cannot rebuild the node's allocations yet, retrying: %s", e)
                await asyncio.sleep(self.converger.pass_seconds)
        self.rebuilt.set()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.converger.follow_inventory(interval_s=self.inventory_interval_s))
            tasks.create_task(self.converger.run())
            tasks.create_task(self.registrar.run())
            if self.dra_registrar is not None:
                tasks.create_task(self._serve_dra(self.dra_registrar))

    async def _serve_dra(self, registrar: DraRegistrar) -> None:
        claims = [] if self.claims is None else self.claims.all()
        try:  # the specs of the prepared claims, and of no other
            await asyncio.to_thread(self.claim_files.match, claims)
        except CheckpointError as e:
            log.warning("%s; written again when the kubelet prepares the claim", e)
        await registrar.run()

    async def stop_servers(self) -> None:
        """Stop every server this plugin runs (idempotent)."""
        for server in self.servers:
            await server.stop()
        if self.dra_registrar is not None:
            await self.dra_registrar.stop()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[NodePlugin]:
        """Run in the background for the block's duration, then stop every server."""
        task = asyncio.create_task(self.run(), name="node-plugin")
        try:
            rebuilt = asyncio.create_task(self.rebuilt.wait())
            done, _ = await asyncio.wait({task, rebuilt}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                rebuilt.cancel()
                task.result()  # the run ended early: raise its error here
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self.stop_servers()
