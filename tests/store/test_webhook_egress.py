"""Webhook deliveries never reach internal addresses a tenant names (SSRF), and the delivery
log never tells a tenant what the network looks like.

The attack this guards against: a tenant subscribed ``http://127.0.0.1:<port>/`` and
``http://169.254.169.254/…``, the server POSTed there, and the delivery log said "connection
refused" for closed ports and an HTTP status for open ones: a port scan of the server's own
network. Here the real delivery loop runs with the default policy (no allowlist) against a real
receiver listening on 127.0.0.1: it must receive nothing, whether named by address, by a name
that resolves to it, or by an IPv4-mapped IPv6 address, and the log of an open port must read
exactly like that of a closed one. With the operator's allowlist, the same receiver is
delivered to (the other tests of ``test_webhooks.py`` use it) but a redirect is not followed.
"""

from __future__ import annotations

import pytest
from aiohttp import web

from bettercompute.core.egress import EgressPolicy
from bettercompute.core.errors import ComputeError
from bettercompute.service.reservations import ReservationService
from bettercompute.service.webhooks import UNREACHABLE
from bettercompute.store import subscriptions
from bettercompute.store.database import Database
from tests.store import test_webhooks
from tests.store.test_webhooks import (
    LOOPBACK,
    Receiver,
    _free_port,
    delivering,
    eventually,
    log,
    reserve,
    subscribe,
)

# The fixtures of the delivery tests, used here too.
receiver = test_webhooks.receiver
world = test_webhooks.world


@pytest.mark.usefixtures("world")
async def test_internal_addresses_are_never_posted_to_and_the_log_names_nothing(
    db: Database, service: ReservationService, receiver: Receiver
):
    open_port, closed_port = receiver.port, _free_port()
    urls = {
        "open loopback port": f"http://127.0.0.1:{open_port}/hook",
        "closed loopback port": f"http://127.0.0.1:{closed_port}/hook",
        "a name resolving to loopback": f"http://localhost:{open_port}/hook",
        "IPv4-mapped loopback": f"http://[::ffff:127.0.0.1]:{open_port}/hook",
        "IPv6 loopback": f"http://[::1]:{open_port}/hook",
        "unspecified": f"http://0.0.0.0:{open_port}/hook",
    }
    made = {what: await subscribe(service, url) for what, url in urls.items()}
    # A metadata address is refused when a subscription is made (``webhooks.check_url``); one
    # stored before that check (or by another door) is still never posted to.
    metadata = "http://169.254.169.254/latest/meta-data/iam/security-credentials/"
    with pytest.raises(ComputeError) as refused:
        await subscribe(service, metadata)
    assert refused.value.details["field"] == "url"
    stored = await subscriptions.create(
        db, tenant_id="acme", url=metadata, event_types=[], created_by="alice", secret="0" * 64
    )
    assert stored is not None
    made["cloud metadata"] = dict(stored)
    await reserve(service, "k1")
    async with delivering(db, egress=EgressPolicy()):
        for what, sub in made.items():
            [entry, *_] = await eventually(
                lambda sub=sub: log(service, sub["id"]),
                # Delivered once is already a failure: shown by the assertions, not a timeout.
                lambda items: (
                    bool(items) and (items[0]["attempts"] >= 2 or items[0]["state"] != "pending")
                ),
            )
            # One generic text for all: no "refused", no address, no port, no reason.
            assert entry["lastError"] == UNREACHABLE, (what, entry)
            assert entry["lastStatus"] is None, (what, entry)
            assert entry["state"] == "pending", (what, entry)
    assert receiver.received == []


@pytest.mark.usefixtures("world")
async def test_an_allowed_receiver_is_delivered_to_but_its_redirect_is_not_followed(
    db: Database, service: ReservationService, receiver: Receiver
):
    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(receiver.url)

    app = web.Application()
    app.router.add_post("/hook", moved)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        redirecting = await subscribe(service, f"http://127.0.0.1:{port}/hook")
        direct = await subscribe(service, receiver.url)
        rid = await reserve(service, "k1")
        async with delivering(db, egress=LOOPBACK):
            await eventually(
                lambda: log(service, direct["id"]),
                lambda items: bool(items) and items[0]["state"] == "delivered",
            )
            [entry, *_] = await eventually(
                lambda: log(service, redirecting["id"]),
                lambda items: bool(items) and items[0]["attempts"] >= 2,
            )
    finally:
        await runner.cleanup()
    assert entry["lastStatus"] == 307
    assert entry["lastError"] == "HTTP 307: redirects are not followed"
    # Only the direct subscription's delivery reached the receiver, never a redirected one.
    assert [e["reservationId"] for e in receiver.accepted()] == [rid]
