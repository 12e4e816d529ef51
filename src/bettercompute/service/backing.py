"""What the services run on, for the programs that start them: the database and its companions.

Why it exists: a program (``dev``, the operator) must open the database with the limits the
environment sets, give the reservation service its budget check, hear which reservations
changed, and (``dev``) run an embedded PostgreSQL, yet the doors do not import ``store``
(import-linter holds them to it). This is the one small place that hands those over; the
services themselves take the ``Database`` it opens.

What it must never do: decide anything or speak SQL; it only names and opens what ``store``
provides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from bettercompute.core import ports
from bettercompute.store import listening
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database as Database
from bettercompute.store.database import Limits as Limits
from bettercompute.store.embedded import EmbeddedPostgres as EmbeddedPostgres

#: What PostgreSQL says on every change of a reservation or of its allocations.
RESERVATION_CHANGES = "compute_reservation"


def limits_from_environ(environ: Mapping[str, str]) -> Limits:
    """The connection pool's limits as the environment sets them; ``ValueError`` naming the
    variable when one is not a number."""
    return Limits.from_environ(environ)


async def open_database(url: str, *, limits: Limits) -> Database:
    """The database at ``url``, migrated; ``StoreError`` when it cannot be reached."""
    return await Database.open(url, limits=limits)


def budget_check(db: Database) -> ports.BudgetCheck:
    """The built-in budget check: tenants' GPU-hour budgets kept in ``db``."""
    return DatabaseBudget(db)


async def reservation_changes(db: Database, deliver: Callable[[str], None]) -> None:
    """Hand the id of every reservation that changes to ``deliver``, until cancelled (hints:
    after a lost connection nothing is replayed, so callers poll as well)."""
    await listening.payloads(db, RESERVATION_CHANGES, deliver)
