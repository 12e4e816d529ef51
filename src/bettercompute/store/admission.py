"""The two transactions of the admission sequence, and the claim that keeps it single-flight.

Transaction 1 (``write_draft``) locks the idempotency row, applies the replay rules, checks the
pool and writes the draft with its authorization row. The policy decision and the budget check
happen in the service, outside any transaction. Transaction 2 (``commit``) charges quota
all-or-nothing, places, schedules the lifecycle and writes the outbox event and audit row.

Why a claim: the decision happens between two transactions, so the row lock of transaction 1
cannot keep 50 concurrent retries of one key from all deciding. Transaction 1 stamps the
idempotency row with a server-minted claim; a concurrent request that finds a live claim backs
off (``Busy``) and asks again, and by then finds the stored reservation. A claim older than 30 s
(a crashed replica) is taken over. This module never calls the policy engine.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bettercompute.core import attributes, errors, placement, pools, states
from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.store import journal, placing, views
from bettercompute.store.database import Conn, Database, jsonb

CLAIM_TTL = dt.timedelta(seconds=30)
PENDING_RETRY = dt.timedelta(seconds=30)
START_WARNING = dt.timedelta(minutes=15)

_POOL = """
    SELECT p.id, p.owner_tenant_id, p.region, p.gpu_model, p.sharing_mode, p.replicas,
           p.archived, p.policy, o.tenant_id IS NOT NULL AS offered, o.on_budget_exceeded
      FROM pools p LEFT JOIN offers o ON o.pool_id = p.id AND o.tenant_id = %s
     WHERE p.id = %s
