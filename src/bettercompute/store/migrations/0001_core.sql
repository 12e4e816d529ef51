-- The core schema: tenants, pools, nodes and atoms, reservations and their bookings, quota,
-- idempotency, the authorization projection, the work queue, the outbox and the audit log.
-- Business time is compute_now(): never a replica's clock.

CREATE EXTENSION IF NOT EXISTS btree_gist;

-- One row: an offset tests and drills can move business time with (never set in production).
CREATE TABLE compute_clock (
    id      boolean PRIMARY KEY DEFAULT true CHECK (id),
    offset_ interval NOT NULL DEFAULT '0'
);
INSERT INTO compute_clock DEFAULT VALUES;

-- Whole milliseconds, as the API speaks: a window that begins "now" ends exactly where its
-- announced end says, so another can be booked from that instant without overlapping.
CREATE FUNCTION compute_now() RETURNS timestamptz
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT date_trunc('milliseconds', now() + (SELECT offset_ FROM compute_clock)) $$;

CREATE FUNCTION epoch_ms(t timestamptz) RETURNS bigint
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT (extract(epoch FROM t) * 1000)::bigint $$;

CREATE TABLE tenants (
    id          text PRIMARY KEY,
    name        text NOT NULL DEFAULT '',
    is_root     boolean NOT NULL DEFAULT false,
    created_at  timestamptz NOT NULL DEFAULT compute_now()
);
-- At most one root tenant.
CREATE UNIQUE INDEX tenants_one_root ON tenants (is_root) WHERE is_root;

CREATE SEQUENCE inventory_versions;

CREATE TABLE pools (
    id              text PRIMARY KEY,
    owner_tenant_id text NOT NULL REFERENCES tenants (id),
    name            text NOT NULL DEFAULT '',
    region          text NOT NULL,
    gpu_model       text,
    sharing_mode    text NOT NULL DEFAULT 'exclusive'
                    CHECK (sharing_mode IN ('exclusive', 'mig', 'timeslice', 'mps')),
    replicas        integer NOT NULL DEFAULT 1 CHECK (replicas BETWEEN 1 AND 64),
    archived        boolean NOT NULL DEFAULT false,
    -- kubernetes, tenantRoot, maxPending, perGpu, admission.budgetCheck, sharing.replicas …
    policy          jsonb NOT NULL DEFAULT '{}',
    -- Changed by every change of the pool's nodes or atoms, so placers may cache the inventory.
    -- Drawn from one sequence: a pool deleted and made again never repeats a version.
    inventory_version bigint NOT NULL DEFAULT nextval('inventory_versions'),
    created_at      timestamptz NOT NULL DEFAULT compute_now(),
    updated_at      timestamptz NOT NULL DEFAULT compute_now()
);

CREATE TABLE offers (
    pool_id             text NOT NULL REFERENCES pools (id) ON DELETE CASCADE,
    tenant_id           text NOT NULL REFERENCES tenants (id),
    on_budget_exceeded  text CHECK (on_budget_exceeded IN ('allow', 'stop-new', 'drain')),
    created_at          timestamptz NOT NULL DEFAULT compute_now(),
    PRIMARY KEY (pool_id, tenant_id)
);

CREATE TABLE quotas (
    tenant_id   text NOT NULL REFERENCES tenants (id),
    resource    text NOT NULL,
    limit_      bigint NOT NULL CHECK (limit_ >= 0),
    used        bigint NOT NULL DEFAULT 0 CONSTRAINT quota_never_negative CHECK (used >= 0),
    PRIMARY KEY (tenant_id, resource)
);

-- Budgets for the built-in billing.check: GPU-hours per rolling window.
CREATE TABLE budgets (
    tenant_id       text PRIMARY KEY REFERENCES tenants (id),
    gpu_hours       numeric NOT NULL CHECK (gpu_hours >= 0),
    window_seconds  integer NOT NULL CHECK (window_seconds > 0)
);

