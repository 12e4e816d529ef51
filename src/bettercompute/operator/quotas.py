"""``GPUQuota`` objects turned into the tenant's quota rows, and the rows into their status.

Why a module of its own: a tenant's quota must not depend on the order objects were applied
in (it did when quotas lived in GPUPools). So exactly one object speaks for a tenant, chosen
the same way by every replica at every moment: the oldest (``creationTimestamp``, then name).
Another object naming the same tenant is shown ``Ready=False`` with reason ``Conflict`` and
changes nothing. A tenant nobody speaks for any more (its object deleted, or retargeted) gets
limits of 0: a missing quota grants nothing, and charges already made stay until their
reservations end.

Pure: no I/O and no clock; the handlers pass in what the index and the database say.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from bettercompute.core import errors, pools, validation
from bettercompute.operator import statuses

CONFLICT = "Conflict"
APPLIED = "Applied"


@dataclass(frozen=True)
class Claim:
    """One GPUQuota object's claim on a tenant, as the operator's index keeps it."""

    name: str
    created: str
    spec: Mapping[str, Any]

    @property
    def order(self) -> tuple[str, str]:
        return (self.created, self.name)


def claim(body: Mapping[str, Any]) -> Claim:
    meta = body.get("metadata") or {}
    return Claim(
        name=str(meta.get("name")),
        created=str(meta.get("creationTimestamp") or ""),
        spec=dict(body.get("spec") or {}),
    )


def parse(spec: Mapping[str, Any]) -> pools.QuotaSpec:
    """The spec as the core takes it; INVALID_INPUT naming the field (``spec.limits[vcpu]``)."""
    # kopf hands a read-only view; strict validation takes plain dicts.
    plain = {k: dict(v) if isinstance(v, Mapping) else v for k, v in spec.items()}
    try:
        return pools.QuotaSpec.model_validate(plain)
    except ValidationError as e:
        loc, reason = validation.first_problem(e, pools.QuotaSpec)
        raise errors.invalid_input(validation.path(loc, under="spec"), reason) from None


def speaker(claims: Iterable[Claim]) -> Claim | None:
    """The object that speaks for a tenant: the oldest valid claim."""
    valid = []
    for found in claims:
        try:
            parse(found.spec)
        except errors.ComputeError:
            continue
        valid.append(found)
    return min(valid, key=lambda c: c.order, default=None)


def differs(wanted: Mapping[str, int], rows: Iterable[Mapping[str, Any]]) -> bool:
    """Whether the quota rows (``{resource, limit}``) say other than exactly ``wanted``."""
    stored = {str(r["resource"]): int(r["limit"]) for r in rows}
    if any(stored.get(resource) != limit for resource, limit in wanted.items()):
        return True
    return any(limit != 0 for resource, limit in stored.items() if resource not in wanted)


def status(
    rows: Iterable[Mapping[str, Any]],
    *,
    generation: int,
    ready: bool,
    reason: str,
    message: str,
    previous: Mapping[str, Any] | None,
    now: str,
) -> dict[str, Any]:
    """The object's ``status``: limits and use by resource, a one-line GPU summary for
    ``kubectl get gq``, and the ``Ready`` condition (its transition time kept while it stands
    still). A losing object shows no figures: they are another object's."""
    figures = list(rows) if ready else []
    value = "True" if ready else "False"
    gpus = [r for r in figures if str(r["resource"]).startswith(("gpu:", "gpuSlices:"))]
    return {
        "observedGeneration": generation,
        "limits": {str(r["resource"]): int(r["limit"]) for r in figures} or None,
        "used": {str(r["resource"]): int(r["used"]) for r in figures} or None,
        "summary": ", ".join(f"{r['resource']} {r['used']}/{r['limit']}" for r in gpus) or None,
        "conditions": [
            {
                "type": "Ready",
                "status": value,
                "reason": reason,
                "message": message,
                "lastTransitionTime": statuses.transition_time(
                    (previous or {}).get("conditions"), "Ready", value, now=now
                ),
                "observedGeneration": generation,
            }
        ],
    }
