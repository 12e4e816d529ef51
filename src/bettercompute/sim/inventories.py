"""Simulated GPU nodes as data: GPUs with stable UUIDs, NUMA nodes, NVLink domains, MIG
instances and time-slice slots, and the system labels their daemon would advertise.

Why data and not writes: ``sim`` sits beside the HTTP API and may not speak to the store, so the
composition root (``dev``) writes what this module describes with ``store.inventory``. The same
name always gives the same UUIDs, so a dev stack restarted on its state dir finds its nodes,
atoms and bookings exactly where it left them.

What it must never do: I/O, randomness or reading a clock.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bettercompute.core import pools

#: All simulated UUIDs derive from this namespace and the node's name.
NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://bc.dev/sim")

#: What a current bcd advertises in ``Hello``; written as labels with source ``system``.
DEFAULT_LABELS: Mapping[str, str] = {
    pools.CAP_BINDING_KUBERNETES: "true",
    pools.CAP_DEVICES_LIMITS: "true",
}

#: Label naming the GPU model, as GPU feature discovery would (informational for capacity).
MODEL_LABEL = "nvidia.com/gpu.product"

#: A GPU has seven compute slices to split into MIG instances.
MIG_SLICES_PER_GPU = 7

#: A simulated host's CPUs and memory per GPU, as a typical 8-GPU server has them (128 CPUs,
#: 1 TiB): bookable host rows, so ``dev`` books host resources like a real cluster.
VCPU_PER_GPU = 16
MEMORY_GIB_PER_GPU = 128


@dataclass(frozen=True)
class SimAtom:
    """One bookable unit of a simulated node (mirrors ``store.inventory.AtomSpec``)."""

    device_id: str
    kind: str
    parent_gpu: str
    profile: str | None
    numa_node: int
    nvlink_domain: str | None


@dataclass(frozen=True)
class SimNode:
    id: str
    name: str
    pool_id: str
    model: str | None
    atoms: tuple[SimAtom, ...]
    #: key -> value, all advertised by the (simulated) daemon, so their source is ``system``.
    labels: Mapping[str, str] = field(default_factory=dict)
    #: The host's inventory: ``vcpu``, ``memoryGiB`` and ``numaNodes`` (cpulists, memory).
    host: Mapping[str, Any] = field(default_factory=dict)

    @property
    def gpus(self) -> tuple[str, ...]:
        """The physical GPUs' UUIDs, in index order."""
        return tuple(dict.fromkeys(a.parent_gpu for a in self.atoms))


def gpu_uuid(node_name: str, index: int) -> str:
    return f"GPU-{uuid.uuid5(NAMESPACE, f'{node_name}/gpu/{index}')}"


def mig_uuid(node_name: str, index: int, profile: str, instance: int) -> str:
    return f"MIG-{uuid.uuid5(NAMESPACE, f'{node_name}/gpu/{index}/mig/{profile}/{instance}')}"


def mig_slices(profile: str) -> int:
    """Compute slices a MIG profile takes: ``3g.40gb`` takes 3."""
    head = profile.split("g.", 1)[0]
    if not (head.isascii() and head.isdigit()) or "g." not in profile:
        raise ValueError(f"not a MIG profile: {profile!r} (expected e.g. '1g.10gb')")
    return int(head)


def check_mig(mig: Mapping[str, int]) -> None:
    """Refuse a MIG layout that one GPU cannot hold (more than seven compute slices)."""
    used = sum(mig_slices(profile) * count for profile, count in mig.items())
    if used > MIG_SLICES_PER_GPU:
        raise ValueError(
            f"these MIG instances take {used} of a GPU's {MIG_SLICES_PER_GPU} compute slices"
        )


