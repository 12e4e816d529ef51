-- Host resources booked with the GPUs: each host's bookable CPUs, memory and huge pages, and
-- what each allocation books of them.
--
-- host_resources holds a node's rows (vcpu, memoryGiB, hugepages2Mi, hugepages1Gi) as its
-- inventory last said, rewritten in the same transaction as the node (store/inventory.py): a
-- new or re-inventoried node is bookable at once, and a node without rows books none.
--
-- An allocation's host_* columns are what it books on its node. Its time is its bookings'
-- time (the device bookings' `during`, which release and extend already move), so a host
-- booking can never outlive or precede its devices'. No constraint can say "the sum of
-- overlapping bookings stays within capacity"; bc_check_hosts is the guard instead, run by every
-- statement that books host resources or moves their time (bc_book_host, extend): under the
-- pool lock every booking of the node takes, it raises exclusion_violation (like the bookings'
-- EXCLUDE) when a node would give more than it has.

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

-- The per-GPU share the pool's hosts can give (vcpu, memoryGiB), kept with the inventory.
ALTER TABLE pools ADD COLUMN host_share jsonb NOT NULL DEFAULT '{}';

-- What the other reservations book of each node's host in [p_start, p_end):
-- {node: {vcpu, memoryGiB, hugepages1Gi}}. Overlapping bookings are summed whether or not they
-- overlap each other: never more generous than the truth.
CREATE FUNCTION bc_busy_hosts(p_pool text, p_start timestamptz, p_end timestamptz, p_rid text)
RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT coalesce(jsonb_object_agg(u.node_id, jsonb_build_object(
               'vcpu', u.vcpu, 'memoryGiB', u.memory, 'hugepages1Gi', u.hugepages)), '{}')
      FROM (SELECT a.node_id, sum(a.host_vcpu) AS vcpu, sum(a.host_memory_gib) AS memory,
                   sum(a.host_hugepages_1gi) AS hugepages
              FROM allocations a
             WHERE a.id IN (SELECT b.allocation_id FROM bookings b
                             WHERE b.pool_id = p_pool AND b.during && tstzrange(p_start, p_end)
                               AND b.reservation_id <> p_rid)
               AND a.host_vcpu + a.host_memory_gib + a.host_hugepages_1gi > 0
             GROUP BY a.node_id) u
$$;

-- Whether every node the allocations p_alloc_ids are on can give what all allocations
-- overlapping [p_start, p_end) book there, each resource on its own; raises
-- exclusion_violation (like the bookings' EXCLUDE) when one cannot. The caller holds the pool
-- lock, which every booking of those nodes takes.
CREATE FUNCTION bc_check_hosts(p_alloc_ids text[], p_start timestamptz, p_end timestamptz)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    over record;
BEGIN
    SELECT u.node_id, u.vcpu, u.memory, u.hugepages INTO over
      FROM (SELECT a.node_id, sum(a.host_vcpu) AS vcpu, sum(a.host_memory_gib) AS memory,
                   sum(a.host_hugepages_1gi) AS hugepages
              FROM allocations a
             WHERE a.node_id IN (SELECT x.node_id FROM allocations x
                                  WHERE x.id = ANY(p_alloc_ids)
                                    AND x.host_vcpu + x.host_memory_gib
                                        + x.host_hugepages_1gi > 0)
               AND a.host_vcpu + a.host_memory_gib + a.host_hugepages_1gi > 0
               AND EXISTS (SELECT 1 FROM bookings b WHERE b.allocation_id = a.id
                              AND b.during && tstzrange(p_start, p_end))
             GROUP BY a.node_id) u
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

-- Book host resources on allocations just written by bc_book, then check their nodes.
CREATE FUNCTION bc_book_host(
    p_alloc_ids text[], p_vcpu integer[], p_memory integer[], p_hugepages integer[],
    p_start timestamptz, p_end timestamptz)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    UPDATE allocations a
       SET host_vcpu = h.vcpu, host_memory_gib = h.memory, host_hugepages_1gi = h.hugepages
      FROM unnest(p_alloc_ids, p_vcpu, p_memory, p_hugepages) AS h(id, vcpu, memory, hugepages)
     WHERE a.id = h.id;
    PERFORM bc_check_hosts(p_alloc_ids, p_start, p_end);
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

-- Transaction 2, first step, with what other reservations book of each host in the window
-- (host_busy). The ten-argument form stays for replicas of the previous version during a
-- rolling upgrade.
CREATE FUNCTION bc_admission_begin(
    p_idem text, p_claim text, p_pool text, p_tenant text, p_resources text[],
    p_amounts bigint[], p_requested timestamptz, p_duration interval, p_rid text,
    p_budget_hours numeric, p_hosts boolean)
RETURNS TABLE (mine boolean, state text, budget_short jsonb, quota_short jsonb,
               now_ timestamptz, start_ timestamptz, end_ timestamptz,
               inventory_version bigint, busy text[], host_busy jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    b record;
BEGIN
    SELECT * INTO b
      FROM bc_admission_begin(p_idem, p_claim, p_pool, p_tenant, p_resources, p_amounts,
                              p_requested, p_duration, p_rid, p_budget_hours);
    -- A statement of its own, so its snapshot is taken after the pool lock was granted.
    RETURN QUERY
    SELECT b.mine, b.state, b.budget_short, b.quota_short, b.now_, b.start_, b.end_,
           b.inventory_version, b.busy,
           CASE WHEN p_hosts AND b.start_ IS NOT NULL
                THEN bc_busy_hosts(p_pool, b.start_, b.end_, p_rid) ELSE '{}'::jsonb END;
END $$;
