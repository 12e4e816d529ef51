"""A GPUNode's ``status``: what a node agent says about its node, and how the operator reads it.

Why here: the node agent writes this status (``deviceplugin.publishing``) and the operator turns
it into bookable atoms (``operator.definitions.node_spec``). One model, spelled as the CRD
spells it (``crds/gpunodes.yaml``, checked field by field by a test), so the writer and the
reader cannot drift. A status is input from a node: the operator parses it with
``parse_status``, whose ``ShapeError`` names the field and the reason, never a ``KeyError``.

What it must never do: I/O, read a clock, or import kopf or either program.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from bettercompute.kube import names, parsing


class _Status(BaseModel):
    # A node agent newer than the operator may say more: unknown fields are ignored, the
    # known ones are checked.
    model_config = ConfigDict(extra="ignore", frozen=True)


class MigEntry(_Status):
    uuid: str = Field(min_length=1)
    profile: str = Field(min_length=1)
    healthy: bool = True


class GpuEntry(_Status):
    uuid: str = Field(min_length=1)
    index: int = Field(ge=0)
    model: str = Field(min_length=1)
    memoryMiB: int = Field(ge=1)
    numaNode: int | None = Field(default=None, ge=0)
    nvlinkDomain: str | None = None
    healthy: bool = True
    mig: list[MigEntry] = Field(default_factory=list)


class NumaNode(_Status):
    id: int = Field(ge=0)
    cpus: str | None = None  # a cpulist, such as 0-63
    memoryGiB: int | None = Field(default=None, ge=0)


class Host(_Status):
    vcpu: int | None = Field(default=None, ge=0)
    memoryGiB: int | None = Field(default=None, ge=0)
    hugepages2Mi: int | None = Field(default=None, ge=0)
    hugepages1Gi: int | None = Field(default=None, ge=0)
    #: The kernel's isolated CPUs (a cpulist, ``isolcpus``): never the host's reserved ones.
    isolatedCpus: str | None = None


class NodeInventory(_Status):
    gpus: list[GpuEntry] = Field(default_factory=list)
    numaNodes: list[NumaNode] | None = None
    host: Host | None = None


class Condition(_Status):
    """A ``metav1.Condition``: what the CRD requires is required here too."""

    type: str = Field(max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(max_length=1024)
    message: str = Field(max_length=32768)
    lastTransitionTime: str
    #: Always absent: a GPUNode has no spec its agent acts on.
    observedGeneration: int | None = Field(default=None, ge=0)


class GpuNodeStatus(_Status):
    inventory: NodeInventory = Field(default_factory=NodeInventory)
    gpus: int = Field(default=0, ge=0)
    capabilities: list[str] = Field(default_factory=list)
    heartbeatTime: str | None = None
    conditions: list[Condition] = Field(default_factory=list)

    @property
    def ready(self) -> bool:
        return any(c.type == "Ready" and c.status == "True" for c in self.conditions)

    @property
    def foreign_exposure(self) -> str | None:
        """What the agent says besides bcd hands the GPUs out (``ForeignGpuExposure``), or
        ``None`` when it says nothing does."""
        for c in self.conditions:
            if c.type == names.FOREIGN_GPU_EXPOSURE and c.status == "True":
                return c.message or "another path hands this node's GPUs to pods"
        return None

    def document(self) -> dict[str, Any]:
        """The status as the node writes it, for a merge patch: every field, ``None`` included
        (a ``None`` removes what an older agent wrote), except inside the host block and the
        NUMA nodes, which name only what the node knows (the CRD does not let them be null)."""
        document = self.model_dump(mode="json")
        inventory = document["inventory"]
        if inventory["host"] is not None:
            inventory["host"] = _known(inventory["host"])
        if inventory["numaNodes"] is not None:
            inventory["numaNodes"] = [_known(n) for n in inventory["numaNodes"]]
        return document


def _known(block: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in block.items() if v is not None}


def parse_status(raw: object) -> GpuNodeStatus:
    """The status a node wrote, checked; ``ShapeError`` names the first bad field."""
    return parsing.parse(GpuNodeStatus, raw, under="status")
