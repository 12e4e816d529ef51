-- The host guard counts the CPUs a host keeps for itself.
--
-- bc_check_hosts (0008) compared what a node's bookings sum to with its whole vcpu row, while
-- the placer books only that row less the pool's policy.hostReserve.vcpu (default 2): a booking
-- written around the placer (a stale inventory cache at worst) could take the host's reserved
-- CPUs and still pass the last word. Now the guard allows what the placer allows, the node's
-- row less its pool's reserve, never below 0. Nothing else changes: same arguments, same
-- exclusion_violation, same index probe per node; existing rows are untouched.

CREATE OR REPLACE FUNCTION bc_check_hosts(
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
      JOIN nodes n ON n.id = u.node_id
      LEFT JOIN pools p ON p.id = n.pool_id
      LEFT JOIN host_resources v ON v.node_id = u.node_id AND v.resource = 'vcpu'
      LEFT JOIN host_resources m ON m.node_id = u.node_id AND m.resource = 'memoryGiB'
      LEFT JOIN host_resources g ON g.node_id = u.node_id AND g.resource = 'hugepages1Gi'
     WHERE u.vcpu > greatest(coalesce(v.capacity, 0)
                             - coalesce((p.policy -> 'hostReserve' ->> 'vcpu')::integer, 2), 0)
        OR u.memory > coalesce(m.capacity, 0)
        OR u.hugepages > coalesce(g.capacity, 0)
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'host % would give more than it has: % vcpu, % GiB, % 1Gi huge pages',
            over.node_id, over.vcpu, over.memory, over.hugepages
            USING ERRCODE = 'exclusion_violation';
    END IF;
END $$;
