-- The usage ledger: what each allocation was billed for, as intervals written at the moments
-- that change billing, and the built-in budget redefined on it (used + still booked).
--
-- Why triggers: billing changes when an allocation is first bound, leaves its binding, when a
-- reservation's end or lease moves (extend, release, renew), and when a node lease's GPU turns
-- unhealthy or healthy again. Those writes happen in many transactions (node reports, the
-- reconciler, release, extend, the inventory); a trigger on the rows they already write records
-- every one of them in the same transaction, whoever writes it, so the ledger cannot miss one.
-- The rules are in store/usage.py's docstring.

-- What one device is worth in whole GPUs: a GPU 1, a MIG instance 1/7, a slot 1/replicas (the
-- pool's, else 4 for time-slicing and 10 for MPS). Mirrors core.hosts.device_worth; a test
-- holds the two to the same figures.
CREATE FUNCTION bc_device_worth(p_kind text, p_sharing text, p_replicas integer)
RETURNS numeric LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE p_kind
        WHEN 'gpu' THEN 1::numeric
        WHEN 'mig' THEN 1::numeric / 7
        ELSE 1::numeric / CASE WHEN p_replicas > 1 THEN p_replicas
                               WHEN p_sharing = 'mps' THEN 10 ELSE 4 END
    END
$$;

-- One row per billed device and stretch of time. Open (ended_at NULL) while billing runs;
-- until is the allocation's end as it stands (the reservation's end, or its lease's, whichever
-- comes first), kept in step while the row is open. Billed: [started_at, least(ended_at or now,
-- until)), never negative. No foreign keys: the ledger outlives what it bills.
CREATE TABLE usage_intervals (
    id              bigserial PRIMARY KEY,
    allocation_id   text NOT NULL,
    reservation_id  text NOT NULL,
    atom_id         text NOT NULL,
    tenant_id       text NOT NULL,
    project_id      text,
    pool_id         text NOT NULL,
    binding         text NOT NULL,
    device_class    text NOT NULL,
    gpu_equivalent  numeric NOT NULL CHECK (gpu_equivalent > 0),
    started_at      timestamptz NOT NULL,
    until           timestamptz NOT NULL,
    ended_at        timestamptz,
    CHECK (ended_at IS NULL OR ended_at >= started_at)
);
CREATE UNIQUE INDEX usage_intervals_one_open
    ON usage_intervals (allocation_id, atom_id) WHERE ended_at IS NULL;
CREATE INDEX usage_intervals_open_atom ON usage_intervals (atom_id) WHERE ended_at IS NULL;
CREATE INDEX usage_intervals_open_reservation
    ON usage_intervals (reservation_id) WHERE ended_at IS NULL;
-- A tenant's window: rows that start before its end and are open or end after its start.
CREATE INDEX usage_intervals_tenant_start ON usage_intervals (tenant_id, started_at);

-- Closed billing per pool and tenant, added to when a row closes: the metrics' counter reads
-- this plus the open rows, never the whole history.
CREATE TABLE usage_totals (
    pool_id                 text NOT NULL,
    tenant_id               text NOT NULL,
    gpu_equivalent_seconds  numeric NOT NULL DEFAULT 0,
    PRIMARY KEY (pool_id, tenant_id)
);

-- When each GPU turned unhealthy or healthy again, from this migration on (atoms keep only
-- the present state): the audit trail of what a node lease was not billed for.
CREATE TABLE atom_health_changes (
    id       bigserial PRIMARY KEY,
    atom_id  text NOT NULL,
    healthy  boolean NOT NULL,
    at       timestamptz NOT NULL DEFAULT compute_now()
);
CREATE INDEX atom_health_changes_atom ON atom_health_changes (atom_id, at);

-- The billed seconds of a row at p_now.
CREATE FUNCTION bc_usage_end(p_started timestamptz, p_until timestamptz, p_ended timestamptz,
                             p_now timestamptz)
RETURNS timestamptz LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT greatest(p_started, least(coalesce(p_ended, p_now), p_until))
$$;

-- Where a reservation's billing must stop at the latest: its end, or its lease's; null when it
-- has no window (released before its start).
CREATE FUNCTION bc_usage_until(p_during tstzrange, p_lease timestamptz)
RETURNS timestamptz LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN p_during IS NOT NULL
                THEN least(upper(p_during), coalesce(p_lease, 'infinity'::timestamptz)) END
$$;

