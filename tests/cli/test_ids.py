"""Ids as people type them, against the real server: a unique start of a reservation's,
subscription's or confirmation's id, with or without its kind, names it; a start too short or
shared by several says so and lists the candidates (exit 2); one that starts nothing is not
found (exit 4). And shell completion of ids and pools, as bash asks for it.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from bettercompute.core import ids as core_ids
from bettercompute.core.exits import Exit
from tests.cli.conftest import Cli, Result, Server, run_cli

RESERVE = ("reserve", "--tenant", "acme", "--pool", "pool_a", "--gpus", "1", "--for", "1h")
HOOK = "https://hooks.example.com/compute"


def _colliding_keys() -> tuple[str, str]:
    """Two idempotency keys whose reservations (alice's, of acme) share their first 4
    characters after rsv_: the shortest start the server reads, and shared."""
    seen: dict[str, str] = {}
    for n in itertools.count():
        key = f"k{n}"
        start = core_ids.draft_id("acme", "alice", key)[:8]
        if start in seen:
            return seen[start], key
        seen[start] = key
    raise AssertionError("unreachable")


async def _reserve(cli: Cli, key: str) -> str:
    made = await cli(*RESERVE, "--key", key, "-o", "json")
    assert made.rc == 0, made
    rid = made.json()["id"]
    assert isinstance(rid, str)
    return rid


def _error(result: Result) -> str:
    return next(line for line in result.stderr.splitlines() if line.startswith("Error"))


async def test_a_reservation_by_a_unique_start_with_or_without_rsv(cli: Cli):
    rid = await _reserve(cli, "one")
    for given in (rid, rid[:12], rid[4:12], rid[4:8]):
        shown = await cli("reservations", "get", given, "--tenant", "acme", "-o", "json")
        assert shown.rc == 0, (given, shown)
        assert shown.json()["id"] == rid
    released = await cli("release", rid[4:10], "--tenant", "acme", "-o", "json")
    assert released.rc == 0, released
    assert released.json()["state"] == "released"


async def test_a_start_too_short_or_shared_says_so_and_lists_them(cli: Cli):
    first, second = _colliding_keys()
    a, b = await _reserve(cli, first), await _reserve(cli, second)
    assert a[:8] == b[:8]
    short = await cli("reservations", "get", a[:6], "--tenant", "acme")
    assert short.rc == Exit.USAGE, short
    line = _error(short)
    assert f"{a[:6]} is too short to name a reservation: give at least 4 characters" in line
    assert a in line
    assert b in line or a[:6] != b[:6]
    shared = await cli("extend", a[4:8], "--by", "1h", "--tenant", "acme")
    assert shared.rc == Exit.USAGE, shared
    assert "starts several reservations" in shared.stderr
    assert a in shared.stderr
    assert b in shared.stderr
    # Nothing was extended: neither reservation moved.
    assert "Idempotency key" in shared.stderr


async def test_a_start_of_nothing_is_not_found_and_another_kind_is_a_usage_error(cli: Cli):
    missing = await cli("release", "rsv_zzzzzzzz", "--tenant", "acme")
    assert missing.rc == Exit.NOT_FOUND, missing
    wrong = await cli("release", "sub_01k4z9xq", "--tenant", "acme")
    assert wrong.rc == Exit.USAGE, wrong
    assert "is a subscription id; this command takes a reservation id (rsv_…)" in wrong.stderr


async def test_a_subscription_by_a_unique_start(cli: Cli, server: Server):
    made = [(await cli("subscriptions", "create", "--url", HOOK, "-o", "json")).json()["id"]]
    made.append((await cli("subscriptions", "create", "--url", HOOK, "-o", "json")).json()["id"])
    first, second = made
    # Made within a second: ULIDs share their time's first characters, so a short start is
    # shared, and the whole random part tells them apart.
    common = next(n for n, (x, y) in enumerate(zip(first, second, strict=True)) if x != y)
    assert common >= 8, (first, second)
    shared = await cli("subscriptions", "deliveries", first[4:8])
    assert shared.rc == Exit.USAGE, shared
    assert f"sub_{first[4:8]} starts several subscriptions" in shared.stderr
    assert first in shared.stderr
    assert second in shared.stderr
    unique = first[4 : common + 1]
    gone = await cli("subscriptions", "delete", unique, "-o", "json")
    assert gone.rc == 0, gone
    assert gone.json()["id"] == first
    nothing = await cli("subscriptions", "delete", "sub_zzzzzzzz")
    assert nothing.rc == Exit.NOT_FOUND, nothing
    assert "no subscription of yours starts with sub_zzzzzzzz" in nothing.stderr


async def _complete(server: Server, home: Path, line: str) -> list[str]:
    """What bash's completion asks for ``line`` (the last word being completed)."""
    words = line.split(" ")
    done = await run_cli(
        home=home,
        env={
            "_BETTER_COMPUTE_COMPLETE": "complete_bash",
            "COMP_WORDS": line,
            "COMP_CWORD": str(len(words) - 1),
            "BETTER_COMPUTE_URL": server.url,
            "BETTER_COMPUTE_TOKEN": "alice-token",
        },
    )
    assert done.rc == 0, done
    assert done.stderr == "", done
    return [word.split(",", 1)[-1] for word in done.stdout.split()]


async def test_completion_of_ids_and_pools_from_the_server(
    cli: Cli, server: Server, tmp_path: Path
):
    rid = await _reserve(cli, "complete-me")
    other = await _reserve(cli, "complete-me-too")
    assert await _complete(server, tmp_path, f"better-compute release {rid[:9]}") == [rid]
    every = await _complete(server, tmp_path, "better-compute reservations get rsv_")
    assert sorted(every) == sorted([rid, other])
    pools = await _complete(server, tmp_path, "better-compute reserve --pool pool_")
    assert sorted(pools) == ["pool_a", "pool_k"]


async def test_completion_is_silent_and_quick_without_a_server(tmp_path: Path):
    done = await run_cli(
        home=tmp_path,
        env={
            "_BETTER_COMPUTE_COMPLETE": "complete_bash",
            "COMP_WORDS": "better-compute release rsv_",
            "COMP_CWORD": "2",
            "BETTER_COMPUTE_URL": "http://127.0.0.1:9",
            "BETTER_COMPUTE_TOKEN": "t",
            "BETTER_COMPUTE_TENANT": "acme",
        },
        timeout_s=10,
    )
    assert done.rc == 0, done
    assert done.stdout.strip() == ""
    assert done.stderr == ""
