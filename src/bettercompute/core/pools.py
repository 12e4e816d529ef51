"""What a pool allows: visibility to a tenant, device classes by sharing mode, bindings.

These are the rules of the guide's "Transaction 1" that need only the pool's row, kept pure so
they are tested as a table. The store reads the pool under the transaction and calls them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bettercompute.core import errors, placement

#: Which device class each sharing mode books.
CLASS_FOR_MODE = {"exclusive": "gpu", "mig": "mig", "timeslice": "slot", "mps": "slot"}

#: The pool's ``maxPending`` when its policy names none: 24 hours.
DEFAULT_MAX_PENDING_MS = 24 * 3_600_000

CAP_BINDING_KUBERNETES = "bc.dev/cap.binding.kubernetes"
CAP_DEVICES_LIMITS = "bc.dev/cap.devices.limits"


@dataclass(frozen=True)
class PoolInfo:
    id: str
    owner_tenant_id: str
    region: str
    gpu_model: str | None
    sharing_mode: str
    replicas: int
    archived: bool
    policy: Mapping[str, Any] = field(default_factory=dict)
    #: Whether the pool is offered to the tenant asking (owners need no offer).
    offered: bool = False
    on_budget_exceeded: str | None = None

    def visible_to(self, tenant_id: str) -> bool:
        return not self.archived and (self.owner_tenant_id == tenant_id or self.offered)

    @property
    def max_pending_ms(self) -> int:
        value = self.policy.get("maxPending")
        if isinstance(value, int) and value > 0:
            return value
        if isinstance(value, str):
            from bettercompute.core import durations

            try:
                return durations.parse_duration_ms(value)
            except durations.DurationError:
                return DEFAULT_MAX_PENDING_MS
        return DEFAULT_MAX_PENDING_MS

    @property
    def wants_budget_check(self) -> bool:
        admission = self.policy.get("admission") or {}
        return admission.get("budgetCheck") == "meter" or self.on_budget_exceeded in (
            "stop-new",
            "drain",
        )


def check_request(*, request: Mapping[str, Any], pool: PoolInfo, tenant_id: str) -> None:
    """Refuse what this pool cannot serve for this tenant; the order is the guide's.

    ``NOT_FOUND`` when the pool is neither owned by nor offered to the tenant, or archived (the
    same answer as a pool that does not exist); then device classes against the sharing mode;
    then the binding's needs.
    """
    if not pool.visible_to(tenant_id):
        raise errors.not_found("pool")
    wanted = CLASS_FOR_MODE[pool.sharing_mode]
    for i, device in enumerate(request["devices"]):
        if device["class"] != wanted:
            raise errors.invalid_input(
                f"devices[{i}].class",
                f"pool {pool.id} shares its GPUs as '{pool.sharing_mode}', which books class "
                f"'{wanted}', not '{device['class']}'",
            )
    binding = request["binding"]
    if binding == "node" and not pool.policy.get("tenantRoot"):
        raise errors.invalid_input("binding", "binding 'node' needs a pool with tenantRoot")
    if binding == "kubernetes":
        if not pool.policy.get("kubernetes"):
            raise errors.invalid_input(
                "binding",
                f"binding 'kubernetes' needs a pool with policy.kubernetes; {pool.id} has none",
            )
        if pool.owner_tenant_id != tenant_id:
            raise errors.invalid_input(
                "binding",
                "binding 'kubernetes' is for the pool's owner only: the kubelet gives bound GPUs "
                "to any pod of the cluster; book binding 'hold' instead",
            )


def demand(*, request: Mapping[str, Any]) -> placement.Demand:
    """The placer's view of a normalised request."""
    labels: dict[str, str] = {}
    if request["binding"] == "kubernetes":
        labels[CAP_BINDING_KUBERNETES] = "*"
    resources = request.get("resources") or {}
    if any(int(v) > 0 for v in resources.values()):
        labels[CAP_DEVICES_LIMITS] = "*"
    return placement.Demand(
        devices=tuple(
            placement.DeviceDemand(
                device_class=d["class"],
                count=int(d["count"]),
                topology=d.get("topology", "any"),
                profile=d.get("profile"),
            )
            for d in request["devices"]
        ),
        gang_size=int(request.get("gang", {}).get("size", 1)),
        whole_node=request["binding"] == "node",
        required_labels=labels,
    )
