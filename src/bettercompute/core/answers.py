"""The shapes every operation answers with, and the row a decision on a reservation is made from.

Why TypedDicts: the answers are JSON objects end to end (the store builds them, the service
returns them, the HTTP API sends them, the CLI and the operator read them); a TypedDict names
every key for the type checker without changing one byte of the JSON. ``api.openapi`` generates
the answers' schemas from these types (pydantic), so the document cannot drift from them, and
tests validate real answers against them, closed: a key they do not name fails.

What it must never do: hold behaviour, or a key the guide's reservation object does not have.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import ConfigDict, Field, WithJsonSchema, with_config

# pydantic reads a TypedDict's keys at runtime only from typing_extensions' on Python 3.11.
from typing_extensions import TypedDict

from bettercompute.core import states

# Closed, so that a test validating a real answer against these types fails on a key they miss.
_CLOSED = ConfigDict(extra="forbid")


Ms = Annotated[int, Field(description="Epoch milliseconds.")]
#: Host resources by name (vcpu, memoryGiB, hugepages1Gi).
HostFigures = dict[str, int]


@with_config(_CLOSED)
class Window(TypedDict):
    """A booked window: epoch milliseconds, ``end`` exclusive."""

    start: Ms
    end: Annotated[int, Field(description="Epoch milliseconds, exclusive.")]


@with_config(_CLOSED)
class OperationError(TypedDict):
    code: str
    message: str


@with_config(_CLOSED)
class Operation(TypedDict):
    """The long-running operation of a create: running, pending, succeeded or failed."""

    id: str
    state: Literal["running", "pending", "succeeded", "failed"]
    error: NotRequired[OperationError]


@with_config(_CLOSED)
class Reservation(TypedDict):
    """The reservation object, as ``get`` and every change answer it."""

    id: Annotated[str, Field(pattern="^rsv_")]
    tenantId: str
    poolId: str
    state: Annotated[str, WithJsonSchema({"enum": [s.value for s in states.State]})]
    request: Annotated[dict[str, Any], Field(description="The normalised request as stored.")]
    during: Annotated[Window | None, Field(description="The booked window; null until placed.")]
    ownerIdentityId: str
    idempotencyKey: str
    conditions: list[dict[str, Any]]
    binding: dict[str, Any] | None
    operation: Operation
    version: int
    createdAt: Ms
    updatedAt: Ms
    requestedStart: NotRequired[Ms]
    leaseExpiresAt: NotRequired[Ms]
    releaseReason: NotRequired[str]
    hostShare: NotRequired[HostFigures]
    resourceName: NotRequired[
        Annotated[
            str,
            Field(
                description="The extended resource a kubernetes binding's devices are advertised"
                " as, which only pods labelled with this reservation may ask for."
            ),
        ]
    ]


@with_config(_CLOSED)
class ReservationList(TypedDict):
    """A page of reservations, newest first."""

    items: list[Reservation]
    nextCursor: Annotated[
        str | None,
        Field(description="Pass as 'cursor' for the next page; null on the last page."),
    ]


@with_config(_CLOSED)
class ExtendResult(TypedDict):
    """What ``extend`` answers: the reservation, whether it was extended, and when another
    booking starts first, until when it could be."""

    reservation: Reservation
    extended: bool
    availableUntil: NotRequired[
        Annotated[int, Field(description="When another booking starts first: how far it could.")]
    ]


@with_config(_CLOSED)
class NodeDevices(TypedDict):
    nodeId: str
    deviceIds: list[str]


_NEVER = (
    "true: no node of the pool could hold it even with every device free (message starts"
    " 'never fits this pool:'); waiting will not help."
)
_RESOURCES = (
    "What each node would book of its host (vcpu, memoryGiB, hugepages1Gi): the request's"
    " resources, raised to the pool's share."
)
_SHARE = (
    "The part of it that is the pool's per-GPU share (rides on the GPUs' quota); {} when the"
    " pool has none."
)


@with_config(_CLOSED)
class Preview(TypedDict):
    """Whether a create would fit now and where (no booking, no decision)."""

    fits: bool
    poolId: str
    during: Window
    nodeIds: list[str]
    devices: list[NodeDevices]
    message: Annotated[str, Field(description="'fits', or the placer's summary.")]
    resources: Annotated[HostFigures, Field(description=_RESOURCES)]
    hostShare: Annotated[HostFigures, Field(description=_SHARE)]
    never: Annotated[bool, Field(description=_NEVER)]
    rejected: Annotated[
        dict[str, int],
        Field(description="Nodes rejected per filter (ready, labels, health, capacity …)."),
    ]


@with_config(_CLOSED)
class Whoami(TypedDict):
    """The caller as the server authenticated it."""

    identityId: str
    tenantId: str
    kind: str
    groups: list[str]


@with_config(_CLOSED)
class DeviceFigures(TypedDict):
    total: int
    healthy: int
    booked: Annotated[int, Field(description="Booked now.")]
    bound: Annotated[int, Field(description="Of the booked, held by an active reservation.")]
    free: Annotated[int, Field(description="Healthy, unbooked, on a ready node.")]


@with_config(_CLOSED)
class PoolHolding(TypedDict):
    """A pool and what it holds now."""

    poolId: str
    name: str
    region: str
    gpuModel: str | None
    sharing: str
    nodes: int
    nodesReady: int
    devices: Annotated[
        dict[str, DeviceFigures], Field(description="By device class: gpu, mig, slot.")
    ]
    nextFreeAt: NotRequired[
        Annotated[int, Field(description="When none is free: when the first booked one frees.")]
    ]


@with_config(_CLOSED)
class PoolList(TypedDict):
    """The pools the tenant owns or is offered."""

    items: list[PoolHolding]


@with_config(_CLOSED)
class QuotaRow(TypedDict):
    resource: Annotated[
        str,
        Field(description="gpu:<model>, gpuSlices:<model>, vcpu, memoryGiB or hugepages1Gi."),
    ]
    limit: int
    used: Annotated[
        int,
        Field(description="Charged now by live reservations (may exceed a lowered limit)."),
    ]


@with_config(_CLOSED)
class QuotaList(TypedDict):
    """The tenant's quota; a resource not listed grants nothing."""

    tenantId: str
    quotas: list[QuotaRow]


