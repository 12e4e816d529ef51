"""Every command of the guide, run as the real ``better-compute`` against the real API.

Each test reads what a person or a script would: the exit code, the table or the JSON on
stdout, and the key, hints and errors on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import pty
import re
import sys
import time
from pathlib import Path

import yaml

from tests.cli.conftest import ALICE, BOB, Cli, Server, run_cli

RESERVE = ("reserve", "--tenant", "acme", "--pool", "pool_a")
HOUR_MS = 3_600_000
KEY_LINE = re.compile(r"Idempotency key: (\S+)")


def key_of(stderr: str) -> str:
    match = KEY_LINE.search(stderr)
    assert match, stderr
    return match.group(1)


async def reserve_json(cli: Cli, *extra: str) -> dict:
    result = await cli(*RESERVE, "--gpus", "2", "--for", "8h", "--output", "json", *extra)
    assert result.rc == 0, result
    return result.json()


# --- reserve -------------------------------------------------------------------------------


async def test_reserve_places_and_prints_a_new_key(cli: Cli):
    result = await cli(*RESERVE, "--gpus", "4", "--for", "8h", "--nvlink")

    assert result.rc == 0, result
    key = key_of(result.stderr)
    assert key.startswith("cli-")
    assert f"add --key {key}" in result.stderr
    assert re.search(r"state\s+placed", result.stdout), result
    assert "4 × gpu (nvlink-all)" in result.stdout
    assert re.search(r"pool\s+pool_a", result.stdout)
    assert re.search(r"during\s+\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ → .*\(8h\)", result.stdout)
    assert re.search(r"operation\s+succeeded", result.stdout)
    assert key in result.stdout  # the key row of the table

    again = await cli(*RESERVE, "--gpus", "4", "--for", "8h", "--nvlink")
    assert again.rc == 0, again
    assert key_of(again.stderr) != key  # a new request on every run without --key


async def test_reserve_json_and_yaml_are_the_servers_data(cli: Cli, server: Server):
    data = await reserve_json(cli, "--key", "train-json", "--cpus", "4", "--memory", "32")

    # The same request with the same key replays the stored reservation: the server's data.
    replay = await server.call(
        "reservations/create",
        {
            "tenantId": "acme",
            "poolId": "pool_a",
            "devices": [{"class": "gpu", "count": 2}],
            "duration": "8h",
            "resources": {"vcpu": 4, "memoryGiB": 32},
            "idempotencyKey": "train-json",
        },
    )
    assert data == replay
    assert data["request"]["resources"] == {"vcpu": 4, "memoryGiB": 32, "hugepages1Gi": 0}

    as_yaml = await cli(
        *RESERVE,
        "--gpus",
        "2",
        "--for",
        "8h",
        "--cpus",
        "4",
        "--memory",
        "32",
        "--key",
        "train-json",
        "--output",
        "yaml",
    )
    assert as_yaml.rc == 0, as_yaml
    assert yaml.safe_load(as_yaml.stdout) == replay


async def test_reserve_with_the_same_key_reaches_the_same_reservation(cli: Cli):
    first = await reserve_json(cli, "--key", "train-2026-09-24")
    second = await cli(
        *RESERVE, "--gpus", "2", "--for", "8h", "--key", "train-2026-09-24", "--output", "json"
    )

    assert second.rc == 0, second
    assert second.json()["id"] == first["id"]
    assert key_of(second.stderr) == "train-2026-09-24"
    assert "add --key" not in second.stderr  # no advice to do what was already done


async def test_reserve_with_a_reused_key_and_another_request_is_a_conflict(cli: Cli):
    first = await reserve_json(cli, "--key", "train-conflict")
    result = await cli(*RESERVE, "--gpus", "3", "--for", "8h", "--key", "train-conflict")

    assert result.rc == 6, result
    assert "Error CONFLICT:" in result.stderr
    assert first["id"] in result.stderr  # details.reservationId
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


async def test_reserve_with_wait_zero_answers_at_once(cli: Cli):
    result = await cli(*RESERVE, "--gpus", "1", "--for", "90m", "--no-wait", "-o", "json")

    assert result.rc == 0, result
    data = result.json()
    assert data["state"] == "placed"
    assert data["operation"]["state"] == "succeeded"
    assert data["during"]["end"] - data["during"]["start"] == 90 * 60_000


async def test_reserve_sends_every_request_option(cli: Cli):
    # pool_a shares whole GPUs: the server judges MIG; the CLI only sent the right body.
    mig = await cli(*RESERVE, "--mig", "1g.10gb", "--count", "2", "--for", "1h")
    assert mig.rc == 2, mig
    assert "Error INVALID_INPUT: devices[0].class:" in mig.stderr

    start = int(time.time() * 1000) + 2 * HOUR_MS
    result = await cli(
        "reserve",
        "--tenant",
        "acme",
        "--pool",
        "pool_k",
        "--gpus",
        "1",
        "--for",
        "1h",
        "--start",
        str(start),
        "--gang",
        "2",
        "--binding",
        "kubernetes",
        "--spot",
        "--project",
        "proj_1",
    )
    # pool_k has no nodes: pending and Unschedulable, shown with the placer's reason, and no
    # wait will place it (exit 5; it stays, as asked without --cancel-if-never-fits).
    assert result.rc == 5, result
    assert "can never be placed: never fits this pool: the pool has no nodes" in result.stderr
    assert re.search(r"state\s+pending", result.stdout), result
    assert re.search(r"conditions\s+Unschedulable \(NoFit\)", result.stdout), result
    assert re.search(r"binding\s+kubernetes", result.stdout), result
    assert "1 × gpu, gang of 2" in result.stdout
    rid = re.search(r"id\s+(rsv_\S+)", result.stdout)
    assert rid, result
    got = await cli(
        "reservations", "get", rid.group(1), "--tenant", "acme", "--query", "request", "-o", "json"
    )
    assert got.json() == {
        "poolId": "pool_k",
        "devices": [{"class": "gpu", "count": 1}],
        "duration": "3600000ms",
        "binding": "kubernetes",
        "gang": {"size": 2},
        "start": start,
        "spot": True,
        "projectId": "proj_1",
    }


async def test_reserve_refuses_bad_flags_before_sending(cli: Cli):
    spaced = await cli(*RESERVE, "--gpus", "2", "--for", "8", "hours")
    assert spaced.rc == 2, spaced
    assert "'--for'" in spaced.stderr
    assert "no unit" in spaced.stderr

    quoted = await cli(*RESERVE, "--gpus", "2", "--for", "8 hours")
    assert quoted.rc == 2, quoted
    assert "'--for'" in quoted.stderr
    assert "cannot read '8 hours'" in quoted.stderr

    both = await cli(*RESERVE, "--gpus", "2", "--slots", "4", "--for", "8h")
    assert both.rc == 2, both
    assert "exactly one of --gpus N, --mig PROFILE or --slots N" in both.stderr

    cpus = await cli(*RESERVE, "--gpus", "2", "--for", "8h", "--cpus", "5000")
    assert cpus.rc == 2, cpus
    assert "'--cpus'" in cpus.stderr

    start = await cli(*RESERVE, "--gpus", "2", "--for", "8h", "--start", "monday")
    assert start.rc == 2, start
    assert "'--start'" in start.stderr
    for result in (spaced, quoted, both, cpus, start):
        assert "Idempotency key" not in result.stderr  # nothing was sent
        assert "Traceback" not in result.stderr


# --- capacity --preview --------------------------------------------------------------------


async def test_capacity_preview_says_whether_and_where_it_fits(cli: Cli):
    preview = ("capacity", "--tenant", "acme", "--preview", "--pool", "pool_a")
    fits = await cli(*preview, "--gpus", "2", "--for", "8h", "--nvlink")
    assert fits.rc == 0, fits
    assert re.search(r"fits\s+yes", fits.stdout), fits
    assert re.search(r"nodes\s+node_pool_a-node-0\d", fits.stdout), fits
    assert re.search(r"during\s+\S+Z → \S+Z \(8h\)", fits.stdout), fits

    as_json = await cli(*preview, "--gpus", "2", "--for", "8h", "-o", "json")
    assert as_json.rc == 0, as_json
    data = as_json.json()
    assert data["fits"] is True
    assert sum(len(d["deviceIds"]) for d in data["devices"]) == 2

    too_big = await cli(*preview, "--gpus", "9", "--for", "8h")
    assert too_big.rc == 0, too_big  # "does not fit" is an answer, not an error
    assert re.search(r"fits\s+no", too_big.stdout), too_big
    assert re.search(r"rejected\s+capacity: 2", too_big.stdout), too_big

    # Host resources are booked as a create would: the asked ones, never below the share.
    host = await cli(*preview, "--gpus", "2", "--for", "8h", "--cpus", "4", "--memory", "32")
    assert host.rc == 0, host
    assert re.search(r"fits\s+yes", host.stdout), host
    assert re.search(
        r"host\s+4 vCPU, 32 GiB memory \(share 2 vCPU, 16 GiB memory\)", host.stdout
    ), host
    # 62 CPUs are bookable on each host (64, less the 2 it keeps).
    too_many = await cli(*preview, "--gpus", "1", "--for", "8h", "--cpus", "63", "-o", "json")
    assert too_many.rc == 0, too_many
    assert too_many.json()["fits"] is False
    assert too_many.json()["rejected"] == {"capacity": 2}


async def test_capacity_without_preview_is_a_usage_error(cli: Cli):
    result = await cli(
        "capacity", "--tenant", "acme", "--pool", "pool_a", "--gpus", "2", "--for", "8h"
    )
    assert result.rc == 2, result
    assert "'--preview'" in result.stderr


# --- reservations get / list ---------------------------------------------------------------


async def test_get_shows_the_reservation_and_query_picks_a_part(cli: Cli):
    made = await reserve_json(cli)
    rid = made["id"]

    table = await cli("reservations", "get", rid, "--tenant", "acme")
    assert table.rc == 0, table
    assert re.search(rf"id\s+{rid}", table.stdout)
    assert re.search(r"state\s+placed", table.stdout)

    binding = await cli("reservations", "get", rid, "--tenant", "acme", "--query", "binding")
    assert binding.rc == 0, binding
    assert json.loads(binding.stdout) == made["binding"]
    assert made["binding"]["nodeIds"]

    node = await cli("reservations", "get", rid, "--tenant", "acme", "--query", "binding.nodeId")
    assert node.stdout == f"{made['binding']['nodeId']}\n"  # a plain value, for scripts

    end = await cli("reservations", "get", rid, "--tenant", "acme", "--query", "during.end")
    assert end.rc == 0, end
    assert end.stdout == f"{made['during']['end']}\n"

    devices = await cli(
        "reservations",
        "get",
        rid,
        "--tenant",
        "acme",
        "--query",
        "request.devices[0]",
        "-o",
        "json",
    )
    assert devices.rc == 0, devices
    assert devices.json() == {"class": "gpu", "count": 2}

    missing = await cli("reservations", "get", rid, "--tenant", "acme", "--query", "during.middle")
    assert missing.rc == 2, missing
    assert "no field 'middle' in during" in missing.stderr


async def test_get_of_an_unknown_reservation_is_not_found(cli: Cli):
    result = await cli("reservations", "get", "rsv_nothing", "--tenant", "acme")
    assert result.rc == 4, result
    assert result.stderr.startswith("Error NOT_FOUND: ")


async def test_list_shows_mine_or_all_filtered_and_paged(cli: Cli):
    mine = [await reserve_json(cli) for _ in range(2)]
    bobs = await cli(*RESERVE, "--gpus", "1", "--for", "1h", "-o", "json", token=BOB)
    assert bobs.rc == 0, bobs
    cancelled = await cli("cancel", mine[0]["id"], "--tenant", "acme")
    assert cancelled.rc == 0, cancelled

    table = await cli("reservations", "list", "--tenant", "acme")
    assert table.rc == 0, table
    header = table.stdout.splitlines()[1]
    assert header.split() == ["ID", "STATE", "POOL", "DEVICES", "START", "END"]
    # A table shows each id's shortest unique start (8 characters after rsv_ here), -o wide
    # the whole id.
    assert mine[0]["id"][:12] in table.stdout
    assert mine[1]["id"][:12] in table.stdout
    assert mine[0]["id"] not in table.stdout
    assert bobs.json()["id"][:12] not in table.stdout
    assert max(len(line.rstrip()) for line in table.stdout.splitlines()) <= 100, table.stdout
    wide = await cli("reservations", "list", "--tenant", "acme", "-o", "wide")
    assert wide.rc == 0, wide
    assert mine[0]["id"] in wide.stdout

    everyone = await cli("reservations", "list", "--tenant", "acme", "--all", "-o", "json")
    assert everyone.rc == 0, everyone
    ids = {item["id"] for item in everyone.json()["items"]}
    assert ids == {mine[0]["id"], mine[1]["id"], bobs.json()["id"]}

    state = await cli(
        "reservations", "list", "--tenant", "acme", "--all", "--state", "cancelled", "-o", "json"
    )
    assert [i["id"] for i in state.json()["items"]] == [mine[0]["id"]]

    page = await cli("reservations", "list", "--tenant", "acme", "--all", "--limit", "1")
    assert page.rc == 0, page
    cursor = re.search(r"More: add --cursor (\S+)", page.stdout)
    assert cursor, page
    rest = await cli(
        "reservations",
        "list",
        "--tenant",
        "acme",
        "--all",
        "--cursor",
        cursor.group(1),
        "-o",
        "json",
    )
    assert len(rest.json()["items"]) == 2

    bad_state = await cli("reservations", "list", "--tenant", "acme", "--state", "sleeping")
    assert bad_state.rc == 2, bad_state
    assert "Error INVALID_INPUT: state: unknown state 'sleeping'" in bad_state.stderr


# --- extend, renew, release, cancel --------------------------------------------------------


async def test_extend_by_and_until(cli: Cli):
    made = await reserve_json(cli)
    rid, end = made["id"], made["during"]["end"]

    by = await cli("extend", rid, "--tenant", "acme", "--by", "4h", "-o", "json")
    assert by.rc == 0, by
    assert key_of(by.stderr).startswith("cli-")
    assert by.json()["extended"] is True
    assert by.json()["reservation"]["during"]["end"] == end + 4 * HOUR_MS

    asked = int(time.time() * 1000) + 13 * HOUR_MS
    until = await cli("extend", rid, "--tenant", "acme", "--until", "+13h")
    assert until.rc == 0, until
    assert "Extended." in until.stdout
    got = await cli("reservations", "get", rid, "--tenant", "acme", "--query", "during.end")
    assert abs(int(got.stdout) - asked) < 60_000, got
    # +13h was resolved once, to the second, and the line to retry with names that time and
    # the key: run later, it is the same request, answered the same, and moves nothing.
    exact = re.search(r"Until: (\S+Z) \(\+13h\)", until.stderr)
    assert exact is not None, until
    assert dt.datetime.fromisoformat(exact.group(1)).timestamp() * 1000 == int(got.stdout)
    retry = re.search(r"to retry this same extend safely: better-compute (extend .+)\)$",
                      until.stderr, re.MULTILINE)  # fmt: skip
    assert retry is not None, until
    assert f"--until {exact.group(1)} --key {key_of(until.stderr)}" in retry.group(1)
    again = await cli(*retry.group(1).split(), "-o", "json")
    assert again.rc == 0, again
    assert again.json()["reservation"]["during"]["end"] == int(got.stdout)

    reached = await cli("extend", rid, "--tenant", "acme", "--until", "+1h")
    assert reached.rc == 0, reached
    assert "Not extended: the reservation already reaches that time." in reached.stdout

    neither = await cli("extend", rid, "--tenant", "acme")
    assert neither.rc == 2, neither
    assert "exactly one of --until" in neither.stderr


async def test_renew_needs_a_lease(cli: Cli):
    plain = await reserve_json(cli)
    refused = await cli("renew", plain["id"], "--tenant", "acme")
    assert refused.rc == 6, refused
    assert refused.stderr.startswith("Error INVALID_STATE: ")

    leased = await reserve_json(cli, "--lease", "600")
    renewed = await cli("renew", leased["id"], "--tenant", "acme", "-o", "json")
    assert renewed.rc == 0, renewed
    assert renewed.json()["leaseExpiresAt"] >= leased["leaseExpiresAt"]


async def test_release_and_cancel(cli: Cli):
    first = await reserve_json(cli)
    released = await cli("release", first["id"], "--tenant", "acme")
    assert released.rc == 0, released
    assert re.search(r"state\s+released", released.stdout), released

    second = await reserve_json(cli)
    cancelled = await cli("cancel", second["id"], "--tenant", "acme", "-o", "json")
    assert cancelled.rc == 0, cancelled
    assert cancelled.json()["state"] == "cancelled"

    again = await cli("cancel", first["id"], "--tenant", "acme")
    assert again.rc == 6, again
    assert again.stderr.startswith("Error INVALID_STATE: ")


# --- connection, credentials and settings --------------------------------------------------


async def test_an_unreachable_server_exits_3_naming_the_url(tmp_path: Path):
    url = "http://127.0.0.1:9"  # the discard port: nothing listens there
    result = await run_cli(
        "reservations", "list", "--tenant", "acme", "--url", url, "--token", "t", home=tmp_path
    )
    assert result.rc == 3, result
    assert f"cannot reach the Better Compute server at {url}" in result.stderr
    assert "better-compute dev" in result.stderr
    assert "Traceback" not in result.stderr


async def test_a_missing_token_is_access_denied_with_a_hint(cli: Cli):
    result = await cli("reservations", "list", "--tenant", "acme", token=None)
    assert result.rc == 5, result
    assert result.stderr.startswith("Error ACCESS_DENIED: the bearer token is missing")
    assert "Hint: no token was sent: pass --token, set $BETTER_COMPUTE_TOKEN" in result.stderr

    wrong = await cli("reservations", "list", "--tenant", "acme", token="not-a-token")
    assert wrong.rc == 5, wrong
    assert wrong.stderr.startswith("Error ACCESS_DENIED: the bearer token is not valid")
    assert "Hint" not in wrong.stderr


async def test_another_tenant_is_refused(cli: Cli):
    result = await cli("reservations", "list", "--tenant", "globex")
    assert result.rc == 5, result
    assert result.stderr.startswith("Error ACCESS_DENIED: ")


async def test_settings_come_from_flag_then_env_then_config(
    cli: Cli, server: Server, tmp_path: Path
):
    config = tmp_path / ".config" / "better-compute" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(f"url: {server.url}\ntoken: alice-token\ntenant: acme\n")

    from_file = await cli(
        "reservations", "list", "-o", "json", env={"BETTER_COMPUTE_URL": ""}, token=None
    )
    assert from_file.rc == 0, from_file
    assert from_file.json() == {"items": [], "nextCursor": None}

    dead = "http://127.0.0.1:9"
    env_wins = await cli("reservations", "list", env={"BETTER_COMPUTE_URL": dead}, token=None)
    assert env_wins.rc == 3, env_wins
    assert dead in env_wins.stderr

    flag_wins = await cli(
        "reservations", "list", "--url", server.url, env={"BETTER_COMPUTE_URL": dead}, token=None
    )
    assert flag_wins.rc == 0, flag_wins

    named = tmp_path / "other.yaml"
    named.write_text("tenant: [not, a, string]\n")
    broken = await cli("reservations", "list", env={"BETTER_COMPUTE_CONFIG": str(named)})
    assert broken.rc == 2, broken
    assert f"config file {named}: tenant must be a non-empty string" in broken.stderr


async def test_no_tenant_given_is_the_tokens_and_without_a_token_a_usage_error(cli: Cli):
    # alice's token belongs to acme: the CLI asks the server (whoami) and uses that.
    mine = await cli(*RESERVE[:1], *RESERVE[3:], "--gpus", "1", "--for", "1h", "-o", "json")
    assert mine.rc == 0, mine
    assert mine.json()["tenantId"] == "acme"
    listed = await cli("reservations", "list", "-o", "json")
    assert listed.rc == 0, listed
    result = await cli("reservations", "list", token=None)
    assert result.rc == 2, result
    assert "no tenant: pass --tenant" in result.stderr


async def test_reserve_of_a_request_that_can_never_fit_exits_5_and_can_cancel_it(cli: Cli):
    never = await cli(*RESERVE, "--gpus", "9", "--for", "1h")  # nodes of 8 GPUs
    # Admitted, pending, and no wait will place it: refused in effect (5), and it says why.
    assert never.rc == 5, never
    assert re.search(r"state\s+pending", never.stdout), never
    assert re.search(
        r"Error: rsv_\w+ can never be placed: never fits this pool: even with every device free",
        never.stderr,
    ), never
    assert "Hint: it stays pending and holds its quota" in never.stderr, never
    # It holds 9 of the 16 H100 of the quota until it is cancelled, as the hint says.
    rid = re.search(r"better-compute cancel (rsv_\w+) --tenant acme", never.stderr)
    assert rid is not None, never
    cancelled = await cli("cancel", rid.group(1), "--tenant", "acme")
    assert cancelled.rc == 0, cancelled
    # Asked to, it cancels what can never fit: the quota is free again.
    gone = await cli(*RESERVE, "--gpus", "9", "--for", "1h", "--cancel-if-never-fits", "-o", "json")
    assert gone.rc == 5, gone
    rid = gone.json()["id"]
    assert f"Cancelled {rid} (cancelled); its quota is free again." in gone.stderr, gone
    after = await cli("reservations", "get", rid, "--tenant", "acme", "-o", "json")
    assert after.json()["state"] == "cancelled", after
    # One that fits gets no such warning (one that waits for devices: tests/store).
    fits = await cli(*RESERVE, "--gpus", "2", "--for", "1h")
    assert fits.rc == 0, fits
    assert "never fits" not in fits.stderr, fits
    preview = await cli(
        "capacity",
        "--tenant",
        "acme",
        "--preview",
        "--pool",
        "pool_a",
        "--gpus",
        "9",
        "--for",
        "1h",
    )
    assert re.search(r"fits\s+no \(never: no node of the pool could hold it\)", preview.stdout)


async def test_capacity_find_lists_the_earliest_windows_and_reserve_takes_the_first(cli: Cli):
    # 5 of each node's 8 GPUs busy for 2 hours: 4 GPUs fit nowhere until then.
    for key in ("fill-a", "fill-b"):
        await reserve_json(cli, "--gpus", "5", "--for", "2h", "--key", key)
    find = ("capacity", "--tenant", "acme", "--find", "--pool", "pool_a")
    found = await cli(*find, "--gpus", "4", "--for", "1h", "-o", "json")
    assert found.rc == 0, found
    windows = found.json()["windows"]
    assert windows, found
    first = windows[0]
    assert first["start"] > found.json()["from"] + HOUR_MS  # not before the fills end
    assert first["end"] - first["start"] == HOUR_MS
    assert [w["start"] for w in windows] == sorted(w["start"] for w in windows)
    table = await cli(*find, "--gpus", "4", "--for", "1h")
    assert re.search(r"START\s+END\s+NODES", table.stdout), table
    none = await cli(*find, "--gpus", "4", "--for", "1h", "--horizon", "30m")
    assert none.rc == 0, none
    assert "no window within the horizon" in none.stdout, none
    both = await cli(*find, "--preview", "--gpus", "4", "--for", "1h")
    assert both.rc == 2, both
    # reserve --start earliest books that window, and says which.
    reserved = await cli(
        *RESERVE, "--gpus", "4", "--for", "1h", "--start", "earliest", "-o", "json"
    )
    assert reserved.rc == 0, reserved
    assert "Earliest window:" in reserved.stderr, reserved
    assert reserved.json()["during"]["start"] == first["start"]
    assert reserved.json()["state"] == "placed"


async def test_pools_shows_what_each_pool_holds_now(cli: Cli):
    await reserve_json(cli, "--gpus", "3", "--key", "three")
    shown = await cli("pools", "--tenant", "acme")
    assert shown.rc == 0, shown
    assert re.search(r"pool_a\s+H100\s+2/2 ready\s+13/16 gpu\s+3\s+0\s+-", shown.stdout), shown
    data = await cli("pools", "--tenant", "acme", "-o", "json")
    [pool_a] = [p for p in data.json()["items"] if p["poolId"] == "pool_a"]
    assert pool_a["devices"]["gpu"] == {
        "total": 16,
        "healthy": 16,
        "booked": 3,
        "bound": 0,
        "free": 13,
    }


async def test_reserve_wait_for_a_state(cli: Cli):
    placed = await cli(*RESERVE, "--gpus", "1", "--for", "1h", "--wait-for", "placed", "-o", "json")
    assert placed.rc == 0, placed
    assert placed.json()["state"] == "placed"
    # No node binds here: it is not active within the second, and the wait ran out (exit 7);
    # the reservation stands.
    waited = await cli(
        *RESERVE, "--gpus", "1", "--for", "1h", "--wait-for", "active", "--timeout", "1s"
    )
    assert waited.rc == 7, waited
    assert re.search(r"is (placed|binding), not active; follow it with", waited.stderr), waited
    bad = await cli(*RESERVE, "--gpus", "1", "--for", "1h", "--wait-for", "bound")
    assert bad.rc == 2, bad


async def test_quota_shows_used_limit_and_left(cli: Cli):
    await reserve_json(cli, "--gpus", "3", "--key", "q-three")
    shown = await cli("quota", "--tenant", "acme")
    assert shown.rc == 0, shown
    assert re.search(r"RESOURCE\s+USED\s+LIMIT\s+LEFT", shown.stdout), shown
    assert re.search(r"gpu:H100\s+3\s+16\s+13", shown.stdout), shown
    data = await cli("quota", "--tenant", "acme", "-o", "json")
    assert {"resource": "gpu:H100", "limit": 16, "used": 3} in data.json()["quotas"]
    other = await cli("quota", "--tenant", "globex")
    assert other.rc != 0, other
    assert "not a member of tenant globex" in other.stderr, other


async def test_watch_prints_each_change_until_its_time_is_up(cli: Cli):
    first = await reserve_json(cli, "--key", "watched")
    # Piped (not a terminal): a new table each time something changed, headed by the time.
    watching = asyncio.create_task(cli("watch", "--tenant", "acme", "--every", "1s", "--for", "4s"))
    await asyncio.sleep(1.5)
    released = await cli("release", first["id"], "--tenant", "acme", "-o", "json")
    assert released.rc == 0, released
    shown = await watching
    assert shown.rc == 0, shown
    tables = [
        part
        for part in re.split(r"^— \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ.*$", shown.stdout, flags=re.M)
        if part.strip()
    ]
    assert len(tables) == 2, shown.stdout
    assert re.search(rf"{first['id'][:12]}\s+placed", tables[0]), tables[0]
    # Released is no longer live: it leaves the table.
    assert first["id"][:12] not in tables[1], tables[1]
    assert "No reservations." in tables[1]


async def test_watch_one_reservation_by_prefix_shows_it_whatever_its_state(cli: Cli):
    first = await reserve_json(cli, "--key", "watched-one")
    await cli("release", first["id"], "--tenant", "acme")
    shown = await cli("watch", first["id"][:12], "--tenant", "acme", "--for", "1s")
    assert shown.rc == 0, shown
    assert re.search(rf"{first['id'][:12]}\s+released", shown.stdout), shown.stdout


async def test_watch_refuses_a_busy_interval_and_an_unknown_reservation(cli: Cli):
    fast = await cli("watch", "--tenant", "acme", "--every", "100ms")
    assert fast.rc == 2, fast
    assert "--every" in fast.stderr, fast
    missing = await cli("watch", "rsv_doesnotexist", "--tenant", "acme", "--for", "1s")
    assert missing.rc == 4, missing
    assert "NOT_FOUND" in missing.stderr, missing


async def test_watch_events_prints_the_tenants_events_live(cli: Cli):
    watching = asyncio.create_task(
        cli("watch", "--events", "--tenant", "acme", "--for", "4s", "-o", "json")
    )
    await asyncio.sleep(1.5)
    made = await reserve_json(cli, "--key", "evented")
    released = await cli("release", made["id"], "--tenant", "acme")
    assert released.rc == 0, released
    shown = await watching
    assert shown.rc == 0, shown
    events = [json.loads(line) for line in shown.stdout.splitlines() if line.strip()]
    mine = [e for e in events if e["reservationId"] == made["id"]]
    assert mine[0]["type"] == "reservation.placed", events
    assert "reservation.released" in [e["type"] for e in mine]
    # Resumed after the first event: the later ones again, as plain lines.
    again = await cli(
        "watch", "--events", "--tenant", "acme", "--after", str(mine[0]["id"]), "--for", "1s"
    )
    assert again.rc == 0, again
    assert str(mine[0]["id"]) not in [line.split()[0] for line in again.stdout.splitlines()]
    assert re.search(rf"^{mine[1]['id']}\s.*{mine[1]['type']}\s+{made['id']}", again.stdout, re.M)


async def test_watch_events_of_another_tenant_is_refused(cli: Cli):
    refused = await cli("watch", "--events", "--tenant", "globex", "--for", "1s")
    assert refused.rc == 5, refused
    assert "ACCESS_DENIED" in refused.stderr, refused


async def test_reserve_on_a_terminal_asks_to_cancel_what_can_never_fit(
    server: Server, tmp_path: Path
):
    # stdin and stderr a terminal (a pty), as a person runs it: the question comes, "y" cancels.
    controller, terminal = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BETTER_COMPUTE_")}
    env.update({"HOME": str(tmp_path), "COLUMNS": "200", "NO_COLOR": "1"})
    env.update({"BETTER_COMPUTE_URL": server.url, "BETTER_COMPUTE_TOKEN": ALICE})
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bettercompute.cli.app",
        *RESERVE, "--gpus", "9", "--for", "1h", "-o", "json",
        stdin=terminal, stdout=asyncio.subprocess.PIPE, stderr=terminal, env=env,
    )  # fmt: skip
    os.close(terminal)
    said = b""
    try:
        async with asyncio.timeout(30):
            while b"[Y/n]" not in said:
                said += await asyncio.to_thread(os.read, controller, 4096)
            os.write(controller, b"y\n")
            out, _ = await process.communicate()
            with contextlib.suppress(OSError):  # the pty closes with the process
                said += await asyncio.to_thread(os.read, controller, 4096)
    finally:
        os.close(controller)
    assert process.returncode == 5, said.decode()
    rid = json.loads(out)["id"]
    assert f"Cancel {rid} now? While pending it holds its quota" in said.decode()
    assert f"Cancelled {rid} (cancelled)" in said.decode()
    after = await server.call("reservations/get", {"tenantId": "acme", "reservationId": rid})
    assert after["state"] == "cancelled"
