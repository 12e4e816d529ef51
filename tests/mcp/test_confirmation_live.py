"""The whole delegated-confirmation loop through the MCP tools against the live API: the agent's
``reserve_gpus`` is held (an answer, not an error), alice approves over HTTP, and the same tool
call again is placed, on the same reservation. Nothing is mocked: the real app, Cedar with a
``@confirm`` policy, the test PostgreSQL, the SDK's in-process client."""

from __future__ import annotations

import httpx

from bettercompute.store.database import Database
from tests.mcp.conftest import called, tools
from tests.support.confirming import AGENT, ALICE, confirming_server

BIG = {"pool": "pool_a", "count": 6, "duration": "2h"}


async def post(url: str, operation: str, body: dict[str, object], token: str) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(
            f"{url}/api/compute/{operation}",
            json=body,
            headers={"Authorization": f"Bearer {token}", "X-Better-Compute": "1"},
        )


async def test_held_then_approved_over_http_then_placed(db: Database):
    async with confirming_server(db) as live, tools(live.url, token=AGENT) as client:
        asked = called(await client.call_tool("reserve_gpus", BIG))
        assert asked["outcome"] == "confirmation-required"
        cid = asked["confirmationId"]
        assert cid.startswith("cnf_")
        assert isinstance(asked["expiresAt"], int)
        assert f"approve confirmation {cid}" in asked["instruction"]
        # Asked again before the person answers: the same confirmation.
        assert called(await client.call_tool("reserve_gpus", BIG)) == asked

        # The agent cannot approve its own request.
        own = await post(
            live.url, "confirmations/approve", {"tenantId": "acme", "confirmationId": cid}, AGENT
        )
        assert own.status_code == 403
        assert own.json()["error"]["code"] == "ACCESS_DENIED"
        # Alice does, over HTTP.
        yes = await post(
            live.url, "confirmations/approve", {"tenantId": "acme", "confirmationId": cid}, ALICE
        )
        assert yes.status_code == 200, yes.text
        assert yes.json()["data"]["state"] == "approved"

        made = called(await client.call_tool("reserve_gpus", BIG))
        assert made["outcome"] == "created"
        reservation = made["reservation"]
        assert reservation["state"] == "placed"
        assert reservation["idempotencyKey"] == asked["idempotencyKey"]
        shown = called(
            await client.call_tool("get_reservation", {"reservation_id": reservation["id"]})
        )
        assert shown["state"] == "placed"
        listed = await post(live.url, "confirmations/list", {"tenantId": "acme"}, ALICE)
        [item] = listed.json()["data"]["items"]
        assert (item["id"], item["reservationId"]) == (cid, reservation["id"])
