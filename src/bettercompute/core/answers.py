"""The shapes the reservation operations answer with, and the row a decision on one is made from.

Why TypedDicts: the answers are JSON objects end to end (the store builds them, the service
returns them, the HTTP API sends them, the CLI and the operator read them), and their shape is
the guide's; a TypedDict names every key for the type checker without changing one byte of the
JSON. ``api.openapi`` documents the same keys (a test holds the two together).

What it must never do: hold behaviour, or a key the guide's reservation object does not have.
"""

from __future__ import annotations

from typing import Any, NotRequired

from pydantic import ConfigDict, with_config

# pydantic reads a TypedDict's keys at runtime only from typing_extensions' on Python 3.11.
from typing_extensions import TypedDict

# Closed, so that a test validating a real answer against these types fails on a key they miss.
_CLOSED = ConfigDict(extra="forbid")


@with_config(_CLOSED)
class Window(TypedDict):
    #: Epoch milliseconds; ``end`` is exclusive.
    start: int
    end: int


@with_config(_CLOSED)
class Reservation(TypedDict):
    """The guide's reservation object, as ``get`` and every change answer it."""

    id: str
    tenantId: str
    poolId: str
    state: str
    #: The normalised request as stored (``core.requests.normalized_request``).
    request: dict[str, Any]
    #: The booked window; ``None`` until placed.
    during: Window | None
    ownerIdentityId: str
    idempotencyKey: str
    conditions: list[dict[str, Any]]
    binding: dict[str, Any] | None
    #: ``core.states.operation``.
    operation: dict[str, Any]
    version: int
    createdAt: int
    updatedAt: int
    requestedStart: NotRequired[int]
    leaseExpiresAt: NotRequired[int]
    releaseReason: NotRequired[str]
    hostShare: NotRequired[dict[str, Any]]
    #: A ``kubernetes`` binding in a pool of pod access ``reservation``: the extended resource
    #: its devices are advertised as (``bcd.dev/rsv-…``), which only its pods may ask for.
    resourceName: NotRequired[str]


@with_config(_CLOSED)
class ReservationList(TypedDict):
    items: list[Reservation]
    nextCursor: str | None


@with_config(_CLOSED)
class ExtendResult(TypedDict):
    """What ``extend`` answers: the reservation, whether it was extended, and when another
    booking starts first, until when it could be."""

    reservation: Reservation
    extended: bool
    availableUntil: NotRequired[int]


class AuthorizationRow(TypedDict):
    """What a read, release or extend decision sees of a stored reservation and its pool."""

    tenant_id: str
    owner_identity_id: str
    #: The decision attributes recorded at admission (``core.attributes``).
    attributes: dict[str, Any]
    state: str
    pool_id: str
    owner_tenant_id: str
    region: str
    gpu_model: str | None
