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

import asyncio
import datetime as dt
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg.errors

from bettercompute.core import attributes, errors, hosts, placement, pools, states
from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.store import budgets, journal, placing, preempting, quotas, views
from bettercompute.store import pools as pool_rows
from bettercompute.store.database import Conn, Database, Row, jsonb, script, scripted

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
    item = _Commit(
        draft=draft,
        request=request,
        duration_ms=duration_ms,
        actor=actor,
        tenant_id=tenant_id,
        context=context,
        demand=demand,
        wanted=pools.demand(request=request),
        budget_hours=budget_hours,
    )
    if budget_hours is not None:
        # The budget lock comes before the pool lock and the quota rows, everywhere: a group
        # already holds those, so a create that checks the built-in budget commits on its own.
        return await (_queue_alone if draft.pool.pool_lease else _commit_alone)(db, item)
    if draft.pool.pool_lease:
        return await _group_of(db, draft.pool.id, _queue_group).submit(item)
    return await _group_of(db, draft.pool.id, _commit_group).submit(item)


@dataclass(frozen=True)
class _Commit:
    """One create's transaction 2, as ``commit`` was asked for it."""

    draft: Draft
    request: Mapping[str, Any]
    duration_ms: int
    actor: str
    tenant_id: str
    context: Mapping[str, Any]
    demand: Mapping[str, int]
    #: What the placer is asked for (``pools.demand``), worked out once.
    wanted: placement.Demand
    budget_hours: float | None


#: The most creates one group commits together: enough to empty a busy pool's queue in one
#: transaction, few enough that the pool lock is never held long.
GROUP_MAX = 32

#: A group's transaction: each create's answer, in order (its reservation or its refusal).
GroupRun = Callable[["Database", list["_Commit"]], Awaitable[list[dict[str, Any] | Exception]]]

_groups: weakref.WeakKeyDictionary[Database, dict[tuple[str, GroupRun], _PoolGroup]] = (
    weakref.WeakKeyDictionary()
)


def _group_of(db: Database, pool_id: str, run: GroupRun) -> _PoolGroup:
    by_pool = _groups.setdefault(db, {})
    group = by_pool.get((pool_id, run))
    if group is None:
        group = by_pool[pool_id, run] = _PoolGroup(db, run)
    return group


class _PoolGroup:
    """Group commit for one pool's creates in this process.

    Why: every inline transaction 2 of a pool runs under the pool's lock, and every transaction
    2 of one tenant under its quota rows' locks, so concurrent creates commit one after
    another, each paying its own lock, round trips and commit (a WAL flush). Here the creates
    that arrive while a group is in flight wait and go together in the next one: one
    transaction and one commit for all of them. Inline (``_commit_group``): one pool lock and
    two round trips, each create placed in turn against the bookings of the ones before it.
    Pool-lease (``_queue_group``): one round trip that queues them all. Each is answered with
    exactly its own outcome: a refusal (claim, budget, quota) writes nothing, so it never
    undoes another's admission, and if the group's writes fail (a stale inventory cache, an
    error) the group is rolled back whole and every create in it runs again on its own.

    It must never hold a caller's cancellation against the others: a group runs in its own
    task, and a caller that stopped waiting simply finds its outcome unread. (A create that
    finds nothing in flight commits in its own task, alone, exactly as a create did before
    groups: cancelled, it rolls back only itself.)
    """

    def __init__(self, db: Database, run: GroupRun) -> None:
        self.db = db
        self.run = run
        self.waiting: list[tuple[_Commit, asyncio.Future[dict[str, Any]]]] = []
        self.runner: asyncio.Task[None] | None = None
        #: A lone create is committing in its caller's task.
        self.alone = False

    async def submit(self, item: _Commit) -> dict[str, Any]:
        if self.runner is None and not self.alone:
            # Nothing in flight: this create goes at once, in its caller's task, as a group of
            # one (no hand-over: a lone create costs what it did before groups); the creates
            # that arrive meanwhile make up the next group.
            self.alone = True
            try:
                [answer] = await self.run(self.db, [item])
            finally:
                self.alone = False
                if self.waiting and self.runner is None:
                    self.runner = asyncio.create_task(self._run())
            if isinstance(answer, Exception):
                raise answer
            return answer
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        # A caller that stopped waiting never reads its outcome: read here, so a refusal
        # nobody awaits is not logged as an error never retrieved.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.waiting.append((item, future))
        if self.runner is None and not self.alone:
            self.runner = asyncio.create_task(self._run())
        return await asyncio.shield(future)

    async def _run(self) -> None:
        try:
            while self.waiting:
                batch, self.waiting = self.waiting[:GROUP_MAX], self.waiting[GROUP_MAX:]
                try:
                    answers = await self.run(self.db, [item for item, _ in batch])
                except BaseException as e:  # every waiter learns it, then it goes on
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(e)
                    if not isinstance(e, Exception):
                        raise
                    continue
                for (_, future), answer in zip(batch, answers, strict=True):
                    if future.done():
                        continue
                    if isinstance(answer, BaseException):
                        future.set_exception(answer)
                    else:
                        future.set_result(answer)
        finally:
            self.runner = None


