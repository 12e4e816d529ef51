"""The connection pool and the few helpers every store module shares.

Why a class and not a module-level pool: tests, the dev server and benchmarks each open their
own database, and several may live in one process; nothing here is a global singleton.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import psycopg.rows
import psycopg_pool
from psycopg.types.json import Jsonb

from bettercompute.store import caching, migrating

log = logging.getLogger(__name__)

Row = dict[str, Any]
Conn = psycopg.AsyncConnection[Row]


class StoreError(Exception):
    """The database could not be reached or answered unexpectedly (not a caller's mistake)."""


class Database:
    """A pooled async connection to one PostgreSQL database."""

    def __init__(self, pool: psycopg_pool.AsyncConnectionPool[Conn], dsn: str):
        self.pool = pool
        self.dsn = dsn
        self.inventory = caching.InventoryCache()

    @classmethod
    async def open(
        cls, dsn: str, *, min_size: int = 2, max_size: int = 20, migrate: bool = True
    ) -> Database:
        """Open a pool on ``dsn`` and, unless told not to, apply pending migrations."""
        pool: psycopg_pool.AsyncConnectionPool[Conn] = psycopg_pool.AsyncConnectionPool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            kwargs={"row_factory": psycopg.rows.dict_row, "autocommit": True},
            open=False,
            name="bettercompute",
        )
        try:
            await pool.open(wait=True, timeout=30)
        except psycopg_pool.PoolTimeout as e:
            raise StoreError(f"cannot connect to PostgreSQL at {_redact(dsn)}: {e}") from e
        db = cls(pool, dsn)
        if migrate:
            async with pool.connection() as conn:
                await migrating.apply(conn)
        return db

    async def close(self) -> None:
        await self.pool.close()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Conn]:
        """A connection inside one transaction, committed when the block ends cleanly."""
        async with self.connection() as conn, conn.transaction():
            yield conn

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[Conn]:
        """A pooled connection. A lost connection or an unreachable server is ``StoreError``,
        so the layers above never see a psycopg exception."""
        try:
            async with self.pool.connection() as conn:
                yield conn
        except (psycopg.OperationalError, psycopg_pool.PoolTimeout) as e:
            raise StoreError(f"the database is unavailable: {e}") from e


@asynccontextmanager
async def scripted(db: Database) -> AsyncIterator[Conn]:
    """A connection for a transaction written as scripts (see ``script``).

    The scripts say ``BEGIN`` and ``COMMIT`` themselves, so a transaction of two steps costs two
    round trips. Whatever the block leaves open (an early answer, an exception) is rolled back.
    """
    async with db.connection() as conn:
        try:
            yield conn
        finally:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                await conn.execute("ROLLBACK")


async def script(conn: Conn, sql: str, params: Sequence[Any] = ()) -> list[list[Row]]:
    """Several statements in one round trip; returns the rows of each statement that has any.

    Why: on these small machines a round trip costs a create more than the SQL it carries.
    Parameters are bound client-side by psycopg (properly quoted; never format SQL by hand), so
    the simple query protocol can carry ``BEGIN; SELECT …`` or ``SELECT …; COMMIT`` at once.
    """
    cur = psycopg.AsyncClientCursor(conn, row_factory=psycopg.rows.dict_row)
    await cur.execute(sql, params)
    results: list[list[Row]] = []
    while True:
        if cur.description is not None:
            results.append(await cur.fetchall())
        if not cur.nextset():
            return results


def jsonb(value: Any) -> Jsonb:
    return Jsonb(value)


def _redact(dsn: str) -> str:
    # Never print a password in an error message.
    if "@" in dsn and "://" in dsn:
        scheme, rest = dsn.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"
    return dsn
