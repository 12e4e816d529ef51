"""What GPUs this node has: the inventory the device plugin advertises to the kubelet.

Why it exists: the device plugin must know each GPU's UUID, model, memory, NUMA node, NVLink
neighbours and MIG instances, and must notice when that changes without a restart. Two sources
stand behind one small ``InventorySource`` protocol:

- ``NvmlInventory`` asks the NVIDIA driver through NVML (``pynvml``, imported lazily so that a
  node or a laptop without the driver can still import this module);
- ``FileInventory`` reads a simulated inventory from a YAML or JSON file, for machines without
  a GPU (development, the simulator, tests).

Two wrappers add what the driver alone does not say, each in its own module and each an
``InventorySource`` around another: ``health.HealthChecked`` marks GPUs that reported a critical
XID unhealthy (``Gpu.problem`` says why), and ``nvidiacdi.WithNvidiaCdi`` names each GPU's
device in NVIDIA's CDI specs (``Inventory.nvidia_cdi``). Both are data here, so an inventory
change of any kind travels the one path: ``watch`` → ``Allocations`` → kubelet and GPUNode.

``watch`` polls a source and yields each new inventory. Every failure of a source is an
``InventoryError`` naming what failed and why; this module never lets an ``NVMLError``, a
``yaml.YAMLError`` or a pydantic ``ValidationError`` escape, and never talks to Kubernetes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import pydantic
import yaml

from bettercompute.core import hosts

log = logging.getLogger(__name__)

SYSFS_PCI_DEVICES = Path("/sys/bus/pci/devices")
SYSFS_HUGEPAGES_1GI = Path("/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages")
#: The CPUs the kernel isolates (``isolcpus``): a cpulist, empty when none are.
SYSFS_ISOLATED_CPUS = Path("/sys/devices/system/cpu/isolated")


class InventoryError(Exception):
    """A source could not say what GPUs the node has; the message names what and why."""


@dataclasses.dataclass(frozen=True)
class MigDevice:
    uuid: str
    profile: str  # e.g. "1g.10gb": GPU-instance slices and memory in GB
    parent_uuid: str
    #: NVML's MIG device index on its GPU (``nvmlDeviceGetMigDeviceHandleByIndex``): NVIDIA's
    #: CDI specs name the instance ``<gpu index>:<this>`` by index. None: not known.
    index: int | None = None


@dataclasses.dataclass(frozen=True)
class Gpu:
    uuid: str
    index: int
    model: str
    memory_mib: int
    numa_node: int | None = None
    # UUIDs of the GPUs this one has an active NVLink to; through an NVSwitch fabric that is
    # every other GPU on the fabric.
    nvlink_peers: tuple[str, ...] = ()
    healthy: bool = True
    mig: tuple[MigDevice, ...] = ()
    #: Why the GPU is unhealthy, when that is known (an NVML error, a critical XID).
    problem: str | None = None


@dataclasses.dataclass(frozen=True)
class NvidiaCdi:
    """The devices NVIDIA's CDI specs on the node give this node's GPUs (``nvidiacdi`` reads
    them): whether Allocate can ask the runtime for NVIDIA's device beside bcd's."""

    #: The folders that were searched; empty: nobody looked (a node without the option).
    searched: tuple[str, ...] = ()
    #: The spec files of kind ``nvidia.com/gpu`` found there.
    files: tuple[str, ...] = ()
    #: GPU or MIG UUID → NVIDIA's fully qualified device name (``nvidia.com/gpu=GPU-…``).
    names: tuple[tuple[str, str], ...] = ()
    #: GPUs and MIG instances of the inventory that no spec names (they go env-only).
    missing: tuple[str, ...] = ()
    #: Spec files that could not be read, each with the reason.
    problems: tuple[str, ...] = ()

    @property
    def found(self) -> bool:
        return bool(self.files)

    @property
    def complete(self) -> bool:
        """Specs exist and name every GPU and MIG instance of the inventory."""
        return self.found and not self.missing

    def name_of(self, uuid: str) -> str | None:
        for device, name in self.names:
            if device == uuid:
                return name
        return None

    def devices_for(self, uuids: Iterable[str]) -> list[str]:
        """NVIDIA's names for these GPUs or MIG instances, once each, in order; a device no
        spec names is left out (it gets the environment variable only)."""
        named = dict(self.names)
        return list(dict.fromkeys(named[u] for u in uuids if u in named))


@dataclasses.dataclass(frozen=True)
class Inventory:
    node_name: str
    gpus: tuple[Gpu, ...]
    vcpu: int | None = None
    memory_gib: int | None = None
    #: 1 GiB huge pages the host has reserved (``nr_hugepages`` of the 1 GiB size).
    hugepages_1gi: int | None = None
    #: The kernel's isolated CPUs, a cpulist (``2-5``): the control plane never takes the
    #: host's reserved CPUs from them.
    isolated_cpus: str | None = None
    #: NVIDIA's CDI devices for the GPUs; the default: nobody looked, env-only.
    nvidia_cdi: NvidiaCdi = NvidiaCdi()
    # Derived from ``gpus``, so neither compared nor hashed: domain id -> GPU UUIDs.
    nvlink_domains: Mapping[str, tuple[str, ...]] = dataclasses.field(
        init=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        domains = nvlink_domains(node_name=self.node_name, gpus=self.gpus)
        object.__setattr__(self, "nvlink_domains", domains)


class InventorySource(Protocol):
    def read(self) -> Inventory: ...


def nvlink_domains(*, node_name: str, gpus: Iterable[Gpu]) -> dict[str, tuple[str, ...]]:
    """The connected components of the NVLink peer graph, as ``{"<node>-nvlN": uuids}``.

    Links are treated as undirected (one side reporting it is enough) and peers that name no
    GPU of the node are ignored. A GPU without NVLink belongs to no domain. Domains are numbered
    by their smallest GPU index and list their GPUs by index, so the ids are stable across reads.
    """
    by_uuid = {gpu.uuid: gpu for gpu in gpus}
    parent = {uuid: uuid for uuid in by_uuid}

    def root(uuid: str) -> str:
        while parent[uuid] != uuid:
            parent[uuid] = parent[parent[uuid]]
            uuid = parent[uuid]
        return uuid

    linked: set[str] = set()
    for gpu in by_uuid.values():
        for peer in gpu.nvlink_peers:
            if peer in by_uuid and peer != gpu.uuid:
                linked.update((gpu.uuid, peer))
                parent[root(gpu.uuid)] = root(peer)
    components: dict[str, list[Gpu]] = {}
    for uuid in linked:
        components.setdefault(root(uuid), []).append(by_uuid[uuid])
    ordered = sorted(
        (sorted(members, key=lambda g: g.index) for members in components.values()),
        key=lambda members: members[0].index,
    )
    return {
        f"{node_name}-nvl{number}": tuple(gpu.uuid for gpu in members)
        for number, members in enumerate(ordered)
    }


# --- Simulated inventory files -------------------------------------------------------------


class _FileModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)


class _MigEntry(_FileModel):
    uuid: str = pydantic.Field(min_length=1)
    profile: str = pydantic.Field(pattern=r"^[1-9][0-9]*g\.[0-9]+gb(\+[a-z0-9]+)?$")
    index: int | None = pydantic.Field(default=None, ge=0)


class _GpuEntry(_FileModel):
    uuid: str = pydantic.Field(min_length=1)
    index: int = pydantic.Field(ge=0)
    model: str = pydantic.Field(min_length=1)
    memoryMiB: int = pydantic.Field(gt=0)
    numaNode: int | None = pydantic.Field(default=None, ge=0)
    nvlinkPeers: list[str] = []
    healthy: bool = True
    mig: list[_MigEntry] = []


class _InventoryFile(_FileModel):
    gpus: list[_GpuEntry]
    vcpu: int | None = pydantic.Field(default=None, gt=0)
    memoryGiB: int | None = pydantic.Field(default=None, gt=0)
    hugepages1Gi: int | None = pydantic.Field(default=None, ge=0)
    isolatedCpus: str | None = pydantic.Field(
        default=None, max_length=hosts.CPULIST_MAX_BYTES, pattern=r"^[0-9,\-]*$"
    )


def _location(loc: Iterable[int | str]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path or "(top level)"


def _cross_check(document: _InventoryFile) -> list[tuple[str, str]]:
    """Rules one entry cannot check alone: unique UUIDs and indexes, peers that exist."""
    problems: list[tuple[str, str]] = []
    seen_uuids: dict[str, str] = {}
    seen_indexes: dict[int, str] = {}
    for i, gpu in enumerate(document.gpus):
        where = f"gpus[{i}]"
        if gpu.uuid in seen_uuids:
            problems.append((f"{where}.uuid", f"{gpu.uuid!r} is also {seen_uuids[gpu.uuid]}"))
        seen_uuids.setdefault(gpu.uuid, f"{where}.uuid")
        if gpu.index in seen_indexes:
            problems.append((f"{where}.index", f"{gpu.index} is also {seen_indexes[gpu.index]}"))
        seen_indexes.setdefault(gpu.index, f"{where}.index")
        for j, mig in enumerate(gpu.mig):
            if mig.uuid in seen_uuids:
                problems.append(
                    (f"{where}.mig[{j}].uuid", f"{mig.uuid!r} is also {seen_uuids[mig.uuid]}")
                )
            seen_uuids.setdefault(mig.uuid, f"{where}.mig[{j}].uuid")
    gpu_uuids = {gpu.uuid for gpu in document.gpus}
    for i, gpu in enumerate(document.gpus):
        for j, peer in enumerate(gpu.nvlinkPeers):
            if peer == gpu.uuid:
                problems.append((f"gpus[{i}].nvlinkPeers[{j}]", "a GPU cannot be its own peer"))
            elif peer not in gpu_uuids:
                problems.append((f"gpus[{i}].nvlinkPeers[{j}]", f"no GPU has uuid {peer!r}"))
    return problems


class FileInventory:
    """A simulated inventory read from a YAML or JSON file (JSON when the name ends in .json)."""

    def __init__(self, *, path: Path, node_name: str) -> None:
        self.path = path
        self.node_name = node_name

    def _fail(self, where: str, reason: str) -> InventoryError:
        return InventoryError(f"{self.path}: {where}: {reason}")

    def read(self) -> Inventory:
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError as e:
            raise self._fail("(file)", f"cannot read: {e.strerror or e}") from e
        try:
            raw: object = json.loads(text) if self.path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise self._fail("(file)", f"not valid {self._format()}: {e}") from e
        if not isinstance(raw, dict):
            raise self._fail("(top level)", "must be a mapping with a 'gpus' list")
        try:
            document = _InventoryFile.model_validate(raw)
        except pydantic.ValidationError as e:
            reasons = "; ".join(f"{_location(err['loc'])}: {err['msg']}" for err in e.errors())
            raise InventoryError(f"{self.path}: {reasons}") from e
        problems = _cross_check(document)
        if problems:
            raise InventoryError(
                f"{self.path}: " + "; ".join(f"{where}: {reason}" for where, reason in problems)
            )
        return Inventory(
            node_name=self.node_name,
            gpus=tuple(
                Gpu(
                    uuid=entry.uuid,
                    index=entry.index,
                    model=entry.model,
                    memory_mib=entry.memoryMiB,
                    numa_node=entry.numaNode,
                    nvlink_peers=tuple(entry.nvlinkPeers),
                    healthy=entry.healthy,
                    mig=tuple(
                        MigDevice(
                            uuid=m.uuid, profile=m.profile, parent_uuid=entry.uuid, index=m.index
                        )
                        for m in entry.mig
                    ),
                )
                for entry in sorted(document.gpus, key=lambda g: g.index)
            ),
            vcpu=document.vcpu,
            memory_gib=document.memoryGiB,
            hugepages_1gi=document.hugepages1Gi,
            isolated_cpus=document.isolatedCpus or None,
        )

    def _format(self) -> str:
        return "JSON" if self.path.suffix == ".json" else "YAML"


def inventory_document(inventory: Inventory) -> dict[str, Any]:
    """The file form of an inventory, as ``FileInventory`` reads it back."""
    document: dict[str, Any] = {
        "gpus": [
            {
                "uuid": gpu.uuid,
                "index": gpu.index,
                "model": gpu.model,
                "memoryMiB": gpu.memory_mib,
                "numaNode": gpu.numa_node,
                "nvlinkPeers": list(gpu.nvlink_peers),
                "healthy": gpu.healthy,
                "mig": [_mig_entry(m) for m in gpu.mig],
            }
            for gpu in inventory.gpus
        ]
    }
    if inventory.vcpu is not None:
        document["vcpu"] = inventory.vcpu
    if inventory.memory_gib is not None:
        document["memoryGiB"] = inventory.memory_gib
    if inventory.hugepages_1gi is not None:
        document["hugepages1Gi"] = inventory.hugepages_1gi
    if inventory.isolated_cpus:
        document["isolatedCpus"] = inventory.isolated_cpus
    return document


def _mig_entry(mig: MigDevice) -> dict[str, Any]:
    entry: dict[str, Any] = {"uuid": mig.uuid, "profile": mig.profile}
    if mig.index is not None:
        entry["index"] = mig.index
    return entry


def write_inventory_file(*, path: Path, inventory: Inventory) -> None:
    """Write ``inventory`` as YAML (or JSON for a .json name), atomically.

    Atomic because a watcher may read the file at any moment: it must see the old inventory or
    the new one, never half of one.
    """
    document = inventory_document(inventory)
    if path.suffix == ".json":
        text = json.dumps(document, indent=2) + "\n"
    else:
        text = yaml.safe_dump(document, sort_keys=False)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)


# --- NVML --------------------------------------------------------------------------------


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases answer bytes, newer ones str.
    return value.decode() if isinstance(value, bytes) else value


def _sysfs_numa_node(bus_id: str) -> int | None:
    try:
        node = int((SYSFS_PCI_DEVICES / bus_id / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None  # the kernel writes -1 when it does not know


def _host_memory_gib() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // (1024 * 1024)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _host_isolated_cpus() -> str | None:
    """The kernel's isolated CPUs as it lists them; ``None`` when none are or it cannot say."""
    try:
        text = SYSFS_ISOLATED_CPUS.read_text()[: hosts.CPULIST_MAX_BYTES + 1].strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if text and hosts.parse_cpulist(text) else None


