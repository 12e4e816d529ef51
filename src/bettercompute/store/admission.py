"""The two transactions of the admission sequence, and the claim that keeps it single-flight.

Transaction 1 (``write_draft``) locks the idempotency row, applies the replay rules, checks the
pool and writes the draft with its authorization row. The policy decision and the budget check
happen in the service, outside any transaction. Transaction 2 (``commit``) charges quota
all-or-nothing, places, schedules the lifecycle and writes the outbox event and audit row.

Why a claim: the decision happens between two transactions, so the row lock of transaction 1
cannot keep 50 concurrent retries of one key from all deciding. Transaction 1 stamps the
idempotency row with a server-minted claim and this process's holder id (``store/holding.py``);
a concurrent request that finds a live claim backs off (``Busy``) and asks again, and by then
finds the stored reservation. A claim is live while its holder's session is: a crashed replica's
claims are taken over at once. A claim older than 30 s is taken over too, as a last resort for a
holder that is alive but hung. Whoever took a claim over, transaction 2 commits only under its
own claim, so a key never commits twice.

With the built-in budget, transaction 2 also checks the budget again under the tenant's budget
lock (``store/budgets.py``). This module never calls the policy engine.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psycopg.errors

from bettercompute.core import attributes, errors, hosts, placement, pools, states
from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.store import budgets, journal, placing, preempting, quotas, views
from bettercompute.store import pools as pool_rows
from bettercompute.store.database import Database, jsonb, script, scripted

#: The ``Queued`` condition's message while a reservation waits for its batch.
QUEUED_MESSAGE = "waiting for the pool-lease placer's next batch"

#: The last resort for a live holder that hung: its claim is taken over after this long.
CLAIM_TTL = dt.timedelta(seconds=30)

# Prepared statements (constant texts, so each connection prepares them once). Transaction 2
# on a pool-lease pool, whole: the function, and the reservation as it left it.
_QUEUE = f"""
    SELECT q.mine, q.budget_short, q.quota_short, {views.COLUMNS}
      FROM bc_admission_queue(%s, %s, %s, %s, %s::text[], %s::bigint[], %s, %s::numeric,
               jsonb_build_object('type', %s::text, 'reason', %s::text, 'message', %s::text,
                                  'since', epoch_ms(compute_now())),
               %s, %s, %s, %s::bigint * interval '1 millisecond') q
      LEFT JOIN LATERAL (SELECT (q.queued).*) r ON true
