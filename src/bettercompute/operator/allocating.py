"""DeviceAllocations: the nodes' desired state out, the nodes' reports in.

Out: for each node whose allocations changed, the node's desired allocations (the service's
``NodeService.desired``) become exactly the ``DeviceAllocation`` objects labelled with that
node: missing ones are created, changed ones patched (``spec.release`` when the reservation was
released, ``spec.until`` when it was extended), and ones the node no longer needs (released,
failed) deleted. A full pass over every node runs at start and every minute, so a lost hint
costs at most a minute.

In: a node's report in a DeviceAllocation's ``status`` goes to the core's report call with
``status.nodeName`` as the reporting node; the core ignores a report about an allocation of
another node. Each report is passed on once per (phase, reportedAt).

What it must never do: change a reservation itself. It only mirrors allocations and relays
reports; the reconciler judges them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from bettercompute.core.errors import ComputeError, StoreError
from bettercompute.kube import allocations, names, resources
from bettercompute.kube.client import KubeClient, KubeError
from bettercompute.kube.parsing import ShapeError
from bettercompute.service.nodes import NodeService
from bettercompute.service.reservations import ReservationService

log = logging.getLogger(__name__)


class AllocationSync:
    """Mirrors allocations onto DeviceAllocations in ``namespace`` and relays reports."""

    def __init__(
        self,
        *,
        service: ReservationService,
        nodes: NodeService,
        kube: KubeClient,
        namespace: str,
        resync_s: float = 60.0,
    ):
        self.service = service
        self.nodes = nodes
        self.kube = kube
        self.namespace = namespace
        self.resync_s = resync_s
        self._dirty_reservations: set[str] = set()
        self._dirty_nodes: set[str] = set()
        self._wake = asyncio.Event()
        self._relayed: dict[str, tuple[str, str]] = {}
        # The last shape error logged per allocation, so a bad status is logged once.
        self._malformed: dict[str, str] = {}

    def mark_reservation(self, rid: str) -> None:
        self._dirty_reservations.add(rid)
        self._wake.set()

    def mark_node(self, node: str) -> None:
        self._dirty_nodes.add(node)
        self._wake.set()

    async def sync_node(self, node: str) -> None:
        """Make ``node``'s DeviceAllocations exactly its desired allocations."""
        desired = {spec["allocationId"]: spec for spec in await self.nodes.desired(node)}
        existing = {
            (obj.get("spec") or {}).get("allocationId"): obj
            for obj in await self.kube.list(
                resources.DEVICE_ALLOCATIONS,
                namespace=self.namespace,
                labels={names.NODE_LABEL: node},
            )
        }
        for allocation_id, spec in desired.items():
            obj = existing.get(allocation_id)
            if obj is None:
                await self._create(allocations.allocation_manifest(spec, namespace=self.namespace))
                continue
            if {k: (obj.get("spec") or {}).get(k) for k in spec} != spec:
                await self.kube.patch(
                    resources.DEVICE_ALLOCATIONS,
                    obj["metadata"]["name"],
                    {"spec": spec},
                    namespace=self.namespace,
                )
        for allocation_id, obj in existing.items():
            if allocation_id not in desired:
                await self.kube.delete(
                    resources.DEVICE_ALLOCATIONS,
                    obj["metadata"]["name"],
                    namespace=self.namespace,
                )
                self._relayed.pop(str(allocation_id), None)
                self._malformed.pop(str(allocation_id), None)

    async def _create(self, manifest: Mapping[str, Any]) -> None:
        try:
            await self.kube.create(resources.DEVICE_ALLOCATIONS, manifest, namespace=self.namespace)
        except KubeError as e:
            if e.status != 409:  # another replica made it first: the same object
                raise

    async def relay(self, body: Mapping[str, Any]) -> str | None:
        """Pass a DeviceAllocation's report to the core once; the reservation id when it was
        accepted (so its status can be re-projected), else ``None``."""
        spec = body.get("spec") or {}
        status = body.get("status") or {}
        allocation_id = spec.get("allocationId")
        try:
            parsed = allocations.report(status)
        except ShapeError as e:
            if self._malformed.get(str(allocation_id)) != str(e):
                log.warning("DeviceAllocation %s: ignoring its status: %s", allocation_id, e)
                self._malformed[str(allocation_id)] = str(e)
            return None
        reporter = status.get("nodeName")
        if parsed is None or not allocation_id or not reporter:
            return None
        kind, details = parsed
        seen = (str(status.get("phase")), str(status.get("reportedAt") or ""))
        if self._relayed.get(allocation_id) == seen:
            return None
        accepted = await self.service.report(
            node_id=str(reporter), allocation_id=str(allocation_id), kind=kind, details=details
        )
        self._relayed[allocation_id] = seen
        if not accepted:
            log.info("ignored a %s report on %s from node %s", kind, allocation_id, reporter)
            return None
        if kind in ("released", "failed"):
            self.mark_node(str(spec.get("nodeName") or reporter))
        return str(spec.get("reservationId") or "") or None

    async def run(self) -> None:
        """Sync dirty nodes as hints arrive, and every node every ``resync_s``."""
        full = asyncio.create_task(self._resync_forever(), name="allocations-resync")
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                rids, self._dirty_reservations = self._dirty_reservations, set()
                nodes, self._dirty_nodes = self._dirty_nodes, set()
                for rid in rids:
                    with contextlib.suppress(ComputeError):
                        nodes.update(await self._guard(self.nodes.nodes_of(rid), default=[]))
                for node in sorted(nodes):
                    await self._guard(self.sync_node(node), default=None)
        finally:
            full.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await full

    async def _resync_forever(self) -> None:
        while True:
            for node in await self._guard(self.nodes.node_ids(), default=[]):
                self.mark_node(node)
            await asyncio.sleep(self.resync_s)

    @staticmethod
    async def _guard(call: Any, *, default: Any) -> Any:
        # A store or API outage must not end the loop: the next hint or pass retries.
        try:
            return await call
        except (KubeError, StoreError) as e:
            log.warning("device allocation sync: %s", e)
        except Exception:
            log.exception("device allocation sync failed")
        return default
