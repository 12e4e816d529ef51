"""Custom resources turned into what the service takes, and the service's answers into objects.

- a Reservation's ``spec`` and stamps → the core's create request and the caller;
- a ``GPUPool`` → a ``PoolDefinition``; a ``GPUNode`` and the pool selecting it → a ``NodeSpec``
  (whole GPUs, MIG instances or ``replicas`` slots per GPU, by the pool's sharing mode);
- a node's desired allocation → a ``DeviceAllocation`` manifest.

Why pure functions: these rules are the contract of ``docs/kubernetes.md``, tested table by
table without a cluster. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from bettercompute.core import errors, moments, pools, ports, validation
from bettercompute.core.inventories import AtomSpec, NodeSpec
from bettercompute.core.pools import PoolDefinition
from bettercompute.kube import names, nodes

# --- Reservations -------------------------------------------------------------------------------


def create_request(spec: Mapping[str, Any], *, tenant_id: str, uid: str) -> dict[str, Any]:
    """The core's create request: ``spec`` without the fields that change later, in the
    namespace's tenant, keyed by ``spec.idempotencyKey`` or else the object's uid."""
    request = {k: v for k, v in spec.items() if k not in names.NOT_THE_REQUEST}
    if "start" in request:
        request["start"] = moment_ms(request["start"], field="start")
    request["tenantId"] = tenant_id
    request["idempotencyKey"] = spec.get("idempotencyKey") or uid
    return request


def moment_ms(value: Any, *, field: str) -> Any:
    """A Reservation's time (``spec.start``, ``spec.until``) as the core takes it, epoch ms;
    ``field`` is named as the core names its fields (``start``), within ``spec``.

    An RFC 3339 string is what the CRD takes; an integer is an object written before it did
    (epoch ms, as then), passed on as it is; anything else is left for the core to refuse.
    """
    if not isinstance(value, str):
        return value
    try:
        return moments.parse_ms(value)
    except moments.MomentError as e:
        raise errors.invalid_input(field, str(e)) from None


def caller(annotations: Mapping[str, str], *, tenant_id: str) -> ports.Caller:
    """The stamped requester, as a caller of ``tenant_id``; INVALID_INPUT when unstamped."""
    identity = annotations.get(names.REQUESTED_BY)
    if not identity:
        raise errors.invalid_input(
            f"metadata.annotations[{names.REQUESTED_BY}]",
            "missing: the object was not stamped by the admission webhook (is it installed?)",
        )
    return ports.Caller(
        identity_id=identity,
        tenant_id=tenant_id,
        kind="user",
        groups=tuple(groups(annotations.get(names.REQUESTED_BY_GROUPS))),
    )


def groups(text: str | None) -> list[str]:
    """The stamped groups (a JSON list of strings); anything else reads as none."""
    if not text:
        return []
    try:
        value = json.loads(text)
    except ValueError:
        return []
    return [g for g in value if isinstance(g, str)] if isinstance(value, list) else []


def tenant_of(namespace: str, labels: Mapping[str, str] | None) -> str:
    tenant = (labels or {}).get(names.TENANT_LABEL)
    if not tenant:
        raise errors.invalid_input(
            "metadata.namespace",
            f"namespace {namespace!r} has no {names.TENANT_LABEL} label naming its tenant",
        )
    return tenant


# --- GPUPools ----------------------------------------------------------------------------------


def pool_definition(name: str, spec: Mapping[str, Any]) -> PoolDefinition:
    """A ``GPUPool`` as the service takes it; INVALID_INPUT naming the field (``spec.owner.tenant``)
    and the reason, in the words the dev configuration uses for the same mistake (one model,
    ``core.pools.PoolSpec``, validates both)."""
    try:
        parsed = pools.PoolSpec.model_validate(_plain(spec))
    except ValidationError as e:
        loc, reason = validation.first_problem(e, pools.PoolSpec)
        raise errors.invalid_input(validation.path(loc, under="spec"), reason) from None
    return parsed.definition(name)


def _plain(value: Any) -> Any:
    """An object's spec (kopf hands a read-only view) as the dicts and lists strict validation
    takes."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Kubernetes LabelSelector semantics; an empty or missing selector selects nothing
    (a pool must say which nodes it takes)."""
    if not selector or not (selector.get("matchLabels") or selector.get("matchExpressions")):
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or ():
        key, op = expression.get("key"), expression.get("operator")
        values = set(expression.get("values") or ())
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


def pool_for(labels: Mapping[str, str], pools_: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The first pool (by name) whose selector takes a node with these labels."""
    for name in sorted(pools_):
        if selects(pools_[name].get("nodeSelector"), labels):
            return name
    return None


