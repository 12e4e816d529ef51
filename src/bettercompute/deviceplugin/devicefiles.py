"""The files a node writes for a bound allocation: a CDI spec and an env file.

Why: the guide's node side hands a hold to the workload manager as
``/etc/cdi/bcd-<allocation>.json`` (device names ``bcd.dev/gpu=<device id>``) and
``/run/bcd/allocations/<allocation>.env``. The
device plugin owns these files: it writes them before it advertises an allocation's devices and
removes them once no pod holds the devices any more. A simulated node (``sim.agents``) runs the
same agent with the two directories under its own root, ``<root>/cdi/`` and
``<root>/run/allocations/``, so what a real node would expose can be inspected on a laptop.

The CDI spec is self-describing: its annotations (``bcd.dev/allocation-id``, ``…/device-class``,
``…/binding``, …) carry everything needed to rebuild the allocation from disk after a restart, and
a ``kubernetes`` binding's spec names the device-plugin resource that advertises it
(``bcd.dev/device-plugin``), or says ``bcd.dev/kubernetes-api: dra`` when claims reach it. A
spec being released carries ``bcd.dev/releasing-since``. An
allocation with host limits carries them (``bcd.dev/limits``, the spec's JSON), so they still
count in the node's admission after a restart, and a ``hold`` with limits names its cgroup
slice (``bcd.dev/cgroup-parent``, and ``BCD_CGROUP_PARENT`` in the env file; ``cgroups``).

Device edits are environment variables only: the NVIDIA container runtime turns
``NVIDIA_VISIBLE_DEVICES`` into device nodes and driver mounts, and the node does not know the
``/dev/nvidia*`` minor numbers of a simulated GPU. For a ``kubernetes`` binding the spec-wide
edits leave ``NVIDIA_VISIBLE_DEVICES`` out, because a container may take only some of an
allocation's devices and spec-wide edits would expose all of them: the device plugin's Allocate
answer sets it for exactly the container's devices.

Where NVIDIA's CDI specs name the allocation's GPUs (``nvidiacdi``), bcd's spec refers to them
instead of copying their edits: the annotation ``bcd.dev/nvidia-cdi-devices`` lists NVIDIA's
fully qualified names (``nvidia.com/gpu=GPU-…``), and the env file's ``BCD_CDI_DEVICES`` lists
every CDI device a workload manager should ask the runtime for (bcd's, then NVIDIA's). Allocate
answers both for a ``kubernetes`` binding. Without NVIDIA specs the CDI spec is exactly the
env-only one.

What it must never do: write outside its directories, or leave a half-written file where a reader
may see it. Allocation ids are checked against a strict pattern before they become file names,
and every file is written to a temporary name in the same directory, then renamed over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from bettercompute.core.ids import cgroup_slice
from bettercompute.deviceplugin.cgroups import HostLimits
from bettercompute.kube.allocations import AllocationSpec, Binding, DeviceClass
from bettercompute.kube.dra import API_DEVICE_PLUGIN, API_DRA
from bettercompute.kube.names import CDI_KIND, RESOURCE_NAMES

CDI_VERSION = "0.6.0"  # spec-level annotations and the dot in a class need 0.6.0

BINDINGS: tuple[str, ...] = get_args(Binding)
DEVICE_CLASSES: tuple[str, ...] = get_args(DeviceClass)

# Spec annotations: what the node needs to rebuild an allocation from its file.
ANNOTATION_ALLOCATION = "bcd.dev/allocation-id"
ANNOTATION_RESERVATION = "bcd.dev/reservation-id"
ANNOTATION_TENANT = "bcd.dev/tenant-id"
ANNOTATION_CLASS = "bcd.dev/device-class"
ANNOTATION_BINDING = "bcd.dev/binding"
ANNOTATION_UNTIL = "bcd.dev/until"
ANNOTATION_PARENTS = "bcd.dev/parent-gpus"
ANNOTATION_DEVICE_PLUGIN = "bcd.dev/device-plugin"
ANNOTATION_RELEASING = "bcd.dev/releasing-since"
ANNOTATION_LIMITS = "bcd.dev/limits"
ANNOTATION_CGROUP_PARENT = "bcd.dev/cgroup-parent"
ANNOTATION_NVIDIA_DEVICES = "bcd.dev/nvidia-cdi-devices"
#: Only on a ``dra`` allocation's spec (absent: the device plugin).
ANNOTATION_KUBERNETES_API = "bcd.dev/kubernetes-api"

#: The kubelet's limit on a device id (the device-plugin proto's comment).
MAX_DEVICE_ID = 63

# Letters, digits, '_' and '-' only: no '/', no '.', so a name can never leave its directory.
_ALLOCATION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
# What may stand in an env file value without quoting.
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_.:,@+=/-]*$")
# The CDI device-name rule: letters and digits at both ends, '_' '-' '.' ':' between.
_CDI_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


class DeviceFileError(ValueError):
    """An allocation that cannot be written safely; the message names the field and why."""


@dataclass(frozen=True)
class Allocation:
    """What the node needs of an allocation to write its files and advertise its devices."""

    allocation_id: str
    reservation_id: str
    tenant_id: str
    device_class: str
    device_ids: tuple[str, ...]
    parent_gpus: tuple[str, ...]
    until_ms: int
    binding: str = "hold"
    limits: HostLimits | None = None
    #: The reservation's own extended resource (pod access ``reservation``); None: the class's
    #: shared one.
    own_resource: str | None = None
    #: The namespace of the Reservation object it serves; None for one made through the API.
    #: Not written to its files: the spec says it again on every pass.
    namespace: str | None = None
    #: A spot reservation being preempted: when its devices go (epoch ms).
    preempt_at: int | None = None
    #: How a ``kubernetes`` binding reaches pods: ``devicePlugin`` (extended resources) or
    #: ``dra`` (ResourceClaims the node prepares; ``kube.dra``). Written to its CDI spec, so a
    #: restarted node still knows a leftover's holders are claims, not pods.
    kubernetes_api: str = API_DEVICE_PLUGIN

    def __post_init__(self) -> None:
        _check(self)

    @classmethod
    def from_spec(cls, spec: AllocationSpec) -> Allocation:
        """From a DeviceAllocation's ``spec``, parsed (``kube.allocations.parse_spec``): the
        rules a file name, a CDI name or an env file adds; errors name ``spec.<field>``."""
        try:
            return cls(
                allocation_id=spec.allocationId,
                reservation_id=spec.reservationId,
                tenant_id=spec.tenantId,
                device_class=spec.device_class,
                device_ids=tuple(spec.deviceIds),
                parent_gpus=tuple(spec.parentGpus),
                until_ms=spec.until,
                binding=spec.binding,
                own_resource=spec.resourceName,
                namespace=spec.reservationNamespace,
                preempt_at=spec.preemptAt,
                kubernetes_api=spec.kubernetesApi or API_DEVICE_PLUGIN,
                limits=None
                if spec.limits is None
                else HostLimits(
                    cpu_millis=spec.limits.cpuMillis,
                    memory_bytes=spec.limits.memoryBytes,
                    hugepages_1gi=spec.limits.hugepages1Gi,
                    cpus=spec.limits.cpus,
                    mems=spec.limits.mems,
                ),
            )
        except _FieldError as e:
            raise DeviceFileError(f"spec.{_SPEC_FIELDS[e.attr]}: {e.reason}") from None

    @property
    def resource_name(self) -> str:
        """What the kubelet knows these devices as: the reservation's own resource, or the
        class's shared one."""
        return self.own_resource or RESOURCE_NAMES[self.device_class]

    @property
    def cgroup_parent(self) -> str | None:
        """The slice of a ``hold`` with limits; None for one without, and for a ``kubernetes``
        binding (its pods live in the kubelet's cgroups, which enforce their limits)."""
        if self.binding != "hold" or self.limits is None:
            return None
        return cgroup_slice(self.allocation_id)

    @property
    def visible_devices(self) -> list[str]:
        """``NVIDIA_VISIBLE_DEVICES``: MIG instances and whole GPUs by their own id; a slot by
        its physical GPU (time-slicing shares the whole device)."""
        return visible_devices(
            device_class=self.device_class,
            device_ids=self.device_ids,
            parent_gpus=self.parent_gpus,
        )

    @property
    def cdi_devices(self) -> list[str]:
        return [cdi_name(d) for d in self.device_ids]


