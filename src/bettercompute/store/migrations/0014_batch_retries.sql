-- Retries on a pool-lease pool go through the batch: a pending reservation that is not queued
-- (what a batch could not place, a spot reservation preempted) is tried again by the pool's
-- batch, in the same fair order as new requests, never by the reconciler inline. When a retry
-- is due (every 30 s, at once when capacity is freed) the reconciler adds a row here and wakes
-- the pool's lease holder; the batch places the rows it picks with the queued ones and deletes
-- them in the same transaction.
--
-- Why a table of its own and not a column of reservations: every update of a reservation row
-- notifies the watchers (compute_reservation, migration 0003), and a retry that changes nothing
-- must not make every watcher read the reservation again every 30 s.
--
-- A row only means "try again": the batch still checks, under the pool lock, that the
-- reservation is pending. A row whose reservation left pending before a batch came is deleted
-- by the pool's next batch, or with the reservation.

CREATE TABLE batch_retries (
    reservation_id  text PRIMARY KEY REFERENCES reservations (id) ON DELETE CASCADE,
    -- The reservation's pool (it never changes): the batch looks its pool's rows up by it.
    pool_id         text NOT NULL,
    requeued_at     timestamptz NOT NULL DEFAULT compute_now()
);

CREATE INDEX batch_retries_pool ON batch_retries (pool_id);