def node(
    *,
    name: str,
    pool_id: str,
    model: str | None,
    gpus: int = 8,
    nvlink_domains: int = 2,
    numa_nodes: int = 2,
    mig: Mapping[str, int] | None = None,
    slots: int = 0,
    labels: Mapping[str, str] | None = None,
) -> SimNode:
    """One node of ``gpus`` GPUs, split evenly (the last domain may be short) into
    ``nvlink_domains`` NVLink domains (0: no NVLink) and ``numa_nodes`` NUMA nodes.

    With ``mig`` (profile → instances per GPU) its atoms are MIG instances; with ``slots``, that
    many time-slice slots per GPU; else whole GPUs. ``labels`` replaces ``DEFAULT_LABELS``.
    """
    if gpus < 1:
        raise ValueError("a node needs at least one GPU")
    if not 0 <= nvlink_domains <= gpus:
        raise ValueError(f"nvlink_domains must be between 0 and the GPU count ({gpus})")
    if mig and slots:
        raise ValueError("a node is either MIG or time-sliced, not both")
    if mig:
        check_mig(mig)
    per_domain = math.ceil(gpus / nvlink_domains) if nvlink_domains else 0
    atoms: list[SimAtom] = []
    for g in range(gpus):
        gpu = gpu_uuid(name, g)
        numa = g * max(1, numa_nodes) // gpus
        domain = f"{name}-nvl{g // per_domain}" if per_domain else None
        if mig:
            for profile, count in mig.items():
                atoms.extend(
                    SimAtom(mig_uuid(name, g, profile, k), "mig", gpu, profile, numa, domain)
                    for k in range(count)
                )
        elif slots:
            atoms.extend(
                SimAtom(f"{gpu}::{k}", "slot", gpu, None, numa, domain) for k in range(slots)
            )
        else:
            atoms.append(SimAtom(gpu, "gpu", gpu, None, numa, domain))
    all_labels = dict(DEFAULT_LABELS if labels is None else labels)
    if model:
        all_labels.setdefault(MODEL_LABEL, model)
    return SimNode(
        id=f"node_{name}",
        name=name,
        pool_id=pool_id,
        model=model,
        atoms=tuple(atoms),
        labels=all_labels,
        host=host_inventory(gpus=gpus, numa_nodes=numa_nodes),
    )


def host_inventory(
    *, gpus: int, numa_nodes: int, isolated_cpus: str | None = None
) -> dict[str, Any]:
    """A host of ``gpus`` GPUs: ``VCPU_PER_GPU`` CPUs and ``MEMORY_GIB_PER_GPU`` GiB per GPU,
    split evenly over its NUMA nodes (CPUs numbered in order); ``isolated_cpus``, a cpulist,
    as the kernel's isolated CPUs (the host's reserved CPUs are never taken from them)."""
    vcpu, memory = gpus * VCPU_PER_GPU, gpus * MEMORY_GIB_PER_GPU
    count = max(1, numa_nodes)
    numa = []
    for i in range(count):
        first, last = i * vcpu // count, (i + 1) * vcpu // count - 1
        numa.append({"id": i, "cpus": f"{first}-{last}", "memoryGiB": memory // count})
    found: dict[str, Any] = {"vcpu": vcpu, "memoryGiB": memory, "numaNodes": numa}
    if isolated_cpus:
        found["isolatedCpus"] = isolated_cpus
    return found


def name_stem(*, pool_id: str, prefix: str | None = None) -> str:
    """What a pool's node names start with: ``prefix``, else ``sim-h100`` for ``pool_h100``."""
    return prefix or "sim-" + pool_id.removeprefix("pool_").replace("_", "-").lower()


def node_names(*, pool_id: str, count: int, first: int = 0, prefix: str | None = None) -> list[str]:
    """Names for ``count`` nodes of a pool, numbered from ``first``: ``sim-h100-00`` …"""
    stem = name_stem(pool_id=pool_id, prefix=prefix)
    return [f"{stem}-{i:02d}" for i in range(first, first + count)]


def summary(nodes: Sequence[SimNode]) -> str:
    """``2 nodes × 8 H100`` style text for people."""
    if not nodes:
        return "no nodes"
    kinds = {(len(n.gpus), n.model or "GPU") for n in nodes}
    if len(kinds) == 1:
        gpus, model = next(iter(kinds))
        return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''} × {gpus} {model}"
    return f"{len(nodes)} nodes"
