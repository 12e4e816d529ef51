"""Webhook subscriptions and their delivery log, in SQL (``event_subscriptions``,
``event_deliveries``; migration 0009).

Why here: the fan-out of outbox events to subscriptions must move its cursor in the same
transaction as the delivery rows it writes (at least once; the primary key makes a repeat a
no-op), and a sender must claim a delivery before it POSTs it, so two replicas never send one
at once. ``service/webhooks.py`` drives both; the API reads and writes subscriptions through
``service/reservations.py``, the operator's ``EventSubscription`` objects through
``service/webhooks.py`` (``update``, ``active_created_by``, ``summary``).

What it must never do: send anything over the network, answer a subscription's secret anywhere
but in the answer of ``create``, or let a delivery overtake an earlier pending one of the same
reservation and subscription.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bettercompute.core import answers, ids
from bettercompute.store import outbox
from bettercompute.store.database import Database

_SUBSCRIPTION = (
    "id, tenant_id, url, event_types, state, created_by, epoch_ms(created_at) AS created_at"
)


def _subscription(row: dict[str, Any], *, secret: str | None = None) -> answers.Subscription:
    answer: answers.Subscription = {
        "id": row["id"],
        "tenantId": row["tenant_id"],
        "url": row["url"],
        "eventTypes": list(row["event_types"]),
        "state": row["state"],
        "createdBy": row["created_by"],
        "createdAt": int(row["created_at"]),
    }
    if secret is not None:
        answer["secret"] = secret
    return answer


def _ms(value: Any) -> int | None:
    return None if value is None else int(value)


async def create(
    db: Database,
    *,
    tenant_id: str,
    url: str,
    event_types: Sequence[str],
    created_by: str,
    secret: str,
) -> answers.Subscription | None:
    """A new active subscription, with its secret; ``None`` when the tenant does not exist. It
    sees the events after the outbox's frontier now (``store/outbox.py``): those committed from
    now on, and any already committed past the frontier."""
    async with db.transaction() as conn:
        row = await (
            await conn.execute(
                "INSERT INTO event_subscriptions"
                " (id, tenant_id, url, event_types, secret, created_by, from_event_id)"
                " SELECT %s, t.id, %s, %s, %s, %s,"
                f"        {outbox.FRONTIER}"
                "   FROM tenants t WHERE t.id = %s"
                f" RETURNING {_SUBSCRIPTION}",
                (
                    ids.new_id("sub"),
                    url,
                    sorted(set(event_types)),
                    secret,
                    created_by,
                    tenant_id,
                ),
            )
        ).fetchone()
    return None if row is None else _subscription(row, secret=secret)


async def list_active(db: Database, *, tenant_id: str) -> list[answers.Subscription]:
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                f"SELECT {_SUBSCRIPTION} FROM event_subscriptions"
                " WHERE tenant_id = %s AND state = 'active' ORDER BY id",
                (tenant_id,),
            )
        ).fetchall()
    return [_subscription(row) for row in rows]


async def disable(
    db: Database, *, tenant_id: str, subscription_id: str
) -> answers.Subscription | None:
    """Disable the tenant's active subscription and end its pending deliveries dead; ``None``
    when the tenant has no such active subscription."""
    async with db.transaction() as conn:
        row = await (
            await conn.execute(
                "UPDATE event_subscriptions SET state = 'disabled', disabled_at = compute_now()"
                " WHERE id = %s AND tenant_id = %s AND state = 'active'"
                f" RETURNING {_SUBSCRIPTION}",
                (subscription_id, tenant_id),
            )
        ).fetchone()
        if row is None:
            return None
        await conn.execute(
            "UPDATE event_deliveries SET state = 'dead', last_error = 'subscription deleted'"
            " WHERE subscription_id = %s AND state = 'pending'",
            (subscription_id,),
        )
    return _subscription(row)


async def update(
    db: Database, *, tenant_id: str, subscription_id: str, url: str, event_types: Sequence[str]
) -> answers.Subscription | None:
    """Point the tenant's active subscription at ``url`` and ``event_types``, in place: its id,
    secret and delivery log stay, and pending deliveries go to the new URL. ``None`` when the
    tenant has no such active subscription."""
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "UPDATE event_subscriptions SET url = %s, event_types = %s"
                " WHERE id = %s AND tenant_id = %s AND state = 'active'"
                f" RETURNING {_SUBSCRIPTION}",
                (url, sorted(set(event_types)), subscription_id, tenant_id),
            )
        ).fetchone()
    return None if row is None else _subscription(row)


async def active_created_by(db: Database, *, tenant_id: str, created_by: str) -> list[str]:
    """The ids of the tenant's active subscriptions that ``created_by`` made, oldest first."""
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT id FROM event_subscriptions"
                " WHERE tenant_id = %s AND created_by = %s AND state = 'active' ORDER BY id",
                (tenant_id, created_by),
            )
        ).fetchall()
    return [str(r["id"]) for r in rows]


