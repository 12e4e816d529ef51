-- The building blocks of admission and placement, as SQL functions.
--
-- Why functions: a create must cost few round trips, and every statement a Python client
-- sends costs it time too. Each function below is one step of the guide's sequence, used by
-- both admission and the reconciler, so "placed" or "charge quota" has exactly one definition.
-- None of them decides policy or chooses devices: those stay in Python (iam, core.placement).

-- Transaction 1, first step: upsert and lock the idempotency row, and read the state of its
-- reservation and the pool as the tenant sees it, in one call.
CREATE FUNCTION bc_draft_begin(
    p_idem text, p_tenant text, p_identity text, p_key text, p_hash text, p_rid text,
    p_pool text, p_claim_ttl interval)
RETURNS TABLE (request_hash text, claim_live boolean, state text, pool_id text,
               owner_tenant_id text, region text, gpu_model text, sharing_mode text,
               replicas integer, archived boolean, policy jsonb, offered boolean,
               on_budget_exceeded text)
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO idempotency (id, scope, tenant_id, identity_id, key, request_hash, reservation_id)
    VALUES (p_idem, 'create', p_tenant, p_identity, p_key, p_hash, p_rid)
    ON CONFLICT (id) DO NOTHING;
    -- Lock first, read after: a read that waited on the lock inside one statement would see the
    -- reservation as its snapshot had it (a draft) while the key's row had moved on.
    PERFORM 1 FROM idempotency WHERE id = p_idem FOR UPDATE;
    RETURN QUERY
    SELECT i.request_hash, i.claim IS NOT NULL AND i.claimed_at > compute_now() - p_claim_ttl,
           r.state, p.id, p.owner_tenant_id, p.region, p.gpu_model, p.sharing_mode, p.replicas,
           p.archived, p.policy, o.tenant_id IS NOT NULL, o.on_budget_exceeded
      FROM idempotency i
      LEFT JOIN reservations r ON r.id = i.reservation_id
      LEFT JOIN pools p ON p.id = p_pool
      LEFT JOIN offers o ON o.pool_id = p.id AND o.tenant_id = p_tenant
     WHERE i.id = p_idem;
END $$;

-- Quota, all or nothing: charge every resource, or none and answer what is short.
-- Returns NULL when charged, else [{resource, requested, limit, used}] for each short one
-- (a missing row grants nothing). Rows are locked in a fixed order: no two charges deadlock.
CREATE FUNCTION bc_charge_quota(p_tenant text, p_resources text[], p_amounts bigint[])
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    short jsonb;
BEGIN
    PERFORM 1 FROM quotas q WHERE q.tenant_id = p_tenant AND q.resource = ANY(p_resources)
      ORDER BY q.resource FOR UPDATE;
    SELECT jsonb_agg(jsonb_build_object('resource', d.resource, 'requested', d.n,
                                        'limit', coalesce(q.limit_, 0),
                                        'used', coalesce(q.used, 0)) ORDER BY d.resource)
      INTO short
      FROM unnest(p_resources, p_amounts) AS d(resource, n)
      LEFT JOIN quotas q ON q.tenant_id = p_tenant AND q.resource = d.resource
     WHERE q.resource IS NULL OR q.used + d.n > q.limit_;
    IF short IS NOT NULL THEN
        RETURN short;
    END IF;
    UPDATE quotas q SET used = q.used + d.n
      FROM unnest(p_resources, p_amounts) AS d(resource, n)
     WHERE q.tenant_id = p_tenant AND q.resource = d.resource;
    RETURN NULL;
END $$;

-- The dynamic part of a placement snapshot: the pool's inventory version and the atoms
-- already booked in [p_start, p_end) by other reservations.
CREATE FUNCTION bc_busy_atoms(p_pool text, p_start timestamptz, p_end timestamptz, p_rid text)
RETURNS TABLE (inventory_version bigint, busy text[])
LANGUAGE sql STABLE AS $$
    SELECT p.inventory_version,
           ARRAY(SELECT DISTINCT b.atom_id FROM bookings b
                  WHERE b.pool_id = p.id AND b.during && tstzrange(p_start, p_end)
                    AND b.reservation_id <> p_rid)
      FROM pools p WHERE p.id = p_pool
$$;

-- Transaction 2, first step: the claim is still ours, the pool lock, quota, the window, and
-- the snapshot's dynamic part, in one call. Raises nothing: the caller reads the answer and
-- rolls back when the claim was lost or quota is short.
CREATE FUNCTION bc_admission_begin(
    p_idem text, p_claim text, p_pool text, p_tenant text, p_resources text[],
    p_amounts bigint[], p_requested timestamptz, p_duration interval, p_rid text)
RETURNS TABLE (mine boolean, state text, quota_short jsonb, now_ timestamptz,
               start_ timestamptz, end_ timestamptz, inventory_version bigint, busy text[])
LANGUAGE plpgsql AS $$
DECLARE
    v_mine boolean;
    v_state text;
    v_short jsonb;
    v_now timestamptz;
    v_start timestamptz;
