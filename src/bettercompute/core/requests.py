"""The inputs of every reservation operation, their validation and their normalised form.

Why pydantic with ``extra="forbid"``: an unknown field is a caller's typo or a version skew, and
the guide makes it ``INVALID_INPUT`` naming the field. ``parse`` turns any validation failure
into that one error, so no door ever shows a pydantic traceback.

Normalisation (``normalized_request``) is the other half of idempotency: durations become
milliseconds, ``binding`` is defaulted and defaults are dropped, so ``'2h'`` and ``7200000``,
with or without ``binding: 'hold'``, hash alike (``request_hash``).

Pure: nothing here reads a clock, a database or the network.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from bettercompute.core import durations, errors

#: ``wait.timeoutMs`` above this is clamped, not refused: the guide caps a wait at 30 s.
MAX_WAIT_MS = 30_000
#: The last millisecond of 9999-12-31: no window may end later (timestamps stop there).
MAX_EPOCH_MS = 253_402_300_799_999

# Ids and keys are printable and bounded so they are safe in logs, URLs and Kubernetes names.
TenantId = Annotated[
    str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
]
ObjectId = Annotated[
    str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
]
IdempotencyKey = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]
MigProfile = Annotated[str, Field(pattern=r"^[1-7]g\.[1-9][0-9]{0,3}gb(\+me)?$")]

DeviceClass = Literal["gpu", "mig", "slot"]
Binding = Literal["hold", "kubernetes", "node", "instance"]


class Input(BaseModel):
    """An operation's input: unknown fields refused, an integral float read as its integer."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        # JSON has one number type, and JSON Schema's "integer" includes 168.0: an integral
        # float is the integer it equals. Strings, booleans and 1.5 stay refused (StrictInt).
        if not isinstance(data, dict):
            return data
        return {
            key: int(value) if isinstance(value, float) and value.is_integer() else value
            for key, value in data.items()
        }


class DeviceRequest(Input):
    device_class: DeviceClass = Field(alias="class")
    count: StrictInt = Field(ge=1, le=1024)
    topology: Literal["any", "nvlink-all"] = "any"
    profile: MigProfile | None = None

    @model_validator(mode="after")
    def _class_rules(self) -> DeviceRequest:
        if self.device_class == "mig" and self.profile is None:
            raise ValueError("a mig device needs a profile such as '1g.10gb'")
        if self.device_class != "mig" and self.profile is not None:
            raise ValueError("profile is only for class 'mig'")
        if self.topology == "nvlink-all" and self.device_class != "gpu":
            raise ValueError("topology 'nvlink-all' is only for whole GPUs (class 'gpu')")
        return self


class Gang(Input):
    size: StrictInt = Field(ge=1, le=1024)


class Resources(Input):
    vcpu: StrictInt = Field(default=0, ge=0, le=4096)
    memoryGiB: StrictInt = Field(default=0, ge=0, le=65_536)
    hugepages1Gi: StrictInt = Field(default=0, ge=0, le=65_536)


class NodeProfile(Input):
    profileId: ObjectId
    profileVersion: StrictInt | None = Field(default=None, ge=0)


class Wait(Input):
    timeoutMs: StrictInt = Field(ge=0)

    @field_validator("timeoutMs")
    @classmethod
    def _cap(cls, value: int) -> int:
        return min(value, MAX_WAIT_MS)


class CreateInput(Input):
    tenantId: TenantId
    poolId: ObjectId
    devices: list[DeviceRequest] = Field(min_length=1, max_length=16)
    gang: Gang | None = None
    duration: StrictInt | str
    start: StrictInt | None = Field(default=None, ge=0, le=MAX_EPOCH_MS)
    binding: Binding = "hold"
    resources: Resources | None = None
    spot: StrictBool = False
    leaseSeconds: StrictInt | None = Field(default=None, ge=60, le=30 * 86_400)
    projectId: ObjectId | None = None
    node: NodeProfile | None = None
    idempotencyKey: IdempotencyKey
    wait: Wait | None = None

    @field_validator("duration")
    @classmethod
    def _duration(cls, value: int | str) -> int:
        try:
            return durations.parse_duration_ms(value)
        except durations.DurationError as e:
            raise ValueError(str(e)) from e

    @model_validator(mode="after")
    def _window_fits_the_calendar(self) -> CreateInput:
        if self.start is not None and self.start + self.duration_ms > MAX_EPOCH_MS:
            raise PydanticCustomError(
                "window_too_late", "the window must end by 9999-12-31", {"field": "start"}
            )
        return self

    @model_validator(mode="after")
    def _binding_rules(self) -> CreateInput:
        if self.binding == "node":
            if self.node is None:
                raise ValueError("binding 'node' needs node: {profileId}")
            if self.spot:
                raise ValueError("binding 'node' cannot be spot")
        elif self.node is not None:
            raise ValueError("node is only for binding 'node'")
        return self

    @property
    def duration_ms(self) -> int:
        # The validator has turned the field into milliseconds; the union type stays for input.
        assert isinstance(self.duration, int)
        return self.duration

    @property
    def gang_size(self) -> int:
        return self.gang.size if self.gang else 1


