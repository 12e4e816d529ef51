"""Waking a loop when PostgreSQL says something changed (``LISTEN``/``NOTIFY``).

Here in ``store`` because it speaks to the database; the service's loops only hand it an event.

The reconciler and event delivery both sleep until their next due moment and are woken early
by a notification on their channel. The listener keeps its own connection (a pooled one would
be held forever) and reconnects after any failure, with a growing, jittered wait; a missed
notification only delays a loop until its next poll, never loses work, since the loops read
their state from the tables.

What it must never do: end before it is cancelled. A lost server, a timeout or anything else
that goes wrong is logged and retried, since the loop it feeds would otherwise sleep through
every change until its next poll.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import psycopg

from bettercompute import supervising
from bettercompute.store.database import Database

log = logging.getLogger(__name__)


async def wake_on(db: Database, channel: str, wake: asyncio.Event) -> None:
    """Set ``wake`` on every notification on ``channel``, until cancelled."""
    await payloads(db, channel, lambda _: wake.set())


async def payloads(db: Database, channel: str, deliver: Callable[[str], None]) -> None:
    """Hand every notification's payload on ``channel`` to ``deliver``, until cancelled.

    ``deliver`` must not block (it is called on the listening connection's loop); after a lost
    connection nothing is replayed, so callers treat payloads as hints and poll as well.
    """
    backoff = supervising.Backoff(first_s=0.5, max_s=5.0)
    while True:
        try:
            conn = await psycopg.AsyncConnection.connect(
                db.dsn, autocommit=True, **db.connect_params
            )
            async with conn:
                await conn.execute(
                    psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel))
                )
                backoff.reset()
                async for note in conn.notifies():
                    deliver(note.payload)
        except psycopg.OperationalError as e:
            log.warning("lost the %s notification connection, reconnecting: %s", channel, e)
        except Exception:
            # Not a lost server: still never the end of the loop it feeds.
            log.exception("the %s notification connection failed, reconnecting", channel)
        await backoff.wait()
