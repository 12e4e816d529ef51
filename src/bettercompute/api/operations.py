"""The table of API operations: path, service method, input model and answer, one row each.

Why a table: the routes, the OpenAPI document and the metrics labels are all read from it, so
an operation cannot be served without being documented, or documented under another name.
Data only: nothing here handles a request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from bettercompute.core import answers, requests, timelines, usage

PREFIX = "/api/compute"


@dataclass(frozen=True)
class Operation:
    #: The guide's name, e.g. ``reservations.create``; also the metrics label.
    name: str
    #: The ``ReservationService`` method that serves it.
    method: str
    #: The pydantic model its body is validated with (by the service).
    model: type[BaseModel]
    #: The component name of its answer's schema in the OpenAPI document.
    answer: str
    summary: str
    #: Fields of ``model`` that this operation does not require (preview: ``idempotencyKey``).
    optional: tuple[str, ...] = ()

    @property
    def path(self) -> str:
        return f"{PREFIX}/{self.name.replace('.', '/')}"

    @property
    def schema_name(self) -> str:
        """The component name of its input's schema."""
        return "PreviewInput" if self.optional else self.model.__name__


OPERATIONS: tuple[Operation, ...] = (
    Operation(
        name="reservations.create",
        method="create",
        model=requests.CreateInput,
        answer="Reservation",
        summary="Reserve devices of a pool for a window: draft, one decision, quota, placement",
    ),
    Operation(
        name="reservations.get",
        method="get",
        model=requests.GetInput,
        answer="Reservation",
        summary="Read one reservation (drafts are NOT_FOUND)",
    ),
    Operation(
        name="reservations.list",
        method="list",
        model=requests.ListInput,
        answer="ReservationList",
        summary="List the caller's (scope 'mine') or the tenant's (scope 'all') reservations",
    ),
    Operation(
        name="reservations.release",
        method="release",
        model=requests.ReleaseInput,
        answer="Reservation",
        summary="End a reservation now (a pending one is cancelled)",
    ),
    Operation(
        name="reservations.cancel",
        method="cancel",
        model=requests.CancelInput,
        answer="Reservation",
        summary="Withdraw a reservation that has not started (pending or placed)",
    ),
    Operation(
        name="reservations.extend",
        method="extend",
        model=requests.ExtendInput,
        answer="ExtendResult",
        summary="Move the end later: exactly one of 'until' or 'by', decided like a create",
    ),
    Operation(
        name="reservations.renew",
        method="renew",
        model=requests.RenewInput,
        answer="Reservation",
        summary="Renew the lease of a reservation created with leaseSeconds",
    ),
    Operation(
        name="capacity.preview",
        method="preview",
        model=requests.CreateInput,
        answer="Preview",
        summary="Whether a create would fit and where (no booking, no decision)",
        optional=("idempotencyKey",),
    ),
    Operation(
        name="reservations.history",
        method="history",
        model=timelines.HistoryInput,
        answer="History",
        summary="A reservation's state transitions (who, why) and its events, oldest first",
    ),
    Operation(
        name="whoami",
        method="whoami",
        model=requests.WhoamiInput,
        answer="Whoami",
        summary="The caller as authenticated: identity, tenant, kind, groups",
    ),
    Operation(
        name="pools.list",
        method="pools",
        model=requests.PoolsInput,
        answer="PoolList",
        summary="The tenant's pools and what they hold now: devices total, booked and free",
    ),
    Operation(
        name="pools.timeline",
        method="timeline",
        model=timelines.TimelineInput,
        answer="Timeline",
        summary="A pool's bookings in a window: the tenant's by name, everyone else's as busy",
    ),
    Operation(
        name="quotas.get",
        method="quotas",
        model=requests.QuotasInput,
        answer="QuotaList",
        summary="The tenant's quota: per resource its limit and what is charged now",
    ),
    Operation(
        name="usage.report",
        method="usage_report",
        model=usage.UsageReportInput,
        answer="UsageReport",
        summary="The tenant's billed GPU usage in a span, by pool, project or day",
    ),
    Operation(
        name="capacity.search",
        method="search",
        model=requests.SearchInput,
        answer="SearchResult",
        summary="The earliest windows a create would fit in (no booking, no decision)",
    ),
    Operation(
        name="events.subscriptions.create",
        method="subscriptions_create",
        model=requests.SubscriptionCreateInput,
        answer="Subscription",
        summary="POST the tenant's events to a URL, signed; answers the secret, once",
    ),
    Operation(
        name="events.subscriptions.list",
        method="subscriptions_list",
        model=requests.SubscriptionListInput,
        answer="SubscriptionList",
        summary="The tenant's webhook subscriptions (without their secrets)",
    ),
    Operation(
        name="events.subscriptions.delete",
        method="subscriptions_delete",
        model=requests.SubscriptionDeleteInput,
        answer="Subscription",
        summary="Stop delivering to a subscription; its pending deliveries end dead",
    ),
    Operation(
        name="events.deliveries.list",
        method="deliveries_list",
        model=requests.DeliveryListInput,
        answer="DeliveryList",
        summary="A subscription's delivery log: per event its attempts, status and state",
    ),
    Operation(
        name="confirmations.list",
        method="confirmations_list",
        model=requests.ConfirmationListInput,
        answer="ConfirmationList",
        summary="Confirmations naming the caller: as the person to ask, or the agent that asked",
    ),
    Operation(
        name="confirmations.approve",
        method="confirmations_approve",
        model=requests.ConfirmationDecisionInput,
        answer="Confirmation",
        summary="Approve what an agent asked for you; its retry with the same key proceeds",
    ),
    Operation(
        name="confirmations.deny",
        method="confirmations_deny",
        model=requests.ConfirmationDecisionInput,
        answer="Confirmation",
        summary="Deny what an agent asked for you; the reservation is denied",
    ),
)

BY_NAME: Mapping[str, Operation] = {op.name: op for op in OPERATIONS}

#: What an operation answers: a reservation (create, get, release, cancel, renew), a page of
#: them (list), an extension (extend), or a preview (``store.previewing``'s plain object).
Answer = answers.Reservation | answers.ReservationList | answers.ExtendResult | dict[str, Any]


def outcome(operation: Operation, data: Answer) -> str:
    """The metrics outcome of a successful answer (bounded: states and fixed words only)."""
    if operation.method == "create":
        return str(data.get("state", "ok"))
    if operation.method == "extend":
        return "extended" if data.get("extended") else "not-extended"
    if operation.method == "preview":
        return "fits" if data.get("fits") else "no-fit"
    if operation.method == "search":
        return "found" if data.get("windows") else "none"
    return "ok"
