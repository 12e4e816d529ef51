"""PostgreSQL, the source of truth: migrations, the admission and lifecycle transactions, the
work queue, the outbox and the audit log.

Everything that speaks SQL lives here and nowhere else. This layer never calls the policy engine
(a decision is never made inside a transaction) and never imports a door or the service.
Library exceptions (``psycopg.Error``) are turned into ``ComputeError`` or ``StoreError`` here.
"""
