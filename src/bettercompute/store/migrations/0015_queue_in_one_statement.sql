-- Transaction 2 of a create on a pool-lease pool as one statement (store/admission.py sends it
-- alone, in autocommit, so the server commits as soon as it ran).
--
-- Why: the tenant's quota rows are locked from the charge to the commit, and every create of
-- the tenant charges the same rows, one after another. Sent as several statements, the commit
-- waited for the client to send the next one, so a busy client held the tenant's quota locked
-- while it did other work, and every other create of the tenant waited with it. Now nothing
-- the client does runs while they are locked.
--
-- The function also writes the reservation's maxPending wake-up (so a queued reservation fails
-- past its pool's maxPending even when no replica runs the placer) and returns the reservation
-- row as it left it, from which the caller reads the reservation object in the same statement.

DROP FUNCTION bc_admission_queue(text, text, text, text, text[], bigint[], text, numeric, jsonb,
                                 jsonb, text, jsonb);

CREATE FUNCTION bc_admission_queue(
    p_idem text, p_claim text, p_pool text, p_tenant text, p_resources text[],
    p_amounts bigint[], p_rid text, p_budget_hours numeric, p_condition jsonb,
    p_charge jsonb, p_actor text, p_context jsonb, p_fail_after interval)
RETURNS TABLE (mine boolean, state text, budget_short jsonb, quota_short jsonb,
               queued reservations)
LANGUAGE plpgsql AS $$
DECLARE
    v_mine boolean;
    v_state text;
    v_budget jsonb;
    v_short jsonb;
    v_row reservations;
BEGIN
    SELECT i.claim = p_claim, r.state INTO v_mine, v_state
      FROM idempotency i JOIN reservations r ON r.id = i.reservation_id
     WHERE i.id = p_idem FOR UPDATE OF i, r;
    IF NOT coalesce(v_mine, false) OR v_state NOT IN ('draft', 'awaiting-confirmation') THEN
        RETURN QUERY SELECT false, v_state, NULL::jsonb, NULL::jsonb, NULL::reservations;
        RETURN;
    END IF;
    IF p_budget_hours IS NOT NULL THEN
        v_budget := bc_budget_lock_check(p_tenant, p_budget_hours);
        IF v_budget IS NOT NULL THEN
            RETURN QUERY SELECT true, v_state, v_budget, NULL::jsonb, NULL::reservations;
            RETURN;
        END IF;
    END IF;
    v_short := bc_charge_quota(p_tenant, p_resources, p_amounts);
    IF v_short IS NOT NULL THEN
        RETURN QUERY SELECT true, v_state, NULL::jsonb, v_short, NULL::reservations;
        RETURN;
    END IF;
    UPDATE reservations
       SET state = 'pending', conditions = jsonb_build_array(p_condition), during = NULL,
           binding = NULL, pending_since = coalesce(pending_since, compute_now()),
           quota_charge = p_charge, version = version + 1, updated_at = compute_now()
     WHERE id = p_rid
    RETURNING * INTO v_row;
    INSERT INTO outbox (type, subject, data)
    VALUES ('reservation.queued', 'reservation/' || p_rid,
            jsonb_build_object('state', 'pending', 'poolId', p_pool, 'reason', 'PoolPlacer'));
    PERFORM bc_admission_done(p_idem, p_rid, p_actor, p_tenant, 'queued', p_context);
    INSERT INTO work_queue (reservation_id, due_at, why)
    VALUES (p_rid, v_row.pending_since + p_fail_after, 'max-pending');
    -- Wakes the pool's lease holder, whichever replica it is, as this commits.
    PERFORM pg_notify('compute_placer', 'queued:' || p_pool);
    RETURN QUERY SELECT true, v_state, NULL::jsonb, NULL::jsonb, v_row;
END $$;
