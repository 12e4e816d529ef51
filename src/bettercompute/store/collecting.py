"""Garbage collection: the rows admission leaves behind that nothing will ever read again.

Why: a refused create keeps its draft so the same key is decided again, a denied one keeps its
reservation, and a crashed extend can leave its hold; none of them ends by itself, so without
this they pile up forever. What goes, in bounded batches (each its own short transaction, rows
taken ``SKIP LOCKED`` so a pass never waits on a request):

* drafts (refused for quota or budget, or abandoned) older than ``draft_age`` whose claim is
  not live, with their authorization rows. Their idempotency rows stay: they hold the request
  hash, so a retry with another request is still ``CONFLICT``, and a retry with the same request
  simply writes the draft again;
* denied reservations older than ``denied_age``, with their authorization rows. The key's
  idempotency row stays and says ``denied``: the key stays refused for good, as the guide says;
* extend holds whose holder's session has ended or that are older than the hold timeout, with
  the pending change they staged;
* claims on idempotency rows whose holder has ended or that timed out.

The audit log always stays. Never decides anything.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from bettercompute.store.admission import CLAIM_TTL
from bettercompute.store.database import Database
from bettercompute.store.extending import EXTEND_HOLD_TTL

#: How long a refused or abandoned draft is kept (its key is remembered regardless).
DRAFT_AGE = dt.timedelta(hours=1)
#: How long a denied reservation stays readable (its key stays refused regardless).
DENIED_AGE = dt.timedelta(days=7)
#: Rows per statement: a pass never holds many locks or runs one long transaction.
BATCH = 500
#: Batches per kind per pass, so one pass is bounded too; the next pass takes the rest.
MAX_BATCHES = 20


@dataclass(frozen=True)
class Collected:
    drafts: int = 0
    denied: int = 0
    holds: int = 0
    claims: int = 0

    @property
    def total(self) -> int:
        return self.drafts + self.denied + self.holds + self.claims


# Lock order: the draft's rows (SKIP LOCKED), then its authorization row, which only the draft's
# own transaction 1 writes.
_DRAFTS = """
    WITH victims AS (
        SELECT r.id, i.id AS idem
          FROM reservations r JOIN idempotency i ON i.reservation_id = r.id
         WHERE r.state = 'draft' AND i.scope = 'create'
           AND r.created_at < compute_now() - %(age)s
           AND NOT bc_claim_live(i.claim, i.claimed_at, i.claim_holder, %(ttl)s)
         ORDER BY r.created_at LIMIT %(batch)s
           FOR UPDATE OF r, i SKIP LOCKED
    ), authz AS (
        DELETE FROM authz_resources a USING victims v WHERE a.id = v.id
    ), claims AS (
        UPDATE idempotency i SET claim = NULL, claimed_at = NULL, claim_holder = NULL
          FROM victims v WHERE i.id = v.idem AND i.claim IS NOT NULL
    )
    DELETE FROM reservations r USING victims v WHERE r.id = v.id
"""

# Only where the key's idempotency row records the denial, so the key stays refused.
_DENIED = """
    WITH victims AS (
        SELECT r.id FROM reservations r
         WHERE r.state = 'denied' AND r.updated_at < compute_now() - %(age)s
           AND EXISTS (SELECT 1 FROM idempotency i
                        WHERE i.reservation_id = r.id AND i.scope = 'create'
                          AND i.outcome = 'denied')
         ORDER BY r.updated_at LIMIT %(batch)s
           FOR UPDATE OF r SKIP LOCKED
    ), authz AS (
        DELETE FROM authz_resources a USING victims v WHERE a.id = v.id
    )
    DELETE FROM reservations r USING victims v WHERE r.id = v.id
"""

# Lock order as extend's own transactions: the reservation row, the hold, then the
# authorization row (both taken SKIP LOCKED, so an extend in flight is simply passed over).
_HOLDS = """
    WITH victims AS (
        SELECT h.reservation_id, h.hold
          FROM extend_holds h JOIN reservations r ON r.id = h.reservation_id
         WHERE NOT bc_claim_live(h.hold, h.taken_at, h.holder, %(ttl)s)
         LIMIT %(batch)s
           FOR UPDATE OF r, h SKIP LOCKED
    ), pending AS (
        UPDATE authz_resources a SET pending = NULL
          FROM victims v WHERE a.id = v.reservation_id AND a.pending ->> 'hold' = v.hold
    )
    DELETE FROM extend_holds h USING victims v
     WHERE h.reservation_id = v.reservation_id AND h.hold = v.hold
"""

_CLAIMS = """
    UPDATE idempotency SET claim = NULL, claimed_at = NULL, claim_holder = NULL
     WHERE id IN (SELECT i.id FROM idempotency i
                   WHERE i.claim IS NOT NULL
                     AND NOT bc_claim_live(i.claim, i.claimed_at, i.claim_holder, %(ttl)s)
                   LIMIT %(batch)s
                     FOR UPDATE SKIP LOCKED)
"""


async def collect(
    db: Database,
    *,
    draft_age: dt.timedelta = DRAFT_AGE,
    denied_age: dt.timedelta = DENIED_AGE,
    batch: int = BATCH,
    max_batches: int = MAX_BATCHES,
) -> Collected:
    """One pass: what was removed (or, for claims, cleared), by kind."""

    async def each(sql: str, **params: object) -> int:
        total = 0
        for _ in range(max_batches):
            async with db.transaction() as conn:
                cur = await conn.execute(sql, {"batch": batch, **params})
                total += cur.rowcount
            if cur.rowcount < batch:
                break
        return total

    return Collected(
        drafts=await each(_DRAFTS, age=draft_age, ttl=CLAIM_TTL),
        denied=await each(_DENIED, age=denied_age),
        holds=await each(_HOLDS, ttl=EXTEND_HOLD_TTL),
        claims=await each(_CLAIMS, ttl=CLAIM_TTL),
    )
