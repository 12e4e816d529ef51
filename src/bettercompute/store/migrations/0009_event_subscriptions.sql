-- Webhook subscriptions: a tenant's URLs that its reservations' events are POSTed to, and the
-- delivery log, one row per (subscription, event).
--
-- A subscription sees the events of its tenant's reservations committed after it was made
-- (from_event_id, the newest outbox id at its creation), of the types it names (none: all).
-- Deleting one disables it (state 'disabled'); its log stays, its pending deliveries end dead.
--
-- event_deliveries is written by the fan-out (service/webhooks.py via store/subscriptions.py)
-- in the transaction that moves its outbox cursor, so an event is fanned out at least once and
-- the primary key makes a second time a no-op. A sender claims a due delivery by moving its
-- next_attempt_at past its own attempt (a lease), so two replicas never POST it at once; a
-- delivery waits while an earlier pending delivery of the same reservation and subscription
-- does (in order per reservation).

CREATE TABLE event_subscriptions (
    id             text PRIMARY KEY,
    tenant_id      text NOT NULL REFERENCES tenants (id),
    url            text NOT NULL CHECK (url ~ '^https?://'),
    event_types    text[] NOT NULL DEFAULT '{}',
    secret         text NOT NULL,
    created_by     text NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT compute_now(),
    from_event_id  bigint NOT NULL DEFAULT 0,
    state          text NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'disabled')),
    disabled_at    timestamptz
);
CREATE INDEX event_subscriptions_tenant ON event_subscriptions (tenant_id) WHERE state = 'active';

CREATE TABLE event_deliveries (
    subscription_id   text NOT NULL REFERENCES event_subscriptions (id) ON DELETE CASCADE,
    event_id          bigint NOT NULL,
    reservation_id    text NOT NULL,
    event_type        text NOT NULL,
    attempts          integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    created_at        timestamptz NOT NULL DEFAULT compute_now(),
    first_attempt_at  timestamptz,
    next_attempt_at   timestamptz NOT NULL DEFAULT compute_now(),
    last_status       integer,
    last_error        text,
    state             text NOT NULL DEFAULT 'pending'
                      CHECK (state IN ('pending', 'delivered', 'dead')),
    delivered_at      timestamptz,
    PRIMARY KEY (subscription_id, event_id)
);
-- What is due, and what an earlier pending delivery of the same reservation holds back.
CREATE INDEX event_deliveries_due ON event_deliveries (next_attempt_at) WHERE state = 'pending';
CREATE INDEX event_deliveries_order ON event_deliveries (subscription_id, reservation_id, event_id)
    WHERE state = 'pending';
