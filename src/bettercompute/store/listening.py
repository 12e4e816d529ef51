"""Waking a loop when PostgreSQL says something changed (``LISTEN``/``NOTIFY``).

Here in ``store`` because it speaks to the database; the service's loops only hand it an event.

The reconciler and event delivery both sleep until their next due moment and are woken early
by a notification on their channel. The listener keeps its own connection (a pooled one would
be held forever) and reconnects after a failure; a missed notification only delays a loop until
its next poll, never loses work, since the loops read their state from the tables.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import psycopg

log = logging.getLogger(__name__)


async def wake_on(dsn: str, channel: str, wake: asyncio.Event) -> None:
    """Set ``wake`` on every notification on ``channel``, until cancelled."""
    await payloads(dsn, channel, lambda _: wake.set())


async def payloads(dsn: str, channel: str, deliver: Callable[[str], None]) -> None:
    """Hand every notification's payload on ``channel`` to ``deliver``, until cancelled.

    ``deliver`` must not block (it is called on the listening connection's loop); after a lost
    connection nothing is replayed, so callers treat payloads as hints and resync on start.
    """
    while True:
        try:
            conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
            async with conn:
                await conn.execute(
                    psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel))
                )
                async for note in conn.notifies():
                    deliver(note.payload)
        except psycopg.OperationalError as e:
            log.warning("lost the %s notification connection, reconnecting: %s", channel, e)
            await asyncio.sleep(1)