CREATE TABLE nodes (
    id          text PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    pool_id     text REFERENCES pools (id),
    -- {"key": {"value": "…", "source": "system"|"operator"}}
    labels      jsonb NOT NULL DEFAULT '{}',
    ready       boolean NOT NULL DEFAULT true,
    connected   boolean NOT NULL DEFAULT true,
    -- host resources (vcpu, memoryGiB, hugepages…) and cpulists, for the host-resources issue
    resources   jsonb NOT NULL DEFAULT '{}',
    updated_at  timestamptz NOT NULL DEFAULT compute_now()
);
CREATE INDEX nodes_pool ON nodes (pool_id);

CREATE TABLE atoms (
    id              text PRIMARY KEY,
    node_id         text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    kind            text NOT NULL CHECK (kind IN ('gpu', 'mig', 'slot')),
    device_id       text NOT NULL,
    parent_gpu      text NOT NULL,
    profile         text,
    numa_node       integer,
    nvlink_domain   text,
    healthy         boolean NOT NULL DEFAULT true,
    -- An atom removed from the inventory stays for its bookings' history but is not bookable.
    retired         boolean NOT NULL DEFAULT false,
    UNIQUE (node_id, device_id)
);

CREATE TABLE reservations (
    id                  text PRIMARY KEY,
    tenant_id           text NOT NULL REFERENCES tenants (id),
    pool_id             text NOT NULL REFERENCES pools (id),
    owner_identity_id   text NOT NULL,
    idempotency_key     text NOT NULL,
    request_hash        text NOT NULL,
    request             jsonb NOT NULL,
    state               text NOT NULL CHECK (state IN (
                            'draft', 'denied', 'awaiting-confirmation', 'pending', 'placed',
                            'binding', 'active', 'releasing', 'released', 'failed', 'cancelled',
                            'expired')),
    conditions          jsonb NOT NULL DEFAULT '[]',
    -- The booked window; null while a draft or pending without a placement.
    during              tstzrange,
    requested_start     timestamptz,
    duration            interval NOT NULL,
    lease_seconds       integer,
    lease_expires_at    timestamptz,
    binding             jsonb,
    failure             jsonb,
    -- Bind attempts that failed or timed out; the third fails the reservation.
    bind_failures       integer NOT NULL DEFAULT 0,
    bind_deadline       timestamptz,
    quota_charge        jsonb,
    host_share          jsonb,
    release_reason      text,
    pending_since       timestamptz,
    released_at         timestamptz,
    created_at          timestamptz NOT NULL DEFAULT compute_now(),
    updated_at          timestamptz NOT NULL DEFAULT compute_now(),
    version             integer NOT NULL DEFAULT 1
);
CREATE INDEX reservations_tenant_list ON reservations (tenant_id, created_at DESC, id DESC);
CREATE INDEX reservations_owner_list
    ON reservations (tenant_id, owner_identity_id, created_at DESC, id DESC);
CREATE INDEX reservations_pool_pending ON reservations (pool_id) WHERE state = 'pending';

-- An idempotency key in a scope ('create', 'extend'): who used it, for what request, and a
-- claim while one request is being admitted, so concurrent retries wait instead of deciding.
CREATE TABLE idempotency (
    id              text PRIMARY KEY,
    scope           text NOT NULL CHECK (scope IN ('create', 'extend')),
    tenant_id       text NOT NULL,
    identity_id     text NOT NULL,
    key             text NOT NULL,
    request_hash    text NOT NULL,
    reservation_id  text NOT NULL,
    outcome         text,
    result          jsonb,
    claim           text,
    claimed_at      timestamptz,
    created_at      timestamptz NOT NULL DEFAULT compute_now()
);

CREATE TABLE allocations (
    id              text PRIMARY KEY,
    reservation_id  text NOT NULL REFERENCES reservations (id) ON DELETE CASCADE,
    node_id         text NOT NULL REFERENCES nodes (id),
    device_class    text NOT NULL,
    device_ids      text[] NOT NULL,
    atom_ids        text[] NOT NULL,
    state           text NOT NULL DEFAULT 'planned' CHECK (state IN (
                        'planned', 'desired', 'bound', 'lost', 'failed', 'releasing',
                        'released')),
    until           timestamptz NOT NULL,
    bound_at        timestamptz,
    report          jsonb,
    releasing_since timestamptz,
    -- Signed report fields, reserved for attested bindings.
    bound_report    bytea,
    bound_sig_kid   text,
    bound_sig       bytea,
    created_at      timestamptz NOT NULL DEFAULT compute_now(),
    updated_at      timestamptz NOT NULL DEFAULT compute_now()
);
CREATE INDEX allocations_reservation ON allocations (reservation_id);
CREATE INDEX allocations_node_live ON allocations (node_id) WHERE state <> 'released';

