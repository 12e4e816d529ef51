"""This node's ResourceSlices for the DRA driver ``gpu.bcd.dev``: what the scheduler may allocate.

Why it exists: with Dynamic Resource Allocation the kube-scheduler allocates a ResourceClaim
from the devices drivers publish as ResourceSlices (``resource.k8s.io/v1``); the kubelet only
prepares what was allocated. For a pool whose policy says ``kubernetes: {api: dra}``, the
operator's DeviceAllocation says ``kubernetesApi: dra`` and this module publishes the bound
devices of such allocations, so the scheduler can give them to the reservation's claims and to
nothing else.

What is published, and why only that:

- **Only bound devices of a ``dra`` allocation**, never an unbooked one. The guide's promise is
  that a device reaches pods only through a booking; a device in a slice is allocatable by any
  claim the admission policy lets through, so an unbooked device is left out rather than
  published with a taint (device taints are an alpha feature, off by default in 1.34, and a
  toleration in a claim would undo one). A device leaves the slice the moment its allocation
  starts releasing, as it leaves the device plugin's list.
- **One device per atom** (a whole GPU, a MIG instance, a time-slice slot), named
  ``kube.dra.device_name(id)``, with the attributes a user can select on: ``uuid``, ``class``,
  ``productName``, ``migProfile`` and ``parentUuid`` (a MIG instance or a slot), ``nvlinkDomain``,
  ``numaNode``, and the booking's ``reservation`` and ``namespace``; capacity ``memory``. The
  claim template the operator writes selects ``namespace`` and ``reservation``, and the chart's
  admission policy makes every claim for our class select its own ``namespace``.
- **One pool per node**, named after the node, in as few slices as the API's limit of 128
  devices per slice allows (``<node>-gpu.bcd.dev``, then ``-1``, ``-2``…). Every change bumps
  the pool's generation, which tells the scheduler to ignore slices of an older one. An empty
  pool is published as one slice without devices, so "nothing bound" is a fact the API shows.

``slices`` is the pure function; ``SlicePublisher`` keeps the API equal to it: at once, and
within a watch-free wait on ``Allocations`` of every change. It reads what is there on start, so
a restarted agent continues the generation instead of starting again at 1.

What it must never do: publish a device that is not bound under a ``dra`` allocation, write a
slice of another node (the chart's admission policy refuses that too), or stop the agent
because the API is down (it says so once and retries with backoff).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from bettercompute.deviceplugin.allocations import Allocations, Held, Phase, is_dra
from bettercompute.deviceplugin.inventory import Gpu, Inventory
from bettercompute.deviceplugin.watching import Backoff
from bettercompute.kube import dra, resources
from bettercompute.kube.client import KubeClient, KubeError

log = logging.getLogger(__name__)

API_VERSION = "resource.k8s.io/v1"
#: The API's limit on devices in one ResourceSlice (``ResourceSliceMaxDevices``).
MAX_DEVICES_PER_SLICE = 128
#: Attribute strings are at most 64 characters in the API.
_MAX_STRING = 64
_MIG_MEMORY = re.compile(r"^[0-9]+g\.([0-9]+)gb")


def published(allocations: Iterable[Held]) -> list[Held]:
    """The allocations whose devices belong in the slices: bound ``dra`` ones."""
    return [held for held in allocations if held.phase is Phase.BOUND and is_dra(held.allocation)]


def devices(held: Sequence[Held], inventory: Inventory | None) -> list[dict[str, Any]]:
    """The slice devices of ``held``, sorted by name."""
    gpus = {} if inventory is None else {gpu.uuid: gpu for gpu in inventory.gpus}
    domains = (
        {}
        if inventory is None
        else {uuid: name for name, uuids in inventory.nvlink_domains.items() for uuid in uuids}
    )
    migs = {} if inventory is None else {m.uuid: m for gpu in inventory.gpus for m in gpu.mig}
    out: list[dict[str, Any]] = []
    for one in held:
        allocation = one.allocation
        for device_id, parent in zip(allocation.device_ids, allocation.parent_gpus, strict=True):
            gpu = gpus.get(parent)
            attributes: dict[str, dict[str, Any]] = {
                dra.ATTR_UUID: _string(device_id),
                dra.ATTR_CLASS: _string(allocation.device_class),
                dra.ATTR_RESERVATION: _string(allocation.reservation_id),
            }
            if allocation.namespace is not None:
                attributes[dra.ATTR_NAMESPACE] = _string(allocation.namespace)
            if allocation.device_class != "gpu":
                attributes[dra.ATTR_PARENT_UUID] = _string(parent)
            mig = migs.get(device_id)
            if mig is not None:
                attributes[dra.ATTR_MIG_PROFILE] = _string(mig.profile)
            if gpu is not None:
                attributes[dra.ATTR_PRODUCT] = _string(gpu.model)
                if gpu.numa_node is not None:
                    attributes[dra.ATTR_NUMA_NODE] = {"int": gpu.numa_node}
            if parent in domains:
                attributes[dra.ATTR_NVLINK_DOMAIN] = _string(domains[parent])
            device: dict[str, Any] = {
                "name": dra.device_name(device_id),
                "attributes": attributes,
            }
            memory = _memory_mib(allocation.device_class, gpu, None if mig is None else mig.profile)
            if memory is not None:
                device["capacity"] = {dra.CAPACITY_MEMORY: {"value": f"{memory}Mi"}}
            out.append(device)
    return sorted(out, key=lambda d: str(d["name"]))


def slices(
    *, node_name: str, generation: int, published_devices: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The ResourceSlice objects of this node's pool at ``generation``."""
    chunks = [
        list(published_devices[i : i + MAX_DEVICES_PER_SLICE])
        for i in range(0, len(published_devices), MAX_DEVICES_PER_SLICE)
    ] or [[]]
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {
                "name": slice_name(node_name, index),
                "labels": {dra.MANAGED_BY_LABEL: "bcd-node-agent"},
            },
            "spec": {
                "driver": dra.DRIVER,
                "nodeName": node_name,
                "pool": {
                    "name": node_name,
                    "generation": generation,
                    "resourceSliceCount": len(chunks),
                },
                "devices": chunk,
            },
        }
        for index, chunk in enumerate(chunks)
    ]