def cdi_name(device_id: str) -> str:
    """The fully qualified CDI name of one device: ``bcd.dev/gpu=<device id>``."""
    return f"{CDI_KIND}={device_id}"


def visible_devices(
    *, device_class: str, device_ids: Sequence[str], parent_gpus: Sequence[str]
) -> list[str]:
    if device_class == "slot":
        return list(dict.fromkeys(parent_gpus))
    return list(device_ids)


#: Where each of ``Allocation``'s fields comes from in a DeviceAllocation's ``spec``.
_SPEC_FIELDS = {
    "allocation_id": "allocationId",
    "reservation_id": "reservationId",
    "tenant_id": "tenantId",
    "device_class": "class",
    "device_ids": "deviceIds",
    "parent_gpus": "parentGpus",
    "until_ms": "until",
    "binding": "binding",
    "limits": "limits",
}


class _FieldError(DeviceFileError):
    def __init__(self, attr: str, reason: str) -> None:
        super().__init__(f"{attr}: {reason}")
        self.attr = attr
        self.reason = reason


def _check(allocation: Allocation) -> None:
    """Every rule a file name, a CDI name, an env value or the kubelet puts on an allocation."""
    if not _ALLOCATION_ID.fullmatch(allocation.allocation_id):
        raise _FieldError(
            "allocation_id",
            f"{allocation.allocation_id!r} is not safe as a file name "
            "(letters, digits, '_' and '-' only, at most 128)",
        )
    if allocation.device_class not in DEVICE_CLASSES:
        raise _FieldError(
            "device_class", f"{allocation.device_class!r} is not one of {list(DEVICE_CLASSES)}"
        )
    if allocation.binding not in BINDINGS:
        raise _FieldError("binding", f"{allocation.binding!r} is not one of {list(BINDINGS)}")
    if not allocation.device_ids:
        raise _FieldError("device_ids", "names no device")
    for i, device_id in enumerate(allocation.device_ids):
        if not _CDI_NAME.fullmatch(device_id) or len(device_id) > MAX_DEVICE_ID:
            raise _FieldError(
                "device_ids",
                f"[{i}] {device_id!r} is not a valid CDI device name of at most "
                f"{MAX_DEVICE_ID} characters",
            )
    if len(set(allocation.device_ids)) != len(allocation.device_ids):
        raise _FieldError("device_ids", "names a device twice")
    if len(allocation.parent_gpus) != len(allocation.device_ids):
        raise _FieldError("parent_gpus", "must give one parent GPU per device, in order")
    for i, parent in enumerate(allocation.parent_gpus):
        if not _CDI_NAME.fullmatch(parent):
            raise _FieldError("parent_gpus", f"[{i}] {parent!r} is not a valid GPU UUID")
    for attr in ("reservation_id", "tenant_id"):
        if not _SAFE_VALUE.fullmatch(getattr(allocation, attr)):
            raise _FieldError(attr, "cannot be written unquoted into an env file")
    if allocation.limits is not None:
        for field, reason in allocation.limits.problems():
            raise _FieldError("limits", f"{field}: {reason}")


