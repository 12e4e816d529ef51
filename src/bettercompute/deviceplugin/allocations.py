"""The node's allocations, what they advertise to the kubelet, and who owns which device.

Why it exists: the converger (``converging``) decides what the node holds; the three gRPC
servers (``serving``) tell the kubelet. This module is the one place both look at: each
allocation with its phase (binding → bound → releasing → released), the device → allocation
ownership that keeps a device from being handed out twice, the inventory that says each device's
health, NUMA node and NVLink domain, and a version counter that ListAndWatch streams wait on.

Only a ``kubernetes`` binding's bound devices are advertised: under the reservation's own
resource (``spec.resourceName``, ``bcd.dev/rsv-…``, pod access ``reservation``), whose endpoint
exists while any allocation of it owns its devices (``own_resources``), or else under the shared
resource of its class: ``bcd.dev/gpu`` (id: the GPU UUID), ``bcd.dev/gpu.mig`` (the MIG UUID)
and ``bcd.dev/gpu.slot`` (``<gpu uuid>::<k>``). A device is advertised, and handed out, under
exactly one name. A ``dra`` allocation (``is_dra``: its pods reach it through ResourceClaims) is
never advertised here, under any name: the node's ResourceSlice and the DRA plugin
(``draslices``, ``draclaims``) are its only way to pods. Once a release starts the devices are
gone from the next list at once, although the allocation still owns them (and its own endpoint
stays) until no pod holds them.

Host admission (``host_shortfall``): the limits of every allocation that owns its devices
(``hold`` and ``kubernetes`` alike, releasing ones included, since their workload may still run)
plus a new one's must fit in the CPUs, memory and 1 GiB huge pages the inventory gives the node.
A resource the inventory does not size is not checked: the control plane books none of it there.

What it must never do: I/O of any kind (files, sockets, the kubelet). It is plain data plus an
``asyncio.Event`` per version, so every rule here is testable without a server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections.abc import Iterable, Sequence

from bettercompute.deviceplugin.cgroups import GIB
from bettercompute.deviceplugin.devicefiles import Allocation
from bettercompute.deviceplugin.inventory import Inventory
from bettercompute.kube.dra import API_DRA
from bettercompute.kube.names import RESOURCE_NAMES


class Phase(enum.Enum):
    BINDING = "binding"  # owns its devices; files being written; not advertised yet
    BOUND = "bound"  # advertised (a kubernetes binding)
    RELEASING = "releasing"  # not advertised; still owns its devices while pods hold them
    RELEASED = "released"  # owns nothing; kept until the desired list forgets it


#: Phases in which an allocation owns its devices.
OWNING = frozenset({Phase.BINDING, Phase.BOUND, Phase.RELEASING})


def is_dra(allocation: Allocation) -> bool:
    """Whether pods reach ``allocation`` through ResourceClaims (``kubernetesApi: dra``)
    rather than the device plugin."""
    return allocation.binding == "kubernetes" and allocation.kubernetes_api == API_DRA


@dataclasses.dataclass(frozen=True)
class Resource:
    """One extended resource the node advertises, and the socket its server listens on."""

    name: str
    device_class: str
    socket_name: str


RESOURCES = (
    Resource(name=RESOURCE_NAMES["gpu"], device_class="gpu", socket_name="bcd-gpu.sock"),
    Resource(name=RESOURCE_NAMES["mig"], device_class="mig", socket_name="bcd-gpu-mig.sock"),
    Resource(name=RESOURCE_NAMES["slot"], device_class="slot", socket_name="bcd-gpu-slot.sock"),
)
RESOURCE_BY_NAME = {resource.name: resource for resource in RESOURCES}
#: The socket of a reservation's own resource: ``bcd-rsv-<the name's suffix>.sock``.
OWN_SOCKET_PREFIX = "bcd-rsv-"


def own_resource(name: str, device_class: str) -> Resource:
    """The endpoint of a reservation's own resource (``bcd.dev/rsv-…``, pod access
    ``reservation``): one socket per name, so every allocation of the reservation on this node
    is advertised under it."""
    suffix = name.rsplit("/", 1)[-1].removeprefix("rsv-")
    return Resource(
        name=name, device_class=device_class, socket_name=f"{OWN_SOCKET_PREFIX}{suffix}.sock"
    )


@dataclasses.dataclass(frozen=True)
class AdvertisedDevice:
    """One device as the kubelet sees it, plus what GetPreferredAllocation groups by."""

    device_id: str
    healthy: bool
    numa_node: int | None
    allocation_id: str
    parent_gpu: str
    nvlink_domain: str | None
    gpu_index: int | None


@dataclasses.dataclass
class Held:
    """One allocation the node knows, and where it stands."""

    allocation: Allocation
    phase: Phase
    releasing_since_ms: int | None = None
    pods: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Conflict:
    """A device of a new allocation that another allocation still owns."""

    device_id: str
    owner: str
    owner_phase: Phase


class Allocations:
    """The node's allocations. Every change bumps ``version`` and wakes ``wait_changed``."""

    def __init__(self) -> None:
        self._held: dict[str, Held] = {}
        self._owner: dict[str, str] = {}  # device id -> allocation id
        self._inventory: Inventory | None = None
        self.version = 0
        self._changed = asyncio.Event()

    # --- reading ------------------------------------------------------------------------

    @property
    def inventory(self) -> Inventory | None:
        return self._inventory

    def get(self, allocation_id: str) -> Held | None:
        return self._held.get(allocation_id)

    def all(self) -> list[Held]:
        return list(self._held.values())

    def owner_of(self, device_id: str) -> Held | None:
        allocation_id = self._owner.get(device_id)
        return None if allocation_id is None else self._held[allocation_id]

    def count(self, phase: Phase) -> int:
        return sum(1 for held in self._held.values() if held.phase is phase)

    def conflicts(self, allocation: Allocation) -> list[Conflict]:
        """Devices of ``allocation`` that another allocation owns."""
        found = []
        for device_id in allocation.device_ids:
            owner = self.owner_of(device_id)
            if owner is not None and owner.allocation.allocation_id != allocation.allocation_id:
                found.append(
                    Conflict(
                        device_id=device_id,
                        owner=owner.allocation.allocation_id,
                        owner_phase=owner.phase,
                    )
                )
        return found

    def host_shortfall(self, allocation: Allocation) -> str | None:
        """Why ``allocation``'s limits do not fit beside the other allocations' on this
        node's host, or None when they fit (or it has none)."""
        limits = allocation.limits
        if limits is None or self._inventory is None:
            return None
        others = [
            held.allocation.limits
            for held in self._held.values()
            if held.phase in OWNING
            and held.allocation.allocation_id != allocation.allocation_id
            and held.allocation.limits is not None
        ]
        inventory = self._inventory
        checks = (
            ("CPU", "cpu_millis", None if inventory.vcpu is None else inventory.vcpu * 1000, "m"),
            (
                "memory",
                "memory_bytes",
                None if inventory.memory_gib is None else inventory.memory_gib * GIB,
                " bytes",
            ),
            ("1 GiB huge pages", "hugepages_1gi", inventory.hugepages_1gi, ""),
        )
        short = []
        for label, attr, capacity, unit in checks:
            asked = getattr(limits, attr) or 0
            if not asked or capacity is None:
                continue
            used = sum(getattr(other, attr) or 0 for other in others)
            if used + asked > capacity:
                free = max(0, capacity - used)
                short.append(
                    f"{label}: {asked}{unit} asked, {free}{unit} of {capacity}{unit} free "
                    f"beside {len(others)} other allocation(s)"
                )
        return "; ".join(short) or None

    def slice_owner(self, allocation: Allocation) -> str | None:
        """Another owning allocation whose cgroup slice has ``allocation``'s name."""
        name = allocation.cgroup_parent
        if name is None:
            return None
        for held in self._held.values():
            other = held.allocation
            if (
                held.phase in OWNING
                and other.allocation_id != allocation.allocation_id
                and other.cgroup_parent == name
            ):
                return other.allocation_id
        return None

    def slices_in_use(self) -> set[str]:
        """The cgroup slices of allocations that own their devices."""
        return {
            held.allocation.cgroup_parent
            for held in self._held.values()
            if held.phase in OWNING and held.allocation.cgroup_parent is not None
        }

    def advertised(self, resource: Resource) -> list[AdvertisedDevice]:
        """The complete device list of ``resource``, in a stable order."""
        devices: list[AdvertisedDevice] = []
        for held in self._held.values():
            allocation = held.allocation
            if (
                held.phase is Phase.BOUND
                and allocation.binding == "kubernetes"
                and not is_dra(allocation)
                and allocation.resource_name == resource.name
            ):
                devices.extend(_describe(allocation, self._inventory))
        return sorted(devices, key=lambda d: d.device_id)

    def own_resources(self) -> list[Resource]:
        """The reservations' own resources to serve: those of every ``kubernetes`` allocation
        that still owns its devices. A releasing one keeps its endpoint while pods hold the
        devices (it advertises nothing by then); it goes once the release is confirmed."""
        found = {
            held.allocation.own_resource: held.allocation.device_class
            for held in self._held.values()
            if held.phase in OWNING
            and held.allocation.binding == "kubernetes"
            and not is_dra(held.allocation)
            and held.allocation.own_resource is not None
        }
        return [own_resource(name, found[name]) for name in sorted(found)]

    async def wait_changed(self, *, after: int) -> int:
        """Return the version once it is past ``after`` (at once if it already is)."""
        while self.version <= after:
            await self._changed.wait()
        return self.version

    # --- changing -----------------------------------------------------------------------

    def set_inventory(self, inventory: Inventory) -> None:
        if inventory != self._inventory:
            self._inventory = inventory
            self._bump()

    def start_binding(self, allocation: Allocation) -> Held:
        """Take ownership of the devices, not yet advertised. Refuses a device another
        allocation owns: the caller checks ``conflicts`` first."""
        taken = self.conflicts(allocation)
        if taken:
            raise ValueError(f"devices owned elsewhere: {taken}")
        held = Held(allocation=allocation, phase=Phase.BINDING)
        self._held[allocation.allocation_id] = held
        for device_id in allocation.device_ids:
            self._owner[device_id] = allocation.allocation_id
        self._bump()
        return held

    def mark_bound(self, allocation_id: str) -> None:
        self._set_phase(allocation_id, Phase.BOUND)

    def start_release(self, allocation_id: str, *, since_ms: int) -> None:
        """Stop advertising at once; the devices stay owned until ``mark_released``."""
        held = self._held[allocation_id]
        if held.phase in (Phase.RELEASING, Phase.RELEASED):
            return
        held.releasing_since_ms = since_ms
        self._set_phase(allocation_id, Phase.RELEASING)

    def set_pods(self, allocation_id: str, pods: Iterable[str]) -> None:
        self._held[allocation_id].pods = tuple(pods)

    def mark_released(self, allocation_id: str) -> None:
        self._disown(allocation_id)
        self._set_phase(allocation_id, Phase.RELEASED)

    def forget(self, allocation_id: str) -> None:
        """Drop an allocation entirely (released and gone from the desired list, or a bind
        that failed before anything was advertised)."""
        if allocation_id in self._held:
            self._disown(allocation_id)
            del self._held[allocation_id]
            self._bump()

    def _disown(self, allocation_id: str) -> None:
        for device_id in self._held[allocation_id].allocation.device_ids:
            if self._owner.get(device_id) == allocation_id:
                del self._owner[device_id]

    def _set_phase(self, allocation_id: str, phase: Phase) -> None:
        held = self._held[allocation_id]
        if held.phase is not phase:
            held.phase = phase
            self._bump()

    def _bump(self) -> None:
        self.version += 1
        self._changed.set()
        # Waiters hold the event they waited on; the next change wakes the next ones.
        self._changed = asyncio.Event()


