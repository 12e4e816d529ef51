-- Outbox visibility: each event records the id of the transaction that wrote it, so a reader
-- takes an event only once that transaction, and every older one, has ended.
--
-- Why: outbox ids come from a sequence, taken when a row is inserted, not when its transaction
-- commits. A transaction holding id 5 may commit after one holding id 6; a reader that moved
-- its cursor past 6 in between (WHERE id > cursor) never saw 5. Every cursor read
-- (store/outbox.py, store/subscriptions.py) now also asks
--     xid < pg_snapshot_xmin(pg_current_snapshot())
-- i.e. only events of transactions older than the oldest one still running, so a cursor never
-- moves past an id whose transaction may still commit. A long open transaction delays the
-- events after it; it never loses one.
--
-- Existing rows get 0, below every snapshot's xmin (their transactions ended long ago). Adding
-- the column with that constant default rewrites nothing; the default for new rows follows.

ALTER TABLE outbox ADD COLUMN xid xid8 NOT NULL DEFAULT '0';
ALTER TABLE outbox ALTER COLUMN xid SET DEFAULT pg_current_xact_id();