class DeviceFiles:
    """The CDI specs and env files of one node.

    ``DeviceFiles(root)`` keeps both under one root (the simulator); a real node names its
    directories: ``DeviceFiles(root, cdi_dir=Path("/var/run/cdi"), env_dir=...)``.
    """

    def __init__(self, root: Path, *, cdi_dir: Path | None = None, env_dir: Path | None = None):
        self.root = root
        self.cdi_dir = cdi_dir if cdi_dir is not None else root / "cdi"
        self.env_dir = env_dir if env_dir is not None else root / "run" / "allocations"

    def cdi_path(self, allocation_id: str) -> Path:
        return self.cdi_dir / f"bcd-{check_allocation_id(allocation_id)}.json"

    def env_path(self, allocation_id: str) -> Path:
        return self.env_dir / f"{check_allocation_id(allocation_id)}.env"

    def write(
        self,
        allocation: Allocation,
        *,
        releasing_since_ms: int | None = None,
        nvidia_devices: Sequence[str] = (),
    ) -> None:
        """Write (or rewrite) both files; each appears whole or not at all. ``nvidia_devices``:
        NVIDIA's CDI names for the allocation's GPUs (``nvidia.com/gpu=…``), if any."""
        spec = cdi_spec(
            allocation, releasing_since_ms=releasing_since_ms, nvidia_devices=nvidia_devices
        )
        env = env_text(allocation, nvidia_devices=nvidia_devices)
        write_atomically(self.cdi_path(allocation.allocation_id), json.dumps(spec, indent=2))
        write_atomically(self.env_path(allocation.allocation_id), env)

    def matches(self, allocation: Allocation, *, nvidia_devices: Sequence[str] = ()) -> bool:
        """Whether both files exist with exactly the content ``write`` would give them."""
        try:
            spec = json.loads(self.cdi_path(allocation.allocation_id).read_text())
            env = self.env_path(allocation.allocation_id).read_text()
        except (OSError, ValueError):
            return False
        return spec == cdi_spec(allocation, nvidia_devices=nvidia_devices) and env == env_text(
            allocation, nvidia_devices=nvidia_devices
        )

    def describes(self, allocation: Allocation) -> bool:
        """Whether the CDI spec on disk is ``allocation``'s, bound and not being released,
        whatever NVIDIA devices it refers to (those follow the node's NVIDIA specs, not the
        allocation): an allocation bound before a restart."""
        try:
            spec = json.loads(self.cdi_path(allocation.allocation_id).read_text())
        except (OSError, ValueError):
            return False
        if isinstance(spec, dict) and isinstance(spec.get("annotations"), dict):
            spec["annotations"].pop(ANNOTATION_NVIDIA_DEVICES, None)
        return bool(spec == cdi_spec(allocation))

    def read(self, allocation_id: str) -> Written | None:
        """The allocation a CDI spec of ours describes, or None when there is no such file or
        it is not one this module wrote (unreadable, or without our annotations)."""
        try:
            spec = json.loads(self.cdi_path(allocation_id).read_text())
        except (OSError, ValueError):
            return None
        return written_from_spec(spec, allocation_id=allocation_id)

    def remove(self, allocation_id: str) -> None:
        for path in (self.cdi_path(allocation_id), self.env_path(allocation_id)):
            path.unlink(missing_ok=True)

    def allocation_ids(self) -> set[str]:
        """Allocations that have a file here (either one), for cleaning up leftovers. Only our
        own names count (``bcd-<id>.json``, ``<id>.env``): other vendors share ``/etc/cdi``."""
        found: set[str] = set()
        if self.cdi_dir.is_dir():
            for path in self.cdi_dir.glob("bcd-*.json"):
                found.add(path.name.removeprefix("bcd-").removesuffix(".json"))
        if self.env_dir.is_dir():
            found.update(path.stem for path in self.env_dir.glob("*.env"))
        return {a for a in found if _ALLOCATION_ID.fullmatch(a)}


