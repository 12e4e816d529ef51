-- Delegated confirmation: a person's yes or no to what an agent acting for them asked, when a
-- policy holds it for confirmation (a Cedar forbid marked @confirm).
--
-- One row per (reservation, action) ask. The agent's retry with the same idempotency key finds
-- it again: pending (ask again), approved (proceed), denied (refused) or past expires_at
-- (the reservation expires). request_hash is what was asked, so an approval can never cover a
-- different request. Times are compute_now(); expires_at is at most 30 minutes after creation.

CREATE TABLE confirmations (
    id              text PRIMARY KEY,
    tenant_id       text NOT NULL REFERENCES tenants (id),
    reservation_id  text NOT NULL REFERENCES reservations (id) ON DELETE CASCADE,
    action          text NOT NULL,
    person_id       text NOT NULL,
    agent_id        text NOT NULL,
    request_hash    text NOT NULL,
    state           text NOT NULL DEFAULT 'pending'
                    CHECK (state IN ('pending', 'approved', 'denied', 'expired')),
    created_at      timestamptz NOT NULL DEFAULT compute_now(),
    expires_at      timestamptz NOT NULL,
    decided_at      timestamptz,
    decided_by      text,
    CHECK (expires_at > created_at AND expires_at <= created_at + interval '30 minutes'),
    -- A decided one names who decided (an approval that expired unused keeps its approver).
    CHECK (state NOT IN ('approved', 'denied') OR decided_by IS NOT NULL),
    CHECK (state <> 'pending' OR decided_by IS NULL)
);
-- One ask per reservation and action: the retry reaches it, never a second one.
CREATE UNIQUE INDEX confirmations_one_per_ask ON confirmations (reservation_id, action);
-- A person's inbox and an agent's outbox, newest first.
CREATE INDEX confirmations_person ON confirmations (tenant_id, person_id, created_at DESC);
CREATE INDEX confirmations_agent ON confirmations (tenant_id, agent_id, created_at DESC);
