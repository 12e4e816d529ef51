"""Cedar, in process: the policy engine that decides every reservation operation.

Why Cedar and why in process: "at most 8 H100s for at most 72 hours in these regions" is one
policy an operator writes, not code we ship, and evaluating a pre-parsed policy set costs tens
of microseconds, so ``decide`` runs inline on the event loop with no thread hop.

What ``decide`` must never do: raise for an evaluation problem. A policy that fails to evaluate
(say it reads an attribute the resource lacks, without ``has``) is skipped by Cedar and reported
in ``Decision.errors``; an attribute we cannot express in Cedar denies, with the reason in
``errors``. Policy text that does not parse is refused when the engine is built
(``INVALID_INPUT``), so a bad policy file stops configuration loading, never a request.

The entity model (the contract policy authors write against)::

    principal  Compute::Identity::"<identity id>"
               attributes  tenant: String, kind: String ("user" | "agent" | "service"),
                           actingFor: String (only for an agent acting for a person: that
                           person's identity id; test it with ``has``)
               parents     Compute::Tenant::"<tenant id>", Compute::Group::"<g>" per group
    action     Compute::Action::"compute:reservations:create"   (also :read, :release, :extend)
    resource   for a reservation or a draft ("compute-reservation"):
               Compute::Reservation::"<resource id>"
               attributes  tenant: String, owner: String (when the reservation has an owner),
                           and every request attribute (gpuModel, gpuCount, gpuSlices, gangSize,
                           durationHours, region, binding, spot, renewable, projectId, …):
                           bool -> Bool, int -> Long, str -> String, float -> decimal (three
                           fractional digits; durationHours is always a decimal, so compare it
                           with .lessThanOrEqual(decimal("72.0"))), list of str -> Set,
                           None -> absent (test it with ``has``)
               parent      Compute::Pool::"<pool id>" when the pool is known
               for ``list`` ("tenant"): Compute::Tenant::"<tenant id>"
    pool       Compute::Pool::"<pool id>"
               attributes  ownerTenant: String, region: String, gpuModel: String
               parent      Compute::Tenant::"<owner tenant id>"
    context    {} (reserved)

A reservation is *not* a child of its tenant: a pool is a child of the tenant that owns it, so
``resource in Compute::Tenant::"t"`` means "in a pool that t owns". Own-tenant rules compare
``principal.tenant == resource.tenant``.

Delegated confirmation: a ``forbid`` annotated ``@confirm`` holds what it forbids for a person's
confirmation. A refusal is *confirmable* (``Decision.held_for_confirmation``) when at least one
policy determined it, every policy that did is such a ``forbid``, and the same request is
allowed once those forbids are set aside (a second evaluation, only in that case). So a refusal
because nothing permits, or one that any plain ``forbid`` joins, is never lifted by a person's
yes. Typically::

    @id("agents-confirm-big-requests") @confirm
    forbid (principal, action == Compute::Action::"compute:reservations:create", resource)
    when { principal has actingFor && resource.gpuCount > 4 };

Whether a confirmation is then asked for is the service's business (only an agent with a
person to ask gets one); this module only says which refusals could be lifted.

``SCHEMA`` writes the same model as a Cedar schema; ``validate=True`` type-checks policies
against it when they are loaded (a misspelt attribute is then a load error, not a silent deny).

This module must never import ``store`` or ``service``, do I/O or read a clock.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import cedarpy

from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.core.ports import Caller, Decision, DecisionRequest, PoolRelation

#: ``DecisionRequest.resource_type`` for a reservation or a draft.
RESERVATION_RESOURCE: Final = "compute-reservation"
#: ``DecisionRequest.resource_type`` for ``list``: the resource is the tenant listed.
TENANT_RESOURCE: Final = "tenant"

# Set from the request's own fields, so a request attribute of that name can never claim
# another tenant or owner.
_RESERVED_ATTRIBUTES: Final = frozenset({"tenant", "owner"})

# Cedar's decimal is a signed 64-bit count of 1/10,000ths; and its Long is a signed 64-bit int.
_DECIMAL_LIMIT: Final = (2**63 - 1) / 10_000
_LONG_MIN: Final = -(2**63)
_LONG_MAX: Final = 2**63 - 1

# Cedar names a policy in an evaluation error as "policy `policy3`".
_POLICY_IN_ERROR: Final = re.compile(r"policy `([^`]*)`")

SCHEMA: Final = """
namespace Compute {
  entity Tenant;
  entity Group;
  entity Identity in [Tenant, Group] = { tenant: String, kind: String, actingFor?: String };
  entity Pool in [Tenant] = { ownerTenant: String, region: String, gpuModel: String };
  entity Reservation in [Pool] = {
    tenant: String,
    owner?: String,
    gpuModel: String,
    gpuCount: Long,
    gpuSlices: Long,
    gangSize: Long,
    durationHours: decimal,
    region: String,
    binding: String,
    spot: Bool,
    renewable: Bool,
    projectId?: String,
    vcpu?: Long,
    memoryGiB?: Long,
  };
  action "compute:reservations:create", "compute:reservations:release",
         "compute:reservations:extend"
    appliesTo { principal: Identity, resource: Reservation, context: {} };
  action "compute:reservations:read"
    appliesTo { principal: Identity, resource: [Reservation, Tenant], context: {} };
}
"""

DEFAULT_POLICIES: Final = """
@id("tenant-members-manage-own-reservations")
permit (
  principal,
  action in [
    Compute::Action::"compute:reservations:create",
    Compute::Action::"compute:reservations:read",
    Compute::Action::"compute:reservations:release",
    Compute::Action::"compute:reservations:extend"
  ],
  resource is Compute::Reservation
)
when { principal.tenant == resource.tenant };

