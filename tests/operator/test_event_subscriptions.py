"""EventSubscription objects: the real operator against the API stand-in and PostgreSQL makes
the subscription ``events.subscriptions.create`` makes, writes its signing secret into a Secret
the object owns, keeps it as the object changes, disables it on delete, never makes a second
one on restart, and shows its deliveries in status. Events come from reservations made
through the operator's own service; receivers are real aiohttp servers on 127.0.0.1 that check
each signature with the Secret's value."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from bettercompute.operator.running import Operator
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.operator.conftest import World, apply_world
from tests.store.test_webhooks import Receiver, until, verify
from tests.support.kubeobjects import SECRETS, Ref
from tests.support.kubeserver import ApiStatusError, KubeApi

ESUBS = Ref(group="bcd.dev", version="v1alpha1", plural="eventsubscriptions", namespaced=True)


def esub(name: str, url: str, *, namespace: str = "ml", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "bcd.dev/v1alpha1",
        "kind": "EventSubscription",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"url": url, **spec},
    }


def _status(obj: Any) -> dict[str, Any]:
    return dict((obj or {}).get("status") or {})


def _ready(obj: Any) -> dict[str, Any]:
    for condition in _status(obj).get("conditions") or ():
        if condition.get("type") == "Ready":
            return dict(condition)
    return {}


def subscribed(o: Any) -> bool:
    return _ready(o).get("status") == "True" and bool(_status(o).get("subscriptionId"))


async def rows(db: Database, tenant: str) -> list[dict[str, Any]]:
    async with db.connection() as conn:
        return await (
            await conn.execute(
                "SELECT id, url, event_types, state, created_by FROM event_subscriptions"
                " WHERE tenant_id = %s ORDER BY created_at, id",
                (tenant,),
            )
        ).fetchall()


def secret_of(kube: KubeApi, namespace: str, name: str) -> str:
    stored = kube.stored(SECRETS, namespace, name)
    assert stored is not None, f"no Secret {namespace}/{name}"
    return base64.b64decode(stored["data"]["secret"]).decode()


@contextlib.asynccontextmanager
async def receiving() -> AsyncIterator[Receiver]:
    made = Receiver()
    await made.start()
    try:
        yield made
    finally:
        await made.stop()


async def reserve(op: Operator, key: str, *, tenant: str = "acme") -> str:
    view = await op.runtime.service.create(
        caller("alice", tenant),
        {
            "tenantId": tenant,
            "poolId": "h100",
            "devices": [{"class": "gpu", "count": 1}],
            "duration": "1h",
            "idempotencyKey": key,
        },
    )
    return str(view["id"])


#: The receivers listen on loopback: subscribed and delivered to only because it is allowed.
LOOPBACK = ("127.0.0.1",)


@pytest.fixture
async def operator(start_operator: Callable[..., Any]) -> AsyncIterator[Operator]:
    async with start_operator(event_webhook_allow=LOOPBACK) as op:
        yield op


@pytest.fixture
async def two_tenants(kube_api: KubeApi, db: Database, operator: Operator) -> World:
    return await apply_world(kube_api, db, tenant_namespaces={"ml": "acme", "ops": "globex"})


@pytest.mark.usefixtures("two_tenants")
async def test_an_eventsubscription_delivers_signed_with_its_secrets_value(
    kube_api: KubeApi, db: Database, operator: Operator
):
    async with receiving() as receiver:
        await kube_api.create(esub("hooks", receiver.url, eventTypes=["reservation.placed"]))
        obj = await kube_api.wait_for(ESUBS, "ml", "hooks", subscribed)
        status = _status(obj)
        [row] = await rows(db, "acme")
        assert row["id"] == status["subscriptionId"]
        assert (row["url"], list(row["event_types"]), row["state"]) == (
            receiver.url,
            ["reservation.placed"],
            "active",
        )
        assert status["tenantId"] == "acme"
        assert status["types"] == "placed"
        assert status["secretName"] == "hooks-signing"
        secret = kube_api.stored(SECRETS, "ml", "hooks-signing")
        assert secret is not None
        assert secret["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "bcd.dev/v1alpha1",
                "kind": "EventSubscription",
                "name": "hooks",
                "uid": obj["metadata"]["uid"],
                "controller": True,
            }
        ]
        key = secret_of(kube_api, "ml", "hooks-signing")
        assert len(key) == 64

        rid = await reserve(operator, "k1")
        [(got, _)] = await until(lambda: receiver.received or None)
        assert got.event["reservationId"] == rid
        assert got.event["type"] == "reservation.placed"
        assert verify(key, got)
        assert not verify("0" * 64, got)  # the check is real: another key fails it

        done = await kube_api.wait_for(
            ESUBS,
            "ml",
            "hooks",
            lambda o: (_status(o).get("deliveries") or {}).get("delivered") == 1,
        )
        deliveries = _status(done)["deliveries"]
        assert deliveries["pending"] == deliveries["failing"] == deliveries["dead"] == 0
        assert deliveries["lastDeliveredAt"]


@pytest.mark.usefixtures("two_tenants")
async def test_failing_deliveries_are_counted(kube_api: KubeApi, operator: Operator):
    async with receiving() as receiver:
        receiver.answer = lambda _: 500
        await kube_api.create(esub("hooks", receiver.url))
        await kube_api.wait_for(ESUBS, "ml", "hooks", subscribed)
        await reserve(operator, "k1")
        obj = await kube_api.wait_for(
            ESUBS,
            "ml",
            "hooks",
            lambda o: (_status(o).get("deliveries") or {}).get("failing", 0) >= 1,
            timeout=15.0,
        )
        assert _status(obj)["deliveries"]["lastError"] == "HTTP 500"
        assert _status(obj)["deliveries"]["delivered"] == 0


@pytest.mark.usefixtures("two_tenants")
async def test_a_spec_change_updates_the_subscription_in_place(
    kube_api: KubeApi, db: Database, operator: Operator
):
    async with receiving() as first, receiving() as second:
        await kube_api.create(esub("hooks", first.url))
        obj = await kube_api.wait_for(ESUBS, "ml", "hooks", subscribed)
        sid = _status(obj)["subscriptionId"]
        key = secret_of(kube_api, "ml", "hooks-signing")
        await kube_api.patch(
            ESUBS,
            "ml",
            "hooks",
            {"spec": {"url": second.url, "eventTypes": ["reservation.placed"]}},
        )
        await kube_api.wait_for(ESUBS, "ml", "hooks", lambda o: _status(o).get("types") == "placed")
        [row] = await rows(db, "acme")
        assert (row["id"], row["url"], list(row["event_types"])) == (
            sid,
            second.url,
            ["reservation.placed"],
        )
        assert secret_of(kube_api, "ml", "hooks-signing") == key  # the secret stays
        await reserve(operator, "k1")
        [(got, _)] = await until(lambda: second.received or None)
        assert verify(key, got)
        assert first.received == []


@pytest.mark.usefixtures("two_tenants")
async def test_delete_disables_the_subscription(
    kube_api: KubeApi, db: Database, operator: Operator
):
    await kube_api.create(esub("hooks", "http://127.0.0.1:9/hook"))
    await kube_api.wait_for(ESUBS, "ml", "hooks", subscribed)
    await kube_api.delete(ESUBS, "ml", "hooks")
    await kube_api.wait_for(ESUBS, "ml", "hooks", lambda o: o is None)
    [row] = await rows(db, "acme")
    assert row["state"] == "disabled"
    # The Secret is the garbage collector's: the stand-in has none, the reference is checked
    # above; what matters here is that nothing is delivered any more.
    assert await operator.runtime.service.subscriptions_list(caller(), {"tenantId": "acme"}) == {
        "items": []
    }


async def test_a_restart_makes_no_second_subscription(
    kube_api: KubeApi, db: Database, start_operator: Callable[..., Any]
):
    async with start_operator(event_webhook_allow=LOOPBACK):
        await apply_world(kube_api, db)
        await kube_api.create(esub("hooks", "http://127.0.0.1:9/hook"))
        obj = await kube_api.wait_for(ESUBS, "ml", "hooks", subscribed)
        sid = _status(obj)["subscriptionId"]
        key = secret_of(kube_api, "ml", "hooks-signing")
    async with start_operator(event_webhook_allow=LOOPBACK):
        await kube_api.patch(ESUBS, "ml", "hooks", {"spec": {"eventTypes": ["reservation.active"]}})
        await kube_api.wait_for(ESUBS, "ml", "hooks", lambda o: _status(o).get("types") == "active")
    [row] = await rows(db, "acme")
    assert (row["id"], row["state"]) == (sid, "active")
    assert secret_of(kube_api, "ml", "hooks-signing") == key


async def test_an_orphan_of_a_crash_is_disabled_not_doubled(
    kube_api: KubeApi, db: Database, start_operator: Callable[..., Any]
):
    """A subscription made but never recorded in status (the operator stopped between the
    two writes): the next run disables it and subscribes once."""
    async with start_operator(event_webhook_allow=LOOPBACK):
        await apply_world(kube_api, db)
        await kube_api.create(esub("hooks", "http://127.0.0.1:9/hook"))
        await kube_api.wait_for(ESUBS, "ml", "hooks", subscribed)
    # As if the status write had never happened, and the Secret never been written.
    await kube_api.patch(ESUBS, "ml", "hooks", {"status": None}, status=True)
    await kube_api.delete(SECRETS, "ml", "hooks-signing")
    async with start_operator(event_webhook_allow=LOOPBACK):
        obj = await kube_api.wait_for(ESUBS, "ml", "hooks", subscribed)
    states = [(r["id"], r["state"]) for r in await rows(db, "acme")]
    assert [s for _, s in states] == ["disabled", "active"]
    assert states[1][0] == _status(obj)["subscriptionId"]


@pytest.mark.usefixtures("two_tenants")
async def test_a_secret_it_did_not_make_is_never_written_over(
    kube_api: KubeApi, db: Database, operator: Operator
):
    theirs = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "hooks-signing", "namespace": "ml"},
        "data": {"password": base64.b64encode(b"hunter2").decode()},
    }
    await kube_api.create(theirs)
    await kube_api.create(esub("hooks", "http://127.0.0.1:9/hook"))
    obj = await kube_api.wait_for(
        ESUBS, "ml", "hooks", lambda o: _ready(o).get("reason") == "SecretExists"
    )
    assert _ready(obj)["status"] == "False"
    assert "hooks-signing" in _ready(obj)["message"]
    stored = kube_api.stored(SECRETS, "ml", "hooks-signing")
    assert stored is not None
    assert stored["data"] == theirs["data"]
    assert [r["state"] for r in await rows(db, "acme")] == ["disabled"]


@pytest.mark.usefixtures("two_tenants")
async def test_invalid_objects_are_refused_by_the_crd(kube_api: KubeApi):
    for spec in (
        {"url": "ftp://example.com/hook"},
        {"url": "http://example.com/a b"},
        {"url": "https://example.com/hook", "eventTypes": ["reservation.teleported"]},
    ):
        with pytest.raises(ApiStatusError) as refused:
            await kube_api.create(esub("bad", **spec))
        assert refused.value.status == 422, spec


async def test_a_namespace_without_a_tenant_is_not_ready(
    kube_api: KubeApi, db: Database, operator: Operator
):
    await apply_world(kube_api, db, tenant_namespaces={"ml": "acme", "loose": ""})
    await kube_api.create(esub("hooks", "http://127.0.0.1:9/hook", namespace="loose"))
    obj = await kube_api.wait_for(
        ESUBS, "loose", "hooks", lambda o: _ready(o).get("status") == "False"
    )
    assert _ready(obj)["reason"] == "INVALID_INPUT"
    assert "bcd.dev/tenant" in _ready(obj)["message"]


@pytest.mark.usefixtures("two_tenants")
async def test_a_subscription_in_tenant_bs_namespace_never_gets_tenant_as_events(
    kube_api: KubeApi, db: Database, operator: Operator
):
    async with receiving() as acme, receiving() as globex:
        await kube_api.create(esub("acme-hooks", acme.url, namespace="ml"))
        await kube_api.create(esub("spy", globex.url, namespace="ops"))
        spy = await kube_api.wait_for(ESUBS, "ops", "spy", subscribed)
        await kube_api.wait_for(ESUBS, "ml", "acme-hooks", subscribed)
        assert _status(spy)["tenantId"] == "globex"
        [row] = await rows(db, "globex")
        assert row["id"] == _status(spy)["subscriptionId"]

        rid = await reserve(operator, "k1")
        await until(lambda: len(acme.accepted()) >= 2)  # pending, placed
        assert {e["reservationId"] for e in acme.accepted()} == {rid}
        # The spy's delivery loop ran past acme's events (the fan-out's cursor is beyond
        # them) and wrote it nothing.
        async with db.connection() as conn:
            found = await (
                await conn.execute(
                    "SELECT count(*) AS n FROM event_deliveries WHERE subscription_id = %s",
                    (_status(spy)["subscriptionId"],),
                )
            ).fetchone()
        assert found is not None
        assert found["n"] == 0
        assert globex.received == []


@pytest.mark.usefixtures("two_tenants")
async def test_a_url_the_operator_does_not_allow_is_refused_and_never_subscribed(
    kube_api: KubeApi, db: Database
):
    """An internal address the operator's ``--event-webhook-allow`` does not take (here only
    127.0.0.1 is): nothing is subscribed, and ``Ready=False`` names ``spec.url``. Changing a
    subscribed object's URL to one is refused the same way, and its subscription keeps the
    URL it had."""
    await kube_api.create(esub("inside", "http://10.0.0.5/hook"))
    obj = await kube_api.wait_for(
        ESUBS, "ml", "inside", lambda o: _ready(o).get("status") == "False"
    )
    assert _ready(obj)["reason"] == "INVALID_INPUT"
    assert _ready(obj)["message"].startswith("spec.url: 10.0.0.5 is not a public address")
    assert await rows(db, "acme") == []

    await kube_api.create(esub("hooks", "http://127.0.0.1:9/hook"))
    await kube_api.wait_for(ESUBS, "ml", "hooks", subscribed)
    await kube_api.patch(
        ESUBS, "ml", "hooks", {"spec": {"url": "http://169.254.169.254/latest/meta-data/"}}
    )
    obj = await kube_api.wait_for(
        ESUBS, "ml", "hooks", lambda o: _ready(o).get("status") == "False"
    )
    assert "cloud metadata address" in _ready(obj)["message"]
    [row] = await rows(db, "acme")
    assert (row["url"], row["state"]) == ("http://127.0.0.1:9/hook", "active")