async def summary(db: Database, *, subscription_id: str) -> dict[str, Any]:
    """The subscription's delivery log in figures: ``delivered``, ``pending`` (not failed yet),
    ``failing`` (failed, still retried), ``dead``, ``lastDeliveredAt`` (epoch ms or ``None``)
    and ``lastError`` (of the newest event that failed, or ``None``)."""
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT count(*) FILTER (WHERE state = 'delivered') AS delivered,"
                " count(*) FILTER (WHERE state = 'pending' AND last_error IS NULL) AS pending,"
                " count(*) FILTER (WHERE state = 'pending' AND last_error IS NOT NULL)"
                "   AS failing,"
                " count(*) FILTER (WHERE state = 'dead') AS dead,"
                " epoch_ms(max(delivered_at)) AS last_delivered_at,"
                " (SELECT last_error FROM event_deliveries"
                "   WHERE subscription_id = %s AND last_error IS NOT NULL"
                "   ORDER BY event_id DESC LIMIT 1) AS last_error"
                " FROM event_deliveries WHERE subscription_id = %s",
                (subscription_id, subscription_id),
            )
        ).fetchone()
    assert row is not None  # an aggregate always answers one row
    return {
        "delivered": int(row["delivered"]),
        "pending": int(row["pending"]),
        "failing": int(row["failing"]),
        "dead": int(row["dead"]),
        "lastDeliveredAt": _ms(row["last_delivered_at"]),
        "lastError": row["last_error"],
    }


async def is_active(db: Database, *, tenant_id: str, subscription_id: str) -> bool:
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT 1 FROM event_subscriptions"
                " WHERE id = %s AND tenant_id = %s AND state = 'active'",
                (subscription_id, tenant_id),
            )
        ).fetchone()
    return row is not None


async def deliveries(
    db: Database, *, subscription_id: str, state: str | None, limit: int
) -> list[answers.Delivery]:
    """The subscription's delivery log, newest event first."""
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT subscription_id, event_id, event_type, reservation_id, state, attempts,"
                " last_status, last_error, epoch_ms(created_at) AS created_at,"
                " epoch_ms(first_attempt_at) AS first_attempt_at,"
                " CASE WHEN state = 'pending' THEN epoch_ms(next_attempt_at) END"
                "   AS next_attempt_at,"
                " epoch_ms(delivered_at) AS delivered_at"
                " FROM event_deliveries WHERE subscription_id = %s"
                " AND (%s::text IS NULL OR state = %s::text)"
                " ORDER BY event_id DESC LIMIT %s",
                (subscription_id, state, state, limit),
            )
        ).fetchall()
    return [
        {
            "subscriptionId": r["subscription_id"],
            "eventId": int(r["event_id"]),
            "eventType": r["event_type"],
            "reservationId": r["reservation_id"],
            "state": r["state"],
            "attempts": int(r["attempts"]),
            "lastStatus": r["last_status"],
            "lastError": r["last_error"],
            "createdAt": int(r["created_at"]),
            "firstAttemptAt": _ms(r["first_attempt_at"]),
            "nextAttemptAt": _ms(r["next_attempt_at"]),
            "deliveredAt": _ms(r["delivered_at"]),
        }
        for r in rows
    ]


# --- delivery ----------------------------------------------------------------------------------


async def fan_out(db: Database, *, subscriber: str, limit: int = 500) -> int:
    """Write a pending delivery for each active subscription matching each of the next
    ``limit`` outbox events after ``subscriber``'s cursor, up to the frontier (never past an id
    whose transaction may still commit, ``store/outbox.py``), and move the cursor past them, in
    one transaction. Returns how many events were read (0: caught up)."""
    async with db.transaction() as conn:
        await conn.execute(
            "INSERT INTO outbox_cursors (subscriber) VALUES (%s) ON CONFLICT DO NOTHING",
            (subscriber,),
        )
        cursor = await (
            await conn.execute(
                "SELECT last_id FROM outbox_cursors WHERE subscriber = %s FOR UPDATE",
                (subscriber,),
            )
        ).fetchone()
        after = int(cursor["last_id"]) if cursor else 0
        span = await (
            await conn.execute(
                "SELECT count(*) AS n, coalesce(max(id), %s) AS last FROM"
                f" (SELECT id FROM outbox WHERE id > %s AND id <= {outbox.FRONTIER}"
                "   ORDER BY id LIMIT %s) AS batch",
                (after, after, limit),
            )
        ).fetchone()
        if span is None or int(span["n"]) == 0:
            return 0
        last = int(span["last"])
        await conn.execute(
            "INSERT INTO event_deliveries"
            " (subscription_id, event_id, reservation_id, event_type)"
            " SELECT s.id, o.id, r.id, o.type"
            "   FROM outbox o"
            "   JOIN reservations r ON o.subject = 'reservation/' || r.id"
            "   JOIN event_subscriptions s ON s.tenant_id = r.tenant_id AND s.state = 'active'"
            "    AND o.id > s.from_event_id"
            "    AND (cardinality(s.event_types) = 0 OR o.type = ANY (s.event_types))"
            "  WHERE o.id > %s AND o.id <= %s"
            " ON CONFLICT (subscription_id, event_id) DO NOTHING",
            (after, last),
        )
        await conn.execute(
            "UPDATE outbox_cursors SET last_id = %s WHERE subscriber = %s", (last, subscriber)
        )
        return int(span["n"])