def _host_hugepages_1gi() -> int | None:
    """The 1 GiB huge pages the kernel holds; 0 when it has none of that size."""
    try:
        return int(SYSFS_HUGEPAGES_1GI.read_text().strip())
    except FileNotFoundError:
        return 0
    except (OSError, ValueError):
        return None


def bus_id(value: str | bytes) -> str:
    """NVML's "00000000:3B:00.0" in sysfs form, "0000:3b:00.0", so that ids compare."""
    domain, bus, device_function = _text(value).strip().lower().split(":")
    return f"{int(domain, 16):04x}:{bus}:{device_function}"


def nvlink_peers(
    *, bus_ids: Mapping[str, str], remote_bus_ids: Mapping[str, Iterable[str]]
) -> dict[str, tuple[str, ...]]:
    """Each GPU's NVLink peers, from its bus id and the bus ids its active links end on.

    A remote that is a local GPU makes that GPU a peer. A remote that is no local GPU is an
    NVSwitch port: every GPU with a link into the switch fabric reaches every other such GPU,
    so they are all peers of each other and form one domain.
    """
    by_bus = {bus: uuid for uuid, bus in bus_ids.items()}
    remotes = {uuid: list(remote_bus_ids.get(uuid, ())) for uuid in bus_ids}
    on_fabric = {uuid for uuid, buses in remotes.items() if any(b not in by_bus for b in buses)}
    peers: dict[str, tuple[str, ...]] = {}
    for uuid, buses in remotes.items():
        found = {by_bus[bus] for bus in buses if bus in by_bus}
        if uuid in on_fabric:
            found.update(on_fabric)
        found.discard(uuid)
        peers[uuid] = tuple(sorted(found))
    return peers


