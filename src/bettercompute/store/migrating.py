"""Numbered SQL migrations, applied at start-up under an advisory lock.

Why an advisory lock: several replicas may start at once; the first applies the pending files,
the others wait and then find nothing to do. Each file runs in its own transaction and is
recorded in ``schema_migrations`` with the same transaction, so a crash never leaves a file half
applied and recorded.
"""

from __future__ import annotations

import importlib.resources
import re
from typing import Any

import psycopg

# An arbitrary constant: the lock id every replica agrees on.
_LOCK_ID = 0x6263_6D69_6772  # "bcmigr"
_NAME = re.compile(r"^([0-9]{4})_[a-z0-9_]+\.sql$")


def migration_files() -> list[tuple[int, str, str]]:
    """(version, file name, SQL text) for every packaged migration, in order."""
    folder = importlib.resources.files("bettercompute.store") / "migrations"
    found = []
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry.name, entry.read_text(encoding="utf-8")))
    found.sort()
    versions = [v for v, _, _ in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"two migrations share a number: {versions}")
    return found


async def apply(conn: psycopg.AsyncConnection[Any]) -> list[str]:
    """Apply the migrations this database lacks; returns the names applied."""
    applied: list[str] = []
    await conn.execute("SELECT pg_advisory_lock(%s)", (_LOCK_ID,))
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        cur = await conn.execute("SELECT version FROM schema_migrations")
        done = {row["version"] if isinstance(row, dict) else row[0] for row in await cur.fetchall()}
        for version, name, sql in migration_files():
            if version in done:
                continue
            async with conn.transaction():
                await conn.execute(sql.encode("utf-8"))
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
                    (version, name),
                )
            applied.append(name)
    finally:
        await conn.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_ID,))
    return applied
