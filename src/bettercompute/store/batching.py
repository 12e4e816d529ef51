"""The pool-lease placer's SQL: the pool's lease, and one batch of queued reservations.

Why it exists: on a pool whose policy says ``placer: pool-lease`` a create ends queued
(``store/admission.py``) and one replica, the holder of the pool's lease, places what is queued
in batches (``service/batching.py`` runs the loop). A batch is one transaction under the pool
lock: the lease checked, the queued rows locked, one snapshot read, a pure plan
(``core.batching.plan``), then guarded writes with the same statements the inline placer uses
(``store/placing.py``), so a batch-placed reservation is exactly what an inline one is.

Retries go the same way: a pending reservation of the pool that is not queued (what a batch
could not place, spot work preempted) is requeued by the reconciler when its retry is due
(every 30 s, at once when capacity is freed; ``lifecycle.Requeue``, table ``batch_retries``,
migration 0014). The batch takes requeued and queued reservations in one fair order, so one
tenant's flood of older pending requests does not take freed capacity ahead of another
tenant's request; a requeued one that still does not fit follows the reconciler's retry rule
(``lifecycle.still_unschedulable``: unchanged, it is left as it is).

The lease (migration 0013) keeps two replicas from both placing a pool: the batch locks the
lease row and places only while it is this holder's, at this epoch, unexpired. Even without
it no reservation could be placed twice: the queued and requeued rows are read and locked
under the pool lock, and placing moves them out of the pending state in the same transaction.

What it must never do: decide policy, charge quota (transaction 2 did, and a pending
reservation keeps its charge), or place a reservation that is neither queued nor requeued.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg.errors

from bettercompute.core import batching, lifecycle, placement, pools
from bettercompute.core.errors import StoreError
from bettercompute.store import journal, placing, preempting, views
from bettercompute.store import pools as pool_rows
from bettercompute.store.database import Conn, Database, Row

# What waits for the batch: the queued reservations and the requeued ones (retries handed over by
# the reconciler, migration 0014), each set found through its own index, then one fair order.
_WAITING = """
    SELECT r.id FROM reservations r
     WHERE r.pool_id = %(pool)s AND r.state = 'pending'
       AND r.conditions @> '[{"type": "Queued"}]'
    UNION
    SELECT r.id FROM batch_retries b JOIN reservations r ON r.id = b.reservation_id
     WHERE b.pool_id = %(pool)s AND r.state = 'pending'
"""

_QUEUED = f"""
    WITH q AS (
        SELECT r.id, coalesce(r.requested_start, r.created_at) AS requested, r.created_at,
               row_number() OVER (PARTITION BY r.tenant_id
                                  ORDER BY coalesce(r.requested_start, r.created_at),
                                           r.created_at, r.id) AS turn
          FROM reservations r
         WHERE r.id IN ({_WAITING})
    ), picked AS (
        SELECT q.id FROM q ORDER BY q.turn, q.requested, q.created_at, q.id LIMIT %(limit)s
    )
    SELECT r.id, r.tenant_id, r.request, r.requested_start, r.created_at, r.duration,
           r.lease_seconds, r.conditions,
           NOT r.conditions @> '[{{"type": "Queued"}}]' AS requeued
      FROM reservations r
     WHERE r.id IN (SELECT id FROM picked) AND r.state = 'pending'
       AND (r.conditions @> '[{{"type": "Queued"}}]'
            OR EXISTS (SELECT 1 FROM batch_retries b WHERE b.reservation_id = r.id))
     ORDER BY r.id
       FOR UPDATE OF r SKIP LOCKED