# --- GPUNodes ----------------------------------------------------------------------------------


def node_spec(
    name: str,
    *,
    labels: Mapping[str, str],
    status: Mapping[str, Any] | nodes.GpuNodeStatus,
    pool: PoolDefinition | None,
    now_s: float | None = None,
) -> NodeSpec:
    """The node's bookable atoms for the pool that takes it (none without a pool).

    ``status`` is what the node's agent wrote; one that does not have the GPUNode shape raises
    ``kube.parsing.ShapeError`` naming the field (the caller says so and books nothing on it).
    """
    parsed = status if isinstance(status, nodes.GpuNodeStatus) else nodes.parse_status(status)
    atoms: list[AtomSpec] = []
    if pool is not None:
        atoms = _atoms(parsed.inventory.gpus, pool=pool)
    node_labels = {key: (value, "operator") for key, value in labels.items()}
    for capability in parsed.capabilities:
        label = _CAPABILITY_LABELS.get(capability)
        if label is not None:
            node_labels[label] = ("true", "system")
    return NodeSpec(
        id=name,
        name=name,
        pool_id=pool.pool_id if pool is not None else None,
        atoms=atoms,
        labels=node_labels,
        ready=parsed.ready,
        connected=parsed.ready and _fresh(parsed, now_s=now_s),
        foreign_exposure=parsed.foreign_exposure,
        resources=_host_resources(parsed.inventory),
    )


def _host_resources(inventory: nodes.NodeInventory) -> dict[str, Any]:
    """The node's host rows (``vcpu``, ``memoryGiB``, huge pages) and its NUMA nodes (their
    cpulists and memory, for the cpusets of its allocations)."""
    found: dict[str, Any] = {}
    if inventory.host is not None:
        found.update({k: v for k, v in inventory.host.model_dump().items() if v is not None})
    if inventory.numaNodes:
        found["numaNodes"] = [
            {k: v for k, v in n.model_dump().items() if v is not None} for n in inventory.numaNodes
        ]
    return found


_CAPABILITY_LABELS = {
    "binding.kubernetes": pools.CAP_BINDING_KUBERNETES,
    "devices.limits": pools.CAP_DEVICES_LIMITS,
    "cdi.nvidia": pools.CAP_CDI_NVIDIA,
}


#: A node agent heartbeats every 30 s; three missed beats and the node counts as not connected
#: (it takes no new work; its bookings stay, as the guide's principle P6 asks).
STALE_AFTER_S = 90.0


def _fresh(status: nodes.GpuNodeStatus, *, now_s: float | None) -> bool:
    """The agent's last heartbeat is recent (a status without one, or no clock, counts as
    fresh: an agent that never heartbeats is judged by its Ready condition alone)."""
    beat = status.heartbeatTime
    if now_s is None or not beat:
        return True
    try:
        at = dt.datetime.fromisoformat(str(beat).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return False
    return now_s - at <= STALE_AFTER_S


def _atoms(gpus: Sequence[nodes.GpuEntry], *, pool: PoolDefinition) -> list[AtomSpec]:
    atoms: list[AtomSpec] = []
    for gpu in gpus:
        uuid, numa, domain = gpu.uuid, gpu.numaNode, gpu.nvlinkDomain
        if pool.pool.sharing == "mig":
            atoms.extend(
                AtomSpec(
                    device_id=m.uuid,
                    kind="mig",
                    parent_gpu=uuid,
                    profile=m.profile,
                    numa_node=numa,
                    nvlink_domain=domain,
                    healthy=gpu.healthy and m.healthy,
                )
                for m in gpu.mig
            )
        elif pool.pool.sharing in pools.SLOT_SHARING:
            atoms.extend(
                AtomSpec(
                    device_id=f"{uuid}::{k}",
                    kind="slot",
                    parent_gpu=uuid,
                    numa_node=numa,
                    nvlink_domain=domain,
                    healthy=gpu.healthy,
                )
                for k in range(pool.pool.replicas)
            )
        else:
            atoms.append(
                AtomSpec(
                    device_id=uuid,
                    kind="gpu",
                    parent_gpu=uuid,
                    numa_node=numa,
                    nvlink_domain=domain,
                    healthy=gpu.healthy,
                )
            )
    return atoms
