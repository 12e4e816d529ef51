-- Host resources booked with the GPUs: each host's bookable CPUs, memory and huge pages, and
-- what each allocation books of them.
--
-- host_resources holds a node's rows (vcpu, memoryGiB, hugepages2Mi, hugepages1Gi) as its
-- inventory last said, rewritten in the same transaction as the node (store/inventory.py): a
-- new or re-inventoried node is bookable at once, and a node without rows books none.
--
-- What an allocation books of its node's host is written twice: on the allocation (host_*,
-- what its node is told as limits) and on the first of its device bookings (host_node and
-- host_*; NULL and 0 on the others), so its time is its devices' time (release and extend move
-- `during`, and with it the host booking, which can never outlive or precede its devices) and
-- the use of each host in a window is summed in the same scan of the pool's bookings that finds
-- the busy atoms. No constraint can say "the sum of overlapping bookings stays within
-- capacity"; bc_check_hosts is the guard instead, run by every statement that books host
-- resources or moves their time (bc_book with host arrays, extend): under the pool lock every
-- booking of the node takes, it raises exclusion_violation (like the bookings' EXCLUDE) when a
-- node would give more than it has.

CREATE TABLE host_resources (
    node_id   text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    resource  text NOT NULL CHECK (resource IN ('vcpu', 'memoryGiB', 'hugepages2Mi',
                                                'hugepages1Gi')),
    capacity  bigint NOT NULL CHECK (capacity >= 0),
    PRIMARY KEY (node_id, resource)
);

ALTER TABLE allocations
    ADD COLUMN host_vcpu integer NOT NULL DEFAULT 0 CHECK (host_vcpu >= 0),
    ADD COLUMN host_memory_gib integer NOT NULL DEFAULT 0 CHECK (host_memory_gib >= 0),
    ADD COLUMN host_hugepages_1gi integer NOT NULL DEFAULT 0 CHECK (host_hugepages_1gi >= 0);
ALTER TABLE bookings
    ADD COLUMN host_node text,
    ADD COLUMN host_vcpu integer NOT NULL DEFAULT 0 CHECK (host_vcpu >= 0),
    ADD COLUMN host_memory_gib integer NOT NULL DEFAULT 0 CHECK (host_memory_gib >= 0),
    ADD COLUMN host_hugepages_1gi integer NOT NULL DEFAULT 0 CHECK (host_hugepages_1gi >= 0);

-- The per-GPU share the pool's hosts can give (vcpu, memoryGiB), kept with the inventory.
-- A node's host bookings in a window, for the guard: one probe per node.
CREATE INDEX bookings_host_node ON bookings USING gist (host_node, during)
    WHERE host_node IS NOT NULL;

ALTER TABLE pools ADD COLUMN host_share jsonb NOT NULL DEFAULT '{}';

-- What the other reservations book of each host in [p_start, p_end): {node: [vcpu, memoryGiB,
-- hugepages1Gi]}. Overlapping bookings are summed whether or not they overlap each other: never
-- more generous than the truth.
CREATE FUNCTION bc_busy_hosts(p_pool text, p_start timestamptz, p_end timestamptz, p_rid text)
RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT coalesce(jsonb_object_agg(u.node, jsonb_build_array(u.vcpu, u.memory, u.hugepages)),
                    '{}')
      FROM (SELECT b.host_node AS node, sum(b.host_vcpu) AS vcpu,
                   sum(b.host_memory_gib) AS memory, sum(b.host_hugepages_1gi) AS hugepages
              FROM bookings b
             WHERE b.pool_id = p_pool AND b.during && tstzrange(p_start, p_end)
               AND b.reservation_id <> p_rid AND b.host_node IS NOT NULL
             GROUP BY b.host_node) u
$$;

-- Whether every node of p_nodes can give what all allocations overlapping [p_start, p_end)
-- book there, each resource on its own; raises exclusion_violation (like the bookings' EXCLUDE)
-- when one cannot (through bookings_host_node: one index probe per node). The caller holds the
-- pool lock, which every booking of those nodes takes.
CREATE FUNCTION bc_check_hosts(
    p_pool text, p_nodes text[], p_start timestamptz, p_end timestamptz)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    over record;
BEGIN
    SELECT u.node_id, u.vcpu, u.memory, u.hugepages INTO over
      FROM (SELECT b.host_node AS node_id, sum(b.host_vcpu) AS vcpu,
                   sum(b.host_memory_gib) AS memory, sum(b.host_hugepages_1gi) AS hugepages
              FROM bookings b
             WHERE b.host_node = ANY(p_nodes) AND b.during && tstzrange(p_start, p_end)
               AND b.host_node IS NOT NULL
             GROUP BY b.host_node) u
      LEFT JOIN host_resources v ON v.node_id = u.node_id AND v.resource = 'vcpu'
      LEFT JOIN host_resources m ON m.node_id = u.node_id AND m.resource = 'memoryGiB'
      LEFT JOIN host_resources g ON g.node_id = u.node_id AND g.resource = 'hugepages1Gi'
     WHERE u.vcpu > coalesce(v.capacity, 0)
        OR u.memory > coalesce(m.capacity, 0)
        OR u.hugepages > coalesce(g.capacity, 0)
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'host % would give more than it has: % vcpu, % GiB, % 1Gi huge pages',
            over.node_id, over.vcpu, over.memory, over.hugepages
            USING ERRCODE = 'exclusion_violation';
    END IF;
END $$;

-- Book a placement with host resources: bc_book's allocations carry what each books of its
-- node's host (p_vcpu, p_memory, p_hugepages, per allocation), then the nodes are checked.
CREATE FUNCTION bc_book(
    p_rid text, p_pool text, p_start timestamptz, p_end timestamptz, p_alloc_ids text[],
    p_nodes text[], p_classes text[], p_devices text[], p_atoms text[],
    p_booking_atoms text[], p_booking_allocs text[], p_vcpu integer[], p_memory integer[],
    p_hugepages integer[])
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO allocations (id, reservation_id, node_id, device_class, device_ids, atom_ids,
                             until, host_vcpu, host_memory_gib, host_hugepages_1gi)
    SELECT a.id, p_rid, a.node, a.class, string_to_array(a.devices, ','),
           string_to_array(a.atoms, ','), p_end, a.vcpu, a.memory, a.hugepages
      FROM unnest(p_alloc_ids, p_nodes, p_classes, p_devices, p_atoms, p_vcpu, p_memory,
                  p_hugepages) AS a(id, node, class, devices, atoms, vcpu, memory, hugepages);
    -- The host booking rides on each allocation's first device booking.
    INSERT INTO bookings (atom_id, reservation_id, allocation_id, pool_id, during, host_node,
                          host_vcpu, host_memory_gib, host_hugepages_1gi)
    SELECT b.atom, p_rid, b.alloc, p_pool, tstzrange(p_start, p_end),
           CASE WHEN b.first THEN h.node END,
           CASE WHEN b.first THEN h.vcpu ELSE 0 END,
           CASE WHEN b.first THEN h.memory ELSE 0 END,
           CASE WHEN b.first THEN h.hugepages ELSE 0 END
      FROM (SELECT x.atom, x.alloc,
                   x.n = min(x.n) OVER (PARTITION BY x.alloc) AS first
              FROM unnest(p_booking_atoms, p_booking_allocs) WITH ORDINALITY AS x(atom, alloc, n)
           ) b
      JOIN unnest(p_alloc_ids, p_nodes, p_vcpu, p_memory, p_hugepages)
           AS h(id, node, vcpu, memory, hugepages) ON h.id = b.alloc;
    PERFORM bc_check_hosts(p_pool, p_nodes, p_start, p_end);
END $$;

-- The smallest per-GPU share any GPU host of the pool can give: its rows (vcpu less the pool's
-- hostReserve) divided by its physical GPUs, every one counted, bookable or not; rounded down.
-- Hosts without rows give none and are not counted. {} when no host has rows.
CREATE FUNCTION bc_pool_host_share(p_pool text) RETURNS jsonb LANGUAGE sql STABLE AS $$
    WITH hosts AS (
        SELECT (SELECT count(DISTINCT a.parent_gpu) FROM atoms a
                 WHERE a.node_id = n.id AND NOT a.retired) AS gpus,
               (SELECT h.capacity FROM host_resources h
                 WHERE h.node_id = n.id AND h.resource = 'vcpu') AS vcpu,
               (SELECT h.capacity FROM host_resources h
                 WHERE h.node_id = n.id AND h.resource = 'memoryGiB') AS memory
          FROM nodes n WHERE n.pool_id = p_pool
    ), reserve AS (
        SELECT coalesce((p.policy -> 'hostReserve' ->> 'vcpu')::integer, 2) AS vcpu
          FROM pools p WHERE p.id = p_pool
    )
    SELECT jsonb_strip_nulls(jsonb_build_object(
               'vcpu', min(greatest(h.vcpu - r.vcpu, 0) / h.gpus),
               'memoryGiB', min(h.memory / h.gpus)))
      FROM hosts h, reserve r
     WHERE h.gpus > 0
$$;

-- Transaction 2, first step, with what other reservations book of hosts in the window
-- (host_busy, when p_hosts, as bc_busy_hosts gives it): one scan of the pool's bookings in the
-- window gives the busy atoms and the hosts' use. The ten-argument form stays for replicas of the previous version during
-- a rolling upgrade.
CREATE FUNCTION bc_admission_begin(
    p_idem text, p_claim text, p_pool text, p_tenant text, p_resources text[],
    p_amounts bigint[], p_requested timestamptz, p_duration interval, p_rid text,
    p_budget_hours numeric, p_hosts boolean)
RETURNS TABLE (mine boolean, state text, budget_short jsonb, quota_short jsonb,
               now_ timestamptz, start_ timestamptz, end_ timestamptz,
               inventory_version bigint, busy text[], host_busy jsonb)
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
                            NULL::timestamptz, NULL::timestamptz, NULL::bigint, NULL::text[],
                            NULL::jsonb;
        RETURN;
    END IF;
    -- Lock order, everywhere: the budget, the pool, then reservation rows, then quota rows.
    -- The draft's rows are the one exception, safe because nothing else waits on a draft.
    IF p_budget_hours IS NOT NULL THEN
        v_budget := bc_budget_lock_check(p_tenant, p_budget_hours);
        IF v_budget IS NOT NULL THEN
            RETURN QUERY SELECT true, v_state, v_budget, NULL::jsonb, NULL::timestamptz,
                                NULL::timestamptz, NULL::timestamptz, NULL::bigint,
                                NULL::text[], NULL::jsonb;
            RETURN;
        END IF;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended(p_pool, 0));
    v_short := bc_charge_quota(p_tenant, p_resources, p_amounts);
    v_now := compute_now();
    v_start := greatest(v_now, coalesce(p_requested, v_now));
    -- A statement of its own, after the lock: its snapshot sees every booking committed before.
    RETURN QUERY
    WITH w AS MATERIALIZED (
        SELECT b.atom_id, b.host_node, b.host_vcpu, b.host_memory_gib, b.host_hugepages_1gi
          FROM bookings b
         WHERE b.pool_id = p_pool AND b.during && tstzrange(v_start, v_start + p_duration)
           AND b.reservation_id <> p_rid
    )
    SELECT true, v_state, NULL::jsonb, v_short, v_now, v_start, v_start + p_duration,
           p.inventory_version, ARRAY(SELECT DISTINCT w.atom_id FROM w),
           CASE WHEN p_hosts THEN (
               SELECT coalesce(jsonb_object_agg(u.node, jsonb_build_array(u.vcpu, u.memory,
                                                                          u.hugepages)), '{}')
                 FROM (SELECT w.host_node AS node, sum(w.host_vcpu) AS vcpu,
                              sum(w.host_memory_gib) AS memory,
                              sum(w.host_hugepages_1gi) AS hugepages
                         FROM w WHERE w.host_node IS NOT NULL GROUP BY w.host_node) u)
           ELSE '{}'::jsonb END
      FROM pools p WHERE p.id = p_pool;
END $$;