async def _commit_group(db: Database, items: list[_Commit]) -> list[dict[str, Any] | Exception]:
    """The group's transaction; if its writes fail, each create again on its own."""
    if len(items) > 1:
        try:
            return await _commit_together(db, items)
        except psycopg.Error:
            # Rolled back whole, nothing written: each create runs again alone and meets its
            # own outcome (the one that failed the group among them).
            pass
    return await _each_alone(db, items, _commit_alone)


async def _each_alone(
    db: Database,
    items: list[_Commit],
    alone: Callable[[Database, _Commit], Awaitable[dict[str, Any]]],
) -> list[dict[str, Any] | Exception]:
    """Each create's transaction 2 on its own, one after another: its answer or its error."""
    answers: list[dict[str, Any] | Exception] = []
    for item in items:
        try:
            answers.append(await alone(db, item))
        except Exception as e:
            answers.append(e)
    return answers


async def _commit_alone(db: Database, item: _Commit) -> dict[str, Any]:
    """One create's transaction 2 on its own transaction."""
    for attempt in range(2):
        try:
            [answer] = await _commit_together(db, [item])
            if isinstance(answer, Exception):
                raise answer
            return answer
        except psycopg.errors.ExclusionViolation:
            # The pool lock makes this a stale inventory cache at worst (a node that changed
            # pools mid-flight): the transaction rolled back whole, so simply run it again.
            if attempt:
                raise
    raise AssertionError("unreachable")


def _queue_params(item: _Commit) -> tuple[Any, ...]:
    draft, resources = item.draft, sorted(item.demand)
    return (
        draft.idempotency_id,
        draft.claim,
        draft.pool.id,
        item.tenant_id,
        resources,
        [item.demand[r] for r in resources],
        draft.reservation_id,
        item.budget_hours,
        states.Condition.QUEUED.value,
        states.Reason.POOL_PLACER.value,
        QUEUED_MESSAGE,
        jsonb(dict(item.demand)),
        item.actor,
        jsonb(dict(item.context)),
        draft.pool.max_pending_ms + 1,
    )


async def _queue_alone(db: Database, item: _Commit) -> dict[str, Any]:
    """Transaction 2 on a pool-lease pool: quota charged, the reservation queued (``pending``
    with ``Queued/PoolPlacer``) for the holder of the pool's lease to place in its next batch.

    No pool lock and no snapshot: that is the batch's work (``store/batching.py``), which is
    what lets creates on one pool commit side by side.
    """
    async with db.connection() as conn:
        # One statement, alone, in autocommit: the server commits as soon as it ran, so the
        # tenant's quota rows it locks wait for nothing this process does (migration 0015). On
        # a refusal (claim lost, budget or quota short) it wrote nothing. The pool's maxPending
        # holds while queued too: a wake-up the first millisecond past it (exactly maxPending
        # still waits), even when no replica runs the placer.
        row = await (await conn.execute(_QUEUE, _queue_params(item), prepare=True)).fetchone()
    assert row is not None
    _refuse_unless_admitted(row, item.draft)
    return views.to_view(row)