_GPU_SECONDS = "Devices × seconds billed: a whole GPU, a MIG instance and a slot each count one."
_EQ_SECONDS = (
    "Seconds billed, each device weighed in whole GPUs "
    "(a GPU 1, a MIG instance 1/7, a slot 1/replicas)."
)


@with_config(_CLOSED)
class UsageFigures(TypedDict):
    """What was billed: from bound to release or end, never past the end."""

    gpuSeconds: Annotated[float, Field(description=_GPU_SECONDS)]
    gpuEquivalentSeconds: Annotated[float, Field(description=_EQ_SECONDS)]
    gpuHours: Annotated[float, Field(description="gpuEquivalentSeconds / 3600.")]


@with_config(_CLOSED)
class UsageRow(TypedDict):
    """One bucket of a usage report, with the key of what it groups by."""

    gpuSeconds: Annotated[float, Field(description=_GPU_SECONDS)]
    gpuEquivalentSeconds: Annotated[float, Field(description=_EQ_SECONDS)]
    gpuHours: Annotated[float, Field(description="gpuEquivalentSeconds / 3600.")]
    poolId: NotRequired[Annotated[str | None, Field(description="With by 'pool'.")]]
    projectId: NotRequired[
        Annotated[str | None, Field(description="With by 'project'; null: no projectId.")]
    ]
    day: NotRequired[Annotated[int, Field(description="With by 'day': the UTC day's start, ms.")]]


@with_config(_CLOSED)
class UsageReport(TypedDict):
    """The tenant's billed usage in ``[from, to)``; ``items`` empty unless ``by`` is given."""

    tenantId: str
    from_: Annotated[int, Field(alias="from", description="Epoch milliseconds.")]
    to: Annotated[int, Field(description="Epoch milliseconds, exclusive.")]
    by: Literal["pool", "project", "day"] | None
    items: list[UsageRow]
    total: UsageFigures


@with_config(_CLOSED)
class FoundWindow(TypedDict):
    start: Ms
    end: Ms
    nodeIds: list[str]


@with_config(_CLOSED)
class SearchResult(TypedDict):
    """The earliest windows a create would fit in (no booking, no decision)."""

    poolId: str
    from_: Annotated[int, Field(alias="from", description="The earliest start considered (ms).")]
    horizonEnd: Annotated[int, Field(description="The latest start considered (ms).")]
    windows: Annotated[
        list[FoundWindow],
        Field(description="In start order; each is what a preview at its start answers."),
    ]
    never: Annotated[bool, Field(description=_NEVER)]
    message: str
    resources: Annotated[HostFigures, Field(description=_RESOURCES)]
    hostShare: Annotated[HostFigures, Field(description=_SHARE)]


@with_config(_CLOSED)
class Subscription(TypedDict):
    """A webhook subscription: the tenant's events POSTed, signed, to ``url``."""

    id: str
    tenantId: str
    url: str
    eventTypes: Annotated[list[str], Field(description="The types delivered; empty: every type.")]
    state: Literal["active", "disabled"]
    createdBy: str
    createdAt: Ms
    secret: NotRequired[
        Annotated[
            str,
            Field(
                description="The HMAC-SHA256 key of the signatures (64 hex digits): in the "
                "answer of create only, never shown again."
            ),
        ]
    ]


@with_config(_CLOSED)
class SubscriptionList(TypedDict):
    """The tenant's active subscriptions, oldest first (without their secrets)."""

    items: list[Subscription]


@with_config(_CLOSED)
class Delivery(TypedDict):
    """One event's delivery to one subscription: its attempts and where it stands."""

    subscriptionId: str
    eventId: int
    eventType: str
    reservationId: str
    state: Literal["pending", "delivered", "dead"]
    attempts: int
    lastStatus: Annotated[
        int | None, Field(description="The receiver's last HTTP status; null: none answered.")
    ]
    lastError: str | None
    createdAt: Ms
    firstAttemptAt: Ms | None
    nextAttemptAt: Annotated[Ms | None, Field(description="While pending: the next attempt.")]
    deliveredAt: Ms | None