"""


class LeaseLost(Exception):
    """The pool's lease is no longer this holder's: the batch placed nothing."""


@dataclass(frozen=True)
class LeasePool:
    """A pool whose policy asks for the pool-lease placer, with its batch settings."""

    id: str
    batch_ms: int
    max_batch: int


@dataclass(frozen=True)
class Batch:
    """What one batch did: the reservations it placed and those left pending (no fit)."""

    placed: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    #: The views of the reservations it decided (placed or left pending), as it committed them.
    views: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.placed) + len(self.pending)


async def lease_pools(db: Database) -> list[LeasePool]:
    """The pools that use the pool-lease placer, archived ones included (what is queued there
    still needs placing or failing)."""
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT id, policy FROM pools WHERE policy ->> 'placer' = 'pool-lease' ORDER BY id"
            )
        ).fetchall()
    out: list[LeasePool] = []
    for row in rows:
        policy = pools.PoolPolicy.stored(row["policy"])
        out.append(
            LeasePool(
                id=row["id"],
                batch_ms=policy.batchMs or pools.DEFAULT_BATCH_MS,
                max_batch=policy.maxBatch or pools.DEFAULT_MAX_BATCH,
            )
        )
    return out


async def take_lease(db: Database, *, pool_id: str, holder: str, ttl: dt.timedelta) -> int | None:
    """Take or renew the pool's lease until ``ttl`` from now (business time); the epoch held,
    or ``None`` while another holder's lease runs."""
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT bc_pool_lease_take(%s, %s, %s) AS epoch", (pool_id, holder, ttl)
            )
        ).fetchone()
    return None if row is None or row["epoch"] is None else int(row["epoch"])


async def give_back_leases(db: Database, *, holder: str) -> None:
    """End this holder's leases now, so another replica takes them over at once (a clean
    stop; a crash leaves them to expire)."""
    async with db.connection() as conn:
        await conn.execute("DELETE FROM pool_leases WHERE holder = %s", (holder,))


async def has_queued(db: Database, *, pool_id: str) -> bool:
    """Whether anything waits for a batch (queued or requeued), read without any lock (a cheap
    idle check)."""
    async with db.connection() as conn:
        row = await (
            await conn.execute(f"SELECT EXISTS ({_WAITING}) AS any", {"pool": pool_id})
        ).fetchone()
    return bool(row and row["any"])


async def place_batch(
    db: Database, *, pool_id: str, holder: str, epoch: int, max_batch: int
) -> Batch:
    """Place up to ``max_batch`` queued or requeued reservations of the pool in one transaction.

    Raises ``LeaseLost`` (nothing written) when the lease is not this holder's at ``epoch``,
    ``StoreError`` when the database refused the batch's bookings twice.
    """
    for attempt in range(2):
        try:
            return await _place_batch(
                db, pool_id=pool_id, holder=holder, epoch=epoch, max_batch=max_batch
            )
        except psycopg.errors.ExclusionViolation as e:
            # As at admission: under the pool lock this is a stale inventory cache at worst,
            # and the transaction rolled back whole, so run it again. Twice is not a cache:
            # the loop logs it and tries again later; the queued reservations wait meanwhile.
            if attempt:
                raise StoreError(f"the batch of pool {pool_id} was refused: {e}") from e
    raise AssertionError("unreachable")


