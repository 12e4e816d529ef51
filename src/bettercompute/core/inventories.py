"""A node as the placer books it: its atoms (bookable device units), labels and readiness.

Why in ``core``: every door that learns about nodes describes them with these two values (the
dev stack's simulated nodes, the operator's ``GPUNode`` objects, tests), and the store writes
them. Keeping them here lets a door build one without importing the store.

Pure data: no I/O, no validation beyond the types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AtomSpec:
    """One bookable unit: a whole GPU, a MIG instance or a time-slice/MPS slot."""

    device_id: str
    kind: str = "gpu"
    parent_gpu: str | None = None
    profile: str | None = None
    numa_node: int | None = None
    nvlink_domain: str | None = None
    healthy: bool = True


@dataclass(frozen=True)
class NodeSpec:
    id: str
    name: str
    pool_id: str | None
    atoms: Sequence[AtomSpec]
    #: key -> (value, source) with source ``system`` or ``operator``
    labels: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    ready: bool = True
    connected: bool = True
    resources: Mapping[str, Any] = field(default_factory=dict)
    #: What besides bcd can hand the node's GPUs to pods (its agent's ``ForeignGpuExposure``
    #: condition); ``None`` while only bcd does.
    foreign_exposure: str | None = None
