"""The holder: what makes this process's idempotency claims and extend holds its own.

Why: admission decides between two transactions, so a create or an extend in flight marks its
key or its reservation with a claim (``idempotency.claim``) or a hold (``extend_holds``) that
makes concurrent requests wait. If the process dies there, nothing would give the claim back,
and its retry would wait out a timeout. So every claim and hold names its holder, and a holder
is a PostgreSQL session: it takes a session-level advisory lock on a dedicated connection, and
its claims are live only while that lock is held (``bc_holder_alive`` reads ``pg_locks``).
When the process dies, or its connection does, PostgreSQL ends the session and the lock goes
with it: the claims are free at once, with no timeout to wait.

Holder ids come from a sequence and are never reused, so a new holder cannot bring a dead
holder's claims back to life. After a lost connection the holder reconnects with a new id on
its next use; a request still running under the old id then finds its claim taken over at
commit (``CONFLICT``), never commits twice.

The holder connection needs a real session: behind a pooler in transaction mode the lock would
not belong to us. This module never reads or writes a claim; admission and extending do.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

import psycopg
import psycopg.pq

from bettercompute.core.errors import StoreError
from bettercompute.store.database import Database

#: How long connecting the holder may take before the request gets ``UNAVAILABLE``.
CONNECT_TIMEOUT_S = 3
#: The holder's session is idle by design: a server-wide idle timeout must not end it. Its
#: server-side keepalives (TCP only) end it when its host vanished without closing the
#: connection, so those claims are freed within about half a minute, not hours.
_SESSION = (
    "-c idle_session_timeout=0"
    " -c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3"
)


class Holder:
    """One dedicated connection holding this process's holder lock.

    ``current()`` answers the holder id to stamp on a claim, connecting (again) when needed.
    """

    def __init__(self, db: Database):
        self._dsn = db.dsn
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._id: int | None = None
        self._connecting = asyncio.Lock()

    async def current(self) -> int:
        """The live holder id. Raises ``StoreError`` when the database cannot be reached."""
        if self._id is not None and self._alive():
            return self._id
        async with self._connecting:
            if self._id is not None and self._alive():
                return self._id
            await self._drop()
            return await self._connect()

    @property
    def backend_pid(self) -> int | None:
        """The holder session's server process, while connected (for operators and tests)."""
        return None if self._conn is None else self._conn.info.backend_pid

    async def close(self) -> None:
        """Give the holder lock back (its claims end now); a later ``current()`` reconnects."""
        async with self._connecting:
            await self._drop()

    def _alive(self) -> bool:
        conn = self._conn
        if conn is None or conn.closed:
            return False
        try:
            # Read what the server sent while we were idle, without waiting. A terminated
            # session sends its goodbye and closes: the first read takes the message, the
            # second sees the close.
            conn.pgconn.consume_input()
            conn.pgconn.consume_input()
        except psycopg.OperationalError:
            return False
        return conn.pgconn.status == psycopg.pq.ConnStatus.OK

    async def _connect(self) -> int:
        try:
            conn = await psycopg.AsyncConnection.connect(
                self._dsn,
                autocommit=True,
                connect_timeout=CONNECT_TIMEOUT_S,
                options=_SESSION,
                application_name="bettercompute holder",
            )
        except psycopg.OperationalError as e:
            raise StoreError(f"the database is unavailable: {e}") from e
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                row = await (await conn.execute("SELECT bc_holder_take()")).fetchone()
        except (psycopg.OperationalError, TimeoutError) as e:
            await conn.close()
            raise StoreError(f"the database is unavailable: {e}") from e
        assert row is not None
        holder_id = int(row[0])
        self._conn, self._id = conn, holder_id
        return holder_id

    async def _drop(self) -> None:
        conn, self._conn, self._id = self._conn, None, None
        if conn is not None and not conn.closed:
            await conn.close()


_HOLDERS: weakref.WeakKeyDictionary[Database, Holder] = weakref.WeakKeyDictionary()


def holder_of(db: Database) -> Holder:
    """The holder of this process for ``db``: one per database, shared by its services.

    A replica is one process; a test that plays two replicas gives the second its own
    ``Holder``.
    """
    holder = _HOLDERS.get(db)
    if holder is None:
        holder = _HOLDERS[db] = Holder(db)
    return holder
