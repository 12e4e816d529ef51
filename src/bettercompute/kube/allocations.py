"""DeviceAllocation objects: a node's desired allocation in, its report out.

Why here: the operator writes these objects from the service's desired allocations and relays
their ``status`` back; the node agent reads the ``spec`` and writes the ``status``; ``dev`` runs
the node agent in-process on the same shapes. The models are spelled as the CRD spells them
(``crds/deviceallocations.yaml``; a test compares them field by field), ``class`` as in a
Reservation's ``devices``. Each side parses what the other wrote: the node a spec with
``parse_spec``, the operator a status with ``report``; a bad one raises ``ShapeError`` naming
the field. The node builds its status with ``AllocationStatus.document``.

What it must never do: I/O, read a clock, or import kopf or either program.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from bettercompute.kube import names, parsing


class _Written(BaseModel):
    """What the operator writes: exactly the CRD's fields."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class _Read(BaseModel):
    """What a node writes: the known fields checked, newer ones ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)


#: GPU UUIDs, MIG UUIDs or slot ids.
DeviceId = Annotated[str, Field(min_length=1)]
DeviceClass = Literal["gpu", "mig", "slot"]
Binding = Literal["hold", "kubernetes"]


class Limits(_Written):
    cpuMillis: int | None = Field(default=None, ge=0)
    memoryBytes: int | None = Field(default=None, ge=0)
    hugepages1Gi: int | None = Field(default=None, ge=0)
    #: cpulists (``0-7,16``): the CPUs and the memory NUMA nodes the workload may use.
    cpus: str | None = Field(default=None, max_length=32768)
    mems: str | None = Field(default=None, max_length=32768)


class AllocationSpec(_Written):
    """A DeviceAllocation's ``spec``: one allocation of a reservation on one node."""

    allocationId: str = Field(min_length=1, max_length=128)
    nodeName: str = Field(min_length=1, max_length=253)
    reservationId: str = Field(min_length=1, max_length=128)
    tenantId: str = Field(min_length=1, max_length=128)
    device_class: DeviceClass = Field(alias="class")
    binding: Binding
    deviceIds: list[DeviceId] = Field(min_length=1)
    parentGpus: list[DeviceId]
    # Strict: epoch milliseconds, never a numeric string or a boolean read as one.
    until: int = Field(ge=0, strict=True)
    limits: Limits | None = None
    #: The extended resource the node advertises these devices as, for a ``kubernetes``
    #: binding of a pool in ``reservation`` pod-access mode (``bcd.dev/rsv-…``, one plugin
    #: endpoint of its own); absent: the class's shared name (``names.RESOURCE_NAMES``).
    resourceName: str | None = Field(
        default=None, max_length=63, pattern=r"^bcd\.dev/rsv-[a-z0-9]{1,24}$"
    )
    #: The namespace of the Reservation object it serves (a reservation made through
    #: Kubernetes): the node checks that the pods holding its devices are of it.
    reservationNamespace: str | None = Field(
        default=None, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
    )
    #: A spot reservation being preempted: when its devices go (epoch ms). The node warns the
    #: pods holding them.
    preemptAt: int | None = Field(default=None, ge=0, strict=True)
    #: How a ``kubernetes`` binding reaches pods: ``devicePlugin`` (extended resources, the
    #: default when absent) or ``dra`` (the node publishes the devices in its ResourceSlice and
    #: prepares the claims allocated them; ``kube.dra``).
    kubernetesApi: Literal["devicePlugin", "dra"] | None = None
    release: bool = False

    def document(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class _ReceivedLimits(Limits):
    model_config = ConfigDict(extra="ignore")


class _ReceivedSpec(AllocationSpec):
    """A spec as a node reads it: the known fields checked, those a newer operator adds
    ignored (the node acts on what it knows)."""

    model_config = ConfigDict(extra="ignore")

    limits: _ReceivedLimits | None = None


class Signature(_Read):
    keyId: str | None = None
    algorithm: str | None = None
    payload: str | None = None
    value: str | None = None
    #: The node's certificate (PEM) from the node-report authority; its key made ``value``.
    certificate: str | None = Field(default=None, max_length=16384)


Phase = Literal["Bound", "Failed", "Releasing", "Released"]


class AllocationStatus(_Read):
    """A DeviceAllocation's ``status``, written by the allocation's node."""

    nodeName: str | None = None
    phase: Phase | None = None
    cdiDevices: list[str] = Field(default_factory=list)
    envFile: str | None = None
    #: A bound hold with limits: the cgroup slice the node made for it (``bcd-alloc-<id>.slice``).
    cgroupParent: str | None = None
    reason: str | None = None
    #: Pods (``namespace/name``) holding the devices: while Bound, and while Releasing.
    pods: list[str] = Field(default_factory=list)
    #: Bound: the pods of ``pods`` outside ``spec.reservationNamespace``.
    intruders: list[str] = Field(default_factory=list)
    since: int | None = None
    reportedAt: str | None = None
    signature: Signature | None = None

    def document(self) -> dict[str, Any]:
        """The status as the node writes it, for a merge patch: every field, ``None`` included
        (a ``None`` removes what an earlier report said, such as a bound allocation's
        ``envFile`` once it fails)."""
        return self.model_dump(mode="json")


def allocation_name(allocation_id: str) -> str:
    """A DNS-1123 name for an allocation id: ``alloc_01K…`` → ``alloc-01k…``."""
    return allocation_id.replace("_", "-").lower()


def allocation_spec(row: Mapping[str, Any], *, node: str) -> dict[str, Any]:
    """The ``spec`` for one of ``node``'s desired allocations (a row of
    ``store.desired.for_node``: its ``state`` says whether it is being released)."""
    return AllocationSpec(
        allocationId=row["allocationId"],
        nodeName=node,
        reservationId=row["reservationId"],
        tenantId=row["tenantId"],
        device_class=row["class"],
        binding=row["binding"] or "hold",
        deviceIds=list(row["deviceIds"]),
        parentGpus=list(row["parentGpus"]),
        until=int(row["until"]),
        resourceName=_resource_name(row),
        reservationNamespace=row.get("reservationNamespace"),
        limits=Limits(**row["limits"]) if row.get("limits") else None,
        preemptAt=row.get("preemptAt"),
        kubernetesApi=row.get("kubernetesApi"),
        release=row["state"] == "releasing",
    ).document()


def _resource_name(row: Mapping[str, Any]) -> str | None:
    # A dra pool's devices reach pods through claims: no extended resource is advertised.
    if row["binding"] != "kubernetes" or row.get("podAccess") == "shared":
        return None
    if row.get("kubernetesApi") == "dra":
        return None
    return names.reservation_resource_name(row["reservationId"])


def allocation_manifest(spec: Mapping[str, Any], *, namespace: str) -> dict[str, Any]:
    """The ``DeviceAllocation`` object for a ``spec`` built by ``allocation_spec``."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": "DeviceAllocation",
        "metadata": {
            "name": allocation_name(spec["allocationId"]),
            "namespace": namespace,
            "labels": {
                names.NODE_LABEL: spec["nodeName"],
                names.RESERVATION_LABEL: spec["reservationId"],
            },
        },
        "spec": dict(spec),
    }


#: A DeviceAllocation's ``status.phase`` → the core's report kind.
REPORT_KINDS = {
    "Bound": "bound",
    "Failed": "failed",
    "Releasing": "releasing",
    "Released": "released",
}


def parse_spec(raw: object) -> AllocationSpec:
    """A spec the operator wrote, as a node reads it; ``ShapeError`` names the first bad field
    (``spec.deviceIds[0]: …``)."""
    return parsing.parse(_ReceivedSpec, raw, under="spec")


def parse_status(raw: object) -> AllocationStatus:
    """A node's status, checked; ``ShapeError`` names the first bad field."""
    return parsing.parse(AllocationStatus, raw, under="status")


def report(raw: object) -> tuple[str, dict[str, Any]] | None:
    """(kind, details) of a node's report in a DeviceAllocation's status; ``None`` if it says
    nothing yet. ``ShapeError`` when the status does not have the CRD's shape."""
    status = parse_status(raw)
    if status.phase is None:
        return None
    kind = REPORT_KINDS[status.phase]
    details: dict[str, Any] = {}
    if kind == "bound":
        details["cdiDevices"] = list(status.cdiDevices)
        if status.envFile:
            details["envFile"] = status.envFile
        if status.cgroupParent:
            details["cgroupParent"] = status.cgroupParent
        if status.pods:
            details["pods"] = list(status.pods)
        if status.intruders:
            details["intruders"] = list(status.intruders)
    if kind == "failed":
        details["reason"] = status.reason or "the node did not say why"
    if kind == "releasing":
        details["pods"] = list(status.pods)
        if status.since is not None:
            details["since"] = status.since
    if status.signature is not None:
        details["signature"] = status.signature.model_dump(exclude_none=True)
    return kind, details
