-- Tell listeners which reservation changed, as it commits: the operator projects a stored
-- reservation onto its Kubernetes object within a second of any change, not only of the
-- lifecycle transitions the outbox carries (a condition set by the reconciler, an allocation
-- a node reported releasing, which DevicesHeld is computed from). A notification is a hint,
-- never the truth: a listener re-reads the reservation, and one that missed notifications
-- (it was down) re-reads everything it projects when it starts.

CREATE FUNCTION notify_reservation_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('compute_reservation', NEW.id);
    RETURN NULL;
END $$;

CREATE TRIGGER reservations_notify_changed AFTER INSERT OR UPDATE ON reservations
    FOR EACH ROW EXECUTE FUNCTION notify_reservation_changed();

CREATE FUNCTION notify_allocation_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('compute_reservation', NEW.reservation_id);
    RETURN NULL;
END $$;

CREATE TRIGGER allocations_notify_changed AFTER INSERT OR UPDATE OF state, report ON allocations
    FOR EACH ROW EXECUTE FUNCTION notify_allocation_changed();