-- Open rows for the allocation's devices (only p_atom when given) that are not open yet. A
-- node lease's unhealthy GPU gets none. Billing starts no earlier than the reservation's start
-- (a node may bind early).
CREATE FUNCTION bc_usage_open(p_allocation text, p_atom text) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO usage_intervals (allocation_id, reservation_id, atom_id, tenant_id, project_id,
                                 pool_id, binding, device_class, gpu_equivalent, started_at,
                                 until)
    SELECT al.id, r.id, at.id, r.tenant_id, r.request ->> 'projectId', r.pool_id,
           coalesce(r.request ->> 'binding', 'hold'), at.kind,
           bc_device_worth(at.kind, p.sharing_mode, p.replicas),
           greatest(compute_now(), lower(r.during)),
           greatest(compute_now(), lower(r.during),
                    bc_usage_until(r.during, r.lease_expires_at))
      FROM allocations al
      JOIN reservations r ON r.id = al.reservation_id
      JOIN pools p ON p.id = r.pool_id
      JOIN atoms at ON at.id = ANY (al.atom_ids)
     WHERE al.id = p_allocation
       AND (p_atom IS NULL OR at.id = p_atom)
       AND r.during IS NOT NULL
       AND (at.healthy OR coalesce(r.request ->> 'binding', 'hold') <> 'node')
    ON CONFLICT (allocation_id, atom_id) WHERE ended_at IS NULL DO NOTHING
$$;

-- Allocations: billing opens at the first bound report and runs while the allocation is bound
-- or lost (a binding marked lost keeps being billed, so a rejected report can neither start nor
-- stop billing); it closes when the allocation is released, releasing or failed.
CREATE FUNCTION bc_usage_on_allocation() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state = 'bound' AND OLD.state NOT IN ('bound', 'lost') THEN
        PERFORM bc_usage_open(NEW.id, NULL);
    ELSIF NEW.state NOT IN ('bound', 'lost') AND OLD.state IN ('bound', 'lost') THEN
        UPDATE usage_intervals
           SET ended_at = bc_usage_end(started_at, until, NULL, compute_now())
         WHERE allocation_id = NEW.id AND ended_at IS NULL;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER usage_on_allocation AFTER UPDATE OF state ON allocations
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION bc_usage_on_allocation();

-- Reservations: an extend moves the end later, a release moves it to now, a renew moves the
-- lease; open rows follow, so billing never runs past the allocation's own end.
CREATE FUNCTION bc_usage_on_reservation() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE usage_intervals
       SET until = greatest(started_at, coalesce(
               bc_usage_until(NEW.during, NEW.lease_expires_at), started_at))
     WHERE reservation_id = NEW.id AND ended_at IS NULL;
    RETURN NULL;
END $$;
CREATE TRIGGER usage_on_reservation AFTER UPDATE OF during, lease_expires_at ON reservations
    FOR EACH ROW WHEN (OLD.during IS DISTINCT FROM NEW.during
                       OR OLD.lease_expires_at IS DISTINCT FROM NEW.lease_expires_at)
    EXECUTE FUNCTION bc_usage_on_reservation();

-- Atoms: a node lease is not billed for a GPU while it is unhealthy. Every change is recorded.
CREATE FUNCTION bc_usage_on_atom() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_allocation text;
BEGIN
    INSERT INTO atom_health_changes (atom_id, healthy) VALUES (NEW.id, NEW.healthy);
    IF NOT NEW.healthy THEN
        UPDATE usage_intervals
           SET ended_at = bc_usage_end(started_at, until, NULL, compute_now())
         WHERE atom_id = NEW.id AND ended_at IS NULL AND binding = 'node';
    ELSE
        FOR v_allocation IN
            SELECT al.id FROM allocations al JOIN reservations r ON r.id = al.reservation_id
             WHERE NEW.id = ANY (al.atom_ids) AND al.state IN ('bound', 'lost')
               AND r.request ->> 'binding' = 'node'
               AND bc_usage_until(r.during, r.lease_expires_at) > compute_now()
        LOOP
            PERFORM bc_usage_open(v_allocation, NEW.id);
        END LOOP;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER usage_on_atom AFTER UPDATE OF healthy ON atoms
    FOR EACH ROW WHEN (OLD.healthy IS DISTINCT FROM NEW.healthy)
    EXECUTE FUNCTION bc_usage_on_atom();

-- A row that closes adds its billing to its pool's and tenant's total.
CREATE FUNCTION bc_usage_on_close() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO usage_totals (pool_id, tenant_id, gpu_equivalent_seconds)
    VALUES (NEW.pool_id, NEW.tenant_id,
            NEW.gpu_equivalent * extract(epoch FROM NEW.ended_at - NEW.started_at))
    ON CONFLICT (pool_id, tenant_id) DO UPDATE
       SET gpu_equivalent_seconds = usage_totals.gpu_equivalent_seconds
                                    + excluded.gpu_equivalent_seconds;
    RETURN NULL;