@with_config(_CLOSED)
class DeliveryList(TypedDict):
    """A subscription's delivery log, newest event first."""

    items: list[Delivery]


@with_config(_CLOSED)
class Confirmation(TypedDict):
    """A person's confirmation of what an agent acting for them asked (delegated confirmation)."""

    id: Annotated[str, Field(pattern="^cnf_")]
    tenantId: str
    reservationId: str
    action: Annotated[str, Field(description="The action held, e.g. compute:reservations:create.")]
    personId: Annotated[str, Field(description="Who may approve or deny it.")]
    agentId: Annotated[str, Field(description="The agent that asked, acting for the person.")]
    state: Literal["pending", "approved", "denied", "expired"]
    request: Annotated[dict[str, Any], Field(description="The reservation's request as stored.")]
    createdAt: Ms
    expiresAt: Annotated[int, Field(description="The deadline, epoch milliseconds.")]
    decidedAt: Ms | None
    decidedBy: str | None


@with_config(_CLOSED)
class ConfirmationList(TypedDict):
    """Confirmations naming the caller as the person or as the agent, newest first."""

    items: list[Confirmation]


@with_config(_CLOSED)
class TimelinePool(TypedDict):
    id: str
    name: str
    sharing: str
    model: str | None
    horizon: Annotated[
        int,
        Field(description="Two weeks ahead, or the end of the pool's last booking if later (ms)."),
    ]


@with_config(_CLOSED)
class TimelineDevice(TypedDict):
    id: Annotated[str, Field(description="The device's id (GPU or MIG UUID, slot id).")]
    label: Annotated[str, Field(description="'GPU 0', 'GPU 0 · 1g.10gb #2', 'GPU 0 · slot 3'.")]
    kind: Literal["gpu", "mig", "slot"]
    healthy: bool


@with_config(_CLOSED)
class TimelineNode(TypedDict):
    id: str
    name: str
    healthy: Annotated[bool, Field(description="Ready and connected: bookable.")]
    maintenance: Annotated[
        bool, Field(description="Connected but not ready (cordoned, drained): no new booking.")
    ]
    devices: list[TimelineDevice]


@with_config(_CLOSED)
class TimelineReservation(TypedDict):
    """One of the caller's own reservations on the timeline."""

    id: str
    name: Annotated[str, Field(description="Its Kubernetes object's namespace/name, else its key.")]
    state: str
    spot: bool
    gpus: Annotated[int, Field(description="Devices asked for, all gang members together.")]
    start: Ms | None
    end: Ms | None
    labels: dict[str, str]


@with_config(_CLOSED)
class TimelinePending(TypedDict):
    id: str
    name: str
    state: str
    gpus: int
    requestedStart: Ms | None


#: ``[nodeIndex, [deviceIndex, …], start, end, stateCode, ref]``: ``ref`` indexes
#: ``reservations`` for the caller's own bookings and is null for everyone else's (whose
#: ``stateCode`` is 0, ``busy``).
TimelineBooking = Annotated[
    list[Any],
    WithJsonSchema(
        {
            "type": "array",
            "prefixItems": [
                {"type": "integer", "minimum": 0},
                {"type": "array", "items": {"type": "integer", "minimum": 0}},
                {"type": "integer"},
                {"type": "integer"},
                {"type": "integer", "minimum": 0},
                {"type": ["integer", "null"], "minimum": 0},
            ],
            "minItems": 6,
            "maxItems": 6,
        }
    ),
]


@with_config(_CLOSED)
class Timeline(TypedDict):
    """A pool's bookings in ``[from, to)``, compact: devices and reservations by index."""

    pool: TimelinePool
    now: Ms
    from_: Annotated[int, Field(alias="from", description="Epoch milliseconds.")]
    to: Annotated[int, Field(description="Epoch milliseconds, exclusive.")]
    nodes: list[TimelineNode]
    bookings: list[TimelineBooking]
    states: Annotated[list[str], Field(description="What a booking's stateCode indexes.")]
    reservations: list[TimelineReservation]
    pending: list[TimelinePending]


@with_config(_CLOSED)
class Transition(TypedDict):
    at: Annotated[str, Field(description="RFC 3339, UTC.")]
    from_: Annotated[str | None, Field(alias="from")]
    to: str
    reason: str | None
    actor: Annotated[str | None, Field(description="Who made it, when a caller did.")]


@with_config(_CLOSED)
class HistoryEvent(TypedDict):
    type: str
    at: Annotated[str, Field(description="RFC 3339, UTC.")]
    message: NotRequired[str]


@with_config(_CLOSED)
class History(TypedDict):
    """A reservation's state transitions and its events, oldest first."""

    items: list[Transition]
    events: list[HistoryEvent]


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
