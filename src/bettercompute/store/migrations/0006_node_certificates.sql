-- Attested bindings: revoked node certificates, and the certificate that vouched for a binding.
--
-- A node's certificates are revoked wholesale (every certificate issued to it at or before
-- revoked_before: the node was removed or is suspected) or one by one (by serial, which is
-- unique per authority). Rows are never removed: an old certificate must stay refused.
CREATE TABLE node_certificate_revocations (
    node_id         text PRIMARY KEY,
    revoked_before  timestamptz NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT compute_now()
);

CREATE TABLE revoked_certificates (
    -- X.509 serials are up to 20 bytes: numeric, not bigint.
    serial      numeric PRIMARY KEY,
    revoked_at  timestamptz NOT NULL DEFAULT compute_now()
);

-- The bound report as the node signed it (bound_report: the payload bytes, bound_sig: the
-- signature, bound_sig_kid: its key id) and the certificate that carried the key, so a binding
-- can be re-checked by anyone later without trusting what the operator relayed.
ALTER TABLE allocations ADD COLUMN bound_certificate text;