@id("tenant-members-list-own-tenant")
permit (
  principal,
  action == Compute::Action::"compute:reservations:read",
  resource is Compute::Tenant
)
when { principal in resource };
"""


class _Unrepresentable(Exception):
    """A request attribute with no Cedar form; the decision denies and says which."""


class CedarPolicyEngine:
    """A ``PolicyEngine`` over one pre-parsed Cedar policy set."""

    def __init__(
        self,
        *,
        policy_set: Any,
        names: Mapping[str, str],
        confirmable: frozenset[str] = frozenset(),
        lifted: Any = None,
    ) -> None:
        # Build with ``from_text``/``from_texts``, which parse and check the text.
        self._policies = policy_set
        self._names = dict(names)
        # Cedar's positional ids of the forbids marked @confirm, and the policy set without
        # them: what would decide once a person confirmed.
        self._confirmable = confirmable
        self._lifted = lifted

    @classmethod
    def from_text(cls, text: str, *, validate: bool = False) -> CedarPolicyEngine:
        """Parse ``text`` (here, at load, never per decision); ``validate`` also type-checks it
        against ``SCHEMA``.

        Raises ``ComputeError(INVALID_INPUT)`` carrying Cedar's message when the text does not
        parse, fails validation, or gives two policies the same ``@id``.
        """
        try:
            policies = cedarpy.PolicySet.from_str(text)
            est = json.loads(cedarpy.policies_to_json_str(text))
        except ValueError as exc:
            raise ComputeError(
                ErrorCode.INVALID_INPUT, f"policies do not parse: {exc}", {"reason": str(exc)}
            ) from exc
        names = _names_by_policy_id(est)
        if validate:
            result = cedarpy.validate_policies(text, SCHEMA)
            if not result.validation_passed:
                problems = [_with_names(e.error, names) for e in result.errors]
                raise ComputeError(
                    ErrorCode.INVALID_INPUT,
                    "policies do not match the schema: " + "; ".join(problems),
                    {"errors": problems},
                )
        confirmable = _confirmable(est)
        lifted = None
        if confirmable:
            rest = {
                **est,
                "staticPolicies": {
                    pid: policy
                    for pid, policy in est.get("staticPolicies", {}).items()
                    if pid not in confirmable
                },
            }
            lifted = cedarpy.PolicySet.from_json_str(json.dumps(rest))
        return cls(policy_set=policies, names=names, confirmable=confirmable, lifted=lifted)

    @classmethod
    def from_texts(cls, texts: Sequence[str], *, validate: bool = False) -> CedarPolicyEngine:
        """One engine over several policy files, as if they were one file."""
        return cls.from_text("\n".join(texts), validate=validate)

    async def decide(self, request: DecisionRequest) -> Decision:
        try:
            resource, entities = _resource_entities(request)
        except _Unrepresentable as exc:
            return Decision(allowed=False, errors=(str(exc),))
        entities.append(_principal_entity(request.principal))
        question = {
            "principal": _uid("Identity", request.principal.identity_id),
            "action": _uid("Action", request.action),
            "resource": resource,
            "context": {},
        }
        result = cedarpy.is_authorized(question, self._policies, entities)
        diagnostics = result.diagnostics
        determining = list(diagnostics.reasons)
        # Held: only marked forbids refused it, and without them it is allowed (so a missing
        # permit or a plain forbid is never lifted by a person's yes).
        held = (
            not result.allowed
            and bool(determining)
            and all(pid in self._confirmable for pid in determining)
            and cedarpy.is_authorized(question, self._lifted, entities).allowed
        )
        return Decision(
            allowed=result.allowed,
            held_for_confirmation=held,
            reasons=tuple(self._names.get(pid, pid) for pid in diagnostics.reasons),
            errors=tuple(_with_names(error, self._names) for error in diagnostics.errors),
        )


class AllowAllPolicyEngine:
    """Allows everything: a null object for tests and local development, never production."""

    async def decide(self, request: DecisionRequest) -> Decision:
        return Decision(allowed=True, reasons=("allow-all",))


class DenyAllPolicyEngine:
    """Denies everything: for tests, and a safe default when no policy is configured."""

    async def decide(self, request: DecisionRequest) -> Decision:
        return Decision(allowed=False, reasons=("deny-all",))


def _names_by_policy_id(est: Mapping[str, Any]) -> dict[str, str]:
    """Cedar's positional ids (``policy0`` …) to the ``@id`` annotations that name them."""
    names: dict[str, str] = {}
    for section in ("staticPolicies", "templates"):
        for policy_id, policy in est.get(section, {}).items():
            name = (policy.get("annotations") or {}).get("id")
            if not name:
                continue
            if name in names.values():
                # Two policies with one name would make the audit's reasons ambiguous.
                raise ComputeError(
                    ErrorCode.INVALID_INPUT,
                    f'policies: @id("{name}") is used by more than one policy',
                    {"id": name},
                )
            names[policy_id] = name
    return names