async def _queue_group(db: Database, items: list[_Commit]) -> list[dict[str, Any] | Exception]:
    """Transaction 2 of ``items`` on a pool-lease pool in one transaction and one round trip
    (pipelined, the statement prepared), then each create's answer; if the transaction fails,
    each create again on its own."""
    if len(items) > 1:
        # Quota rows are locked in tenant order, as a group on any pool locks them.
        order = sorted(range(len(items)), key=lambda k: items[k].tenant_id)
        try:
            rows: list[Row | None] = [None] * len(items)
            async with db.connection() as conn, conn.pipeline(), conn.transaction():
                cur = conn.cursor()
                await cur.executemany(
                    _QUEUE, [_queue_params(items[k]) for k in order], returning=True
                )
                for k in order:
                    rows[k] = await cur.fetchone()
                    cur.nextset()
        except psycopg.Error:
            pass  # rolled back whole, nothing written: each on its own, below
        else:
            answers: list[dict[str, Any] | Exception] = []
            for item, row in zip(items, rows, strict=True):
                assert row is not None
                try:
                    _refuse_unless_admitted(row, item.draft)
                    answers.append(views.to_view(row))
                except ComputeError as e:
                    answers.append(e)
            return answers
    return await _each_alone(db, items, _queue_alone)


def _refuse_unless_admitted(begun: Mapping[str, Any], draft: Draft) -> None:
    """Raise what transaction 2's first step found short: the claim taken over (CONFLICT),
    the budget (SPEND_LIMIT_REACHED) or the quota (QUOTA_EXCEEDED). Nothing was charged."""
    if not begun["mine"]:
        raise errors.claim_taken_over(draft.reservation_id)
    if begun["budget_short"] is not None:
        raise budgets.short_error(begun["budget_short"])
    if begun["quota_short"] is not None:
        raise quotas.short_error(begun["quota_short"])


#: Transaction 2's first step for one create: claim, budget, pool lock, quota, window
#: (``bc_admission_charge``).
_CHARGE = (
    "SELECT * FROM bc_admission_charge(%s, %s, %s, %s, %s, %s,"
    " to_timestamp(%s / 1000.0), %s * interval '1 millisecond', %s::numeric)"
)
#: A create alone: the charge and the read of its window in one (``bc_admission_begin``).
_BEGIN = (
    "SELECT * FROM bc_admission_begin(%s, %s, %s, %s, %s, %s,"
    " to_timestamp(%s / 1000.0), %s * interval '1 millisecond', %s, %s::numeric, %s)"
)
#: The reservation objects, read once the group committed.
_VIEWS = f"SELECT {views.COLUMNS} FROM reservations r WHERE r.id = ANY(%s)"
#: Then, once for the group, what is booked in each distinct window of its creates.
_WINDOWS = "SELECT * FROM bc_busy_windows(%s, %s::timestamptz[], %s::interval[], %s, %s)"


@dataclass
class _Booked:
    """What a create earlier in the group books: the later ones place around it."""

    start: dt.datetime
    end: dt.datetime
    atoms: list[str]
    #: Per node, the host it books: [vcpu, memoryGiB, hugepages1Gi].
    host: dict[str, list[int]]


