"""The ports the service talks through: who is calling, the policy engine, the budget check.

Why ports and not concrete classes: the admission sequence must not care whether a decision
comes from Cedar in-process, a remote IAM or an allow-all engine in a test, nor whether budgets
live in our database or in a billing system. Each port is a small ``typing.Protocol``; the
implementations live in ``iam`` (policy, authentication) and ``store`` (the built-in budget).

This module holds types only: no I/O, no implementation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

CallerKind = Literal["user", "agent", "service"]

# Actions, named as the guide's API table names them.
CREATE = "compute:reservations:create"
READ = "compute:reservations:read"
RELEASE = "compute:reservations:release"
EXTEND = "compute:reservations:extend"
ACTIONS = (CREATE, READ, RELEASE, EXTEND)


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: a stable identity id and the tenant it belongs to."""

    identity_id: str
    tenant_id: str
    kind: CallerKind = "user"
    groups: tuple[str, ...] = ()
    #: Set for an agent acting for a person in a delegated session (delegated confirmation).
    on_behalf_of: str | None = None


@dataclass(frozen=True)
class PoolRelation:
    """What a decision may know of the pool a reservation is parented to."""

    pool_id: str
    owner_tenant_id: str
    region: str
    gpu_model: str


@dataclass(frozen=True)
class DecisionRequest:
    """One question for the policy engine: may ``principal`` do ``action`` on this resource?

    ``resource_type`` is ``compute-reservation`` for a reservation or a draft, ``tenant`` for
    ``list``. ``attributes`` are the guide's attribute table (``gpuModel``, ``gpuCount``,
    ``durationHours`` …); ``tenant_id`` and ``owner_identity_id`` say whose it is.
    """

    principal: Caller
    action: str
    resource_type: str
    resource_id: str
    tenant_id: str
    owner_identity_id: str | None = None
    attributes: Mapping[str, Any] = field(default_factory=dict)
    pool: PoolRelation | None = None


@dataclass(frozen=True)
class Decision:
    allowed: bool
    #: Ids of the policies that determined the decision, for the audit row.
    reasons: tuple[str, ...] = ()
    #: Evaluation errors (a policy that failed to evaluate on these attributes).
    errors: tuple[str, ...] = ()
    #: A refusal a person may lift: every policy that determined it is a ``forbid`` marked for
    #: confirmation (Cedar's ``@confirm``). Never set on an allow, nor on a refusal because no
    #: policy permits. Only an agent acting for a person (``Caller.on_behalf_of``) is offered a
    #: confirmation for it; anyone else is simply refused.
    held_for_confirmation: bool = False


class PolicyEngine(Protocol):
    """Decides one request. Never called inside a database transaction."""

    async def decide(self, request: DecisionRequest) -> Decision: ...


class Authenticator(Protocol):
    """Turns a bearer credential into a caller, or ``None`` when it is not valid."""

    async def authenticate(self, token: str) -> Caller | None: ...


class AdmissionObserver(Protocol):
    """Told how long decisions and placements take (metrics); must never raise or block."""

    def decided(self, *, action: str, allowed: bool, seconds: float) -> None: ...

    def placed(self, *, outcome: str, seconds: float) -> None: ...


@dataclass(frozen=True)
class BudgetVerdict:
    allowed: bool
    message: str = ""
    #: When the budget's window resets, epoch ms, if the budget knows.
    resets_at_ms: int | None = None


class BudgetCheck(Protocol):
    """Better IAM's ``billing.check``: may this caller spend ``gpu_hours`` more now?

    Called before transaction 2, never inside one. Two creates checked at the same moment can
    both fit: a budget whose ledger is compute's own reservations (the built-in one) sets
    ``ledger_in_store``, and transaction 2 then checks it again under the tenant's budget lock,
    so concurrent creates cannot overrun it. An external billing system leaves it false and
    serialises its own check and charge.
    """

    ledger_in_store: bool

    async def check(self, *, caller: Caller, tenant_id: str, gpu_hours: float) -> BudgetVerdict: ...
