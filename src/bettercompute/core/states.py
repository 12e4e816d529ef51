"""Reservation states, conditions and the ``operation`` object derived from them.

Why here: the state a reservation is in decides what every operation may do to it (cancel only
before the start, renew only while it holds devices …) and what ``operation.state`` a client
sees. Keeping the tables in one pure module means the store's guarded UPDATEs and the API's
answers cannot drift apart.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any


class State(enum.StrEnum):
    DRAFT = "draft"
    DENIED = "denied"
    AWAITING_CONFIRMATION = "awaiting-confirmation"
    PENDING = "pending"
    PLACED = "placed"
    BINDING = "binding"
    ACTIVE = "active"
    RELEASING = "releasing"
    RELEASED = "released"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


TERMINAL = frozenset({State.DENIED, State.RELEASED, State.FAILED, State.CANCELLED, State.EXPIRED})
#: States that hold (or will hold) devices and quota.
CHARGED = frozenset({State.PENDING, State.PLACED, State.BINDING, State.ACTIVE, State.RELEASING})
#: States a lease can be renewed in (the guide: placed, binding and active).
RENEWABLE = frozenset({State.PLACED, State.BINDING, State.ACTIVE})
#: States ``cancel`` accepts: the reservation has not started.
CANCELLABLE = frozenset({State.PENDING, State.PLACED})
#: States an extend may move the end of.
EXTENDABLE = frozenset({State.PENDING, State.PLACED, State.BINDING, State.ACTIVE})
#: States invisible to get and list.
INTERNAL = frozenset({State.DRAFT})


class Condition(enum.StrEnum):
    UNSCHEDULABLE = "Unschedulable"
    QUEUED = "Queued"
    BIND_TIMEOUT = "BindTimeout"
    DEGRADED = "Degraded"
    NODE_UNREACHABLE = "NodeUnreachable"
    PREEMPTED = "Preempted"
    CONFIRMATION_REQUIRED = "ConfirmationRequired"
    UNHEALTHY_ATOMS = "UnhealthyAtoms"
    DEVICES_HELD = "DevicesHeld"


class Reason(enum.StrEnum):
    NO_FIT = "NoFit"
    MAX_PENDING_EXCEEDED = "MaxPendingExceeded"
    POOL_GONE = "PoolGone"
    BOOKING_REPAIR_FAILED = "BookingRepairFailed"
    SPOT_PREEMPTED = "SpotPreempted"
    POOL_PLACER = "PoolPlacer"
    NODE_DID_NOT_BIND = "NodeDidNotBind"
    NODE_REJECTED_BINDING = "NodeRejectedBinding"
    BINDING_LOST = "BindingLost"
    FOREIGN_GPU_EXPOSURE = "ForeignGpuExposure"
    POD_OUTSIDE_NAMESPACE = "PodOutsideNamespace"
    ATOM_UNHEALTHY = "AtomUnhealthy"
    UNREACHABLE = "Unreachable"
    PODS_HOLD_DEVICES = "PodsHoldDevices"
    NOT_BILLED = "NotBilled"


def condition(
    kind: Condition, reason: str, message: str, *, at_ms: int, **extra: Any
) -> dict[str, Any]:
    """A condition as stored and shown: ``type``, ``reason``, ``message``, ``since``."""
    return {"type": kind.value, "reason": reason, "message": message, "since": at_ms, **extra}


def has_condition(conditions: Iterable[Mapping[str, Any]], kind: Condition) -> bool:
    return any(c.get("type") == kind.value for c in conditions)


def without(conditions: Iterable[Mapping[str, Any]], *kinds: Condition) -> list[dict[str, Any]]:
    names = {k.value for k in kinds}
    return [dict(c) for c in conditions if c.get("type") not in names]


# The error a failed operation carries, by terminal state (the guide's operation table).
_FAILED_ERROR = {
    State.FAILED: "CAPACITY_UNAVAILABLE",
    State.DENIED: "ACCESS_DENIED",
    State.CANCELLED: "INVALID_STATE",
    State.EXPIRED: "INVALID_STATE",
}


def operation(
    *,
    reservation_id: str,
    state: State,
    conditions: Iterable[Mapping[str, Any]],
    failure_message: str | None = None,
) -> dict[str, Any]:
    """The ``operation`` object of a reservation, as the guide's table derives it.

    ``running``: a draft, or pending and ``Queued``; ``pending``: pending otherwise, or awaiting
    confirmation; ``succeeded``: placed through released; ``failed``: with an ``error``.
    """
    conds = list(conditions)
    op: dict[str, Any] = {"id": reservation_id}
    if state == State.DRAFT or (state == State.PENDING and has_condition(conds, Condition.QUEUED)):
        op["state"] = "running"
    elif state in (State.PENDING, State.AWAITING_CONFIRMATION):
        op["state"] = "pending"
    elif state in _FAILED_ERROR:
        op["state"] = "failed"
        code = _FAILED_ERROR[state]
        op["error"] = {"code": code, "message": failure_message or _default_message(state)}
    else:
        op["state"] = "succeeded"
    return op


def _default_message(state: State) -> str:
    return {
        State.FAILED: "the reservation failed",
        State.DENIED: "the request was denied by policy",
        State.CANCELLED: "the reservation was cancelled",
        State.EXPIRED: "the reservation expired",
    }.get(state, state.value)
