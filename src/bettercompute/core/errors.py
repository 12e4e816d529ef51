"""The one error type every boundary of Better Compute speaks.

Why one type: the HTTP API, the CLI and the operator all turn a refusal into the same three
fields (``code``, ``message``, ``details``), so the code that raises never needs to know which
door it is behind. The codes are exactly those of the reservations guide.

Hierarchy::

    ComputeError            code + message + details
      (no subclasses: the code is the discriminator, so a door maps it with one table)
    StoreError              the database failed (not the caller's mistake): 503 at a door

``StoreError`` lives here, not in ``store``, so that the doors can tell an outage from a refusal
without importing the store.

This module must never import anything of ours, nor wrap library exceptions itself: the layer
that catches a library exception (``store``, ``iam``) raises a ``ComputeError`` ``from`` it.
"""

from __future__ import annotations

import enum
from typing import Any


class ErrorCode(enum.StrEnum):
    INVALID_INPUT = "INVALID_INPUT"
    NOT_FOUND = "NOT_FOUND"
    ACCESS_DENIED = "ACCESS_DENIED"
    CONFLICT = "CONFLICT"
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    CAPACITY_UNAVAILABLE = "CAPACITY_UNAVAILABLE"
    INVALID_STATE = "INVALID_STATE"
    UNSUPPORTED = "UNSUPPORTED"
    SPEND_LIMIT_REACHED = "SPEND_LIMIT_REACHED"
    CONFIRMATION_REQUIRED = "CONFIRMATION_REQUIRED"


class ComputeError(Exception):
    """A refusal with a stable ``code``, a ``message`` for people and ``details`` for programs."""

    def __init__(self, code: ErrorCode, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.details: dict[str, Any] = dict(details or {})

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code.value, "message": self.message, "details": self.details}

    def __repr__(self) -> str:
        return f"ComputeError({self.code.value}, {self.message!r}, {self.details!r})"


def invalid_input(field: str, reason: str, **details: Any) -> ComputeError:
    """The field is named both in the message and in ``details.field`` so a form can point at it."""
    return ComputeError(
        ErrorCode.INVALID_INPUT, f"{field}: {reason}", {"field": field, "reason": reason, **details}
    )


def not_found(what: str = "reservation") -> ComputeError:
    return ComputeError(ErrorCode.NOT_FOUND, f"{what} not found")


def access_denied(message: str = "access denied", **details: Any) -> ComputeError:
    return ComputeError(ErrorCode.ACCESS_DENIED, message, details)


def invalid_state(message: str, **details: Any) -> ComputeError:
    return ComputeError(ErrorCode.INVALID_STATE, message, details)


def claim_taken_over(reservation_id: str) -> ComputeError:
    """Another request with the same idempotency key took over this one's admission claim
    (this one stalled past the claim's age): it decides the key now, this one stops."""
    return ComputeError(
        ErrorCode.CONFLICT,
        "another request with this idempotency key took over its admission",
        {"reservationId": reservation_id},
    )


class StoreError(Exception):
    """The database could not be reached or answered unexpectedly (not a caller's mistake)."""