BEGIN
    SELECT i.claim = p_claim, r.state INTO v_mine, v_state
      FROM idempotency i JOIN reservations r ON r.id = i.reservation_id
     WHERE i.id = p_idem FOR UPDATE OF i, r;
    IF NOT coalesce(v_mine, false) OR v_state NOT IN ('draft', 'awaiting-confirmation') THEN
        RETURN QUERY SELECT false, v_state, NULL::jsonb, NULL::timestamptz, NULL::timestamptz,
                            NULL::timestamptz, NULL::bigint, NULL::text[];
        RETURN;
    END IF;
    -- Lock order, everywhere: the pool, then reservation rows, then quota rows. The draft's
    -- row is the one exception, safe because nothing else ever locks a draft.
    PERFORM pg_advisory_xact_lock(hashtextextended(p_pool, 0));
    v_short := bc_charge_quota(p_tenant, p_resources, p_amounts);
    v_now := compute_now();
    v_start := greatest(v_now, coalesce(p_requested, v_now));
    RETURN QUERY SELECT true, v_state, v_short, v_now, v_start, v_start + p_duration,
                        b.inventory_version, b.busy
                   FROM bc_busy_atoms(p_pool, v_start, v_start + p_duration, p_rid) b;
END $$;

-- Book a placement: one planned allocation per node and one booking per atom.
CREATE FUNCTION bc_book(
    p_rid text, p_pool text, p_start timestamptz, p_end timestamptz, p_alloc_ids text[],
    p_nodes text[], p_classes text[], p_devices text[], p_atoms text[],
    p_booking_atoms text[], p_booking_allocs text[])
RETURNS void LANGUAGE sql AS $$
    INSERT INTO allocations (id, reservation_id, node_id, device_class, device_ids, atom_ids,
                             until)
    SELECT a.id, p_rid, a.node, a.class, string_to_array(a.devices, ','),
           string_to_array(a.atoms, ','), p_end
      FROM unnest(p_alloc_ids, p_nodes, p_classes, p_devices, p_atoms)
           AS a(id, node, class, devices, atoms);
    INSERT INTO bookings (atom_id, reservation_id, allocation_id, pool_id, during)
    SELECT b.atom, p_rid, b.alloc, p_pool, tstzrange(p_start, p_end)
      FROM unnest(p_booking_atoms, p_booking_allocs) AS b(atom, alloc);
$$;

-- The reservation is placed: window, binding, wake-ups (start - 15 min, start, end, lease) and
-- its event (reservation.placed, or reservation.repaired after a repair).
CREATE FUNCTION bc_mark_placed(
    p_rid text, p_pool text, p_start timestamptz, p_end timestamptz, p_lease timestamptz,
    p_now timestamptz, p_node_ids text[], p_event text, p_quota_charge jsonb)
RETURNS void LANGUAGE sql AS $$
    UPDATE reservations
       SET state = 'placed', during = tstzrange(p_start, p_end),
           binding = jsonb_build_object('nodeId', p_node_ids[1], 'nodeIds', to_jsonb(p_node_ids)),
           conditions = '[]', pending_since = NULL, version = version + 1,
           lease_expires_at = coalesce(lease_expires_at, p_lease),
           quota_charge = coalesce(p_quota_charge, quota_charge), updated_at = compute_now()
     WHERE id = p_rid;
    INSERT INTO work_queue (reservation_id, due_at, why)
    SELECT p_rid, w.at, w.why
      FROM (VALUES (p_start - interval '15 minutes', 'start-15m'), (p_start, 'start'),
                   (p_end, 'end'), (p_lease, 'lease')) AS w(at, why)
     WHERE w.at IS NOT NULL AND (w.why <> 'start-15m' OR w.at > p_now);
    INSERT INTO outbox (type, subject, data)
    VALUES (p_event, 'reservation/' || p_rid,
            jsonb_build_object('state', 'placed', 'poolId', p_pool,
                               'nodeIds', to_jsonb(p_node_ids), 'start', epoch_ms(p_start),
                               'end', epoch_ms(p_end)));
$$;

-- The reservation waits, pending with Unschedulable; retried in 30 s (sooner when capacity is
-- freed). The event is written the first time only.
CREATE FUNCTION bc_mark_pending(
    p_rid text, p_pool text, p_condition jsonb, p_reason text, p_now timestamptz,
    p_first boolean, p_quota_charge jsonb)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    UPDATE reservations
       SET state = 'pending', conditions = jsonb_build_array(p_condition), during = NULL,
           binding = NULL, pending_since = coalesce(pending_since, compute_now()),
           quota_charge = coalesce(p_quota_charge, quota_charge), version = version + 1,
           updated_at = compute_now()
     WHERE id = p_rid;
    INSERT INTO work_queue (reservation_id, due_at, why)
    VALUES (p_rid, p_now + interval '30 seconds', 'retry');
    IF p_first THEN
        INSERT INTO outbox (type, subject, data)
        VALUES ('reservation.pending', 'reservation/' || p_rid,
                jsonb_build_object('state', 'pending', 'poolId', p_pool, 'reason', p_reason));
    END IF;
END $$;

-- Transaction 2, last step: the claim is given back and the decision audited.
CREATE FUNCTION bc_admission_done(
    p_idem text, p_rid text, p_actor text, p_tenant text, p_outcome text, p_context jsonb)
RETURNS void LANGUAGE sql AS $$
    UPDATE idempotency SET claim = NULL, claimed_at = NULL, outcome = 'admitted'
     WHERE id = p_idem;
    INSERT INTO audit_log (actor, tenant_id, action, resource_id, outcome, context)
    VALUES (p_actor, p_tenant, 'compute:reservations:create', p_rid, p_outcome, p_context);
$$;
