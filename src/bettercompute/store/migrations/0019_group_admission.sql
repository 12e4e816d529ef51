-- Group commit of inline creates (store/admission.py): a group begins each of its creates with
-- bc_admission_charge (claim, budget, pool lock, quota, window: bc_admission_begin without
-- the read of the bookings) and then reads the bookings of each distinct window once, with
-- bc_busy_windows, rather than once per create: creates of one group mostly share a window
-- ("now", or the same future start), and that read was the dearest part of the begin.
-- bc_admission_begin stays: a create committed alone calls it (one statement for both), and
-- replicas of the previous version do during a rolling upgrade.

CREATE FUNCTION bc_admission_charge(
    p_idem text, p_claim text, p_pool text, p_tenant text, p_resources text[],
    p_amounts bigint[], p_requested timestamptz, p_duration interval, p_budget_hours numeric)
RETURNS TABLE (mine boolean, state text, budget_short jsonb, quota_short jsonb,
               now_ timestamptz, start_ timestamptz, end_ timestamptz,
               inventory_version bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_mine boolean;
    v_state text;
    v_budget jsonb;
    v_short jsonb;
    v_now timestamptz;
    v_start timestamptz;
BEGIN
    SELECT i.claim = p_claim, r.state INTO v_mine, v_state
      FROM idempotency i JOIN reservations r ON r.id = i.reservation_id
     WHERE i.id = p_idem FOR UPDATE OF i, r;
    IF NOT coalesce(v_mine, false) OR v_state NOT IN ('draft', 'awaiting-confirmation') THEN
        RETURN QUERY SELECT false, v_state, NULL::jsonb, NULL::jsonb, NULL::timestamptz,
                            NULL::timestamptz, NULL::timestamptz, NULL::bigint;
        RETURN;
    END IF;
    -- Lock order, everywhere: the budget, the pool, then reservation rows, then quota rows.
    -- The draft's rows are the one exception, safe because nothing else waits on a draft.
    IF p_budget_hours IS NOT NULL THEN
        v_budget := bc_budget_lock_check(p_tenant, p_budget_hours);
        IF v_budget IS NOT NULL THEN
            RETURN QUERY SELECT true, v_state, v_budget, NULL::jsonb, NULL::timestamptz,
                                NULL::timestamptz, NULL::timestamptz, NULL::bigint;
            RETURN;
        END IF;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended(p_pool, 0));
    v_short := bc_charge_quota(p_tenant, p_resources, p_amounts);
    v_now := compute_now();
    v_start := greatest(v_now, coalesce(p_requested, v_now));
    RETURN QUERY
    SELECT true, v_state, NULL::jsonb, v_short, v_now, v_start, v_start + p_duration,
           p.inventory_version
      FROM pools p WHERE p.id = p_pool;
END $$;

-- Per distinct window of a group: each create's window as bc_admission_charge computes it
-- (from its requested start, or now, and its duration; compute_now() is the transaction's, so
-- the same in both), the atoms booked in it and, when p_hosts, what each node's host has
-- booked, as bc_admission_begin reads them, leaving out the bookings of the group's own
-- reservations (p_rids); own_booked counts those, so the caller reads such a window for each
-- reservation alone. Run after the charges, in the same transaction and under the pool lock:
-- its snapshot sees every booking committed before.
CREATE FUNCTION bc_busy_windows(
    p_pool text, p_requested timestamptz[], p_durations interval[], p_rids text[],
    p_hosts boolean)
RETURNS TABLE (start_ timestamptz, end_ timestamptz, busy text[], host_busy jsonb,
               own_booked bigint)
-- PL/pgSQL rather than SQL: its plan is made once per session and kept, where a SQL function
-- this size would be inlined into every call and planned again each time.
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN QUERY
    SELECT win.s, win.e, u.busy, u.host_busy, u.own
      FROM (SELECT DISTINCT n.s, n.s + x.d AS e
              FROM unnest(p_requested, p_durations) AS x(r, d),
                   LATERAL (SELECT greatest(compute_now(), coalesce(x.r, compute_now())) AS s) n
           ) win
      CROSS JOIN LATERAL (
          WITH w AS MATERIALIZED (
              SELECT b.atom_id, b.host_node, b.host_vcpu, b.host_memory_gib,
                     b.host_hugepages_1gi, b.reservation_id = ANY(p_rids) AS own
                FROM bookings b
               WHERE b.pool_id = p_pool AND b.during && tstzrange(win.s, win.e)
          )
          SELECT ARRAY(SELECT DISTINCT w.atom_id FROM w WHERE NOT w.own) AS busy,
                 CASE WHEN p_hosts THEN (
                     SELECT coalesce(jsonb_object_agg(h.node, jsonb_build_array(h.vcpu,
                                                      h.memory, h.hugepages)), '{}')
                       FROM (SELECT w.host_node AS node, sum(w.host_vcpu) AS vcpu,
                                    sum(w.host_memory_gib) AS memory,
                                    sum(w.host_hugepages_1gi) AS hugepages
                               FROM w WHERE w.host_node IS NOT NULL AND NOT w.own
                              GROUP BY w.host_node) h)
                 ELSE '{}'::jsonb END AS host_busy,
                 (SELECT count(*) FROM w WHERE w.own) AS own
      ) u;
END $$;
