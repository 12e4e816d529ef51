"""The connection pool, its time limits, and the few helpers every store module shares.

Why a class and not a module-level pool: tests, the dev server and benchmarks each open their
own database, and several may live in one process; nothing here is a global singleton.

Every use of a pooled connection is bounded (``Limits``, docs/operations.md): getting the
connection and using it must end within the bound of what it is (an interactive request's
``use_s``, 2.5 s, unless the caller names a batch's or a bulk load's), or the connection is
cut and the caller gets ``StoreError``, which the API answers with 503 ``UNAVAILABLE``. Why
cut the socket rather than cancel the task: cancelling a query makes psycopg send PostgreSQL
a cancel request and wait for it (up to 10 s), and a frozen server answers neither; a socket
shut down ends every wait on it at once, and the pool discards the closed connection, so
nothing half-used is ever handed out again.

What it must never do: return a connection to the pool in an unknown state, or let a psycopg
exception reach the layers above.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg.rows
import psycopg_pool
from psycopg.types.json import Jsonb

from bettercompute.core.errors import StoreError
from bettercompute.store import caching, migrating

log = logging.getLogger(__name__)

Row = dict[str, Any]
Conn = psycopg.AsyncConnection[Row]

#: What the store reads as "PostgreSQL is not there, or not answering": each is ``StoreError``.
_UNAVAILABLE = (
    psycopg.OperationalError,
    psycopg.InterfaceError,
    psycopg_pool.PoolTimeout,
    psycopg_pool.PoolClosed,
)


#: The environment variables ``Limits.from_environ`` reads, by field.
LIMIT_VARIABLES: Mapping[str, str] = {
    "use_s": "BCD_DB_TIMEOUT_S",
    "connect_s": "BCD_DB_CONNECT_TIMEOUT_S",
    "statement_s": "BCD_DB_STATEMENT_TIMEOUT_S",
    "idle_in_transaction_s": "BCD_DB_IDLE_IN_TRANSACTION_TIMEOUT_S",
    "batch_s": "BCD_DB_BATCH_TIMEOUT_S",
    "bulk_s": "BCD_DB_BULK_TIMEOUT_S",
}


@dataclass(frozen=True)
class Limits:
    """How long the store waits for PostgreSQL.

    ``use_s`` bounds one use of a pooled connection, waiting for it included (client-side, so
    it holds with a frozen server on a unix socket too). ``connect_s`` bounds opening a
    connection (libpq's ``connect_timeout``: whole seconds, at least 2). On the server,
    ``statement_s`` and ``idle_in_transaction_s`` end work whose client went quiet, and every
    session checks every second whether its client is still there, so the backend of a cut
    connection stops at once. Over TCP, keepalives and ``tcp_user_timeout`` notice a server
    that vanished from the network. A DSN that sets one of these libpq parameters itself wins.

    Each operation is bounded by what it is, not by one number: ``use_s`` is an interactive
    request's (a client waits on it; past it the answer is 503 and the client retries),
    ``batch_s`` a placement batch's (hundreds of reservations in one transaction), ``bulk_s``
    a bulk load's (seeding a world, a benchmark's fixtures: minutes of rows in one go).
    Migrations run on a connection of their own, unbounded (``migrate``).
    """

    use_s: float = 2.5
    connect_s: int = 3
    statement_s: float = 30.0
    idle_in_transaction_s: float = 30.0
    batch_s: float = 15.0
    bulk_s: float = 300.0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Limits:
        """The defaults, with each ``BCD_DB_*_S`` variable that is set (seconds, above 0)."""
        values: dict[str, Any] = {}
        for name, variable in LIMIT_VARIABLES.items():
            text = environ.get(variable)
            if text is None or not text.strip():
                continue
            try:
                value = float(text)
            except ValueError:
                value = float("nan")
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{variable} must be a number of seconds above 0, not {text!r}")
            values[name] = max(2, round(value)) if name == "connect_s" else value
        return cls(**values)

    def connect_params(self, dsn: str) -> dict[str, Any]:
        """libpq parameters for every connection to ``dsn`` (those it does not set itself)."""
        given = psycopg.conninfo.conninfo_to_dict(dsn)
        ours: dict[str, Any] = {
            "connect_timeout": self.connect_s,
            "keepalives": 1,
            "keepalives_idle": 10,
            "keepalives_interval": 3,
            "keepalives_count": 3,
            "tcp_user_timeout": 10_000,  # milliseconds
        }
        params = {key: value for key, value in ours.items() if key not in given}
        server = (
            f"-c statement_timeout={round(self.statement_s * 1000)}"
            f" -c idle_in_transaction_session_timeout={round(self.idle_in_transaction_s * 1000)}"
            " -c client_connection_check_interval=1000"
        )
        params["options"] = f"{given.get('options') or ''} {server}".strip()
        return params


class Database:
    """A pooled async connection to one PostgreSQL database."""

    def __init__(self, pool: psycopg_pool.AsyncConnectionPool[Conn], dsn: str, *, limits: Limits):
        self.pool = pool
        self.dsn = dsn
        self.limits = limits
        #: libpq parameters for a connection of one's own (the LISTEN loops).
        self.connect_params = limits.connect_params(dsn)
        self.inventory = caching.InventoryCache()

    @classmethod
    async def open(
        cls,
        dsn: str,
        *,
        min_size: int = 2,
        max_size: int = 20,
        migrate: bool = True,
        limits: Limits | None = None,
    ) -> Database:
        """Open a pool on ``dsn`` and, unless told not to, apply pending migrations."""
        limits = limits or Limits()
        pool: psycopg_pool.AsyncConnectionPool[Conn] = psycopg_pool.AsyncConnectionPool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            kwargs={
                "row_factory": psycopg.rows.dict_row,
                "autocommit": True,
                **limits.connect_params(dsn),
            },
            timeout=limits.use_s,
            open=False,
            name="bettercompute",
        )
        try:
            await pool.open(wait=True, timeout=30)
        except psycopg_pool.PoolTimeout as e:
            raise StoreError(f"cannot connect to PostgreSQL at {_redact(dsn)}: {e}") from e
        db = cls(pool, dsn, limits=limits)
        if migrate:
            await db.migrate()
        return db

    async def migrate(self) -> list[str]:
        """Apply pending migrations on a connection of their own, without the server-side
        limits: a migration may rightly run for minutes."""
        try:
            conn = await psycopg.AsyncConnection.connect(
                self.dsn,
                autocommit=True,
                row_factory=psycopg.rows.dict_row,
                connect_timeout=self.connect_params.get("connect_timeout", self.limits.connect_s),
            )
            async with conn:
                return await migrating.apply(conn)
        except _UNAVAILABLE as e:
            raise StoreError(f"cannot apply the migrations: {e}") from e

    async def close(self) -> None:
        # Bounded: a stopping process must not wait on a server that does not answer.
        await self.pool.close(timeout=2.0)

    async def reachable(self, *, within_s: float = 0.8) -> bool:
        """Whether PostgreSQL answers a trivial query within ``within_s`` (for ``/readyz``)."""
        try:
            async with self.connection(within_s=within_s) as conn:
                await conn.execute("SELECT 1")
        except StoreError:
            return False
        return True

    @asynccontextmanager
    async def transaction(self, *, within_s: float | None = None) -> AsyncIterator[Conn]:
        """A connection inside one transaction, committed when the block ends cleanly."""
        async with self.connection(within_s=within_s) as conn, conn.transaction():
            yield conn

    @asynccontextmanager
    async def connection(self, *, within_s: float | None = None) -> AsyncIterator[Conn]:
        """A pooled connection, for at most ``within_s`` (default ``limits.use_s``) counted
        from the call. A lost connection, an unreachable server or the time running out is
        ``StoreError``, so the layers above never see a psycopg exception."""
        limit = self.limits.use_s if within_s is None else within_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        cut = False
        try:
            async with self.pool.connection(timeout=limit) as conn:

                def out_of_time() -> None:
                    nonlocal cut
                    cut = True
                    log.warning(
                        "the database did not answer within %g s: cutting a connection", limit
                    )
                    _sever(conn)

                timer = loop.call_at(deadline, out_of_time)
                try:
                    yield conn
                finally:
                    timer.cancel()
                    if cut:
                        # Closed here, the pool discards it and opens a fresh one.
                        await conn.close()
        except psycopg_pool.PoolTimeout as e:
            # No connection could be had in time: to the caller, the same bound ran out.
            raise StoreError(
                f"the database did not answer within {limit:g} s (no connection could be had)"
            ) from e
        except _UNAVAILABLE as e:
            if cut:
                raise StoreError(f"the database did not answer within {limit:g} s") from e
            raise StoreError(f"the database is unavailable: {e}") from e


def _sever(conn: Conn) -> None:
    """Shut the connection's socket down in both directions: every wait on it ends now with
    "server closed the connection", and libpq marks the connection bad. The socket itself is
    left open for psycopg to close (closing it under the event loop's reader would not be safe).
    """
    try:
        fd = conn.pgconn.socket
    except psycopg.OperationalError:
        return  # already closed
    try:
        with socket.socket(fileno=os.dup(fd)) as duplicate:
            duplicate.shutdown(socket.SHUT_RDWR)
    except OSError as e:
        log.debug("could not shut a connection down: %s", e)


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

    Why: on these small machines a round trip costs more than the SQL it carries, and the
    server runs a script's statements back to back: a transaction that ends ``…; COMMIT`` holds
    its locks for no time the client spends elsewhere. (psycopg's pipeline mode sends each
    statement as it is executed, with a turn of the event loop in between, and measured slower
    here at 32 callers.) The price: the server parses and plans every statement each time, so
    keep scripts to cheap statements (function calls) and read the reservation object with a
    prepared statement, after the commit.
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
