"""``better-compute confirmations list|approve|deny``, run as the real command against the real
API: the agent's request held, alice sees it and answers, the agent's retry is placed; the
refusals (someone else, a forged id, too late) print the server's code and exit non-zero."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bettercompute.store import inventory
from bettercompute.store.database import Database
from tests.cli.conftest import Result, run_cli
from tests.support.confirming import AGENT, ALICE, BOB, GINA, Confirming, confirming_server


@pytest.fixture
async def live(db: Database) -> AsyncIterator[Confirming]:
    async with confirming_server(db) as running:
        yield running


async def cli(live: Confirming, home: Path, *args: str, token: str = ALICE) -> Result:
    env = {"BETTER_COMPUTE_URL": live.url, "BETTER_COMPUTE_TOKEN": token}
    return await run_cli(*args, home=home, env=env)


RESERVE = ("reserve", "--pool", "pool_a", "--gpus", "6", "--for", "2h", "--key", "agent-1")


async def held(live: Confirming, home: Path) -> dict[str, Any]:
    """The agent's reserve, held: the CLI prints the code and the confirmation id."""
    asked = await cli(live, home, *RESERVE, "-o", "json", token=AGENT)
    assert asked.rc != 0, asked
    assert "CONFIRMATION_REQUIRED" in asked.stderr
    listed = await cli(live, home, "confirmations", "list", "-o", "json")
    assert listed.rc == 0, listed
    [item] = listed.json()["items"]
    assert item["id"] in asked.stderr
    return dict(item)


async def test_list_approve_and_the_agents_retry_is_placed(live: Confirming, tmp_path: Path):
    item = await held(live, tmp_path)
    cid = item["id"]
    table = await cli(live, tmp_path, "confirmations", "list")
    assert table.rc == 0, table
    for shown in (cid[:12], "pending", "6 x gpu for 2h in pool_a", "agent", "alice"):
        assert shown in table.stdout, table
    assert (
        "No confirmations."
        in (await cli(live, tmp_path, "confirmations", "list", token=BOB)).stdout
    )

    approved = await cli(live, tmp_path, "confirmations", "approve", cid)
    assert approved.rc == 0, approved
    assert "approved" in approved.stdout
    assert "alice" in approved.stdout
    again = await cli(live, tmp_path, "confirmations", "approve", cid, "-o", "json")
    assert again.json()["state"] == "approved"

    placed = await cli(live, tmp_path, *RESERVE, "-o", "json", token=AGENT)
    assert placed.rc == 0, placed
    assert placed.json()["state"] == "placed"
    assert placed.json()["id"] == item["reservationId"]
    late_no = await cli(live, tmp_path, "confirmations", "deny", cid)
    assert late_no.rc != 0
    assert "Error INVALID_STATE" in late_no.stderr


async def test_deny_refuses_the_agent_for_good(live: Confirming, tmp_path: Path):
    cid = (await held(live, tmp_path))["id"]
    denied = await cli(live, tmp_path, "confirmations", "deny", cid, "--tenant", "acme")
    assert denied.rc == 0, denied
    assert "denied" in denied.stdout
    retry = await cli(live, tmp_path, *RESERVE, token=AGENT)
    assert retry.rc != 0
    assert "Error ACCESS_DENIED" in retry.stderr
    pending = await cli(live, tmp_path, "confirmations", "list", "--state", "pending")
    assert "No confirmations." in pending.stdout


async def test_refusals_print_the_code_and_exit_non_zero(
    live: Confirming, tmp_path: Path, db: Database
):
    cid = (await held(live, tmp_path))["id"]
    for token in (AGENT, BOB):
        refused = await cli(live, tmp_path, "confirmations", "approve", cid, token=token)
        assert refused.rc != 0, refused
        assert "Error ACCESS_DENIED" in refused.stderr
    # A whole id that is no confirmation of yours: the server's refusal, which never says
    # whether it exists; a start of none of yours is not found before anything is sent.
    forged = await cli(live, tmp_path, "confirmations", "approve", "cnf_" + "0" * 26)
    assert "Error ACCESS_DENIED" in forged.stderr
    short = await cli(live, tmp_path, "confirmations", "approve", "cnf_forged")
    assert short.rc == 4, short
    assert "no confirmation of yours starts with cnf_forged" in short.stderr
    outsider = await cli(live, tmp_path, "confirmations", "list", "--tenant", "acme", token=GINA)
    assert "Error ACCESS_DENIED" in outsider.stderr
    bad = await cli(live, tmp_path, "confirmations", "list", "--state", "maybe")
    assert bad.rc != 0
    assert "Error INVALID_INPUT" in bad.stderr
    assert "state" in bad.stderr
    await inventory.advance_clock(db, seconds=31 * 60)
    late = await cli(live, tmp_path, "confirmations", "approve", cid)
    assert "Error INVALID_STATE" in late.stderr
    assert "expired" in late.stderr


async def test_help_teaches_the_loop(tmp_path: Path):
    shown = await run_cli("confirmations", "--help", home=tmp_path)
    assert shown.rc == 0
    for words in ("CONFIRMATION_REQUIRED", "same idempotency", "list", "approve", "deny"):
        assert words in shown.stdout
