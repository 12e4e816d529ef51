-- The pool-lease placer (policy.placer: 'pool-lease'): transaction 2 charges quota and queues
-- the reservation (pending, condition Queued/PoolPlacer) without the pool lock; the replica
-- holding the pool's lease places the queued reservations of the pool in batches, one
-- transaction and one pool lock per batch (store/batching.py).
--
-- The lease: one row per pool, its holder (a placer loop's random id), an epoch bumped on every
-- change of holder, and an expiry in business time (compute_now()) that the holder renews. A
-- holder that stops renewing loses the lease at its expiry; anyone may take it then. The batch
-- transaction locks the lease row and checks holder and epoch under the pool lock, so a holder
-- whose lease was taken over places nothing; the state guard on the queued rows, read under
-- the same pool lock, is the second line: a reservation is placed by one batch only.

CREATE TABLE pool_leases (
    pool_id     text PRIMARY KEY REFERENCES pools (id) ON DELETE CASCADE,
    holder      text NOT NULL,
    epoch       bigint NOT NULL DEFAULT 1,
    expires_at  timestamptz NOT NULL
);

-- Take or renew the lease of p_pool for p_holder until now + p_ttl. Returns the epoch held, or
-- NULL when another holder's lease has not expired. A renewal keeps the epoch; a takeover
-- bumps it.
CREATE FUNCTION bc_pool_lease_take(p_pool text, p_holder text, p_ttl interval)
RETURNS bigint LANGUAGE sql AS $$
    INSERT INTO pool_leases AS l (pool_id, holder, epoch, expires_at)
    VALUES (p_pool, p_holder, 1, compute_now() + p_ttl)
    ON CONFLICT (pool_id) DO UPDATE
       SET holder = excluded.holder,
           epoch = CASE WHEN l.holder = excluded.holder THEN l.epoch ELSE l.epoch + 1 END,
           expires_at = excluded.expires_at
     WHERE l.holder = excluded.holder OR l.expires_at <= compute_now()
    RETURNING epoch
$$;

-- Transaction 2 for a pool-lease pool: the claim, the budget, quota all-or-nothing, then the
-- reservation queued with its event and the admission's audit row. No pool lock: placing is
-- the batch's. On a shortfall nothing is written (the caller rolls back what was locked).
-- Lock order as everywhere: the draft's rows, the budget, then quota rows.
CREATE FUNCTION bc_admission_queue(
    p_idem text, p_claim text, p_pool text, p_tenant text, p_resources text[],
    p_amounts bigint[], p_rid text, p_budget_hours numeric, p_condition jsonb,
    p_charge jsonb, p_actor text, p_context jsonb)
RETURNS TABLE (mine boolean, state text, budget_short jsonb, quota_short jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_mine boolean;
    v_state text;
    v_budget jsonb;
    v_short jsonb;
BEGIN
    SELECT i.claim = p_claim, r.state INTO v_mine, v_state
      FROM idempotency i JOIN reservations r ON r.id = i.reservation_id
     WHERE i.id = p_idem FOR UPDATE OF i, r;
    IF NOT coalesce(v_mine, false) OR v_state NOT IN ('draft', 'awaiting-confirmation') THEN
        RETURN QUERY SELECT false, v_state, NULL::jsonb, NULL::jsonb;
        RETURN;
    END IF;
    IF p_budget_hours IS NOT NULL THEN
        v_budget := bc_budget_lock_check(p_tenant, p_budget_hours);
        IF v_budget IS NOT NULL THEN
            RETURN QUERY SELECT true, v_state, v_budget, NULL::jsonb;
            RETURN;
        END IF;
    END IF;
    v_short := bc_charge_quota(p_tenant, p_resources, p_amounts);
    IF v_short IS NOT NULL THEN
        RETURN QUERY SELECT true, v_state, NULL::jsonb, v_short;
        RETURN;
    END IF;
    UPDATE reservations
       SET state = 'pending', conditions = jsonb_build_array(p_condition), during = NULL,
           binding = NULL, pending_since = coalesce(pending_since, compute_now()),
           quota_charge = p_charge, version = version + 1, updated_at = compute_now()
     WHERE id = p_rid;
    INSERT INTO outbox (type, subject, data)
    VALUES ('reservation.queued', 'reservation/' || p_rid,
            jsonb_build_object('state', 'pending', 'poolId', p_pool, 'reason', 'PoolPlacer'));
    PERFORM bc_admission_done(p_idem, p_rid, p_actor, p_tenant, 'queued', p_context);
    -- Wakes the pool's lease holder, whichever replica it is, as this commits.
    PERFORM pg_notify('compute_placer', 'queued:' || p_pool);
    RETURN QUERY SELECT true, v_state, NULL::jsonb, NULL::jsonb;
END $$;

-- The queued reservations of a pool, oldest first, for the batch (and for nothing else): the
-- partial index keeps the batch's look-up small however many reservations the pool has.
CREATE INDEX reservations_pool_queued ON reservations (pool_id, created_at)
    WHERE state = 'pending' AND conditions @> '[{"type": "Queued"}]';