class GetInput(Input):
    tenantId: TenantId
    reservationId: ObjectId


class WhoamiInput(Input):
    """``whoami``: no fields; the answer is the caller as the server authenticated it."""


class PoolsInput(Input):
    """``pools.list``: the pools the tenant owns or is offered, with what they hold now."""

    tenantId: TenantId


class QuotasInput(Input):
    """``quotas.get``: the tenant's quota rows, each with its limit and what is charged now."""

    tenantId: TenantId


class ListInput(Input):
    tenantId: TenantId
    scope: Literal["mine", "all"] = "mine"
    state: str | None = Field(default=None, max_length=32)
    poolId: ObjectId | None = None
    limit: StrictInt = Field(default=50, ge=1, le=200)
    cursor: ObjectId | None = None


class ReleaseInput(Input):
    tenantId: TenantId
    reservationId: ObjectId


class CancelInput(Input):
    tenantId: TenantId
    reservationId: ObjectId


class ExtendInput(Input):
    tenantId: TenantId
    reservationId: ObjectId
    until: StrictInt | None = Field(default=None, ge=0, le=MAX_EPOCH_MS)
    by: StrictInt | str | None = None
    idempotencyKey: IdempotencyKey

    @field_validator("by")
    @classmethod
    def _by(cls, value: int | str | None) -> int | None:
        if value is None:
            return None
        try:
            return durations.parse_duration_ms(value)
        except durations.DurationError as e:
            raise ValueError(str(e)) from e

    @model_validator(mode="after")
    def _exactly_one(self) -> ExtendInput:
        if (self.until is None) == (self.by is None):
            raise ValueError("give exactly one of 'until' (epoch ms) or 'by' (a duration)")
        return self


class RenewInput(Input):
    tenantId: TenantId
    reservationId: ObjectId


# --- event subscriptions (webhooks) ------------------------------------------------------------

#: Every type of event the outbox carries, i.e. what a subscription may name: the store's
#: ``journal.emit`` calls and admission's SQL (``reservation.pending``), owner offboarding's
#: ``reservation.reassigned`` included.
EventType = Literal[
    "reservation.pending",
    "reservation.queued",
    "reservation.placed",
    "reservation.repaired",
    "reservation.binding",
    "reservation.binding-rejected",
    "reservation.active",
    "reservation.extended",
    "reservation.preempting",
    "reservation.preempted",
    "reservation.failed",
    "reservation.released",
    "reservation.cancelled",
    "reservation.awaiting-confirmation",
    "reservation.expired",
    "reservation.reassigned",
]
EVENT_TYPES: tuple[str, ...] = get_args(EventType)
#: What a subscription's URL must look like: http or https, a host, then a path, query or
#: fragment, all printable ASCII (anything else percent-encoded). ASCII ranges, not ``\s``:
#: which characters ``\s`` means differs between regex dialects, and the OpenAPI document
#: states this pattern exactly as the server checks it.
WEBHOOK_URL_PATTERN = r'^https?://[!-"$-.0->@-~]+(?:[/?#][!-~]*)?$'
_WEBHOOK_URL = re.compile(WEBHOOK_URL_PATTERN)
DeliveryState = Literal["pending", "delivered", "dead"]


def _webhook_url(value: str) -> str:
    if not _WEBHOOK_URL.match(value):
        raise ValueError(
            "must be an http:// or https:// URL with a host, in printable ASCII (no spaces)"
        )
    # ``$`` also matches before a last newline (as JSON Schema's validators read the pattern
    # too); the URL kept is without it.
    return value.removesuffix("\n")


WebhookUrl = Annotated[
    str,
    Field(min_length=1, max_length=2048, json_schema_extra={"pattern": WEBHOOK_URL_PATTERN}),
    AfterValidator(_webhook_url),
]


class SubscriptionCreateInput(Input):
    """``events.subscriptions.create``: POST the tenant's events of ``eventTypes`` (none: all)
    to ``url``."""

    tenantId: TenantId
    url: WebhookUrl
    eventTypes: list[EventType] = Field(default_factory=list, max_length=len(EVENT_TYPES))


class SubscriptionListInput(Input):
    """``events.subscriptions.list``: the tenant's active subscriptions (never their secrets)."""

    tenantId: TenantId


class SubscriptionDeleteInput(Input):
    """``events.subscriptions.delete``: stop delivering to a subscription (its log stays)."""

    tenantId: TenantId
    subscriptionId: ObjectId


class DeliveryListInput(Input):
    """``events.deliveries.list``: a subscription's delivery log, newest event first."""

    tenantId: TenantId
    subscriptionId: ObjectId
    state: DeliveryState | None = None
    limit: StrictInt = Field(default=100, ge=1, le=500)


