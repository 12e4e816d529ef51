"""``GET /api/compute/events/watch``: a tenant's events as Server-Sent Events, through the real
app on a real socket, read with an SSE client (httpx-sse); resumable with ``Last-Event-ID``;
refused before anything is streamed to a caller of another tenant, whose own stream never
carries the first tenant's events."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
from httpx_sse import aconnect_sse

from tests.api.conftest import Api, create_body

PATH = "/api/compute/events/watch"


class Watcher:
    """Events one stream delivered so far, read in the background."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.ids: list[str] = []
        self.arrived = asyncio.Event()

    async def until(self, count: int, *, within: float = 10.0) -> list[dict[str, Any]]:
        async with asyncio.timeout(within):
            while len(self.events) < count:
                self.arrived.clear()
                await self.arrived.wait()
        return self.events


@contextlib.asynccontextmanager
async def watching(
    api: Api, tenant: str, *, who: str = "alice", after: str | None = None
) -> AsyncIterator[Watcher]:
    watcher = Watcher()
    headers = {"Authorization": f"Bearer token-of-{who}"}
    if after is not None:
        headers["Last-Event-ID"] = after
    opened = asyncio.Event()

    async def read() -> None:
        async with aconnect_sse(
            api.client,
            "GET",
            PATH,
            params={"tenantId": tenant},
            headers=headers,
            timeout=httpx.Timeout(None, connect=5.0),
        ) as source:
            assert source.response.status_code == 200
            opened.set()
            async for message in source.aiter_sse():
                watcher.events.append(json.loads(message.data))
                watcher.ids.append(message.id)
                assert message.event == watcher.events[-1]["type"]
                watcher.arrived.set()

    task = asyncio.create_task(read())
    async with asyncio.timeout(5):
        await opened.wait()
    try:
        yield watcher
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_tenants_events_stream_in_order_and_resume_after_the_last_id(api: Api):
    async with watching(api, "acme") as live:
        created = await api.ok("reservations/create", create_body(idempotencyKey="ev-1"))
        await api.ok("reservations/release", {"tenantId": "acme", "reservationId": created["id"]})
        events = await live.until(2)
    types = [e["type"] for e in events]
    assert types[0] == "reservation.placed"
    assert "reservation.released" in types
    assert {e["reservationId"] for e in events} == {created["id"]}
    ids = [e["id"] for e in events]
    assert ids == sorted(set(ids))
    assert live.ids[: len(ids)] == [str(i) for i in ids]
    assert events[0]["data"]["poolId"] == created["poolId"]

    # Resumed after the first: the rest again, nothing before it.
    async with watching(api, "acme", after=str(ids[0])) as resumed:
        again = await resumed.until(len(ids) - 1)
    assert [e["id"] for e in again][: len(ids) - 1] == ids[1:]


async def test_another_tenant_can_neither_open_nor_receive_the_tenants_events(api: Api):
    refused = await api.client.get(
        PATH, params={"tenantId": "acme"}, headers={"Authorization": "Bearer token-of-gina"}
    )
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "ACCESS_DENIED"
    async with watching(api, "globex", who="gina") as theirs, watching(api, "acme") as ours:
        await api.ok("reservations/create", create_body(idempotencyKey="ev-2"))
        await ours.until(1)
        await asyncio.sleep(1.0)  # several polls of gina's stream
    assert theirs.events == []


async def test_a_bad_request_is_refused_before_the_stream(api: Api):
    anonymous = await api.client.get(PATH, params={"tenantId": "acme"})
    assert anonymous.status_code == 401
    alice = {"Authorization": "Bearer token-of-alice"}
    missing = await api.client.get(PATH, headers=alice)
    assert missing.status_code == 400
    assert missing.json()["error"]["details"]["field"] == "tenantId"
    bad = await api.client.get(
        PATH, params={"tenantId": "acme"}, headers={**alice, "Last-Event-ID": "x1"}
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["details"]["field"] == "Last-Event-ID"


async def test_the_openapi_document_says_what_the_server_accepts_as_tenant_id(api: Api):
    # The document once allowed an empty tenantId the server refuses: each value is valid by
    # the document's schema exactly when the server does not refuse it as the tenantId.
    doc = (await api.client.get("/api/compute/openapi.json")).json()
    parameters = doc["paths"][PATH]["get"]["parameters"]
    schema = next(p for p in parameters if p["name"] == "tenantId")["schema"]
    alice = {"Authorization": "Bearer token-of-alice"}
    for value in ("", "acme"):
        valid = jsonschema.Draft202012Validator(schema).is_valid(value)
        async with api.client.stream(
            "GET", PATH, params={"tenantId": value}, headers=alice
        ) as response:
            refused = response.status_code == 400
            if refused:
                await response.aread()
                assert response.json()["error"]["details"]["field"] == "tenantId"
        assert valid is not refused, (value, schema, response.status_code)