async def _place_batch(
    db: Database, *, pool_id: str, holder: str, epoch: int, max_batch: int
) -> Batch:
    # A batch may run longer than a create (hundreds of reservations in one): its own bound.
    async with db.transaction(within_s=db.limits.batch_s) as conn:
        # The pool lock, the lease and the queued rows in one round trip (pipelined, each
        # statement after the one before it): rows read by a holder that turns out fenced are
        # let go with the rollback.
        async with conn.pipeline():
            await placing.lock_pool(conn, pool_id)
            leased = await conn.execute(
                "SELECT compute_now() AS now, inventory_version,"
                " (SELECT l.expires_at > compute_now() FROM pool_leases l WHERE l.pool_id = p.id"
                "    AND l.holder = %s AND l.epoch = %s FOR UPDATE) AS mine"
                " FROM pools p WHERE p.id = %s",
                (holder, epoch, pool_id),
            )
            picked = await conn.execute(_QUEUED, {"pool": pool_id, "limit": max_batch})
            lease = await leased.fetchone()
            rows = await picked.fetchall()
        if lease is None or not lease["mine"]:
            raise LeaseLost(pool_id)
        now: dt.datetime = lease["now"]
        if not rows:
            return Batch()
        # The retries it picked are taken (tried now; a no-fit below schedules the next), and
        # those whose reservation left pending meanwhile are let go.
        await conn.execute(
            "DELETE FROM batch_retries b USING reservations r"
            " WHERE b.pool_id = %s AND r.id = b.reservation_id"
            "   AND (b.reservation_id = ANY(%s) OR r.state <> 'pending')",
            (pool_id, [row["id"] for row in rows if row["requeued"]]),
        )
        queued: list[batching.Queued] = []
        by_id: dict[str, Row] = {}
        for row in rows:
            start = max(now, row["requested_start"]) if row["requested_start"] else now
            queued.append(
                batching.Queued(
                    reservation_id=row["id"],
                    tenant_id=row["tenant_id"],
                    requested=row["requested_start"] or row["created_at"],
                    created=row["created_at"],
                    start=start,
                    end=start + row["duration"],
                    demand=pools.demand(request=row["request"]),
                )
            )
            by_id[row["id"]] = row
        inventory = await placing.snapshot_from(
            conn,
            cache=db.inventory,
            pool_id=pool_id,
            version=int(lease["inventory_version"]),
            busy=[],
        )
        booked = await _booked(
            conn,
            pool_id=pool_id,
            start=min(q.start for q in queued),
            end=max(q.end for q in queued),
        )
        decisions = batching.plan(
            nodes=inventory.nodes,
            atoms=inventory.atoms,
            booked=booked,
            queued=queued,
            index=inventory.index,
        )
        done = Batch()
        unplaced: list[tuple[batching.Queued, placement.NoFit]] = []
        # The placed first: a preemption below then sees the whole batch's bookings. Their
        # writes travel pipelined: one round trip for the whole batch, not two per reservation.
        async with conn.pipeline():
            for decision in decisions:
                q, outcome = decision.queued, decision.outcome
                if isinstance(outcome, placement.NoFit):
                    unplaced.append((q, outcome))
                    continue
                await _mark_placed(
                    conn,
                    pool_id=pool_id,
                    queued=q,
                    outcome=outcome,
                    atom_of=placing.atoms_by_id(inventory),
                    lease_seconds=by_id[q.reservation_id]["lease_seconds"],
                    now=now,
                )
                done.placed.append(q.reservation_id)
        notice: dt.timedelta | None = None
        for q, no_fit in unplaced:
            request = by_id[q.reservation_id]["request"]
            if (
                not no_fit.never
                and not request.get("spot")
                and request.get("binding") != "node"
                and not by_id[q.reservation_id]["requeued"]
            ):
                # A regular request may take the capacity of spot work when it is admitted, as
                # inline; a retry never does (it waits, as the reconciler's retries do).
                if notice is None:
                    info = await pool_rows.read_pool(conn, pool_id=pool_id, tenant_id=q.tenant_id)
                    notice = dt.timedelta(
                        seconds=info.spot_notice_s if info else pools.DEFAULT_SPOT_NOTICE_S
                    )
                preempted = await preempting.preempt(
                    conn,
                    cache=db.inventory,
                    pool_id=pool_id,
                    reservation_id=q.reservation_id,
                    demand=q.demand,
                    start=q.start,
                    end=q.end,
                    now=now,
                    notice=notice,
                )
                if preempted is not None:
                    outcome, snap, start, end = preempted
                    await _mark_placed(
                        conn,
                        pool_id=pool_id,
                        queued=dataclasses.replace(q, start=start, end=end),
                        outcome=outcome,
                        atom_of=placing.atoms_by_id(snap),
                        lease_seconds=by_id[q.reservation_id]["lease_seconds"],
                        now=now,
                    )
                    done.placed.append(q.reservation_id)
                    continue
            done.pending.append(q.reservation_id)
            row = by_id[q.reservation_id]
            if row["requeued"] and lifecycle.still_unschedulable(row["conditions"], no_fit.message):
                # A retry that changes nothing, as the reconciler's: the row stays as it is
                # (no version, no condition: no churn for watchers), tried again in 30 s.
                await journal.wake(
                    conn,
                    reservation_id=q.reservation_id,
                    at=now + lifecycle.PENDING_RETRY,
                    why="retry",
                )
                continue
            # Left exactly as the inline placer leaves what does not fit: pending with
            # Unschedulable/NoFit and a retry in 30 s (at once when capacity is freed), which
            # the reconciler hands back to a batch (``lifecycle.Requeue``). The ``pending``
            # event only the first time: a retry's new reason is no new event.
            await conn.execute(
                *placing.mark_pending_statement(
                    reservation_id=q.reservation_id,
                    pool_id=pool_id,
                    message=no_fit.message,
                    now=now,
                    first=not row["requeued"],
                )
            )
        # Waiters on every replica learn what the batch decided (service/batching.py): those in
        # this process get the reservations as they now read, without a read of their own;
        # those elsewhere read only the ones named in the notifications.
        decided = done.placed + done.pending
        async with conn.pipeline():
            for payload in placed_payloads(pool_id, decided):
                await conn.execute("SELECT pg_notify('compute_placer', %s)", (payload,))
            decided_rows = await (
                await conn.execute(
                    f"SELECT {views.COLUMNS} FROM reservations r WHERE r.id = ANY(%s)",
                    (decided,),
                )
            ).fetchall()
        done.views.update({row["id"]: views.to_view(row) for row in decided_rows})
        return done


