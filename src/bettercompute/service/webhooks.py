"""Delivering events to webhook subscriptions: fan-out from the outbox, then signed POSTs.

Why a loop of its own: a receiver is someone else's server, slow or down for hours, and must
never hold back the in-process subscribers of ``service/events.py``. So new outbox events are
first fanned out to ``event_deliveries`` rows (cursor ``webhooks``, moved in the same
transaction: at least once, a repeat is a no-op), then due deliveries are claimed and POSTed
with httpx, each signed::

    X-Better-Compute-Signature: sha256=<hex HMAC-SHA256(secret, f"{timestamp}.{body}")>

A 2xx answer delivers it; anything else (another status, a refused connection, a timeout) is
retried with exponential backoff (1 s doubling, capped at 10 min, jittered) until 24 h after
its first attempt, then it is ``dead`` and stays in the delivery log. Within one subscription a
reservation's events go in order: one waits while an earlier one of the same reservation is
pending (``store/subscriptions.py`` claims only the earliest).

A subscription's URL is a tenant's, so every connection goes through ``service.egress``: only
to addresses ``core.egress`` allows (global ones, and the operator's allowlist), checked after
DNS resolution at each attempt, no redirects followed. The delivery log says what the receiver
answered (its status) or a generic text (``UNREACHABLE``, a timeout), never why a connection
failed, which address was tried or which port: that would map the cluster's network for
whoever subscribes.

The same rule is applied early, when a subscription is made or its URL changed
(``check_url``): a URL whose host is an address the deliveries would refuse (written out in
any form, or ``localhost``) is ``INVALID_INPUT`` on ``url``, unless the operator's allowlist
takes it. Names are not resolved then (see ``core.egress``). A service not told the allowlist
refuses there only what no allowlist can allow, the cloud metadata addresses.

The functions at the end are what the operator's ``EventSubscription`` objects need beside
the API's create and delete (``operator/subscribing.py``): an update in place, the
subscriptions an object made, and the delivery log in figures.

What it must never do: end on a store error or on a receiver's failure (it logs, waits and goes
on), send a delivery that is not claimed, put the secret anywhere but the HMAC key, connect
to an address the egress policy refuses, or put network details in the delivery log.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from bettercompute import supervising
from bettercompute.core import answers, errors, requests
from bettercompute.core.egress import EgressPolicy
from bettercompute.core.errors import StoreError
from bettercompute.service import egress
from bettercompute.store import listening, subscriptions
from bettercompute.store.database import Database

log = logging.getLogger(__name__)

#: The outbox cursor of the fan-out.
SUBSCRIBER = "webhooks"
EVENT_HEADER = "X-Better-Compute-Event"
DELIVERY_HEADER = "X-Better-Compute-Delivery"
TIMESTAMP_HEADER = "X-Better-Compute-Timestamp"
SIGNATURE_HEADER = "X-Better-Compute-Signature"
#: The delivery log's error for every attempt that reached no receiver: refused, unresolvable,
#: not allowed by the egress policy, or no connection within the timeout.
UNREACHABLE = "the receiver could not be reached"


#: The allowlist assumed where the operator's is not known: anything an allowlist could allow
#: passes the early check, so only the cloud metadata addresses are refused there (every
#: delivery still checks with the real one).
UNKNOWN_ALLOWLIST = EgressPolicy(
    networks=(ipaddress.IPv4Network("0.0.0.0/0"), ipaddress.IPv6Network("::/0"))
)


def check_url(url: str, allowlist: EgressPolicy | None, *, field: str = "url") -> None:
    """``INVALID_INPUT`` naming ``field`` when no delivery to ``url`` could ever be made: its
    host is an address (or ``localhost``) that neither is public nor on ``allowlist``
    (``None``: not known here, see ``UNKNOWN_ALLOWLIST``)."""
    refused = egress.url_refusal(url, allowlist or UNKNOWN_ALLOWLIST)
    if refused is None:
        return
    host, why = refused
    if why == "a cloud metadata address":
        reason = f"{host} is a cloud metadata address: webhooks are never delivered there"
    else:
        reason = (
            f"{host} is not a public address ({why}): webhooks are delivered only to public "
            "addresses and to those the operator allows"
        )
    raise errors.invalid_input(field, reason, host=host)


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The signature header's value: ``sha256=`` and the hex HMAC-SHA256, keyed with the
    secret's text, of ``<timestamp>.<body>``."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"sha256={digest.hexdigest()}"


def body_of(event: dict[str, Any]) -> bytes:
    """The JSON sent: ``{id, type, reservationId, at, data}``, compact."""
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Retries:
    """When a failed delivery is tried again: ``base_s`` doubling per attempt, at most
    ``cap_s``, jittered down by up to ``jitter`` of it; dead once ``deadline_s`` has passed
    since its first attempt."""

    base_s: float = 1.0
    cap_s: float = 600.0
    deadline_s: float = 86_400.0
    jitter: float = 0.2

    def delay_s(self, attempts: int, *, rand: Callable[[], float] = random.random) -> float:
        full = min(self.cap_s, self.base_s * 2.0 ** max(0, attempts - 1))
        return full * (1.0 - self.jitter * rand())


class WebhookDelivery:
    """Fans new events out to the subscriptions that want them and POSTs what is due."""

    def __init__(
        self,
        db: Database,
        *,
        retries: Retries | None = None,
        egress: EgressPolicy | None = None,
        timeout_s: float = 10.0,
        poll_s: float = 5.0,
        batch: int = 50,
    ):
        self.db = db
        self.retries = retries or Retries()
        # Global addresses only, unless the operator allowed more (``core.egress``).
        self.egress = egress or EgressPolicy()
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.batch = batch
        self._wake = asyncio.Event()

    async def fan_out(self) -> int:
        """Turn every event after the cursor into pending deliveries; returns how many events."""
        total = 0
        while n := await subscriptions.fan_out(self.db, subscriber=SUBSCRIBER):
            total += n
        return total

    async def send_due(self, client: httpx.AsyncClient) -> int:
        """POST every delivery due now, batch by batch; returns how many were attempted."""
        total = 0
        while True:
            # The claim outlasts an attempt, so no other sender takes one while it is in flight.
            due = await subscriptions.claim_due(
                self.db, limit=self.batch, lease_s=self.timeout_s * 3
            )
            if not due:
                return total
            await asyncio.gather(*(self._attempt(client, d) for d in due))
            total += len(due)

    async def _attempt(self, client: httpx.AsyncClient, due: subscriptions.Due) -> None:
        body = body_of(due.event)
        timestamp = int(time.time())
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "better-compute-webhooks",
            EVENT_HEADER: str(due.event["type"]),
            DELIVERY_HEADER: str(due.event_id),
            TIMESTAMP_HEADER: str(timestamp),
            SIGNATURE_HEADER: sign(due.secret, timestamp, body),
        }
        status: int | None = None
        try:
            response = await client.post(
                due.url, content=body, headers=headers, timeout=self.timeout_s
            )
            status = response.status_code
            if 200 <= status < 300:
                await subscriptions.delivered(
                    self.db,
                    subscription_id=due.subscription_id,
                    event_id=due.event_id,
                    status=status,
                )
                return
            error = f"HTTP {status}"
            if response.is_redirect:
                error += ": redirects are not followed"
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            # Refused, unresolvable, blocked by the egress policy or silent: one text for all,
            # so the log never tells a tenant which internal ports are open (``service.egress``
            # logs the details for the operator).
            log.info("webhook delivery to %s: cannot connect: %s", due.subscription_id, e)
            error = UNREACHABLE
        except httpx.TimeoutException:
            error = f"no answer within {self.timeout_s:g} seconds"
        except httpx.HTTPError as e:
            log.info("webhook delivery to %s failed: %r", due.subscription_id, e)
            error = "the receiver did not send a valid HTTP answer"
        except ValueError:  # a URL httpx cannot send to
            error = "the URL cannot be sent to"
        state = await subscriptions.failed(
            self.db,
            subscription_id=due.subscription_id,
            event_id=due.event_id,
            status=status,
            error=error,
            retry_in_s=self.retries.delay_s(due.attempts),
            deadline_s=self.retries.deadline_s,
        )
        if state == "dead":
            log.warning(
                "webhook delivery of event %s to %s is dead after %d attempts: %s",
                due.event_id,
                due.subscription_id,
                due.attempts,
                error,
            )

    async def run(self) -> None:
        """Until cancelled: fan out, send, then wait for a new event, the next due delivery or
        ``poll_s``, whichever is first."""
        listener = asyncio.create_task(
            listening.wake_on(self.db, "compute_outbox", self._wake), name="webhooks-listen"
        )
        backoff = supervising.Backoff()
        failing = ""
        try:
            async with egress.client(self.egress, timeout_s=self.timeout_s) as client:
                while True:
                    self._wake.clear()
                    try:
                        await self.fan_out()
                        await self.send_due(client)
                        due_in = await subscriptions.next_due_in(self.db)
                    except StoreError as e:
                        if str(e) != failing:
                            log.warning("webhook delivery failed, retrying: %s", e)
                        failing = str(e)
                        await backoff.wait()
                        continue
                    if failing:
                        log.info("webhook delivery succeeds again")
                        failing = ""
                    backoff.reset()
                    wait_s = self.poll_s if due_in is None else min(self.poll_s, max(due_in, 0.01))
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait_s):
                            await self._wake.wait()
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener


# --- for the operator's EventSubscription objects -----------------------------------------------


async def update_subscription(
    db: Database,
    *,
    tenant_id: str,
    subscription_id: str,
    url: str,
    event_types: Sequence[str],
    allowlist: EgressPolicy | None = None,
) -> answers.Subscription | None:
    """Point an active subscription at another URL and event types, checked as
    ``events.subscriptions.create`` checks them (INVALID_INPUT, the URL's host against
    ``allowlist`` too: ``check_url``); its secret and log stay. ``None`` when the tenant has no
    such active subscription."""
    value = requests.parse(
        requests.SubscriptionCreateInput,
        {"tenantId": tenant_id, "url": url, "eventTypes": list(event_types)},
    )
    check_url(value.url, allowlist)
    return await subscriptions.update(
        db,
        tenant_id=value.tenantId,
        subscription_id=subscription_id,
        url=value.url,
        event_types=value.eventTypes,
    )


async def is_active(db: Database, *, tenant_id: str, subscription_id: str) -> bool:
    return await subscriptions.is_active(db, tenant_id=tenant_id, subscription_id=subscription_id)


async def made_by(db: Database, *, tenant_id: str, created_by: str) -> list[str]:
    """The tenant's active subscriptions ``created_by`` made (its ``createdBy``)."""
    return await subscriptions.active_created_by(db, tenant_id=tenant_id, created_by=created_by)


async def delivery_summary(db: Database, *, subscription_id: str) -> dict[str, Any]:
    """Deliveries by state (``delivered``, ``pending``, ``failing``, ``dead``), the last
    delivery's time (epoch ms) and the newest error."""
    return await subscriptions.summary(db, subscription_id=subscription_id)
