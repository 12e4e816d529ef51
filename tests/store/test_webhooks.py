"""Webhook delivery end to end: reservations made through the service write outbox events,
``service.webhooks.WebhookDelivery`` (its real loop) fans them out and POSTs them to receivers
that are real aiohttp servers on real sockets of 127.0.0.1, which check the signature as a
receiver would. Retries run on short, configured backoffs and deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from bettercompute.core.egress import EgressPolicy
from bettercompute.service.reservations import ReservationService
from bettercompute.service.webhooks import UNREACHABLE, Retries, WebhookDelivery
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.support.world import World

FAST = Retries(base_s=0.05, cap_s=0.2, deadline_s=60.0)
#: The receivers here listen on loopback, which deliveries refuse unless the operator allows it.
LOOPBACK = EgressPolicy.parse(["127.0.0.1"])


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes

    @property
    def event(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.body)
        return parsed


@dataclass
class Receiver:
    """An HTTP server that records every POST and answers ``answer(request number)``."""

    answer: Callable[[Received], int] = lambda _: 200
    received: list[tuple[Received, int]] = field(default_factory=list)
    port: int = 0
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook?x=1"

    async def _handle(self, request: web.Request) -> web.Response:
        got = Received(headers=dict(request.headers), body=await request.read())
        status = self.answer(got)
        self.received.append((got, status))
        return web.Response(status=status, text="ok")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def accepted(self) -> list[dict[str, Any]]:
        return [got.event for got, status in self.received if 200 <= status < 300]


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    made = Receiver()
    await made.start()
    try:
        yield made
    finally:
        await made.stop()


@contextlib.asynccontextmanager
async def delivering(
    db: Database, retries: Retries = FAST, egress: EgressPolicy = LOOPBACK
) -> AsyncIterator[WebhookDelivery]:
    loop = WebhookDelivery(db, retries=retries, egress=egress, poll_s=0.05, timeout_s=2.0)
    task = asyncio.create_task(loop.run())
    try:
        yield loop
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def until(check: Callable[[], Any], *, within: float = 15.0) -> Any:
    async with asyncio.timeout(within):
        while True:
            if found := check():
                return found
            await asyncio.sleep(0.02)


async def eventually(read: Callable[[], Any], check: Callable[[Any], bool], within: float = 15.0):
    async with asyncio.timeout(within):
        while True:
            value = await read()
            if check(value):
                return value
            await asyncio.sleep(0.05)


@pytest.fixture
async def world(db: Database) -> None:
    await (
        World(db)
        .tenant("acme")
        .tenant("globex")
        .tenant("root", root=True)
        .pool("pool_a", owner="acme")
        .pool("pool_g", owner="globex")
        .nodes("pool_a", 2)
        .nodes("pool_g", 1)
        .quota("acme", "gpu:H100", 16)
        .quota("globex", "gpu:H100", 8)
        .build()
    )


async def subscribe(
    service: ReservationService, url: str, *, tenant: str = "acme", types: list[str] | None = None
) -> dict[str, Any]:
    who = caller("alice" if tenant == "acme" else "gina", tenant)
    body: dict[str, Any] = {"tenantId": tenant, "url": url}
    if types is not None:
        body["eventTypes"] = types
    return dict(await service.subscriptions_create(who, body))


async def reserve(service: ReservationService, key: str, *, tenant: str = "acme") -> str:
    who = caller("alice" if tenant == "acme" else "gina", tenant)
    view = await service.create(
        who,
        {
            "tenantId": tenant,
            "poolId": "pool_a" if tenant == "acme" else "pool_g",
            "devices": [{"class": "gpu", "count": 1}],
            "duration": "1h",
            "idempotencyKey": key,
        },
    )
    assert view["state"] == "placed", view
    return view["id"]


async def release(service: ReservationService, rid: str) -> None:
    await service.release(caller(), {"tenantId": "acme", "reservationId": rid})


async def log(
    service: ReservationService, subscription_id: str, state: str | None = None
) -> list[dict[str, Any]]:
    body: dict[str, Any] = {"tenantId": "acme", "subscriptionId": subscription_id}
    if state is not None:
        body["state"] = state
    return [dict(d) for d in (await service.deliveries_list(caller(), body))["items"]]


def verify(secret: str, got: Received, *, tolerance_s: int = 300) -> bool:
    """What a receiver does: recompute the HMAC of ``<timestamp>.<body>`` and compare."""
    import time

    timestamp = got.headers["X-Better-Compute-Timestamp"]
    if abs(time.time() - int(timestamp)) > tolerance_s:
        return False
    signed = f"{timestamp}.".encode() + got.body
    expected = "sha256=" + hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, got.headers["X-Better-Compute-Signature"])


@pytest.mark.usefixtures("world")
async def test_a_delivery_arrives_signed_and_only_what_was_subscribed(
    db: Database, service: ReservationService, receiver: Receiver
):
    everything = await subscribe(service, receiver.url)
    only_released = Receiver()
    await only_released.start()
    globex = Receiver()
    await globex.start()
    try:
        picky = await subscribe(service, only_released.url, types=["reservation.released"])
        await subscribe(service, globex.url, tenant="globex")
        async with delivering(db):
            rid = await reserve(service, "k1")
            await release(service, rid)
            await until(lambda: only_released.accepted())
            types = await until(
                lambda: (
                    [e["type"] for e in receiver.accepted()]
                    if any(e["type"] == "reservation.released" for e in receiver.accepted())
                    else None
                )
            )
        assert types[-1] == "reservation.released"
        assert "reservation.placed" in types
        for got, _ in receiver.received:
            assert verify(everything["secret"], got)
            assert not verify(picky["secret"], got)
            event = got.event
            assert set(event) == {"id", "type", "reservationId", "at", "data"}
            assert event["reservationId"] == rid
            assert got.headers["X-Better-Compute-Event"] == event["type"]
            assert got.headers["X-Better-Compute-Delivery"] == str(event["id"])
            assert got.headers["Content-Type"] == "application/json"
        assert [e["type"] for e in only_released.accepted()] == ["reservation.released"]
        assert verify(picky["secret"], only_released.received[0][0])
        assert globex.received == []  # another tenant's subscription sees none of acme's
        delivered = await log(service, everything["id"], "delivered")
        assert {d["eventId"] for d in delivered} == {e["id"] for e in receiver.accepted()}
        assert all(d["attempts"] == 1 and d["lastStatus"] == 200 for d in delivered)
        assert all(d["deliveredAt"] and d["nextAttemptAt"] is None for d in delivered)
    finally:
        await only_released.stop()
        await globex.stop()


@pytest.mark.usefixtures("world")
async def test_a_reservations_events_arrive_in_order_even_when_the_first_fails(
    db: Database, service: ReservationService, receiver: Receiver
):
    refused: dict[int, int] = {}

    def answer(got: Received) -> int:
        event = got.event
        # Each reservation's first event is refused twice before it is taken.
        if event["type"] != "reservation.released" and refused.get(event["id"], 0) < 2:
            refused[event["id"]] = refused.get(event["id"], 0) + 1
            return 500
        return 204

    receiver.answer = answer
    await subscribe(service, receiver.url)
    first = await reserve(service, "k1")
    second = await reserve(service, "k2")
    await release(service, first)
    await release(service, second)
    async with delivering(db):
        await until(lambda: len([e for e in receiver.accepted() if "released" in e["type"]]) == 2)
    for rid in (first, second):
        seen = [
            (got.event["id"], status)
            for got, status in receiver.received
            if got.event["reservationId"] == rid
        ]
        ids = [event_id for event_id, _ in seen]
        assert ids == sorted(ids), seen  # never a later event before an earlier one
        accepted = [event_id for event_id, status in seen if status == 204]
        assert accepted == sorted(set(accepted))
        # The refused event was tried three times, and nothing after it came meanwhile.
        assert [status for _, status in seen[:3]] == [500, 500, 204]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.mark.usefixtures("world")
async def test_a_receiver_down_then_back_gets_it_after_retries(
    db: Database, service: ReservationService
):
    down = Receiver(port=_free_port())  # nothing listens there yet
    made = await subscribe(service, down.url)
    rid = await reserve(service, "k1")
    try:
        async with delivering(db):
            failing = await eventually(
                lambda: log(service, made["id"]),
                lambda items: bool(items) and items[-1]["attempts"] >= 3,
            )
            oldest = failing[-1]
            assert oldest["state"] == "pending"
            assert oldest["lastStatus"] is None
            assert oldest["lastError"] == UNREACHABLE, oldest
            assert oldest["nextAttemptAt"] is not None
            await down.start()
            await until(lambda: down.accepted())
            items = await eventually(
                lambda: log(service, made["id"]),
                lambda items: all(d["state"] == "delivered" for d in items),
            )
    finally:
        await down.stop()
    assert down.accepted()[0]["reservationId"] == rid
    assert items[-1]["attempts"] >= 4
    assert items[-1]["lastStatus"] == 200
    assert items[-1]["lastError"] is None
    assert verify(made["secret"], down.received[0][0])


@pytest.mark.usefixtures("world")
async def test_past_the_deadline_a_delivery_is_dead_and_stays_in_the_log(
    db: Database, service: ReservationService, receiver: Receiver
):
    receiver.answer = lambda _: 503
    made = await subscribe(service, receiver.url, types=["reservation.placed"])
    await reserve(service, "k1")
    async with delivering(db, Retries(base_s=0.05, cap_s=0.1, deadline_s=0.6)):
        dead = await eventually(lambda: log(service, made["id"], "dead"), bool)
    assert len(dead) == 1
    entry = dead[0]
    assert entry["eventType"] == "reservation.placed"
    assert entry["lastStatus"] == 503
    assert entry["lastError"] == "HTTP 503"
    assert entry["attempts"] >= 3
    assert entry["nextAttemptAt"] is None
    assert entry["deliveredAt"] is None
    tried = len(receiver.received)
    assert tried == entry["attempts"]
    await asyncio.sleep(0.3)
    assert len(receiver.received) == tried  # a dead delivery is never tried again
    assert await log(service, made["id"], "pending") == []


@pytest.mark.usefixtures("world")
async def test_a_deleted_subscription_is_not_delivered_to(
    db: Database, service: ReservationService, receiver: Receiver
):
    receiver.answer = lambda _: 500
    made = await subscribe(service, receiver.url)
    await reserve(service, "k1")
    async with delivering(db):
        await until(lambda: receiver.received)
        await service.subscriptions_delete(
            caller(), {"tenantId": "acme", "subscriptionId": made["id"]}
        )
        tried = len(receiver.received)
        await reserve(service, "k2")
        await asyncio.sleep(0.5)
    assert len(receiver.received) <= tried + 1  # at most the attempt in flight