def slice_name(node_name: str, index: int) -> str:
    base = dra.slice_name(node_name)
    return base if index == 0 else f"{base}-{index}"


def _string(value: str) -> dict[str, str]:
    return {"string": value[:_MAX_STRING]}


def _memory_mib(device_class: str, gpu: Gpu | None, mig_profile: str | None) -> int | None:
    if mig_profile is not None:
        found = _MIG_MEMORY.match(mig_profile)
        return None if found is None else int(found.group(1)) * 1024
    if device_class == "gpu" and gpu is not None:
        return gpu.memory_mib
    return None  # a slot shares its GPU's memory with the other slots: no capacity of its own


class SlicePublisher:
    """Keeps this node's ResourceSlices equal to its bound ``dra`` devices."""

    def __init__(
        self,
        *,
        client: KubeClient,
        node_name: str,
        registry: CollectorRegistry,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.node_name = node_name
        self.backoff = backoff or Backoff(initial_s=0.2, max_s=10.0)
        self.clock = clock
        self.generation: int | None = None
        self._written: list[dict[str, Any]] | None = None
        self._names: set[str] = set()
        self._last_problem = ""
        self.publish_seconds = Histogram(
            "bettercompute_node_resourceslice_publish_seconds",
            "From an allocation change to this node's ResourceSlices saying it",
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.failures = Counter(
            "bettercompute_node_resourceslice_publish_failures",
            "ResourceSlice writes that failed (they are retried)",
            registry=registry,
        )

    async def publish(self, wanted: list[dict[str, Any]]) -> None:
        """Write the pool as ``wanted`` devices at the next generation, unless it already is."""
        if self.generation is None:
            await self._adopt()
        if wanted == self._written:
            return
        generation = (self.generation or 0) + 1
        objects = slices(node_name=self.node_name, generation=generation, published_devices=wanted)
        for body in objects:
            await self._put(body)
        names = {str(body["metadata"]["name"]) for body in objects}
        for stale in sorted(self._names - names):
            await self.client.delete(resources.RESOURCE_SLICES, stale)
        self.generation, self._written, self._names = generation, wanted, names
        log.info(
            "ResourceSlice %s: %d devices published (pool generation %d)",
            dra.slice_name(self.node_name),
            len(wanted),
            generation,
        )

    async def run(self, *, allocations: Allocations) -> None:
        """Publish now and after every change of ``allocations``, until cancelled."""
        while True:
            version = allocations.version
            changed_at = self.clock()
            wanted = devices(published(allocations.all()), allocations.inventory)
            try:
                await self.publish(wanted)
                self.publish_seconds.observe(self.clock() - changed_at)
                self.backoff.reset()
                self._last_problem = ""
                await allocations.wait_changed(after=version)
            except KubeError as e:
                self.failures.inc()
                delay = self.backoff.next()
                self._say(f"cannot write ResourceSlices of node {self.node_name}: {e}")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await allocations.wait_changed(after=version)

    async def _adopt(self) -> None:
        """Continue the generation of what an earlier run wrote (the names of its slices)."""
        found = await self.client.list(
            resources.RESOURCE_SLICES, labels={dra.MANAGED_BY_LABEL: "bcd-node-agent"}
        )
        generation = 0
        for item in found:
            spec = item.get("spec") or {}
            if spec.get("nodeName") != self.node_name or spec.get("driver") != dra.DRIVER:
                continue
            self._names.add(str(item["metadata"]["name"]))
            generation = max(generation, int((spec.get("pool") or {}).get("generation") or 0))
        self.generation = generation

    async def _put(self, body: dict[str, Any]) -> None:
        name = str(body["metadata"]["name"])
        current = await self.client.get(resources.RESOURCE_SLICES, name)
        if current is None:
            try:
                await self.client.create(resources.RESOURCE_SLICES, body)
                return
            except KubeError as e:
                if e.status != 409:
                    raise
                current = await self.client.get(resources.RESOURCE_SLICES, name) or {}
        version = (current.get("metadata") or {}).get("resourceVersion")
        replaced = dict(body, metadata=dict(body["metadata"], resourceVersion=version))
        await self.client.replace(resources.RESOURCE_SLICES, name, replaced)

    def _say(self, problem: str) -> None:
        if problem != self._last_problem:
            log.warning("%s (retrying)", problem)
            self._last_problem = problem