#: Room for reservation ids in one notification (PostgreSQL's payload limit is 8,000 bytes).
_PAYLOAD_ROOM = 7_000


def placed_payloads(pool_id: str, decided: Sequence[str]) -> list[str]:
    """``placed:<pool>:<id>,<id>,…``: what a batch decided, in as many notifications as its ids
    need (one at least). ``service.batching.Signals.deliver`` reads them."""
    payloads: list[str] = []
    chunk: list[str] = []
    size = 0
    for rid in decided:
        if chunk and size + len(rid) + 1 > _PAYLOAD_ROOM:
            payloads.append(f"placed:{pool_id}:{','.join(chunk)}")
            chunk, size = [], 0
        chunk.append(rid)
        size += len(rid) + 1
    payloads.append(f"placed:{pool_id}:{','.join(chunk)}")
    return payloads


async def _booked(
    conn: Conn, *, pool_id: str, start: dt.datetime, end: dt.datetime
) -> list[batching.Booked]:
    """The pool's bookings that overlap [start, end): the one snapshot of the batch."""
    rows = await (
        await conn.execute(
            "SELECT atom_id, lower(during) AS s, upper(during) AS e, host_node, host_vcpu,"
            " host_memory_gib, host_hugepages_1gi FROM bookings"
            " WHERE pool_id = %s AND during && tstzrange(%s, %s)",
            (pool_id, start, end),
        )
    ).fetchall()
    return [
        batching.Booked(
            atom_id=r["atom_id"],
            start=r["s"],
            end=r["e"],
            host_node=r["host_node"],
            host={
                "vcpu": r["host_vcpu"],
                "memoryGiB": r["host_memory_gib"],
                "hugepages1Gi": r["host_hugepages_1gi"],
            },
        )
        for r in rows
    ]


async def _mark_placed(
    conn: Conn,
    *,
    pool_id: str,
    queued: batching.Queued,
    outcome: placement.Placed,
    atom_of: Mapping[str, placement.Atom],
    lease_seconds: int | None,
    now: dt.datetime,
) -> None:
    """Book and mark placed, with the inline placer's statements (no quota: charged at
    transaction 2)."""
    book_sql, book_params = placing.book_statement(
        reservation_id=queued.reservation_id,
        pool_id=pool_id,
        outcome=outcome,
        atom_of=atom_of,
        start=queued.start,
        end=queued.end,
        host=queued.demand.host,
    )
    mark_sql, mark_params = placing.mark_placed_statement(
        reservation_id=queued.reservation_id,
        pool_id=pool_id,
        outcome=outcome,
        start=queued.start,
        end=queued.end,
        lease=now + dt.timedelta(seconds=lease_seconds) if lease_seconds else None,
        now=now,
    )
    await conn.execute(book_sql, book_params)
    await conn.execute(mark_sql, mark_params)
