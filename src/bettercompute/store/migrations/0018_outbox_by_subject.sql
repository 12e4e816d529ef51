-- A reservation's events in order (reservations.history), without reading the whole outbox,
-- which keeps every event ever published.
CREATE INDEX outbox_subject ON outbox (subject, id);