async def _commit_together(db: Database, items: list[_Commit]) -> list[dict[str, Any] | Exception]:
    """Transaction 2 of ``items`` (of one pool) in one transaction: two round trips under the
    pool lock, however many creates, and the reservation objects read once committed.

    Round trip one charges every create (``bc_admission_charge``: claim, budget, pool lock,
    quota, window) and reads what is booked in each distinct window once
    (``bc_busy_windows``; a create alone does both in ``bc_admission_begin``). Each is placed
    in Python in turn, against those bookings and the ones of the creates before it in the
    group; round trip two writes them all and commits, and the reservation objects are read.
    A create whose charge was refused (claim taken over, budget or quota short) wrote nothing
    and is answered with its refusal. Raises ``psycopg.Error`` when the writes fail: then
    nothing of the group was written.
    """
    # Quota rows are locked in tenant order, everywhere a transaction locks more than one
    # tenant's: two groups of different pools never wait on each other in a circle.
    order = sorted(range(len(items)), key=lambda k: items[k].tenant_id)
    answers: list[dict[str, Any] | Exception | None] = [None] * len(items)
    pool_id = items[0].draft.pool.id
    placed_ids: list[str] = []
    async with scripted(db) as conn:
        if len(items) == 1:
            # Alone, one statement charges and reads its window (``bc_admission_begin``), as
            # cheap as it gets for a single create; its row carries what a window row does.
            [item] = items
            [[begun]] = await script(
                conn,
                "BEGIN; " + _BEGIN,
                [
                    *_charge_params(item),
                    item.draft.reservation_id,
                    item.budget_hours,
                    bool(item.wanted.host),
                ],
            )
            begun_rows, windows = [[begun]], {(begun["start_"], begun["end_"]): begun}
        else:
            *begun_rows, window_rows = await script(
                conn,
                "BEGIN; " + "; ".join([_CHARGE] * len(items)) + "; " + _WINDOWS,
                [
                    *(p for k in order for p in (*_charge_params(items[k]), items[k].budget_hours)),
                    pool_id,
                    [_start_of(item.request) for item in items],
                    [dt.timedelta(milliseconds=item.duration_ms) for item in items],
                    [item.draft.reservation_id for item in items],
                    any(item.wanted.host for item in items),
                ],
            )
            windows = {(w["start_"], w["end_"]): w for w in window_rows if not w["own_booked"]}
        group = _Written()
        for k, [begun] in zip(order, begun_rows, strict=True):
            item = items[k]
            try:
                # A refusal wrote nothing: the others go on.
                _refuse_unless_admitted(begun, item.draft)
            except ComputeError as e:
                answers[k] = e
                continue
            window = windows.get((begun["start_"], begun["end_"]))
            sql, params, placed = await _place_one(conn, db, item, begun, window, group)
            if placed is not None:
                group.booked.append(placed)
            group.sql += [sql, "SELECT bc_admission_done(%s, %s, %s, %s, %s, %s)"]
            group.params += [
                *params,
                item.draft.idempotency_id,
                item.draft.reservation_id,
                item.actor,
                item.tenant_id,
                "placed" if placed is not None else "pending",
                jsonb(dict(item.context)),
            ]
            placed_ids.append(item.draft.reservation_id)
        if not placed_ids:
            return [a for a in answers if a is not None]  # all refused: rolled back
        # The writes and the commit; then the objects as committed, outside the pool lock, by
        # a prepared statement (planned once per connection: in the script it would be planned
        # for every group).
        await script(conn, "; ".join(group.sql) + "; COMMIT", group.params)
        rows = await (await conn.execute(_VIEWS, (placed_ids,), prepare=True)).fetchall()
    by_id = {row["id"]: views.to_view(row) for row in rows}
    for k, item in enumerate(items):
        if answers[k] is None:
            answers[k] = by_id[item.draft.reservation_id]
    return [a for a in answers if a is not None]


@dataclass
class _Written:
    """The group's writes not sent yet, and what they book."""

    sql: list[str] = field(default_factory=list)
    params: list[Any] = field(default_factory=list)
    booked: list[_Booked] = field(default_factory=list)
    #: A preemption changed the bookings after the group's begins read them: every later
    #: create reads them again.
    stale: bool = False

    async def flush(self, conn: Conn) -> None:
        """Send the writes so far: the database sees the group's bookings from now on."""
        if self.sql:
            await script(conn, "; ".join(self.sql), self.params)
        self.sql, self.params, self.booked = [], [], []


