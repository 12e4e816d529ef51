"""``better-compute usage``, run as the real command against the real API: the figures of a
reservation used for ten minutes of business time, as a table and as JSON, and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from bettercompute.store import inventory
from bettercompute.store.database import Database
from tests.cli.conftest import Cli, Server, run_cli
from tests.conftest import caller
from tests.store.test_lifecycle import activate


async def used_ten_minutes(db: Database, server: Server) -> None:
    view = await server.service.create(
        caller(),
        {
            "tenantId": "acme",
            "poolId": "pool_a",
            "devices": [{"class": "gpu", "count": 2}],
            "duration": "8h",
            "idempotencyKey": "u1",
            "projectId": "vision",
        },
    )
    await activate(server.service, db, view["id"])
    await inventory.advance_clock(db, seconds=600)
    await server.service.release(caller(), {"tenantId": "acme", "reservationId": view["id"]})


async def test_usage_as_json_and_as_a_table(cli: Cli, server: Server, db: Database):
    await used_ten_minutes(db, server)
    shown = await cli("usage", "--tenant", "acme", "--by", "project", "-o", "json")
    assert shown.rc == 0, shown
    data = shown.json()
    [row] = data["items"]
    assert row["projectId"] == "vision"
    assert row["gpuEquivalentSeconds"] == pytest.approx(2 * 600, abs=20)
    # Not the 16 GPU-hours the reservation asked for.
    assert data["total"]["gpuHours"] == pytest.approx(1200 / 3600, abs=0.01)

    table = await cli("usage", "--tenant", "acme", "--by", "pool", "--from", "-1d")
    assert table.rc == 0, table
    assert "pool_a" in table.stdout
    assert "GPU-HOURS" in table.stdout
    assert "DEVICE-SECONDS" in table.stdout
    assert "0.33" in table.stdout

    before = await cli(
        "usage",
        "--tenant",
        "acme",
        "--from",
        "2000-01-01T00:00Z",
        "--to",
        "2000-01-02T00:00Z",
        "-o",
        "json",
    )
    assert before.rc == 0, before
    assert before.json()["total"]["gpuSeconds"] == 0


async def test_usage_refusals(cli: Cli):
    bad = await cli("usage", "--tenant", "acme", "--by", "week")
    assert bad.rc != 0
    assert "INVALID_INPUT" in bad.stderr + bad.stdout
    assert "by" in bad.stderr + bad.stdout
    other = await cli("usage", "--tenant", "globex")
    assert other.rc != 0
    assert "ACCESS_DENIED" in other.stderr + other.stdout
    unreadable = await cli("usage", "--tenant", "acme", "--from", "last tuesday")
    assert unreadable.rc == 2
    assert "--from" in unreadable.stderr


async def test_usage_help_teaches(tmp_path: Path):
    shown = await run_cli("usage", "--help", home=tmp_path)
    assert shown.rc == 0, shown
    for words in ("bound", "released", "--by", "better-compute usage --tenant acme"):
        assert words in shown.stdout, words