END $$;
CREATE TRIGGER usage_on_close AFTER UPDATE OF ended_at ON usage_intervals
    FOR EACH ROW WHEN (OLD.ended_at IS NULL AND NEW.ended_at IS NOT NULL)
    EXECUTE FUNCTION bc_usage_on_close();

-- Allocations bound before this migration: billed from now on (what they used before was
-- never recorded, so it is not guessed).
SELECT bc_usage_open(id, NULL) FROM allocations WHERE state IN ('bound', 'lost');

-- The GPU-hours a tenant used in [p_from, p_to), by the ledger, as of p_now.
CREATE FUNCTION bc_usage_used_hours(p_tenant text, p_from timestamptz, p_to timestamptz,
                                    p_now timestamptz)
RETURNS TABLE (hours numeric, first_use timestamptz) LANGUAGE sql STABLE AS $$
    SELECT coalesce(sum(u.gpu_equivalent * extract(epoch FROM
               least(bc_usage_end(u.started_at, u.until, u.ended_at, p_now), p_to)
               - greatest(u.started_at, p_from))) / 3600, 0),
           min(greatest(u.started_at, p_from))
      FROM usage_intervals u
     WHERE u.tenant_id = p_tenant AND u.started_at < p_to
       AND bc_usage_end(u.started_at, u.until, u.ended_at, p_now) > p_from
$$;

-- The built-in billing.check's ledger, on use: the tenant's budget; the GPU-hours it used in the
-- rolling window; the GPU-hours its live reservations still have booked from now on (a pending
-- one its whole duration); spent = used + booked; and when the earliest of them leaves the
-- window (null when nothing counts). No row: the tenant has no budget. A reservation's worth
-- per hour is its gpuCount plus its gpuSlices at the pool's worth of a slice.
DROP FUNCTION bc_budget_state(text);
CREATE FUNCTION bc_budget_state(p_tenant text)
RETURNS TABLE (budget numeric, spent numeric, used numeric, booked numeric,
               resets_at_ms bigint)
LANGUAGE sql STABLE AS $$
    WITH b AS (
        SELECT b.gpu_hours, b.window_seconds * interval '1 second' AS span, compute_now() AS now_
          FROM budgets b WHERE b.tenant_id = p_tenant
    ), u AS (
        SELECT x.hours, x.first_use
          FROM b, LATERAL bc_usage_used_hours(p_tenant, b.now_ - b.span, b.now_, b.now_) x
    ), f AS (
        SELECT coalesce(sum(((a.attributes ->> 'gpuCount')::numeric
                  + (a.attributes ->> 'gpuSlices')::numeric
                    * bc_device_worth(CASE WHEN p.sharing_mode = 'mig' THEN 'mig' ELSE 'slot'
                                      END, p.sharing_mode, p.replicas))
                  * CASE WHEN r.during IS NULL THEN extract(epoch FROM r.duration)
                         ELSE greatest(0, extract(epoch FROM
                                upper(r.during) - greatest(b.now_, lower(r.during))))
                    END / 3600), 0) AS hours,
               min(CASE WHEN r.during IS NULL THEN b.now_
                        ELSE greatest(b.now_, lower(r.during)) END) AS first_booked
          FROM b, reservations r
          JOIN authz_resources a ON a.id = r.id
          JOIN pools p ON p.id = r.pool_id
         WHERE r.tenant_id = p_tenant
           AND r.state IN ('pending', 'placed', 'binding', 'active')
           AND (r.during IS NULL OR upper(r.during) > b.now_)
    )
    SELECT b.gpu_hours, u.hours + f.hours, u.hours, f.hours,
           epoch_ms(least(u.first_use, f.first_booked) + b.span)
      FROM b, u, f
$$;

-- Transaction 2's re-check (same signature as 0004), on the same ledger as billing.check, and
-- naming what is used and what is booked in the shortfall.
CREATE OR REPLACE FUNCTION bc_budget_lock_check(p_tenant text, p_hours numeric)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v record;
BEGIN
    PERFORM pg_advisory_xact_lock(1651467617, hashtext(p_tenant));
    -- A statement of its own: its snapshot is taken after the lock was granted.
    SELECT * INTO v FROM bc_budget_state(p_tenant);
    IF NOT FOUND OR v.spent + p_hours <= v.budget THEN
        RETURN NULL;
    END IF;
    RETURN jsonb_build_object('budget', v.budget, 'spent', v.spent, 'used', v.used,
                              'booked', v.booked, 'asked', p_hours,
                              'resetsAt', v.resets_at_ms);
END $$;
