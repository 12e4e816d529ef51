"""Migration 0019 (group admission) on a database the previous version filled, and a rolling
upgrade across it.

The database is migrated to 0018, the last schema before it, and filled the way the previous
version admits: ``write_draft`` and then transaction 2 through ``bc_admission_begin``, the
function that version calls (it stays for exactly such replicas). Then the real migration
runner brings it forward, and this version's group commit places around what is there: no
device twice, the old reservations unchanged. And the previous version's transaction 2 still
works on the migrated schema, beside this version's, as it must while a rolling update
replaces one replica at a time.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from bettercompute.core import attributes, hosts, placement, pools, requests
from bettercompute.core.errors import ComputeError
from bettercompute.iam import policies
from bettercompute.service.reservations import ReservationService
from bettercompute.store import admission, migrating, placing, views
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database, jsonb, script, scripted
from tests.conftest import caller
from tests.store.test_group_commit import LATER, booked
from tests.support.database import drop_database, fresh_database
from tests.support.world import World

BEFORE = 18  # the last migration of the previous version


@pytest.fixture
async def old_db(pg_server_dsn: str) -> AsyncIterator[Database]:
    """A database of its own, migrated only as far as the previous version did."""
    name = f"bc_migrate_{uuid.uuid4().hex[:8]}"
    dsn = fresh_database(pg_server_dsn, name)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "CREATE TABLE schema_migrations (version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for version, file, sql in migrating.migration_files():
            if version > BEFORE:
                break
            async with conn.transaction():
                await conn.execute(sql.encode("utf-8"))
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
                    (version, file),
                )
    db = await Database.open(dsn, min_size=1, max_size=8, migrate=False)
    try:
        yield db
    finally:
        await db.close()
        drop_database(pg_server_dsn, name)


def service_on(db: Database) -> ReservationService:
    return ReservationService(
        db=db,
        policy=policies.CedarPolicyEngine.from_text(policies.DEFAULT_POLICIES),
        budget=DatabaseBudget(db),
        root_tenant_id="root",
    )


async def create_as_previous_version(db: Database, key: str) -> str:
    """One GPU in the LATER window, admitted as the previous version admits: the draft, then
    ``bc_admission_begin``, the placement, the writes and ``bc_admission_done``."""
    value = requests.parse(
        requests.CreateInput,
        {
            "tenantId": "acme",
            "poolId": "pool_a",
            "devices": [{"class": "gpu", "count": 1}],
            "duration": "1h",
            "start": LATER,
            "idempotencyKey": key,
        },
    )
    request = requests.normalized_request(value)
    rid = f"rsv_{key}"
    draft = await admission.write_draft(
        db,
        reservation_id=rid,
        idempotency_id=f"idem_{key}",
        identity_id="alice",
        tenant_id="acme",
        key=key,
        request=request,
        request_hash=key,
        duration_ms=3_600_000,
        claim=f"claim_{key}",
        holder=0,
    )
    assert isinstance(draft, admission.Draft)
    demand = {
        **attributes.quota_demand(draft.request, gpu_model=draft.pool.gpu_model),
        **hosts.quota_excess(draft.request, host_share=draft.host_share),
    }
    resources = sorted(demand)
    wanted = pools.demand(request=draft.request)
    async with scripted(db) as conn:
        [[begun]] = await script(
            conn,
            "BEGIN; SELECT * FROM bc_admission_begin(%s, %s, %s, %s, %s, %s,"
            " to_timestamp(%s / 1000.0), %s * interval '1 millisecond', %s, %s::numeric, %s)",
            (
                draft.idempotency_id,
                draft.claim,
                "pool_a",
                "acme",
                resources,
                [demand[r] for r in resources],
                LATER,
                3_600_000,
                rid,
                None,
                False,
            ),
        )
        assert begun["mine"]
        assert begun["quota_short"] is None
        snap = await placing.snapshot_from(
            conn,
            cache=None,
            pool_id="pool_a",
            version=int(begun["inventory_version"]),
            busy=begun["busy"],
        )
        outcome = placement.place(snapshot=snap, demand=wanted)
        assert isinstance(outcome, placement.Placed)
        book_sql, book_params = placing.book_statement(
            reservation_id=rid,
            pool_id="pool_a",
            outcome=outcome,
            atom_of=placing.atoms_by_id(snap),
            start=begun["start_"],
            end=begun["end_"],
        )
        mark_sql, mark_params = placing.mark_placed_statement(
            reservation_id=rid,
            pool_id="pool_a",
            outcome=outcome,
            start=begun["start_"],
            end=begun["end_"],
            lease=None,
            now=begun["now_"],
            quota_charge=demand,
        )
        await script(
            conn,
            f"{book_sql}; {mark_sql}; SELECT bc_admission_done(%s, %s, %s, %s, %s, %s); COMMIT",
            (
                *book_params,
                *mark_params,
                draft.idempotency_id,
                rid,
                "alice",
                "acme",
                "placed",
                jsonb({}),
            ),
        )
    return rid


async def reservation(db: Database, rid: str) -> dict[str, Any]:
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                f"SELECT {views.COLUMNS} FROM reservations r WHERE r.id = %s", (rid,)
            )
        ).fetchone()
    assert row is not None
    return views.to_view(row)


async def test_a_database_the_previous_version_filled_migrates_and_is_placed_around(
    old_db: Database,
) -> None:
    db = old_db
    await (
        World(db)
        .tenant("acme")
        .tenant("root", root=True)
        .pool("pool_a", owner="acme")
        .nodes("pool_a", 2)
        .quota("acme", "gpu:H100", 64)
        .build()
    )
    old = [await create_as_previous_version(db, f"old{n}") for n in range(6)]
    before = {rid: await reservation(db, rid) for rid in old}

    applied = await db.migrate()
    assert applied == [f for v, f, _ in migrating.migration_files() if v > BEFORE]

    for rid in old:  # unchanged by the migration
        assert await reservation(db, rid) == before[rid]
    # This version's group commit, and the previous version's transaction 2 beside it, as
    # during a rolling update: 16 GPUs, 6 booked before, 10 more creates of each kind.
    service = service_on(db)

    async def new(n: int) -> dict[str, Any] | ComputeError:
        try:
            return await service.create(
                caller(),
                {
                    "tenantId": "acme",
                    "poolId": "pool_a",
                    "devices": [{"class": "gpu", "count": 1}],
                    "duration": "1h",
                    "start": LATER,
                    "idempotencyKey": f"new{n}",
                },
            )
        except ComputeError as e:
            return e

    answers = await asyncio.gather(
        *(new(n) for n in range(8)),
        *(create_as_previous_version(db, f"late{n}") for n in range(2)),
    )
    views_new = [a for a in answers[:8] if isinstance(a, dict)]
    assert len(views_new) == 8
    assert {v["state"] for v in views_new} == {"placed"}
    rows = await booked(db)
    assert len(rows) == 16  # the pool is exactly full
    assert len({r["atom_id"] for r in rows}) == 16  # and no device twice
    for rid in old:
        assert await reservation(db, rid) == before[rid]
