"""The JSON bodies the CLI sends, built from its flags.

Why pure builders: ``reserve`` and ``capacity --preview`` describe the same request from the
same flags (the guide: "capacity --preview takes the same three"), and the mapping from
``--gpus 4 --nvlink`` to ``devices: [{class: gpu, count: 4, topology: nvlink-all}]`` is a rule
that deserves tests without a server.

What this module must never do: validate what only the server can judge (pool, quota, policy),
read the clock or the network, or invent fields the guide's bodies do not have. Combinations
of flags that can never be right are refused here, naming the flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bettercompute.cli.parsing import ParseError


@dataclass(frozen=True)
class Ask:
    """What ``reserve`` and ``capacity --preview`` both describe."""

    tenant: str
    pool: str
    duration: str
    gpus: int | None = None
    mig: str | None = None
    count: int | None = None
    slots: int | None = None
    nvlink: bool = False
    start_ms: int | None = None
    gang: int | None = None
    cpus: int | None = None
    memory_gib: int | None = None
    kubernetes: bool = False


def devices(ask: Ask) -> list[dict[str, Any]]:
    """The one device entry of ``--gpus N``, ``--mig PROFILE [--count N]`` or ``--slots N``."""
    given = [
        name
        for name, value in (("--gpus", ask.gpus), ("--mig", ask.mig), ("--slots", ask.slots))
        if value is not None
    ]
    if len(given) != 1:
        found = f" (got {' and '.join(given)})" if given else ""
        raise ParseError(
            f"give exactly one of --gpus N, --mig PROFILE or --slots N{found}",
            option="--gpus" if not given else given[-1],
        )
    if ask.count is not None and ask.mig is None:
        raise ParseError(
            "--count is the number of MIG instances: use it with --mig", option="--count"
        )
    if ask.nvlink and ask.gpus is None:
        raise ParseError("--nvlink needs whole GPUs (--gpus N)", option="--nvlink")
    if ask.gpus is not None:
        device: dict[str, Any] = {"class": "gpu", "count": ask.gpus}
        if ask.nvlink:
            device["topology"] = "nvlink-all"
        return [device]
    if ask.mig is not None:
        return [
            {"class": "mig", "profile": ask.mig, "count": 1 if ask.count is None else ask.count}
        ]
    assert ask.slots is not None
    return [{"class": "slot", "count": ask.slots}]


def request(ask: Ask) -> dict[str, Any]:
    """The part of a create body that a preview shares: pool, devices, window, binding, host."""
    body: dict[str, Any] = {
        "tenantId": ask.tenant,
        "poolId": ask.pool,
        "devices": devices(ask),
        "duration": ask.duration,
    }
    if ask.start_ms is not None:
        body["start"] = ask.start_ms
    if ask.gang is not None:
        body["gang"] = {"size": ask.gang}
    resources: dict[str, int] = {}
    if ask.cpus is not None:
        resources["vcpu"] = ask.cpus
    if ask.memory_gib is not None:
        resources["memoryGiB"] = ask.memory_gib
    if resources:
        body["resources"] = resources
    if ask.kubernetes:
        body["binding"] = "kubernetes"
    return body


def create(
    ask: Ask,
    *,
    key: str,
    wait_s: float,
    spot: bool = False,
    lease_seconds: int | None = None,
    project: str | None = None,
) -> dict[str, Any]:
    """A ``reservations.create`` body; ``wait`` only when there is something to wait for."""
    body = request(ask)
    if spot:
        body["spot"] = True
    if lease_seconds is not None:
        body["leaseSeconds"] = lease_seconds
    if project is not None:
        body["projectId"] = project
    body["idempotencyKey"] = key
    if wait_s > 0:
        body["wait"] = {"timeoutMs": int(wait_s * 1000)}
    return body


def extend(
    *, tenant: str, reservation_id: str, key: str, until_ms: int | None, by: str | None
) -> dict[str, Any]:
    """A ``reservations.extend`` body with exactly one of ``until`` or ``by``."""
    if (until_ms is None) == (by is None):
        raise ParseError(
            "give exactly one of --until (+12h, an ISO 8601 time or epoch ms) or --by (4h)",
            option="--until",
        )
    body: dict[str, Any] = {"tenantId": tenant, "reservationId": reservation_id}
    if until_ms is not None:
        body["until"] = until_ms
    else:
        body["by"] = by
    body["idempotencyKey"] = key
    return body
