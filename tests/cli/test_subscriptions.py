"""``better-compute subscriptions create/list/delete/deliveries``, run as the real command
against the real API; deliveries made by the real ``WebhookDelivery`` loop to a real receiver."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator

from aiohttp import web

from bettercompute.core.egress import EgressPolicy
from bettercompute.service.webhooks import Retries, WebhookDelivery
from bettercompute.store.database import Database
from tests.cli.conftest import Cli, Server, serve

HOOK = "https://hooks.example.com/compute"


async def test_create_list_delete(cli: Cli, server: Server):
    made = await cli(
        "subscriptions",
        "create",
        "--url",
        HOOK,
        "--event",
        "reservation.placed",
        "--event",
        "reservation.released",
        "--tenant",
        "acme",
        "-o",
        "json",
    )
    assert made.rc == 0, made
    sub = made.json()
    assert sub["url"] == HOOK
    assert sub["eventTypes"] == ["reservation.placed", "reservation.released"]
    assert len(sub["secret"]) == 64

    shown = await cli("subscriptions", "create", "--url", HOOK)  # tenant from the token
    assert shown.rc == 0, shown
    assert "secret" in shown.stdout
    assert "never shown again" in shown.stdout
    assert "all" in shown.stdout

    listed = await cli("subscriptions", "list")
    assert listed.rc == 0, listed
    assert sub["id"][:12] in listed.stdout  # its shortest unique start, 8 after the kind
    assert sub["id"] not in listed.stdout
    assert sub["secret"] not in listed.stdout
    assert "reservation.placed, reservation.released" in listed.stdout
    assert listed.stdout.split("\n")[1].split()[:2] == ["ID", "STATE"], listed.stdout
    # Ids made in the same moment share more of their start: the table shows as many as it takes.
    assert re.search(rf"{sub['id'][:12]}\w*\s+active\s+", listed.stdout), listed.stdout
    as_json = await cli("subscriptions", "list", "-o", "json")
    assert as_json.json() == await server.call("events/subscriptions/list", {"tenantId": "acme"})

    gone = await cli("subscriptions", "disable", sub["id"])
    assert gone.rc == 0, gone
    assert re.search(r"state\s+disabled", gone.stdout), gone
    # 'delete' is the old name, still read: the subscription is already disabled.
    again = await cli("subscriptions", "delete", sub["id"])
    assert again.rc == 4, again
    assert "Error NOT_FOUND" in again.stderr


async def test_bad_input_is_the_servers_refusal_naming_the_field(cli: Cli):
    bad_url = await cli("subscriptions", "create", "--url", "ftp://hooks.example.com/x")
    assert bad_url.rc == 2, bad_url
    assert "Error INVALID_INPUT" in bad_url.stderr
    assert "url" in bad_url.stderr
    bad_type = await cli("subscriptions", "create", "--url", HOOK, "--event", "reservation.nope")
    assert bad_type.rc == 2, bad_type
    assert "eventTypes[0]" in bad_type.stderr
    no_url = await cli("subscriptions", "create")
    assert no_url.rc == 2, no_url  # a usage error: --url is required


@contextlib.asynccontextmanager
async def receiving() -> AsyncIterator[tuple[str, list[bytes]]]:
    got: list[bytes] = []

    async def hook(request: web.Request) -> web.Response:
        got.append(await request.read())
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner, url = await serve(app)
    try:
        yield f"{url}/hook", got
    finally:
        await runner.cleanup()


async def test_deliveries_show_the_log(cli: Cli, server: Server, db: Database):
    async with receiving() as (hook_url, got):
        made = await cli("subscriptions", "create", "--url", hook_url, "-o", "json")
        sub = made.json()
        reserved = await cli(
            "reserve", "--pool", "pool_a", "--gpus", "1", "--for", "1h", "-o", "json"
        )
        assert reserved.rc == 0, reserved
        loop = WebhookDelivery(
            db, retries=Retries(base_s=0.05), egress=EgressPolicy.parse(["127.0.0.1"]), poll_s=0.05
        )
        task = asyncio.create_task(loop.run())
        try:
            body = {"tenantId": "acme", "subscriptionId": sub["id"]}
            async with asyncio.timeout(15):
                while True:
                    log = await server.call("events/deliveries/list", body)
                    if (
                        got
                        and log["items"]
                        and all(d["state"] == "delivered" for d in log["items"])
                    ):
                        break
                    await asyncio.sleep(0.05)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    table = await cli("subscriptions", "deliveries", sub["id"])
    assert table.rc == 0, table
    assert "delivered" in table.stdout
    assert reserved.json()["id"][:12] in table.stdout
    dead = await cli("subscriptions", "deliveries", sub["id"], "--state", "dead")
    assert dead.rc == 0, dead
    assert "No deliveries." in dead.stdout
    as_json = await cli("subscriptions", "deliveries", sub["id"], "-o", "json")
    items = as_json.json()["items"]
    assert items
    assert all(d["state"] == "delivered" for d in items)
