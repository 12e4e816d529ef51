"""A real PostgreSQL for the tests: ``DATABASE_URL`` when set, else an embedded server.

A pytest plugin (loaded from ``tests/conftest.py``): one server and one migrated database per
test session, emptied between tests. Nothing here mocks the database.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest

from bettercompute.core.errors import StoreError
from bettercompute.store.database import Database
from bettercompute.store.embedded import EmbeddedPostgres

TEST_DB = "bettercompute_test"

# Every table the tests write, emptied between tests (schema and migrations stay).
_TABLES = (
    "audit_log, outbox, outbox_cursors, work_queue, extend_holds, authz_resources, bookings,"
    " allocations, idempotency, reservations, atoms, nodes, budgets, quotas, offers, pools,"
    " tenants, node_certificate_revocations, revoked_certificates"
    # The usage ledger (migration 0011) keeps no foreign keys: the ledger outlives what it bills.
    ", usage_intervals, usage_totals, atom_health_changes"
    # The pool-lease placer's leases (migration 0013).
    ", pool_leases"
)


@pytest.fixture(scope="session")
def pg_server_dsn() -> Iterator[str]:
    """A DSN for the server's maintenance database."""
    url = os.environ.get("DATABASE_URL")
    if url:
        yield url
        return
    root = Path(tempfile.mkdtemp(prefix="bc-test-pg-"))
    server = EmbeddedPostgres(root / "data", delete_on_stop=True)
    try:
        yield server.dsn
    finally:
        server.stop()


def fresh_database(server_dsn: str, name: str) -> str:
    """An empty database ``name`` on the server (dropped first if it exists); its DSN."""
    drop_database(server_dsn, name)
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    info = psycopg.conninfo.conninfo_to_dict(server_dsn)
    info["dbname"] = name
    return psycopg.conninfo.make_conninfo(**info)


def drop_database(server_dsn: str, name: str) -> None:
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="session")
def pg_dsn(pg_server_dsn: str) -> str:
    """A fresh database for this session on that server."""
    return fresh_database(pg_server_dsn, TEST_DB)


@pytest.fixture(scope="session")
async def session_db(pg_dsn: str) -> AsyncIterator[Database]:
    db = await Database.open(pg_dsn, min_size=2, max_size=40)
    try:
        yield db
    finally:
        await db.close()


@pytest.fixture
async def db(session_db: Database) -> Database:
    """The session's database, empty at the start of every test, with business time reset."""
    # A previous test's background loop (a stream or a delivery loop winding down) may still
    # hold a table the TRUNCATE needs: PostgreSQL then breaks the deadlock by failing one side,
    # possibly the TRUNCATE. Setting up again is the right answer; the loops end on their own.
    for attempt in range(20):
        try:
            async with session_db.connection() as conn:
                await conn.execute(f"TRUNCATE {_TABLES} RESTART IDENTITY CASCADE")
                await conn.execute("UPDATE compute_clock SET offset_ = '0'")
            return session_db
        except StoreError as e:
            if "deadlock" not in str(e) or attempt == 19:
                raise
            await asyncio.sleep(0.1)
    raise AssertionError("unreachable")