@dataclass(frozen=True)
class Written:
    """An allocation read back from its CDI spec, and when its release began (if it has)."""

    allocation: Allocation
    releasing_since_ms: int | None


def check_allocation_id(allocation_id: str) -> str:
    if not _ALLOCATION_ID.fullmatch(allocation_id):
        raise DeviceFileError(
            f"allocation id {allocation_id!r} is not safe as a file name "
            "(letters, digits, '_' and '-' only)"
        )
    return allocation_id


def cdi_spec(
    allocation: Allocation,
    *,
    releasing_since_ms: int | None = None,
    nvidia_devices: Sequence[str] = (),
) -> dict[str, Any]:
    """The CDI spec of one allocation: one device per booked device id; the allocation's env
    goes in the spec-wide edits, which apply whichever of its devices a container asks for.
    NVIDIA's devices for its GPUs, when the node has them, are named in an annotation."""
    annotations = {
        ANNOTATION_ALLOCATION: allocation.allocation_id,
        ANNOTATION_RESERVATION: allocation.reservation_id,
        ANNOTATION_TENANT: allocation.tenant_id,
        ANNOTATION_CLASS: allocation.device_class,
        ANNOTATION_BINDING: allocation.binding,
        ANNOTATION_UNTIL: str(allocation.until_ms),
        ANNOTATION_PARENTS: ",".join(allocation.parent_gpus),
    }
    shared_env = [f"BCD_ALLOCATION_ID={allocation.allocation_id}"]
    if allocation.binding == "kubernetes" and allocation.kubernetes_api == API_DRA:
        annotations[ANNOTATION_KUBERNETES_API] = API_DRA
    elif allocation.binding == "kubernetes":
        annotations[ANNOTATION_DEVICE_PLUGIN] = allocation.resource_name
    else:
        shared_env.insert(0, "NVIDIA_VISIBLE_DEVICES=" + ",".join(allocation.visible_devices))
    if releasing_since_ms is not None:
        annotations[ANNOTATION_RELEASING] = str(releasing_since_ms)
    if allocation.limits is not None:
        annotations[ANNOTATION_LIMITS] = json.dumps(
            allocation.limits.document(), sort_keys=True, separators=(",", ":")
        )
    if allocation.cgroup_parent is not None:
        annotations[ANNOTATION_CGROUP_PARENT] = allocation.cgroup_parent
    if nvidia_devices:
        annotations[ANNOTATION_NVIDIA_DEVICES] = ",".join(nvidia_devices)
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "annotations": annotations,
        "devices": [
            {"name": device_id, "containerEdits": {"env": [f"BCD_DEVICE_{i}={device_id}"]}}
            for i, device_id in enumerate(allocation.device_ids)
        ],
        "containerEdits": {"env": shared_env},
    }