"""
# The reservation object, read after an inline transaction 2 committed.
_VIEW = f"SELECT {views.COLUMNS} FROM reservations r WHERE r.id = %s"


@dataclass(frozen=True)
class Draft:
    """This request holds the claim: decide, then ``commit`` or ``abandon``."""

    reservation_id: str
    idempotency_id: str
    claim: str
    pool: pools.PoolInfo
    attributes: dict[str, Any]
    #: The request as stored: with the host resources it books (``core.hosts.resolve``).
    request: dict[str, Any]
    #: The pool's per-GPU share times its GPUs' worth: rides on the GPUs' quota.
    host_share: dict[str, int]


@dataclass(frozen=True)
class Existing:
    """The key already reached a reservation past the draft stage: answer it, decide nothing."""

    reservation_id: str


@dataclass(frozen=True)
class Busy:
    """Another request with this key is being admitted right now; ask again shortly."""


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
    holder: int,
) -> Draft | Existing | Busy:
    """Transaction 1. Raises ``ComputeError`` for a refused key, a conflict or a bad pool.

    Two round trips (``script``): the idempotency upsert, its locked read and the pool read in
    one, the writes and the commit in the other.
    """
    async with scripted(db) as conn:
        [[row], share_rows] = await script(
            conn,
            "BEGIN; SELECT * FROM bc_draft_begin(%s, %s, %s, %s, %s, %s, %s, %s);"
            " SELECT host_share FROM pools WHERE id = %s",
            (
                idempotency_id,
                tenant_id,
                identity_id,
                key,
                request_hash,
                reservation_id,
                str(request["poolId"]),
                CLAIM_TTL,
                str(request["poolId"]),
            ),
        )
        assert row is not None  # inserted or found, and locked
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
        pool = (
            pool_rows.pool_info({**row, "id": row["pool_id"]})
            if row["pool_id"] is not None
            else None
        )
        if pool is None:
            raise errors.not_found("pool")
        pools.check_request(request=request, pool=pool, tenant_id=tenant_id)
        # The host resources it books, resolved once, here, and stored with the request.
        request, host_share = pools.resolve_host(
            request, pool=pool, hosts_share=share_rows[0]["host_share"] if share_rows else None
        )
        attrs = attributes.reservation_attributes(
            request=request, gpu_model=pool.gpu_model, region=pool.region, duration_ms=duration_ms
        )
        # The draft, its authorization row and our claim, in one statement, and the commit.
        # A draft decided again keeps its row and refreshes what the decision sees.
        await script(
            conn,
            """
            WITH draft AS (
                INSERT INTO reservations (id, tenant_id, pool_id, owner_identity_id,
                    idempotency_key, request_hash, request, state, requested_start, duration,
                    lease_seconds, host_share)
                VALUES (%s, %s, %s, %s, %s, %s, %s, 'draft', to_timestamp(%s / 1000.0),
                        %s * interval '1 millisecond', %s, %s)
                ON CONFLICT (id) DO UPDATE SET request = excluded.request,
                    host_share = excluded.host_share
            ), authz AS (
                INSERT INTO authz_resources (id, resource_type, tenant_id, parent_id,
                                             owner_identity_id, attributes)
                VALUES (%s, 'compute-reservation', %s, %s, %s, %s)
                ON CONFLICT (id) DO UPDATE SET attributes = excluded.attributes
            )
            UPDATE idempotency SET claim = %s, claim_holder = %s, claimed_at = compute_now()
             WHERE id = %s;
            COMMIT
            """,
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
                jsonb(host_share),
                reservation_id,
                tenant_id,
                pool.id,
                identity_id,
                jsonb(attrs),
                claim,
                holder,
                idempotency_id,
            ),
        )
    return Draft(reservation_id, idempotency_id, claim, pool, attrs, dict(request), host_share)


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
            "UPDATE idempotency SET claim = NULL, claimed_at = NULL, claim_holder = NULL"
            " WHERE id = %s AND claim = %s",
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
            "UPDATE idempotency SET claim = NULL, claimed_at = NULL, claim_holder = NULL,"
            " outcome = 'denied'"
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
    duration_ms: int,
    actor: str,
    tenant_id: str,
    context: Mapping[str, Any],
    budget_hours: float | None = None,
) -> dict[str, Any]:
    """Transaction 2: budget, quota all-or-nothing, placement, lifecycle, event, audit.

    ``budget_hours``: the GPU-hours to check against the built-in budget under the tenant's
    budget lock (``None``: no budget here). Returns the reservation object. Raises
    ``SPEND_LIMIT_REACHED`` or ``QUOTA_EXCEEDED`` (nothing written; the caller abandons the
    draft) or ``CONFLICT`` when the claim was lost to a takeover.
    """
    request = draft.request  # with the host resources resolved at the draft
    demand = {
        **attributes.quota_demand(request, gpu_model=draft.pool.gpu_model),
        **hosts.quota_excess(request, host_share=draft.host_share),
    }
    if draft.pool.pool_lease:
        return await _queue(
            db,
            draft=draft,
            actor=actor,
            tenant_id=tenant_id,
            context=context,
            demand=demand,
            budget_hours=budget_hours,
        )
    for attempt in range(2):
        try:
            return await _commit_once(
                db,
                draft=draft,
                request=request,
                duration_ms=duration_ms,
                actor=actor,
                tenant_id=tenant_id,
                context=context,
                demand=demand,
                budget_hours=budget_hours,
            )
        except psycopg.errors.ExclusionViolation:
            # The pool lock makes this a stale inventory cache at worst (a node that changed
            # pools mid-flight): the transaction rolled back whole, so simply run it again.
            if attempt:
                raise
    raise AssertionError("unreachable")


async def _queue(
    db: Database,
    *,
    draft: Draft,
    actor: str,
    tenant_id: str,
    context: Mapping[str, Any],
    demand: Mapping[str, int],
    budget_hours: float | None,
) -> dict[str, Any]:
    """Transaction 2 on a pool-lease pool: quota charged, the reservation queued (``pending``
    with ``Queued/PoolPlacer``) for the holder of the pool's lease to place in its next batch.

    No pool lock and no snapshot: that is the batch's work (``store/batching.py``), which is
    what lets creates on one pool commit side by side.
    """
    resources = sorted(demand)
    async with db.connection() as conn:
        # One statement, alone, in autocommit: the server commits as soon as it ran, so the
        # tenant's quota rows it locks wait for nothing this process does (migration 0015). On
        # a refusal (claim lost, budget or quota short) it wrote nothing. The pool's maxPending
        # holds while queued too: a wake-up the first millisecond past it (exactly maxPending
        # still waits), even when no replica runs the placer.
        row = await (
            await conn.execute(
                _QUEUE,
                (
                    draft.idempotency_id,
                    draft.claim,
                    draft.pool.id,
                    tenant_id,
                    resources,
                    [demand[r] for r in resources],
                    draft.reservation_id,
                    budget_hours,
                    states.Condition.QUEUED.value,
                    states.Reason.POOL_PLACER.value,
                    QUEUED_MESSAGE,
                    jsonb(dict(demand)),
                    actor,
                    jsonb(dict(context)),
                    draft.pool.max_pending_ms + 1,
                ),
                prepare=True,
            )
        ).fetchone()
    assert row is not None
    _refuse_unless_admitted(row, draft)
    return views.to_view(row)


def _refuse_unless_admitted(begun: Mapping[str, Any], draft: Draft) -> None:
    """Raise what transaction 2's first step found short: the claim taken over (CONFLICT),
    the budget (SPEND_LIMIT_REACHED) or the quota (QUOTA_EXCEEDED). Nothing was charged."""
    if not begun["mine"]:
        raise errors.claim_taken_over(draft.reservation_id)
    if begun["budget_short"] is not None:
        raise budgets.short_error(begun["budget_short"])
    if begun["quota_short"] is not None:
        raise quotas.short_error(begun["quota_short"])


async def _commit_once(
    db: Database,
    *,
    draft: Draft,
    request: Mapping[str, Any],
    duration_ms: int,
    actor: str,
    tenant_id: str,
    context: Mapping[str, Any],
    demand: Mapping[str, int],
    budget_hours: float | None,
) -> dict[str, Any]:
    # Two round trips under the pool lock: begin (claim, budget, pool lock, quota, window, busy
    # atoms), then the writes and the commit; placement is decided in Python in between. The
    # reservation object is read after the commit.
    resources = sorted(demand)
    wanted = pools.demand(request=request)
    host = wanted.host
    async with scripted(db) as conn:
        [[begun]] = await script(
            conn,
            "BEGIN; SELECT * FROM bc_admission_begin(%s, %s, %s, %s, %s, %s,"
            " to_timestamp(%s / 1000.0), %s * interval '1 millisecond', %s, %s::numeric, %s)",
            (
                draft.idempotency_id,
                draft.claim,
                draft.pool.id,
                tenant_id,
                resources,
                [demand[r] for r in resources],
                request.get("start"),
                duration_ms,
                draft.reservation_id,
                budget_hours,
                bool(host),
            ),
        )
        # A refusal leaves the block, which rolls the transaction back, and with it the locks.
        _refuse_unless_admitted(begun, draft)
        now, start, end = begun["now_"], begun["start_"], begun["end_"]
        snap = await placing.snapshot_from(
            conn,
            cache=db.inventory,
            pool_id=draft.pool.id,
            version=int(begun["inventory_version"]),
            busy=begun["busy"],
            host_busy=begun["host_busy"],
        )
        outcome = placement.place(snapshot=snap, demand=wanted)
        if (
            isinstance(outcome, placement.NoFit)
            and not outcome.never
            and not request.get("spot")
            and request.get("binding") != "node"
        ):
            # A regular request may take the capacity of spot work (never the other way).
            preempted = await preempting.preempt(
                conn,
                cache=db.inventory,
                pool_id=draft.pool.id,
                reservation_id=draft.reservation_id,
                demand=wanted,
                start=start,
                end=end,
                now=now,
                notice=dt.timedelta(seconds=draft.pool.spot_notice_s),
            )
            if preempted is not None:
                outcome, snap, start, end = preempted
        lease = (
            now + dt.timedelta(seconds=int(request["leaseSeconds"]))
            if request.get("leaseSeconds")
            else None
        )
        if isinstance(outcome, placement.Placed):
            book_sql, book_params = placing.book_statement(
                reservation_id=draft.reservation_id,
                pool_id=draft.pool.id,
                outcome=outcome,
                atom_of=placing.atoms_by_id(snap),
                start=start,
                end=end,
                host=host,
            )
            mark_sql, mark_params = placing.mark_placed_statement(
                reservation_id=draft.reservation_id,
                pool_id=draft.pool.id,
                outcome=outcome,
                start=start,
                end=end,
                lease=lease,
                now=now,
                quota_charge=demand,
            )
            apply_sql = f"{book_sql}; {mark_sql}"
            apply_params: tuple[Any, ...] = (*book_params, *mark_params)
            result = "placed"
        else:
            apply_sql, apply_params = placing.mark_pending_statement(
                reservation_id=draft.reservation_id,
                pool_id=draft.pool.id,
                message=outcome.message,
                now=now,
                first=True,
                quota_charge=demand,
            )
            result = "pending"
        await script(
            conn,
            f"{apply_sql}; SELECT bc_admission_done(%s, %s, %s, %s, %s, %s); COMMIT",
            (
                *apply_params,
                draft.idempotency_id,
                draft.reservation_id,
                actor,
                tenant_id,
                result,
                jsonb(dict(context)),
            ),
        )
        # Read once committed, outside the pool lock, as a prepared statement.
        row = await (await conn.execute(_VIEW, (draft.reservation_id,), prepare=True)).fetchone()
    assert row is not None
    return views.to_view(row)