@dataclasses.dataclass
class _Probe:
    """What NVML said about one GPU, before NVLink remotes are mapped to local GPUs."""

    uuid: str
    index: int
    bus_id: str
    model: str = ""
    memory_mib: int = 0
    numa_node: int | None = None
    remote_bus_ids: list[str] = dataclasses.field(default_factory=list)
    healthy: bool = True
    problem: str | None = None
    mig: list[MigDevice] = dataclasses.field(default_factory=list)


class NvmlInventory:
    """The real inventory, from the NVIDIA driver through NVML."""

    def __init__(self, *, node_name: str) -> None:
        self.node_name = node_name

    def read(self) -> Inventory:
        try:
            import pynvml
        except ImportError as e:  # the dependency is declared; this is a broken install
            raise InventoryError(f"NVML: the pynvml module is missing: {e}") from e
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise InventoryError(f"NVML did not initialise: {e}") from e
        try:
            return self._read(pynvml)
        except pynvml.NVMLError as e:
            raise InventoryError(f"NVML: {e}") from e
        finally:
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as e:
                log.warning("NVML did not shut down cleanly: %s", e)

    def _read(self, nvml: Any) -> Inventory:
        probes = [self._probe(nvml, index) for index in range(nvml.nvmlDeviceGetCount())]
        peers = nvlink_peers(
            bus_ids={probe.uuid: probe.bus_id for probe in probes},
            remote_bus_ids={probe.uuid: probe.remote_bus_ids for probe in probes},
        )
        gpus = []
        for probe in probes:
            gpus.append(
                Gpu(
                    uuid=probe.uuid,
                    index=probe.index,
                    model=probe.model,
                    memory_mib=probe.memory_mib,
                    numa_node=probe.numa_node,
                    nvlink_peers=peers[probe.uuid],
                    healthy=probe.healthy,
                    mig=tuple(probe.mig),
                    problem=probe.problem,
                )
            )
        return Inventory(
            node_name=self.node_name,
            gpus=tuple(gpus),
            vcpu=os.cpu_count(),
            memory_gib=_host_memory_gib(),
            hugepages_1gi=_host_hugepages_1gi(),
            isolated_cpus=_host_isolated_cpus(),
        )

    def _probe(self, nvml: Any, index: int) -> _Probe:
        # Without a handle, a UUID and a bus id the GPU cannot even be named: those errors
        # fail the whole read. Anything after that marks just this GPU unhealthy.
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        probe = _Probe(
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            index=index,
            bus_id=bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId),
        )
        try:
            probe.model = _text(nvml.nvmlDeviceGetName(handle))
            probe.memory_mib = int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024)
            probe.numa_node = self._numa_node(nvml, handle, probe.bus_id)
            self._nvlinks(nvml, handle, probe)
            probe.mig = self._mig(nvml, handle, probe.uuid)
        except nvml.NVMLError as e:
            log.warning("GPU %s (%s) answers NVML with an error: %s", index, probe.uuid, e)
            probe.healthy = False
            probe.problem = f"NVML: {e}"
        return probe

    @staticmethod
    def _numa_node(nvml: Any, handle: Any, bus_id: str) -> int | None:
        get_numa = getattr(nvml, "nvmlDeviceGetNumaNodeId", None)
        if get_numa is not None:
            try:
                node = int(get_numa(handle))
            except nvml.NVMLError:
                pass  # older drivers do not know the call: ask the kernel instead
            else:
                if node >= 0:
                    return node
        return _sysfs_numa_node(bus_id)

    @staticmethod
    def _nvlinks(nvml: Any, handle: Any, probe: _Probe) -> None:
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                active = nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED
                if not active:
                    continue
                remote = bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
            except nvml.NVMLError:
                # A link number past this GPU's links, or a GPU without NVLink at all.
                continue
            # A remote that is no local GPU is an NVSwitch port; ``_read`` decides which.
            probe.remote_bus_ids.append(remote)

    @staticmethod
    def _mig(nvml: Any, handle: Any, parent_uuid: str) -> list[MigDevice]:
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError_NotSupported:
            return []
        if current != nvml.NVML_DEVICE_MIG_ENABLE:
            return []
        devices = []
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError_NotFound:
                continue  # an empty slot
            attributes = nvml.nvmlDeviceGetAttributes(mig)
            # NVIDIA's own plugin names profiles the same way, rounding memory up to GB.
            memory_gb = math.ceil(int(attributes.memorySizeMB) / 1024)
            devices.append(
                MigDevice(
                    uuid=_text(nvml.nvmlDeviceGetUUID(mig)),
                    profile=f"{attributes.gpuInstanceSliceCount}g.{memory_gb}gb",
                    parent_uuid=parent_uuid,
                    index=slot,
                )
            )
        return devices


# --- Watching ----------------------------------------------------------------------------


async def watch(source: InventorySource, *, interval_s: float = 5.0) -> AsyncIterator[Inventory]:
    """Yield the inventory at once, then again each time it differs from the last one yielded.

    Reads run in a thread (NVML and file reads block). A failed read is logged and retried at
    the next interval: a half-written file or a driver hiccup must not stop the device plugin.
    """
    last: Inventory | None = None
    while True:
        try:
            current = await asyncio.to_thread(source.read)
        except InventoryError as e:
            log.warning("cannot read the GPU inventory, retrying in %ss: %s", interval_s, e)
        else:
            if current != last:
                last = current
                yield current
        await asyncio.sleep(interval_s)