def written_from_spec(spec: Any, *, allocation_id: str) -> Written | None:
    """Read ``cdi_spec``'s output back; None for anything else (a foreign or damaged file)."""
    if not isinstance(spec, dict) or spec.get("kind") != CDI_KIND:
        return None
    annotations = spec.get("annotations")
    devices = spec.get("devices")
    if not isinstance(annotations, dict) or not isinstance(devices, list):
        return None
    if annotations.get(ANNOTATION_ALLOCATION) != allocation_id:
        return None
    try:
        names = [str(device["name"]) for device in devices]
        parents = str(annotations[ANNOTATION_PARENTS]).split(",")
        allocation = Allocation(
            allocation_id=allocation_id,
            reservation_id=str(annotations[ANNOTATION_RESERVATION]),
            tenant_id=str(annotations[ANNOTATION_TENANT]),
            device_class=str(annotations[ANNOTATION_CLASS]),
            device_ids=tuple(names),
            parent_gpus=tuple(parents),
            until_ms=int(annotations[ANNOTATION_UNTIL]),
            binding=str(annotations[ANNOTATION_BINDING]),
            kubernetes_api=str(annotations.get(ANNOTATION_KUBERNETES_API, API_DEVICE_PLUGIN)),
        )
        limits = annotations.get(ANNOTATION_LIMITS)
        if limits is not None:
            allocation = dataclasses.replace(
                allocation, limits=HostLimits.from_document(json.loads(limits))
            )
        since = annotations.get(ANNOTATION_RELEASING)
        return Written(
            allocation=allocation, releasing_since_ms=None if since is None else int(since)
        )
    except (KeyError, TypeError, ValueError):
        return None


def env_text(allocation: Allocation, *, nvidia_devices: Sequence[str] = ()) -> str:
    """``KEY=value`` lines for the workload manager (systemd ``EnvironmentFile`` syntax).
    ``BCD_CDI_DEVICES``: every CDI device to ask the runtime for, bcd's then NVIDIA's."""
    values = {
        "BCD_ALLOCATION_ID": allocation.allocation_id,
        "BCD_RESERVATION_ID": allocation.reservation_id,
        "BCD_TENANT_ID": allocation.tenant_id,
        "BCD_DEVICE_CLASS": allocation.device_class,
        "BCD_UNTIL_MS": str(allocation.until_ms),
        "NVIDIA_VISIBLE_DEVICES": ",".join(allocation.visible_devices),
        "BCD_CDI_DEVICES": ",".join([*allocation.cdi_devices, *nvidia_devices]),
    }
    if allocation.cgroup_parent is not None:
        values["BCD_CGROUP_PARENT"] = allocation.cgroup_parent
    for key, value in values.items():
        if not _SAFE_VALUE.fullmatch(value):
            raise DeviceFileError(f"{key} value {value!r} cannot be written unquoted")
    return "".join(f"{key}={value}\n" for key, value in values.items())


def read_env(path: Path) -> dict[str, str]:
    """Parse an env file written by ``env_text``."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {key: value for key, value in pairs}


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (mode 0644, read by the container runtime) through a
    temporary file in the same folder, fsynced and renamed over: a reader (the runtime, the
    next agent) sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
