-- Which Kubernetes Reservation object owns a stored reservation. Two objects with the same
-- idempotency key and request (same tenant, same requester) name the same reservation; the
-- first to claim it here owns it, the other is refused. A primary key decides, not a listing of
-- objects, so two operator replicas claiming at once cannot both win.
--
-- The row outlives its object on purpose: after the owner is deleted (and its reservation
-- released) the other object must stay refused, not adopt the released reservation. It goes
-- with the reservation row, if that is ever removed.

CREATE TABLE kube_owners (
    reservation_id  text PRIMARY KEY REFERENCES reservations (id) ON DELETE CASCADE,
    object_uid      text NOT NULL,
    namespace       text NOT NULL,
    name            text NOT NULL,
    claimed_at      timestamptz NOT NULL DEFAULT now()
);
