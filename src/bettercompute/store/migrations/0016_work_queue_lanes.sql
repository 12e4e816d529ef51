-- The work queue's two lanes: lifecycle wake-ups are taken before pending retries.
--
-- Why: the reconciler took every due wake-up in due order, and a release wakes every pending
-- reservation of its pool ('capacity-freed'), each a placement attempt under the pool lock.
-- With 2,000 pending, a reservation placed just after a release waited behind all of them
-- twice (its start, then its node's bound report): seconds to minutes in `binding`, while a
-- pending retry taken a second later loses nothing. This partial index finds the oldest due
-- lifecycle wake-up without walking the retries due before it (store/reconciling.py,
-- RETRY_WHYS: the same list, written the same way, so the planner matches the predicate).
CREATE INDEX work_queue_due_lifecycle ON work_queue (due_at)
    WHERE why NOT IN ('retry', 'capacity-freed', 'capacity-changed');
