"""Host CPUs, memory and 1 GiB huge pages booked with the GPUs: the share, the floor, the quota.

Why it exists: a GPU without CPU and memory runs nothing, and a host's CPUs sold twice run
everything badly. Every reservation books host resources with its devices on the same node:
what its request says (``resources``, per node, per gang member), never less than the pool's
per-GPU share times the GPUs' worth it asks for. The share rides on the GPUs' quota; anything
above it is charged to the tenant's ``vcpu`` and ``memoryGiB`` quota. These rules are pure and
live here once; the store applies them when it writes the draft, charges quota and books.

Also here: reading a cpulist (``0-7,16``) within bounds, since node inventories carry them and
an oversized one must never stall the control plane.

What it must never do: I/O, clocks, or rounding up (a share is what every host can give, so it
is rounded down).
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

#: What a request books of a host, per node.
BOOKED = ("vcpu", "memoryGiB", "hugepages1Gi")
#: A MIG instance is this much of a GPU.
MIG_PER_GPU = 7
#: Slots per GPU when the pool names none: time-slicing, and MPS.
DEFAULT_REPLICAS = {"timeslice": 4, "mps": 10}
#: The CPUs a host keeps for itself when the pool's ``policy.hostReserve.vcpu`` names none.
DEFAULT_HOST_RESERVE_VCPU = 2

#: Bounds a cpulist is read within: larger CPU ids, longer text or more parts read as empty.
CPULIST_MAX_ID = 8191
CPULIST_MAX_BYTES = 32 * 1024
CPULIST_MAX_PARTS = 4096


def gpu_equivalent(
    devices: list[Mapping[str, Any]] | tuple[Mapping[str, Any], ...],
    *,
    sharing_mode: str,
    replicas: int,
) -> Fraction:
    """What one member's devices are worth in whole GPUs: a GPU 1, a MIG instance 1/7, a slot
    1/replicas (the pool's, else 4 for time-slicing and 10 for MPS)."""
    return sum(
        (
            int(device["count"])
            * device_worth(device["class"], sharing_mode=sharing_mode, replicas=replicas)
            for device in devices
        ),
        Fraction(0),
    )


def device_worth(kind: str, *, sharing_mode: str, replicas: int) -> Fraction:
    """What one device of ``kind`` (gpu, mig, slot) is worth in whole GPUs. The one definition
    quota shares, budgets and the usage ledger count with (the ledger's SQL mirrors it in
    ``bc_device_worth``, held to it by a test)."""
    if kind == "gpu":
        return Fraction(1)
    if kind == "mig":
        return Fraction(1, MIG_PER_GPU)
    slots = replicas if replicas > 1 else DEFAULT_REPLICAS.get(sharing_mode, 4)
    return Fraction(1, slots)


def per_gpu_share(
    *, per_gpu: Mapping[str, Any] | None, hosts: Mapping[str, Any] | None
) -> dict[str, int]:
    """The pool's share of one GPU: ``policy.perGpu`` where it names a resource, else what the
    pool's hosts can give (``hosts``: the store's smallest per-GPU share over the pool's hosts).
    Huge pages come from ``policy.perGpu`` only."""
    share: dict[str, int] = {}
    given = dict(per_gpu or {})
    found = dict(hosts or {})
    for name in BOOKED:
        value = given.get(name)
        if value is None and name != "hugepages1Gi":
            value = found.get(name)
        if isinstance(value, int) and value > 0:
            share[name] = value
    return share


def resolve(
    request: Mapping[str, Any],
    *,
    sharing_mode: str,
    replicas: int,
    per_gpu: Mapping[str, Any] | None,
    hosts: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, int]]:
    """The request with the host resources it books, and its ``hostShare``.

    The share is the pool's per-GPU share times the GPUs' worth of one member, rounded down,
    ``{}`` when the pool has none. It is also the floor: ``resources`` below it, or
    ``resources: {}``, are raised to it. A ``node`` binding books no host resources. A request
    that books nothing keeps no ``resources`` key, exactly as it came.
    """
    resolved = dict(request)
    if request.get("binding") == "node":
        return resolved, {}
    worth = gpu_equivalent(request["devices"], sharing_mode=sharing_mode, replicas=replicas)
    share = {
        name: int(value * worth)
        for name, value in per_gpu_share(per_gpu=per_gpu, hosts=hosts).items()
        if int(value * worth) > 0
    }
    given = dict(request.get("resources") or {})
    booked = {name: max(int(given.get(name, 0)), share.get(name, 0)) for name in BOOKED}
    if any(booked.values()):
        resolved["resources"] = booked
    else:
        resolved.pop("resources", None)
    return resolved, share


def booked(request: Mapping[str, Any]) -> dict[str, int]:
    """What one member books of its node's host (a resolved request); zeros left out."""
    resources = request.get("resources") or {}
    if request.get("binding") == "node":
        return {}
    return {name: int(resources.get(name, 0)) for name in BOOKED if int(resources.get(name, 0))}