async def _place_one(
    conn: Conn,
    db: Database,
    item: _Commit,
    begun: Mapping[str, Any],
    window: Mapping[str, Any] | None,
    group: _Written,
) -> tuple[str, tuple[Any, ...], _Booked | None]:
    """Place one charged create: its writes (bookings and ``placed``, or ``pending``), and
    what it books for the creates after it (``None`` when it went pending).

    ``window``: what ``bc_busy_windows`` read of its window; ``None`` when it could not say
    (the window holds bookings of the group's own reservations): then read for it alone."""
    draft, request, wanted = item.draft, item.request, item.wanted
    host = wanted.host
    now, start, end = begun["now_"], begun["start_"], begun["end_"]
    if group.stale or window is None:
        await group.flush(conn)
        snap = await placing.snapshot(
            conn,
            cache=db.inventory,
            pool_id=draft.pool.id,
            start=start,
            end=end,
            ignore_reservation=draft.reservation_id,
        )
    else:
        snap = await _snapshot_in_group(conn, db, draft.pool.id, begun, window, group.booked)
    outcome = placement.place(snapshot=snap, demand=wanted)
    if (
        isinstance(outcome, placement.NoFit)
        and not outcome.never
        and not request.get("spot")
        and request.get("binding") != "node"
    ):
        # A regular request may take the capacity of spot work (never the other way). The
        # preemption reads the bookings, so the group's writes so far go first.
        await group.flush(conn)
        group.stale = True
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
    if not isinstance(outcome, placement.Placed):
        sql, params = placing.mark_pending_statement(
            reservation_id=draft.reservation_id,
            pool_id=draft.pool.id,
            message=outcome.message,
            now=now,
            first=True,
            quota_charge=item.demand,
        )
        return sql, params, None
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
        quota_charge=item.demand,
    )
    host_row = [int((host or {}).get(k, 0)) for k in ("vcpu", "memoryGiB", "hugepages1Gi")]
    mine = _Booked(
        start=start,
        end=end,
        atoms=[a for m in outcome.members for a in m.atom_ids],
        host={m.node_id: host_row for m in outcome.members} if any(host_row) else {},
    )
    return f"{book_sql}; {mark_sql}", (*book_params, *mark_params), mine


async def _snapshot_in_group(
    conn: Conn,
    db: Database,
    pool_id: str,
    begun: Mapping[str, Any],
    window: Mapping[str, Any],
    booked: list[_Booked],
) -> placement.Snapshot:
    """The snapshot of a charged create's window as the group read it, with what the creates
    before it in the group book there (not written yet) added as busy."""
    start, end = begun["start_"], begun["end_"]
    busy = list(window["busy"])
    host_busy: dict[str, list[int]] = {
        node: [int(v) for v in use] for node, use in (window["host_busy"] or {}).items()
    }
    for other in booked:
        if other.start < end and start < other.end:
            busy += other.atoms
            for node, use in other.host.items():
                sums = host_busy.setdefault(node, [0, 0, 0])
                for n, v in enumerate(use):
                    sums[n] += v
    return await placing.snapshot_from(
        conn,
        cache=db.inventory,
        pool_id=pool_id,
        version=int(begun["inventory_version"]),
        busy=busy,
        host_busy=host_busy,
    )


def _charge_params(item: _Commit) -> list[Any]:
    """What ``bc_admission_charge`` and ``bc_admission_begin`` both take first: the claim, the
    pool, the tenant's demand and the window asked for."""
    resources = sorted(item.demand)
    return [
        item.draft.idempotency_id,
        item.draft.claim,
        item.draft.pool.id,
        item.tenant_id,
        resources,
        [item.demand[r] for r in resources],
        item.request.get("start"),
        item.duration_ms,
    ]


def _start_of(request: Mapping[str, Any]) -> dt.datetime | None:
    """The requested start (epoch ms) as the charge reads it (``to_timestamp(ms / 1000.0)``)."""
    start = request.get("start")
    return None if start is None else dt.datetime.fromtimestamp(start / 1000, tz=dt.UTC)