@dataclass(frozen=True)
class Due:
    """A claimed delivery: where to POST it, with what key, and the event as the JSON sent."""

    subscription_id: str
    event_id: int
    url: str
    secret: str
    attempts: int
    event: dict[str, Any]


async def claim_due(db: Database, *, limit: int, lease_s: float) -> list[Due]:
    """Claim up to ``limit`` due deliveries of active subscriptions, each the earliest pending
    one of its reservation and subscription: their next attempt moves ``lease_s`` ahead (so no
    other sender takes them meanwhile) and their attempt is counted."""
    async with db.transaction() as conn:
        rows = await (
            await conn.execute(
                "WITH due AS ("
                "  SELECT d.subscription_id, d.event_id FROM event_deliveries d"
                "    JOIN event_subscriptions s ON s.id = d.subscription_id"
                "   WHERE d.state = 'pending' AND s.state = 'active'"
                "     AND d.next_attempt_at <= compute_now()"
                "     AND NOT EXISTS (SELECT 1 FROM event_deliveries e"
                "       WHERE e.subscription_id = d.subscription_id"
                "         AND e.reservation_id = d.reservation_id"
                "         AND e.event_id < d.event_id AND e.state = 'pending')"
                "   ORDER BY d.next_attempt_at, d.event_id LIMIT %s"
                "   FOR UPDATE OF d SKIP LOCKED)"
                " UPDATE event_deliveries d SET attempts = d.attempts + 1,"
                "   first_attempt_at = coalesce(d.first_attempt_at, compute_now()),"
                "   next_attempt_at = compute_now() + make_interval(secs => %s)"
                "  FROM due, event_subscriptions s, outbox o"
                " WHERE d.subscription_id = due.subscription_id AND d.event_id = due.event_id"
                "   AND s.id = d.subscription_id AND o.id = d.event_id"
                " RETURNING d.subscription_id, d.event_id, d.attempts, d.reservation_id,"
                "   s.url, s.secret, o.type, o.data, epoch_ms(o.created_at) AS at",
                (limit, lease_s),
            )
        ).fetchall()
    return [
        Due(
            subscription_id=r["subscription_id"],
            event_id=int(r["event_id"]),
            url=r["url"],
            secret=r["secret"],
            attempts=int(r["attempts"]),
            event={
                "id": int(r["event_id"]),
                "type": r["type"],
                "reservationId": r["reservation_id"],
                "at": int(r["at"]),
                "data": r["data"],
            },
        )
        for r in sorted(rows, key=lambda r: int(r["event_id"]))
    ]


async def delivered(db: Database, *, subscription_id: str, event_id: int, status: int) -> None:
    async with db.connection() as conn:
        await conn.execute(
            "UPDATE event_deliveries SET state = 'delivered', delivered_at = compute_now(),"
            " last_status = %s, last_error = NULL"
            " WHERE subscription_id = %s AND event_id = %s AND state = 'pending'",
            (status, subscription_id, event_id),
        )


async def failed(
    db: Database,
    *,
    subscription_id: str,
    event_id: int,
    status: int | None,
    error: str,
    retry_in_s: float,
    deadline_s: float,
) -> str:
    """Record a failed attempt: retried in ``retry_in_s`` (never later than ``deadline_s``
    after its first attempt), or ``dead`` once that deadline has passed. Returns the state."""
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "UPDATE event_deliveries SET last_status = %s, last_error = %s,"
                " state = CASE WHEN first_attempt_at + make_interval(secs => %s)"
                "   <= compute_now() THEN 'dead' ELSE 'pending' END,"
                " next_attempt_at = least(compute_now() + make_interval(secs => %s),"
                "   first_attempt_at + make_interval(secs => %s))"
                " WHERE subscription_id = %s AND event_id = %s AND state = 'pending'"
                " RETURNING state",
                (
                    status,
                    error[:1000],
                    deadline_s,
                    retry_in_s,
                    deadline_s,
                    subscription_id,
                    event_id,
                ),
            )
        ).fetchone()
    return str(row["state"]) if row else "gone"


async def next_due_in(db: Database) -> float | None:
    """Seconds until the earliest claimable delivery (pending, of an active subscription, no
    earlier one of its reservation pending) is due (0 when one is due now); ``None``: none."""
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT extract(epoch FROM min(d.next_attempt_at) - compute_now()) AS s"
                "  FROM event_deliveries d JOIN event_subscriptions s ON s.id = d.subscription_id"
                " WHERE d.state = 'pending' AND s.state = 'active'"
                "   AND NOT EXISTS (SELECT 1 FROM event_deliveries e"
                "     WHERE e.subscription_id = d.subscription_id"
                "       AND e.reservation_id = d.reservation_id"
                "       AND e.event_id < d.event_id AND e.state = 'pending')"
            )
        ).fetchone()
    if row is None or row["s"] is None:
        return None
    return max(0.0, float(row["s"]))