def quota_excess(request: Mapping[str, Any], *, host_share: Mapping[str, Any]) -> dict[str, int]:
    """What the reservation charges to ``vcpu`` and ``memoryGiB`` quota: whatever it books
    above its share, over the whole gang (1 GiB huge pages count as memory)."""
    gang = int(request.get("gang", {}).get("size", 1))
    mine = booked(request)
    vcpu = mine.get("vcpu", 0) - int(host_share.get("vcpu", 0))
    memory = (mine.get("memoryGiB", 0) + mine.get("hugepages1Gi", 0)) - (
        int(host_share.get("memoryGiB", 0)) + int(host_share.get("hugepages1Gi", 0))
    )
    excess: dict[str, int] = {}
    if vcpu > 0:
        excess["vcpu"] = vcpu * gang
    if memory > 0:
        excess["memoryGiB"] = memory * gang
    return excess


def parse_cpulist(text: str | None) -> frozenset[int]:
    """The CPU ids of a Linux cpulist (``0-3,8,10-11``), read within bounds: ids up to 8191,
    at most 32 KiB and 4096 comma-separated parts. Anything outside them, or not a cpulist,
    reads as empty, so an oversized or broken list can cost no more than reading 32 KiB."""
    if not text:
        return frozenset()
    if len(text) > CPULIST_MAX_BYTES:
        return frozenset()
    stripped = text.strip()
    if not stripped:
        return frozenset()
    parts = stripped.split(",")
    if len(parts) > CPULIST_MAX_PARTS:
        return frozenset()
    cpus: set[int] = set()
    for part in parts:
        low, dash, high = part.partition("-")
        if not _is_id(low) or (dash and not _is_id(high)):
            return frozenset()
        first, last = int(low), int(high) if dash else int(low)
        if last < first or last > CPULIST_MAX_ID:
            return frozenset()
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def limits(
    *,
    vcpu: int,
    memory_gib: int,
    hugepages_1gi: int,
    numa_nodes: list[Mapping[str, Any]] | None,
    device_numa: set[int],
    reserve_vcpu: int,
    isolated_cpus: str | None = None,
) -> dict[str, Any] | None:
    """An allocation's limits on its node from what it booked (``None`` when it booked none):
    ``cpuMillis``, ``memoryBytes``, ``hugepages1Gi``, and a cpuset on the NUMA nodes of its
    devices when those have enough CPUs (``cpus``) or memory (``mems``). The host's reserved
    CPUs (its lowest ``reserve_vcpu`` that are not isolated, ``isolated_cpus`` being the
    inventory's cpulist) are never in a cpuset: the host's own work cannot run on an isolated
    CPU (the kernel keeps its scheduler off them), so reserving one would leave the host
    short and hand a workload's CPU to nobody."""
    if not (vcpu or memory_gib or hugepages_1gi):
        return None
    out: dict[str, Any] = {
        "cpuMillis": vcpu * 1000,
        "memoryBytes": memory_gib * 2**30,
        "hugepages1Gi": hugepages_1gi,
    }
    nodes = [n for n in numa_nodes or () if isinstance(n, Mapping) and isinstance(n.get("id"), int)]
    cpus_of = {int(n["id"]): parse_cpulist(_text(n.get("cpus"))) for n in nodes}
    reserved = reserved_cpus(
        frozenset().union(*cpus_of.values()),
        isolated=parse_cpulist(isolated_cpus),
        reserve_vcpu=reserve_vcpu,
    )
    near = [n for n in nodes if n["id"] in device_numa]
    if near and vcpu:
        cpus = frozenset().union(*(cpus_of[int(n["id"])] for n in near)) - reserved
        if len(cpus) >= vcpu:
            out["cpus"] = format_cpulist(cpus)
    if near and memory_gib:
        memory = sum(int(n.get("memoryGiB") or 0) for n in near)
        if memory >= memory_gib:
            out["mems"] = format_cpulist({int(n["id"]) for n in near})
    return out


def reserved_cpus(
    cpus: frozenset[int], *, isolated: frozenset[int], reserve_vcpu: int
) -> frozenset[int]:
    """The host's reserved CPUs: the lowest ``reserve_vcpu`` of ``cpus`` that are not
    ``isolated``."""
    return frozenset(sorted(cpus - isolated)[: max(0, reserve_vcpu)])


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _is_id(text: str) -> bool:
    # ASCII digits only, and short: "٣" is a digit to str.isdigit, and "1" * 10_000 is an int.
    return 0 < len(text) <= 4 and all("0" <= c <= "9" for c in text)


def format_cpulist(cpus: frozenset[int] | set[int]) -> str:
    """The shortest cpulist for ``cpus`` (``0-3,8``); empty for none."""
    ordered = sorted(cpus)
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)