CREATE TABLE bookings (
    id              bigserial PRIMARY KEY,
    atom_id         text NOT NULL REFERENCES atoms (id),
    reservation_id  text NOT NULL REFERENCES reservations (id) ON DELETE CASCADE,
    allocation_id   text,
    -- The atom's pool, kept in step when a node changes pools: the placer's busy-atom read.
    pool_id         text NOT NULL,
    during          tstzrange NOT NULL CHECK (NOT isempty(during)),
    -- The database itself makes double booking impossible.
    CONSTRAINT bookings_no_overlap EXCLUDE USING gist (atom_id WITH =, during WITH &&)
);
CREATE INDEX bookings_reservation ON bookings (reservation_id);
CREATE INDEX bookings_allocation ON bookings (allocation_id);
CREATE INDEX bookings_pool_during ON bookings USING gist (pool_id, during);

-- The IAM authorization projection: one row per decided resource.
CREATE TABLE authz_resources (
    id                  text PRIMARY KEY,
    resource_type       text NOT NULL,
    tenant_id           text NOT NULL,
    parent_id           text,
    owner_identity_id   text,
    attributes          jsonb NOT NULL,
    -- The change an extend is being decided on (one at a time: see extend_holds).
    pending             jsonb
);

CREATE TABLE extend_holds (
    reservation_id  text PRIMARY KEY REFERENCES reservations (id) ON DELETE CASCADE,
    hold            text NOT NULL,
    taken_at        timestamptz NOT NULL
);

-- Wake a reservation's reconcile at a moment; taken with FOR UPDATE SKIP LOCKED.
CREATE TABLE work_queue (
    id              bigserial PRIMARY KEY,
    reservation_id  text NOT NULL,
    due_at          timestamptz NOT NULL,
    why             text NOT NULL
);
CREATE INDEX work_queue_due ON work_queue (due_at);
CREATE INDEX work_queue_reservation ON work_queue (reservation_id);

CREATE TABLE outbox (
    id          bigserial PRIMARY KEY,
    type        text NOT NULL,
    subject     text NOT NULL,
    data        jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT compute_now()
);

CREATE TABLE outbox_cursors (
    subscriber  text PRIMARY KEY,
    last_id     bigint NOT NULL DEFAULT 0
);

CREATE TABLE audit_log (
    id              bigserial PRIMARY KEY,
    at              timestamptz NOT NULL DEFAULT compute_now(),
    actor           text,
    tenant_id       text,
    action          text NOT NULL,
    resource_id     text,
    outcome         text NOT NULL,
    context         jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_log_resource ON audit_log (resource_id);

-- Wake listeners at once instead of at their next poll. Statement-level: one notification per
-- statement, however many rows it wrote.
CREATE FUNCTION notify_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_notify('compute_outbox', ''); RETURN NULL; END $$;
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION notify_outbox();

CREATE FUNCTION notify_work() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_notify('compute_work', ''); RETURN NULL; END $$;
CREATE TRIGGER work_queue_notify AFTER INSERT ON work_queue
    FOR EACH STATEMENT EXECUTE FUNCTION notify_work();

-- An audit row for every transition of a reservation, whoever made it (admission, the
-- reconciler, an operation): written by the database, so no code path can forget it.
-- Decisions are audited by the code that asked for them, with their context.
CREATE FUNCTION audit_transition() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO audit_log (actor, tenant_id, action, resource_id, outcome, context)
    VALUES (NULL, NEW.tenant_id, 'transition', NEW.id, NEW.state,
            jsonb_build_object('from', OLD.state, 'to', NEW.state, 'version', NEW.version,
                               'releaseReason', NEW.release_reason));
    RETURN NULL;
END $$;
CREATE TRIGGER reservations_audit_transition AFTER UPDATE OF state ON reservations
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION audit_transition();