# --- delegated confirmation ---------------------------------------------------------------------

ConfirmationState = Literal["pending", "approved", "denied", "expired"]


class ConfirmationListInput(Input):
    """``confirmations.list``: the caller's confirmations, as the person asked and as the agent
    that asked, newest first."""

    tenantId: TenantId
    state: ConfirmationState | None = None
    limit: StrictInt = Field(default=50, ge=1, le=200)


class ConfirmationDecisionInput(Input):
    """``confirmations.approve`` and ``confirmations.deny``: the person's answer to one."""

    tenantId: TenantId
    confirmationId: ObjectId


M = TypeVar("M", bound=BaseModel)


#: ``capacity.search``: the default and the longest horizon it looks ahead.
SEARCH_HORIZON_DEFAULT_MS = 14 * 86_400_000
SEARCH_HORIZON_MAX_MS = 90 * 86_400_000


class SearchInput(CreateInput):
    """``capacity.search``: the create input (its ``idempotencyKey`` optional: a search stores
    nothing), plus where to look: ``from`` (epoch ms, default now), ``horizon`` (a duration:
    the latest start is ``from + horizon``; default 14 days, longer read as 90) and ``limit``
    (windows to answer, 1-50, default 5). ``start`` is not taken: the search finds it."""

    idempotencyKey: IdempotencyKey | None = None  # type: ignore[assignment]
    from_: StrictInt | None = Field(
        default=None,
        alias="from",
        ge=0,
        # Any window it can find ends by 9999-12-31.
        le=MAX_EPOCH_MS - durations.MAX_DURATION_MS - SEARCH_HORIZON_MAX_MS,
    )
    horizon: StrictInt | str | None = None
    limit: StrictInt = Field(default=5, ge=1, le=50)

    @field_validator("horizon")
    @classmethod
    def _horizon(cls, value: int | str | None) -> int:
        if value is None:
            return SEARCH_HORIZON_DEFAULT_MS
        try:
            ms = durations.parse_duration_ms(value)
        except durations.DurationError as e:
            raise ValueError(str(e)) from e
        return min(ms, SEARCH_HORIZON_MAX_MS)  # never further ahead than 90 days

    @model_validator(mode="after")
    def _no_start(self) -> SearchInput:
        if self.start is not None:
            raise PydanticCustomError(
                "start_not_searched",
                "not taken by a search: give 'from' (the earliest start to consider)",
                {"field": "start"},
            )
        return self

    @property
    def horizon_ms(self) -> int:
        return int(self.horizon or SEARCH_HORIZON_DEFAULT_MS)


def parse(model: type[M], data: Any) -> M:
    """Validate ``data`` into ``model`` or raise ``INVALID_INPUT`` naming the first bad field."""
    if not isinstance(data, dict):
        raise errors.invalid_input("body", "must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        field = (first.get("ctx") or {}).get("field") or _field_path(first.get("loc", ()))
        if first.get("type") == "extra_forbidden":
            # Quote a name that would otherwise be invisible (empty, or only spaces).
            shown = field if field.strip() and field == field.strip() else repr(field)
            raise errors.invalid_input(shown, "unknown field") from None
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise errors.invalid_input(field or "body", message) from None


def _field_path(loc: tuple[int | str, ...] | Any) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def normalized_request(value: CreateInput) -> dict[str, Any]:
    """The stored ``request``: what was asked for, in one canonical shape.

    Durations are milliseconds (``"28800000ms"``), ``binding`` is always present, and other
    defaults (``topology: 'any'``, ``spot: false``, absent options) are left out, so two ways of
    writing the same request produce the same dict.
    """
    devices = []
    for d in value.devices:
        device: dict[str, Any] = {"class": d.device_class, "count": d.count}
        if d.topology != "any":
            device["topology"] = d.topology
        if d.profile is not None:
            device["profile"] = d.profile
        devices.append(device)
    request: dict[str, Any] = {
        "poolId": value.poolId,
        "devices": devices,
        "duration": durations.format_ms(value.duration_ms),
        "binding": value.binding,
    }
    if value.gang is not None and value.gang.size > 1:
        request["gang"] = {"size": value.gang.size}
    if value.start is not None:
        request["start"] = value.start
    if value.resources is not None:
        request["resources"] = value.resources.model_dump()
    if value.spot:
        request["spot"] = True
    if value.leaseSeconds is not None:
        request["leaseSeconds"] = value.leaseSeconds
    if value.projectId is not None:
        request["projectId"] = value.projectId
    if value.node is not None:
        request["node"] = value.node.model_dump(exclude_none=True)
    return request


def request_hash(tenant_id: str, request: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of the normalised input without ``wait`` and the key."""
    canonical = json.dumps(
        {"tenantId": tenant_id, **request},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def extend_hash(value: ExtendInput) -> str:
    canonical = json.dumps(
        {
            "tenantId": value.tenantId,
            "reservationId": value.reservationId,
            "until": value.until,
            "by": value.by,
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
