"""``CONFIRMATION_REQUIRED``: the tool answers what to do instead of failing, and the retry the
person's approval leads to reaches the same request.

These tests point the tools at a small HTTP server on a real socket that answers as the API
would (``test_confirmation_live.py`` runs the loop against the real API): the error envelope
with status 403 until "the person approves", then the reservation. It records every body it
is sent, so the tests see the idempotency key and the window each retry carried.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from bettercompute.core import moments
from bettercompute.mcp import door
from tests.cli.conftest import serve
from tests.mcp.conftest import called, error_text, tools
from tests.support import epochs

EXPIRES_MS = 1_790_000_000_000


@dataclass
class Approver:
    """The stand-in API: which calls came, and whether the person has approved yet."""

    approved: bool = False
    bodies: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    searches: int = 0

    def sent(self, operation: str) -> list[dict[str, Any]]:
        return self.bodies.get(operation, [])

    async def handle(self, request: web.Request) -> web.Response:
        operation = request.match_info["operation"]
        body = await request.json()
        self.bodies.setdefault(operation, []).append(body)
        if request.headers.get("Authorization") != "Bearer agent-token":
            return _error(401, "ACCESS_DENIED", "no token")
        if operation == "whoami":
            return web.json_response({"data": {"tenantId": "acme", "identityId": "agent"}})
        if operation == "capacity/search":
            # Each search finds a later window: only a kept start makes the retry the same.
            self.searches += 1
            start = 1_800_000_000_000 + self.searches * 60_000
            window = {"start": start, "end": start + 3_600_000, "nodeIds": ["n1"]}
            return web.json_response({"data": {"windows": [window], "never": False}})
        if not self.approved:
            return _error(
                403,
                "CONFIRMATION_REQUIRED",
                "a person must approve spending on this request",
                {"confirmationId": "cnf_1", "expiresAt": EXPIRES_MS},
            )
        if operation == "reservations/create":
            start = body.get("start", 1_800_000_000_000)
            return web.json_response(
                {
                    "data": {
                        "id": "rsv_approved",
                        "state": "placed",
                        "idempotencyKey": body["idempotencyKey"],
                        "during": {"start": start, "end": start + 3_600_000},
                    }
                }
            )
        return _error(404, "NOT_FOUND", f"no {operation} here")


def _error(status: int, code: str, message: str, details: Any = None) -> web.Response:
    error = {"code": code, "message": message, "details": details or {}}
    return web.json_response({"error": error}, status=status)


@pytest.fixture
async def approver() -> AsyncIterator[tuple[Approver, str]]:
    stand_in = Approver()
    app = web.Application()
    app.router.add_post("/api/compute/{operation:.+}", stand_in.handle)
    runner, url = await serve(app)
    try:
        yield stand_in, url
    finally:
        await runner.cleanup()


RESERVE = {"pool": "pool_a", "count": 4, "duration": "1h", "nvlink": True}


async def test_confirmation_is_an_answer_and_the_retry_reaches_the_same_request(
    approver: tuple[Approver, str],
):
    stand_in, url = approver
    async with tools(url, token="agent-token") as client:
        asked = called(await client.call_tool("reserve_gpus", RESERVE))
        asked_again = called(await client.call_tool("reserve_gpus", RESERVE))
        stand_in.approved = True  # the person approves cnf_1
        made = called(await client.call_tool("reserve_gpus", RESERVE))

    assert asked["outcome"] == "confirmation-required"
    assert asked["confirmationId"] == "cnf_1"
    assert asked["expiresAt"] == EXPIRES_MS
    assert asked["expiresAtTime"] == moments.rfc3339(EXPIRES_MS)
    assert asked["message"] == "a person must approve spending on this request"
    instruction = asked["instruction"]
    assert "approve confirmation cnf_1" in instruction
    assert f"before {moments.rfc3339(EXPIRES_MS)}" in instruction
    assert "call reserve_gpus again with exactly the same arguments" in instruction
    assert epochs.found(instruction + asked["message"]) == []  # read by a model and a person
    assert asked_again == asked

    assert made["outcome"] == "created"
    assert made["reservation"]["id"] == "rsv_approved"
    creates = stand_in.sent("reservations/create")
    assert len(creates) == 3
    keys = {body["idempotencyKey"] for body in creates}
    assert keys == {asked["idempotencyKey"]}, "every retry carries the one key"
    assert made["reservation"]["idempotencyKey"] == asked["idempotencyKey"]
    assert creates[0]["tenantId"] == "acme"  # the token's own tenant, asked once
    assert len(stand_in.sent("whoami")) == 1
    assert creates[0]["devices"] == [{"class": "gpu", "count": 4, "topology": "nvlink-all"}]
    assert "wait" not in creates[0]


async def test_an_earliest_start_is_kept_for_the_retry(approver: tuple[Approver, str]):
    stand_in, url = approver
    earliest = {**RESERVE, "start": "earliest", "wait_seconds": 10}
    async with tools(url, token="agent-token") as client:
        asked = called(await client.call_tool("reserve_gpus", earliest))
        stand_in.approved = True
        made = called(await client.call_tool("reserve_gpus", {**earliest, "wait_seconds": 0}))
        other = called(await client.call_tool("reserve_gpus", {**earliest, "count": 2}))
    assert asked["outcome"] == "confirmation-required"
    assert made["outcome"] == "created"
    first, retry, changed = stand_in.sent("reservations/create")
    # Searched once for this request: the retry sends the same window under the same key,
    # whatever a new search would find now; the wait is not part of the request.
    assert retry["start"] == first["start"] == made["reservation"]["during"]["start"]
    assert retry["idempotencyKey"] == first["idempotencyKey"]
    assert first["wait"] == {"timeoutMs": 10_000}
    assert "wait" not in retry
    assert stand_in.searches == 2
    assert changed["idempotencyKey"] != first["idempotencyKey"]
    assert changed["start"] != first["start"]
    assert other["reservation"]["idempotencyKey"] == changed["idempotencyKey"]


async def test_extend_asks_for_confirmation_the_same_way(approver: tuple[Approver, str]):
    stand_in, url = approver
    arguments = {"reservation_id": "rsv_approved", "by": "4h"}
    async with tools(url, token="agent-token", tenant="acme") as client:
        first = called(await client.call_tool("extend_reservation", arguments))
        second = called(await client.call_tool("extend_reservation", arguments))
    assert first["outcome"] == "confirmation-required"
    assert "call extend_reservation again with exactly the same arguments" in first["instruction"]
    assert first == second
    sent = stand_in.sent("reservations/extend")
    assert sent[0] == {
        "tenantId": "acme",
        "reservationId": "rsv_approved",
        "by": "4h",
        "idempotencyKey": first["idempotencyKey"],
    }
    assert sent[1] == sent[0]
    assert stand_in.sent("whoami") == []  # the tenant given is used as given


async def test_other_refusals_of_this_server_stay_errors(approver: tuple[Approver, str]):
    stand_in, url = approver
    stand_in.approved = True
    async with tools(url, token="agent-token") as client:
        missing = await client.call_tool("get_reservation", {"reservation_id": "rsv_gone"})
    assert missing.is_error
    assert "NOT_FOUND: no reservations/get here" in error_text(missing)


def test_a_refusals_text_shows_its_times_as_rfc_3339():
    # The text a tool error carries is read; the details' epoch-ms times are shown as RFC 3339.
    refused = door.Refused(
        "CONFLICT",
        "another booking starts first",
        details={"availableUntil": EXPIRES_MS, "nested": [{"start": EXPIRES_MS}], "count": 2},
    )
    text = refused.text()
    assert epochs.found(text) == [], text
    assert text.count(moments.rfc3339(EXPIRES_MS, exact=True)) == 2
    assert '"count": 2' in text
