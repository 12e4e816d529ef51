-- Claims and extend holds owned by a live session, the tenant's budget lock, and what the
-- garbage collector reads.
--
-- Why holders: a claim (idempotency.claim) or an extend hold that outlived a crashed process
-- used to block its retry until a timeout ran out. Now each process holds a session-level
-- advisory lock for its holder id (store/holding.py), every claim and hold names its holder,
-- and a claim is live only while that lock is held: when the session ends, so do its claims.
-- The age limits stay as a last resort for a holder that is alive but hung.
--
-- Advisory locks here use the two-key form, pg_advisory_lock(class, key): PostgreSQL keeps
-- them apart from the one-key form the pool lock and the migration lock use, so they never
-- collide with those.
--   class 1651468396: a holder, key = the holder id
--   class 1651467617: a tenant's budget, key = hashtext(tenant id)

-- Never cycles: a holder id is never reused, so no new session revives a dead holder's claims.
CREATE SEQUENCE bc_holders AS integer NO CYCLE;

ALTER TABLE idempotency ADD COLUMN claim_holder integer;
ALTER TABLE extend_holds ADD COLUMN holder integer;

-- Called on the holder's own connection: a fresh holder id, locked for this session.
CREATE FUNCTION bc_holder_take() RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_id integer := nextval('bc_holders');
BEGIN
    IF NOT pg_try_advisory_lock(1651468396, v_id) THEN
        RAISE EXCEPTION 'holder % is already held', v_id;
    END IF;
    RETURN v_id;
END $$;

-- Whether the holder's session still holds its lock. A claim taken before this migration has
-- no holder: only its age counts. Volatile: pg_locks is read now, not from a snapshot.
CREATE FUNCTION bc_holder_alive(p_holder integer) RETURNS boolean LANGUAGE sql VOLATILE AS $$
    SELECT p_holder IS NULL OR EXISTS (
        SELECT 1 FROM pg_locks l
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
           AND l.classid = 1651468396::oid AND l.objid = p_holder::oid
           AND l.database = (SELECT d.oid FROM pg_database d
                              WHERE d.datname = current_database()))
$$;

-- A claim (or hold) is live while it exists, is younger than p_ttl and its holder is alive.
-- CASE, not AND: pg_locks is read only for a row that carries a young claim.
CREATE FUNCTION bc_claim_live(
    p_claim text, p_claimed_at timestamptz, p_holder integer, p_ttl interval)
RETURNS boolean LANGUAGE sql VOLATILE AS $$
    SELECT CASE
        WHEN p_claim IS NULL OR p_claimed_at IS NULL
             OR p_claimed_at <= compute_now() - p_ttl THEN false
        ELSE bc_holder_alive(p_holder)
    END
$$;

-- Transaction 1, first step (same signature as 0002): a claim is live only while its holder
-- is, and a key whose denied draft was collected stays denied (its idempotency row says so).
CREATE OR REPLACE FUNCTION bc_draft_begin(
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
    SELECT i.request_hash, bc_claim_live(i.claim, i.claimed_at, i.claim_holder, p_claim_ttl),
           coalesce(r.state, CASE WHEN i.outcome = 'denied' THEN 'denied' END),
           p.id, p.owner_tenant_id, p.region, p.gpu_model, p.sharing_mode, p.replicas,
           p.archived, p.policy, o.tenant_id IS NOT NULL, o.on_budget_exceeded
      FROM idempotency i
      LEFT JOIN reservations r ON r.id = i.reservation_id
      LEFT JOIN pools p ON p.id = p_pool
      LEFT JOIN offers o ON o.pool_id = p.id AND o.tenant_id = p_tenant
     WHERE i.id = p_idem;
END $$;

-- The built-in billing.check's ledger: the tenant's budget, the GPU-hours of its admitted
-- reservations created in the rolling window, and when the oldest of them leaves the window.
-- No row: the tenant has no budget.
CREATE FUNCTION bc_budget_state(p_tenant text)
RETURNS TABLE (budget numeric, spent numeric, resets_at_ms bigint)
LANGUAGE sql STABLE AS $$
    SELECT b.gpu_hours, w.spent,
           epoch_ms(w.oldest + b.window_seconds * interval '1 second')
      FROM budgets b, LATERAL (
        SELECT coalesce(sum(((a.attributes ->> 'gpuCount')::numeric
                  + (a.attributes ->> 'gpuSlices')::numeric / 7)
                  * (a.attributes ->> 'durationHours')::numeric), 0) AS spent,
               min(r.created_at) AS oldest
          FROM reservations r JOIN authz_resources a ON a.id = r.id
         WHERE r.tenant_id = b.tenant_id
           AND r.state NOT IN ('draft', 'denied', 'awaiting-confirmation')
           AND r.created_at > compute_now() - b.window_seconds * interval '1 second'
      ) w
     WHERE b.tenant_id = p_tenant
$$;

-- Inside transaction 2: take the tenant's budget lock (held to the end of the transaction,
-- so the next create of the tenant reads the ledger only after this one committed or rolled
-- back), then check p_hours more against the ledger. NULL when it fits, else the shortfall.
-- Lock order: after the draft's own rows, before the pool lock (store/locking.py).
CREATE FUNCTION bc_budget_lock_check(p_tenant text, p_hours numeric)
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
    RETURN jsonb_build_object('budget', v.budget, 'spent', v.spent, 'asked', p_hours,
                              'resetsAt', v.resets_at_ms);
END $$;

-- Transaction 2, first step, with the budget (0002's nine-argument form stays for replicas of
-- the previous version during a rolling upgrade). p_budget_hours NULL: no budget check here.
CREATE FUNCTION bc_admission_begin(
    p_idem text, p_claim text, p_pool text, p_tenant text, p_resources text[],
    p_amounts bigint[], p_requested timestamptz, p_duration interval, p_rid text,
    p_budget_hours numeric)
RETURNS TABLE (mine boolean, state text, budget_short jsonb, quota_short jsonb,
               now_ timestamptz, start_ timestamptz, end_ timestamptz,
               inventory_version bigint, busy text[])
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
                            NULL::timestamptz, NULL::timestamptz, NULL::bigint, NULL::text[];
        RETURN;
    END IF;
    -- Lock order, everywhere: the budget, the pool, then reservation rows, then quota rows.
    -- The draft's rows are the one exception, safe because nothing else waits on a draft.
    IF p_budget_hours IS NOT NULL THEN
        v_budget := bc_budget_lock_check(p_tenant, p_budget_hours);
        IF v_budget IS NOT NULL THEN
            RETURN QUERY SELECT true, v_state, v_budget, NULL::jsonb, NULL::timestamptz,
                                NULL::timestamptz, NULL::timestamptz, NULL::bigint,
                                NULL::text[];
            RETURN;
        END IF;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended(p_pool, 0));
    v_short := bc_charge_quota(p_tenant, p_resources, p_amounts);
    v_now := compute_now();
    v_start := greatest(v_now, coalesce(p_requested, v_now));
    RETURN QUERY SELECT true, v_state, NULL::jsonb, v_short, v_now, v_start,
                        v_start + p_duration, b.inventory_version, b.busy
                   FROM bc_busy_atoms(p_pool, v_start, v_start + p_duration, p_rid) b;
END $$;

-- What the garbage collector looks for (store/collecting.py), without reading every row.
CREATE INDEX reservations_drafts ON reservations (created_at) WHERE state = 'draft';
CREATE INDEX reservations_denied ON reservations (updated_at) WHERE state = 'denied';
CREATE INDEX idempotency_claimed ON idempotency (claimed_at) WHERE claim IS NOT NULL;