def _confirmable(est: Mapping[str, Any]) -> frozenset[str]:
    """Cedar's positional ids of the ``forbid`` policies annotated ``@confirm`` (with or without
    a value). A ``permit`` so annotated means nothing: only a refusal can be held."""
    return frozenset(
        policy_id
        for policy_id, policy in est.get("staticPolicies", {}).items()
        if policy.get("effect") == "forbid" and "confirm" in (policy.get("annotations") or {})
    )


def _with_names(message: str, names: Mapping[str, str]) -> str:
    # Cedar's messages name policies by positional id; show the author's @id, as reasons do.
    return _POLICY_IN_ERROR.sub(lambda m: f"policy `{names.get(m[1], m[1])}`", message)


def _uid(entity_type: str, entity_id: str) -> dict[str, str]:
    # The dict form takes any id, where the surface syntax would reject some characters.
    return {"type": f"Compute::{entity_type}", "id": entity_id}


def _principal_entity(caller: Caller) -> dict[str, Any]:
    attrs: dict[str, Any] = {"tenant": caller.tenant_id, "kind": caller.kind}
    if caller.on_behalf_of is not None:
        attrs["actingFor"] = caller.on_behalf_of
    return {
        "uid": _uid("Identity", caller.identity_id),
        "attrs": attrs,
        "parents": [
            _uid("Tenant", caller.tenant_id),
            *(_uid("Group", group) for group in caller.groups),
        ],
    }


def _pool_entity(pool: PoolRelation) -> dict[str, Any]:
    return {
        "uid": _uid("Pool", pool.pool_id),
        "attrs": {
            "ownerTenant": pool.owner_tenant_id,
            "region": pool.region,
            "gpuModel": pool.gpu_model,
        },
        "parents": [_uid("Tenant", pool.owner_tenant_id)],
    }


def _resource_entities(request: DecisionRequest) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """The resource's uid and the entities it brings (itself and its pool)."""
    if request.resource_type == TENANT_RESOURCE:
        # Only the uid is needed: ``principal in resource`` reads the principal's parents.
        return _uid("Tenant", request.tenant_id), []
    if request.resource_type != RESERVATION_RESOURCE:
        raise _Unrepresentable(f"unknown resource type {request.resource_type!r}")
    attrs = {
        key: _attribute(key, value)
        for key, value in request.attributes.items()
        if value is not None and key not in _RESERVED_ATTRIBUTES
    }
    attrs["tenant"] = request.tenant_id
    if request.owner_identity_id is not None:
        attrs["owner"] = request.owner_identity_id
    uid = _uid("Reservation", request.resource_id)
    entities: list[dict[str, Any]] = [{"uid": uid, "attrs": attrs, "parents": []}]
    if request.pool is not None:
        entities[0]["parents"].append(_uid("Pool", request.pool.pool_id))
        entities.append(_pool_entity(request.pool))
    return uid, entities


def _attribute(key: str, value: Any) -> Any:
    """One request attribute in Cedar's JSON form."""
    # durationHours is always a decimal, even when whole, so policies can compare it one way.
    if key == "durationHours" and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    try:
        return _cedar_value(value)
    except _Unrepresentable as exc:
        raise _Unrepresentable(f"attribute {key!r}: {exc}") from None


def _cedar_value(value: Any) -> Any:
    # bool first: it is an int to Python but not a Long to Cedar.
    if isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        if not _LONG_MIN <= value <= _LONG_MAX:
            raise _Unrepresentable(f"{value} does not fit Cedar's Long")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) >= _DECIMAL_LIMIT:
            raise _Unrepresentable(f"{value} does not fit Cedar's decimal")
        return {"__extn": {"fn": "decimal", "arg": f"{value:.3f}"}}
    if isinstance(value, list | tuple | set | frozenset):
        return [_cedar_value(item) for item in value]
    raise _Unrepresentable(f"a {type(value).__name__} has no Cedar form")
