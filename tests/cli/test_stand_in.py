"""The CLI against a stand-in HTTP server, for answers the real API cannot be made to give on
demand: a reservation that stays ``Queued`` for as many reads as a test wants (the real
pool-lease placer is followed in ``test_against_dev.py``), a proxy's HTML page, an internal error.

The stand-in sits at the CLI's own boundary (HTTP on a real socket), like kopf's kmock: the CLI
under test is the real one, run as a subprocess.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.cli.conftest import Result, run_cli, serve

RID = "rsv_standin"


def view(op_state: str, state: str) -> dict[str, Any]:
    return {
        "id": RID,
        "tenantId": "acme",
        "poolId": "pool_a",
        "state": state,
        "request": {"poolId": "pool_a", "devices": [{"class": "gpu", "count": 1}]},
        "during": None,
        "conditions": (
            [{"type": "Queued", "reason": "PoolPlacer", "message": "next batch"}]
            if op_state == "running"
            else []
        ),
        "binding": None,
        "operation": {"id": RID, "state": op_state},
        "idempotencyKey": "k",
        "version": 1,
    }


QUEUED = view("running", "pending")
PLACED = view("succeeded", "placed")


def refusal(code: str, status: int) -> dict[str, Any]:
    return {"status": status, "error": {"code": code, "message": code.lower(), "details": {}}}


@dataclass
class StandIn:
    url: str = ""
    #: (path, headers, body) of every request, in order.
    seen: list[tuple[str, dict[str, str], Any]] = field(default_factory=list)
    #: Answers for ``reservations/get``, in order; the last one repeats.
    gets: list[dict[str, Any]] = field(default_factory=list)
    create: Callable[[], web.Response] = lambda: web.json_response({"data": QUEUED})

    def paths(self) -> list[str]:
        return [path for path, _, _ in self.seen]


@pytest.fixture
async def stand_in() -> AsyncIterator[StandIn]:
    state = StandIn()

    async def create(request: web.Request) -> web.Response:
        state.seen.append((request.path, dict(request.headers), await request.json()))
        return state.create()

    async def get(request: web.Request) -> web.Response:
        state.seen.append((request.path, dict(request.headers), await request.json()))
        answer = state.gets.pop(0) if len(state.gets) > 1 else state.gets[0]
        if "error" in answer:
            return web.json_response(answer, status=answer["status"])
        return web.json_response({"data": answer})

    app = web.Application()
    app.router.add_post("/api/compute/reservations/create", create)
    app.router.add_post("/api/compute/reservations/get", get)
    runner, state.url = await serve(app)
    try:
        yield state
    finally:
        await runner.cleanup()


async def reserve(stand_in: StandIn, home: Path, *extra: str) -> Result:
    return await run_cli("reserve", "--tenant", "acme", "--pool", "pool_a", "--gpus", "1",
                         "--for", "1h", "--url", stand_in.url, "--token", "t", *extra,
                         home=home)  # fmt: skip


async def test_reserve_follows_a_queued_reservation_until_it_is_placed(
    stand_in: StandIn, tmp_path: Path
):
    stand_in.gets = [QUEUED, QUEUED, PLACED]

    result = await reserve(stand_in, tmp_path, "--timeout", "25s", "-o", "json")

    assert result.rc == 0, result
    assert result.json() == PLACED  # the last read, exactly
    path, headers, body = stand_in.seen[0]
    assert path == "/api/compute/reservations/create"
    assert body["wait"] == {"timeoutMs": 25_000}
    assert headers["Authorization"] == "Bearer t"
    assert headers["X-Better-Compute"] == "1"
    assert stand_in.paths()[1:] == ["/api/compute/reservations/get"] * 3
    assert all(b == {"tenantId": "acme", "reservationId": RID} for _, _, b in stand_in.seen[1:])
    assert "still queued" not in result.stderr


async def test_reserve_stops_polling_at_the_wait_deadline(stand_in: StandIn, tmp_path: Path):
    stand_in.gets = [QUEUED]

    started = time.monotonic()
    result = await reserve(stand_in, tmp_path, "--timeout", "2s")
    took = time.monotonic() - started

    assert result.rc == 7, result  # the wait ran out; the request stands
    assert "state" in result.stdout
    assert "Queued (PoolPlacer): next batch" in result.stdout
    assert f"{RID} is still queued" in result.stderr
    assert f"better-compute reservations get {RID} --tenant acme" in result.stderr
    assert stand_in.paths().count("/api/compute/reservations/get") >= 2
    assert took < 15, took


async def test_reserve_keeps_polling_while_a_draft_is_not_found_yet(
    stand_in: StandIn, tmp_path: Path
):
    stand_in.gets = [refusal("NOT_FOUND", 404), PLACED]

    result = await reserve(stand_in, tmp_path, "-o", "json")

    assert result.rc == 0, result
    assert result.json() == PLACED


async def test_a_failed_read_after_the_create_says_the_reservation_exists(
    stand_in: StandIn, tmp_path: Path
):
    stand_in.gets = [refusal("INTERNAL", 500)]

    result = await reserve(stand_in, tmp_path)

    assert result.rc == 1, result
    assert "Error INTERNAL: internal" in result.stderr
    assert f"Hint: {RID} was created before this failed; follow it with" in result.stderr


async def test_reserve_with_wait_zero_sends_no_wait_and_does_not_poll(
    stand_in: StandIn, tmp_path: Path
):
    stand_in.gets = [PLACED]

    result = await reserve(stand_in, tmp_path, "--no-wait", "-o", "yaml")

    assert result.rc == 0, result
    assert stand_in.paths() == ["/api/compute/reservations/create"]
    assert "wait" not in stand_in.seen[0][2]
    assert f"{RID} is still queued" in result.stderr  # and it says how to follow it


async def test_an_answer_that_is_not_the_api_exits_3(stand_in: StandIn, tmp_path: Path):
    stand_in.create = lambda: web.Response(
        status=502, text="<html>Bad Gateway</html>", content_type="text/html"
    )

    result = await reserve(stand_in, tmp_path)

    assert result.rc == 3, result
    assert f"the server at {stand_in.url} answered HTTP 502 (text/html)" in result.stderr
    assert "check --url" in result.stderr
    assert "Traceback" not in result.stderr


async def test_an_internal_error_exits_1_with_its_details(stand_in: StandIn, tmp_path: Path):
    error = {"code": "INTERNAL", "message": "internal error", "details": {"requestId": "req_1"}}
    stand_in.create = lambda: web.json_response({"error": error}, status=500)

    table = await reserve(stand_in, tmp_path)
    assert table.rc == 1, table
    assert table.stderr.splitlines()[1:3] == ["Error INTERNAL: internal error", "details:"]
    assert "requestId: req_1" in table.stderr

    as_json = await reserve(stand_in, tmp_path, "-o", "json")
    assert as_json.rc == 1, as_json
    assert '"requestId": "req_1"' in as_json.stderr
    assert as_json.stdout == ""


async def test_reserve_reads_the_renamed_flags_old_spellings(stand_in: StandIn, tmp_path: Path):
    old = await reserve(stand_in, tmp_path, "--kubernetes", "--wait", "0", "--lease", "600")
    assert old.rc == 0, old
    new = await reserve(
        stand_in, tmp_path, "--binding", "kubernetes", "--no-wait", "--lease", "10m"
    )
    assert new.rc == 0, new
    (_, _, first), (_, _, second) = stand_in.seen
    assert first["binding"] == second["binding"] == "kubernetes"
    assert "wait" not in first
    assert "wait" not in second
    assert first["leaseSeconds"] == second["leaseSeconds"] == 600
    both = await reserve(stand_in, tmp_path, "--timeout", "5s", "--no-wait")
    assert both.rc == 2, both
    assert "--no-wait" in both.stderr


async def test_a_released_reservations_binding_reads_as_past(stand_in: StandIn, tmp_path: Path):
    device = "bcd.dev/gpu=GPU-0"
    bound = {"nodeId": "node_1", "cdiDevices": [device], "envFile": "/run/bcd/a.env"}
    stand_in.gets = [{**view("succeeded", "released"), "binding": bound}]
    released = await run_cli("reservations", "get", RID, "--tenant", "acme",
                             "--url", stand_in.url, "--token", "t", home=tmp_path)  # fmt: skip
    assert released.rc == 0, released
    assert "hold (past: bound until it was released)" in released.stdout, released
    stand_in.gets = [{**view("succeeded", "active"), "binding": bound}]
    active = await run_cli("reservations", "get", RID, "--tenant", "acme",
                           "--url", stand_in.url, "--token", "t", home=tmp_path)  # fmt: skip
    assert "past" not in active.stdout, active
    assert device in active.stdout, active