def _describe(allocation: Allocation, inventory: Inventory | None) -> list[AdvertisedDevice]:
    gpus = {} if inventory is None else {gpu.uuid: gpu for gpu in inventory.gpus}
    domains = {} if inventory is None else _domain_of(inventory)
    migs = {} if inventory is None else {mig.uuid: mig for gpu in inventory.gpus for mig in gpu.mig}
    described = []
    for device_id, parent in zip(allocation.device_ids, allocation.parent_gpus, strict=True):
        gpu = gpus.get(parent)
        present = gpu is not None and (allocation.device_class != "mig" or device_id in migs)
        described.append(
            AdvertisedDevice(
                device_id=device_id,
                # A device the inventory no longer shows cannot be healthy.
                healthy=present and gpu is not None and gpu.healthy,
                numa_node=None if gpu is None else gpu.numa_node,
                allocation_id=allocation.allocation_id,
                parent_gpu=parent,
                nvlink_domain=domains.get(parent),
                gpu_index=None if gpu is None else gpu.index,
            )
        )
    return described


def _domain_of(inventory: Inventory) -> dict[str, str]:
    return {uuid: domain for domain, uuids in inventory.nvlink_domains.items() for uuid in uuids}


def inventory_problems(*, inventory: Inventory, allocation: Allocation) -> list[str]:
    """Why ``allocation`` cannot be delivered by this node's inventory (empty: it can).

    A GPU is named by its UUID and is its own parent; a MIG instance by its UUID, under the
    parent the inventory gives it; a slot is ``<gpu uuid>::<k>`` of a GPU the node has.
    """
    gpus = {gpu.uuid for gpu in inventory.gpus}
    mig_parent = {mig.uuid: gpu.uuid for gpu in inventory.gpus for mig in gpu.mig}
    problems = []
    pairs: Sequence[tuple[str, str]] = list(
        zip(allocation.device_ids, allocation.parent_gpus, strict=True)
    )
    for device_id, parent in pairs:
        if allocation.device_class == "gpu":
            if device_id not in gpus:
                problems.append(f"GPU {device_id} is not in this node's inventory")
            elif parent != device_id:
                problems.append(f"GPU {device_id} is given parent {parent}, not itself")
        elif allocation.device_class == "mig":
            if device_id not in mig_parent:
                problems.append(f"MIG device {device_id} is not in this node's inventory")
            elif mig_parent[device_id] != parent:
                problems.append(
                    f"MIG device {device_id} belongs to {mig_parent[device_id]}, not {parent}"
                )
        else:
            gpu_uuid, separator, k = device_id.rpartition("::")
            if not separator or not (k.isascii() and k.isdigit()) or gpu_uuid != parent:
                problems.append(f"slot {device_id} is not '<parent gpu uuid>::<k>' of {parent}")
            elif gpu_uuid not in gpus:
                problems.append(f"slot {device_id}: GPU {gpu_uuid} is not in this node's inventory")
    return problems


def resource_of(allocation: Allocation) -> Resource:
    if allocation.own_resource is not None:
        return own_resource(allocation.own_resource, allocation.device_class)
    return RESOURCE_BY_NAME[RESOURCE_NAMES[allocation.device_class]]