"""


@dataclass(frozen=True)
class Draft:
    """This request holds the claim: decide, then ``commit`` or ``abandon``."""

    reservation_id: str
    idempotency_id: str
    claim: str
    pool: pools.PoolInfo
    attributes: dict[str, Any]


@dataclass(frozen=True)
class Existing:
    """The key already reached a reservation past the draft stage: answer it, decide nothing."""

    reservation_id: str


@dataclass(frozen=True)
class Busy:
    """Another request with this key is being admitted right now; ask again shortly."""


async def read_pool(conn: Conn, *, pool_id: str, tenant_id: str) -> pools.PoolInfo | None:
    row = await (await conn.execute(_POOL, (tenant_id, pool_id))).fetchone()
    if row is None:
        return None
    return pools.PoolInfo(
        id=row["id"],
        owner_tenant_id=row["owner_tenant_id"],
        region=row["region"],
        gpu_model=row["gpu_model"],
        sharing_mode=row["sharing_mode"],
        replicas=row["replicas"],
        archived=row["archived"],
        policy=row["policy"],
        offered=row["offered"],
        on_budget_exceeded=row["on_budget_exceeded"],
    )


async def write_draft(
    db: Database,
    *,
    reservation_id: str,
    idempotency_id: str,
    identity_id: str,
    tenant_id: str,
    key: str,
    request: Mapping[str, Any],
    request_hash: str,
    duration_ms: int,
    claim: str,
) -> Draft | Existing | Busy:
    """Transaction 1. Raises ``ComputeError`` for a refused key, a conflict or a bad pool."""
    async with db.transaction() as conn:
        await conn.execute(
            "INSERT INTO idempotency (id, scope, tenant_id, identity_id, key, request_hash,"
            " reservation_id) VALUES (%s, 'create', %s, %s, %s, %s, %s)"
            " ON CONFLICT (id) DO NOTHING",
            (idempotency_id, tenant_id, identity_id, key, request_hash, reservation_id),
        )
        row = await (
            await conn.execute(
                "SELECT i.request_hash, i.claim IS NOT NULL"
                "       AND i.claimed_at > compute_now() - %s AS claim_live, r.state"
                "  FROM idempotency i LEFT JOIN reservations r ON r.id = i.reservation_id"
                " WHERE i.id = %s FOR UPDATE OF i",
                (CLAIM_TTL, idempotency_id),
            )
        ).fetchone()
        assert row is not None  # inserted or found above, and locked
        if row["state"] == states.State.DENIED:
            raise errors.access_denied(
                "this request was refused by policy; its idempotency key stays refused",
                reservationId=reservation_id,
            )
        if row["request_hash"] != request_hash:
            raise ComputeError(
                ErrorCode.CONFLICT,
                "this idempotency key was used with a different request",
                {"reservationId": reservation_id},
            )
        if row["claim_live"]:
            return Busy()
        if row["state"] is not None and row["state"] not in (
            states.State.DRAFT,
            states.State.AWAITING_CONFIRMATION,
        ):
            return Existing(reservation_id)

        pool = await read_pool(conn, pool_id=str(request["poolId"]), tenant_id=tenant_id)
        if pool is None:
            raise errors.not_found("pool")
        pools.check_request(request=request, pool=pool, tenant_id=tenant_id)
        attrs = attributes.reservation_attributes(
            request=request, gpu_model=pool.gpu_model, region=pool.region, duration_ms=duration_ms
        )
        if row["state"] is None:
            await conn.execute(
                "INSERT INTO reservations (id, tenant_id, pool_id, owner_identity_id,"
                " idempotency_key, request_hash, request, state, requested_start, duration,"
                " lease_seconds)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, 'draft',"
                "         to_timestamp(%s / 1000.0), %s * interval '1 millisecond', %s)",
                (
                    reservation_id,
                    tenant_id,
                    pool.id,
                    identity_id,
                    key,
                    request_hash,
                    jsonb(request),
                    request.get("start"),
                    duration_ms,
                    request.get("leaseSeconds"),
                ),
            )
            await conn.execute(
                "INSERT INTO authz_resources (id, resource_type, tenant_id, parent_id,"
                " owner_identity_id, attributes)"
                " VALUES (%s, 'compute-reservation', %s, %s, %s, %s)",
                (reservation_id, tenant_id, pool.id, identity_id, jsonb(attrs)),
            )
        else:
            # The same draft decided again: refresh what the decision sees (the pool's region
            # or model may have changed since).
            await conn.execute(
                "UPDATE authz_resources SET attributes = %s WHERE id = %s",
                (jsonb(attrs), reservation_id),
            )
        await conn.execute(
            "UPDATE idempotency SET claim = %s, claimed_at = compute_now() WHERE id = %s",
            (claim, idempotency_id),
        )
    return Draft(reservation_id, idempotency_id, claim, pool, attrs)


async def abandon(
    db: Database,
    *,
    draft: Draft,
    actor: str,
    tenant_id: str,
    outcome: str,
    context: Mapping[str, Any],
) -> None:
    """Give the claim back after a refusal that keeps the draft (quota, budget, an error), and
    record the outcome, so the same key is decided again on retry."""
    async with db.transaction() as conn:
        await conn.execute(
            "UPDATE idempotency SET claim = NULL, claimed_at = NULL WHERE id = %s AND claim = %s",
            (draft.idempotency_id, draft.claim),
        )
        await journal.audit(
            conn,
            action="compute:reservations:create",
            outcome=outcome,
            resource_id=draft.reservation_id,
            actor=actor,
            tenant_id=tenant_id,
            context=context,
        )


async def deny(
    db: Database, *, draft: Draft, actor: str, tenant_id: str, context: Mapping[str, Any]
) -> None:
    """The policy refused: the draft becomes ``denied`` for good."""
    async with db.transaction() as conn:
        await conn.execute(
            "UPDATE reservations SET state = 'denied', version = version + 1,"
            " updated_at = compute_now(), failure = %s WHERE id = %s AND state IN"
            " ('draft', 'awaiting-confirmation')",
            (jsonb({"message": "the request was denied by policy"}), draft.reservation_id),
        )
        await conn.execute(
            "UPDATE idempotency SET claim = NULL, claimed_at = NULL, outcome = 'denied'"
            " WHERE id = %s AND claim = %s",
            (draft.idempotency_id, draft.claim),
        )
        await journal.audit(
            conn,
            action="compute:reservations:create",
            outcome="denied",
            resource_id=draft.reservation_id,
            actor=actor,
            tenant_id=tenant_id,
            context=context,
        )


async def commit(
    db: Database,
    *,
    draft: Draft,
    request: Mapping[str, Any],
    duration_ms: int,
    actor: str,
    tenant_id: str,
    context: Mapping[str, Any],
) -> dict[str, Any]:
    """Transaction 2: quota all-or-nothing, placement, lifecycle, event, audit.

    Returns the reservation object. Raises ``QUOTA_EXCEEDED`` (nothing written; the caller
    abandons the draft) or ``CONFLICT`` when the claim was lost to a takeover.
    """
    demand = attributes.quota_demand(request, gpu_model=draft.pool.gpu_model)
    async with db.transaction() as conn:
        claimed = await (
            await conn.execute(
                "SELECT i.claim = %s AS mine, r.state FROM idempotency i"
                " JOIN reservations r ON r.id = i.reservation_id"
                " WHERE i.id = %s FOR UPDATE OF i, r",
                (draft.claim, draft.idempotency_id),
            )
        ).fetchone()
        if (
            claimed is None
            or not claimed["mine"]
            or claimed["state"]
            not in (
                states.State.DRAFT,
                states.State.AWAITING_CONFIRMATION,
            )
        ):
            raise ComputeError(
                ErrorCode.CONFLICT,
                "another request with this idempotency key took over its admission",
                {"reservationId": draft.reservation_id},
            )
        # Lock order, everywhere: pool, then reservation rows, then quota rows (see lifecycle).
        await placing.lock_pool(conn, draft.pool.id)
        await charge_quota(conn, tenant_id=tenant_id, demand=demand)
        now = await current_time(conn)
        requested = request.get("start")
        start = max(now, from_ms(requested)) if requested is not None else now
        end = start + dt.timedelta(milliseconds=duration_ms)
        outcome = await placing.place(
            conn,
            reservation_id=draft.reservation_id,
            pool_id=draft.pool.id,
            request=request,
            start=start,
            end=end,
        )
        lease = (
            now + dt.timedelta(seconds=int(request["leaseSeconds"]))
            if request.get("leaseSeconds")
            else None
        )
        if isinstance(outcome, placement.Placed):
            await mark_placed(
                conn,
                reservation_id=draft.reservation_id,
                pool_id=draft.pool.id,
                outcome=outcome,
                start=start,
                end=end,
                lease=lease,
                now=now,
                extra_sets="quota_charge = %s",
                extra_params=(jsonb(demand),),
            )
        else:
            await mark_pending(
                conn,
                reservation_id=draft.reservation_id,
                pool_id=draft.pool.id,
                message=outcome.message,
                now=now,
                first=True,
                extra_sets="quota_charge = %s",
                extra_params=(jsonb(demand),),
            )
        await conn.execute(
            "UPDATE idempotency SET claim = NULL, claimed_at = NULL, outcome = 'admitted'"
            " WHERE id = %s",
            (draft.idempotency_id,),
        )
        await journal.audit(
            conn,
            action="compute:reservations:create",
            outcome="placed" if isinstance(outcome, placement.Placed) else "pending",
            resource_id=draft.reservation_id,
            actor=actor,
            tenant_id=tenant_id,
            context=context,
        )
        row = await views.read(conn, draft.reservation_id)
    assert row is not None
    return views.to_view(row)


async def charge_quota(conn: Conn, *, tenant_id: str, demand: Mapping[str, int]) -> None:
    """Charge every resource or none: a missing quota row grants nothing."""
    resources = sorted(demand)  # a fixed order: two charges never lock rows crosswise
    amounts = [demand[r] for r in resources]
    charged = await (
        await conn.execute(
            "UPDATE quotas q SET used = q.used + d.n"
            "  FROM unnest(%s::text[], %s::bigint[]) AS d(resource, n)"
            " WHERE q.tenant_id = %s AND q.resource = d.resource AND q.used + d.n <= q.limit_"
            " RETURNING q.resource",
            (resources, amounts, tenant_id),
        )
    ).fetchall()
    if len(charged) == len(resources):
        return
    short = sorted(set(resources) - {r["resource"] for r in charged})
    rows = await (
        await conn.execute(
            "SELECT resource, limit_, used FROM quotas WHERE tenant_id = %s AND resource = ANY(%s)",
            (tenant_id, short),
        )
    ).fetchall()
    have = {r["resource"]: r for r in rows}
    detail: list[dict[str, Any]] = []
    words: list[str] = []
    for r in short:
        limit = int(have[r]["limit_"]) if r in have else 0
        used = int(have[r]["used"]) if r in have else 0
        detail.append({"resource": r, "requested": demand[r], "limit": limit, "used": used})
        words.append(f"{r} (asked {demand[r]}, {limit - used} left of {limit})")
    # Raising rolls the whole transaction back: the quota rows that were charged are refunded.
    raise ComputeError(
        ErrorCode.QUOTA_EXCEEDED, f"quota exceeded: {', '.join(words)}", {"quota": detail}
    )


async def refund_quota(conn: Conn, *, tenant_id: str, charge: Mapping[str, int] | None) -> None:
    if not charge:
        return
    resources = sorted(charge)
    await conn.execute(
        "UPDATE quotas q SET used = greatest(q.used - d.n, 0)"
        "  FROM unnest(%s::text[], %s::bigint[]) AS d(resource, n)"
        " WHERE q.tenant_id = %s AND q.resource = d.resource",
        (resources, [charge[r] for r in resources], tenant_id),
    )


async def current_time(conn: Conn) -> dt.datetime:
    row = await (await conn.execute("SELECT compute_now() AS now")).fetchone()
    assert row is not None
    now: dt.datetime = row["now"]
    return now


def from_ms(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)


def to_ms(at: dt.datetime) -> int:
    return int(at.timestamp() * 1000)


async def mark_placed(
    conn: Conn,
    *,
    reservation_id: str,
    pool_id: str,
    outcome: placement.Placed,
    start: dt.datetime,
    end: dt.datetime,
    lease: dt.datetime | None,
    now: dt.datetime,
    event: str = "reservation.placed",
    extra_sets: str = "",
    extra_params: tuple[Any, ...] = (),
) -> None:
    """The reservation is ``placed`` on ``outcome``: window, binding, wake-ups, event."""
    node_ids = [m.node_id for m in outcome.members]
    binding = {"nodeId": node_ids[0], "nodeIds": node_ids}
    sets = "".join(f", {extra_sets}" if extra_sets else "")
    await conn.execute(
        "UPDATE reservations SET state = 'placed', during = tstzrange(%s, %s), binding = %s,"
        " conditions = '[]', pending_since = NULL, version = version + 1,"
        " lease_expires_at = coalesce(lease_expires_at, %s), updated_at = compute_now()"
        f"{sets} WHERE id = %s",
        (start, end, jsonb(binding), lease, *extra_params, reservation_id),
    )
    moments: dict[str, dt.datetime | None] = {
        "start-15m": start - START_WARNING if start - START_WARNING > now else None,
        "start": start,
        "end": end,
        "lease": lease,
    }
    await journal.wake_many(conn, reservation_id=reservation_id, moments=moments)
    await journal.emit(
        conn,
        event,
        reservation_id=reservation_id,
        data={
            "state": "placed",
            "poolId": pool_id,
            "nodeIds": node_ids,
            "start": to_ms(start),
            "end": to_ms(end),
        },
    )


async def mark_pending(
    conn: Conn,
    *,
    reservation_id: str,
    pool_id: str,
    message: str,
    now: dt.datetime,
    first: bool,
    reason: str = states.Reason.NO_FIT,
    extra_sets: str = "",
    extra_params: tuple[Any, ...] = (),
) -> None:
    """``pending`` with ``Unschedulable``; retried in 30 s (sooner when capacity is freed)."""
    cond = states.condition(states.Condition.UNSCHEDULABLE, reason, message, at_ms=to_ms(now))
    sets = f", {extra_sets}" if extra_sets else ""
    await conn.execute(
        "UPDATE reservations SET state = 'pending', conditions = %s, during = NULL,"
        " binding = NULL, pending_since = coalesce(pending_since, compute_now()),"
        f" version = version + 1, updated_at = compute_now(){sets} WHERE id = %s",
        (jsonb([cond]), *extra_params, reservation_id),
    )
    await journal.wake(conn, reservation_id=reservation_id, at=now + PENDING_RETRY, why="retry")
    if first:
        await journal.emit(
            conn,
            "reservation.pending",
            reservation_id=reservation_id,
            data={"state": "pending", "poolId": pool_id, "reason": reason},
        )
