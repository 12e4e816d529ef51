"""``events.subscriptions.{create,list,delete}`` and ``events.deliveries.list`` through the real
app on a real socket: the secret shown once, the tenancy of every call, bad input refused
naming the field, and the answers as their types say (closed)."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

from bettercompute.core import answers
from tests.api.conftest import Api

URL = "https://hooks.example.com/compute"


async def create(api: Api, **body: Any) -> dict[str, Any]:
    return await api.ok("events/subscriptions/create", {"tenantId": "acme", "url": URL, **body})


async def test_create_answers_the_secret_once_and_list_never_shows_it(api: Api):
    made = await create(api, eventTypes=["reservation.placed", "reservation.released"])
    TypeAdapter(answers.Subscription).validate_python(made, strict=True)
    assert made["id"].startswith("sub_")
    assert (made["tenantId"], made["url"], made["state"], made["createdBy"]) == (
        "acme",
        URL,
        "active",
        "alice",
    )
    assert made["eventTypes"] == ["reservation.placed", "reservation.released"]
    assert len(made["secret"]) == 64
    assert int(made["secret"], 16) >= 0
    other = await create(api)
    assert other["eventTypes"] == []
    assert other["secret"] != made["secret"]

    listed = await api.ok("events/subscriptions/list", {"tenantId": "acme"}, who="bob")
    TypeAdapter(answers.SubscriptionList).validate_python(listed, strict=True)
    assert [s["id"] for s in listed["items"]] == [made["id"], other["id"]]
    assert all("secret" not in s for s in listed["items"])
    assert listed["items"][0] == {k: v for k, v in made.items() if k != "secret"}


async def test_delete_disables_it_and_it_leaves_the_list(api: Api):
    made = await create(api)
    body = {"tenantId": "acme", "subscriptionId": made["id"]}
    gone = await api.ok("events/subscriptions/delete", body)
    TypeAdapter(answers.Subscription).validate_python(gone, strict=True)
    assert gone["state"] == "disabled"
    assert "secret" not in gone
    assert (await api.ok("events/subscriptions/list", {"tenantId": "acme"}))["items"] == []
    await api.error("events/subscriptions/delete", body, status=404, code="NOT_FOUND")
    await api.error("events/deliveries/list", body, status=404, code="NOT_FOUND")


async def test_another_tenant_can_neither_list_nor_delete_nor_read_the_log(api: Api):
    made = await create(api)
    acme = {"tenantId": "acme", "subscriptionId": made["id"]}
    # Naming acme: refused by the tenant pre-check.
    await api.error(
        "events/subscriptions/list",
        {"tenantId": "acme"},
        who="gina",
        status=403,
        code="ACCESS_DENIED",
    )
    for operation in ("events/subscriptions/delete", "events/deliveries/list"):
        await api.error(operation, acme, who="gina", status=403, code="ACCESS_DENIED")
    await api.error(
        "events/subscriptions/create",
        {"tenantId": "acme", "url": URL},
        who="gina",
        status=403,
        code="ACCESS_DENIED",
    )
    # Naming its own tenant: acme's subscription is not there.
    globex = {"tenantId": "globex", "subscriptionId": made["id"]}
    listed = await api.ok("events/subscriptions/list", {"tenantId": "globex"}, who="gina")
    assert listed["items"] == []
    for operation in ("events/subscriptions/delete", "events/deliveries/list"):
        await api.error(operation, globex, who="gina", status=404, code="NOT_FOUND")
    # Still acme's, still active.
    assert [
        s["id"] for s in (await api.ok("events/subscriptions/list", {"tenantId": "acme"}))["items"]
    ] == [made["id"]]


async def test_bad_input_is_refused_naming_the_field(api: Api):
    async def refused(body: dict[str, Any]) -> str:
        err = await api.error(
            "events/subscriptions/create",
            {"tenantId": "acme", **body},
            status=400,
            code="INVALID_INPUT",
        )
        return str(err["details"]["field"])

    for url in ("ftp://hooks.example.com/x", "hooks.example.com/x", "https://", "http://a b/"):
        assert await refused({"url": url}) == "url"
    assert await refused({}) == "url"
    assert await refused({"url": URL, "eventTypes": ["reservation.nope"]}) == "eventTypes[0]"
    assert await refused({"url": URL, "eventTypes": "reservation.placed"}) == "eventTypes"
    assert await refused({"url": URL, "secret": "mine"}) == "secret"  # never the caller's
    err = await api.error(
        "events/deliveries/list",
        {"tenantId": "acme", "subscriptionId": "sub_x", "state": "lost"},
        status=400,
        code="INVALID_INPUT",
    )
    assert err["details"]["field"] == "state"
    assert await api.rows("event_subscriptions") == 0


async def test_the_delivery_log_of_a_new_subscription_is_empty(api: Api):
    made = await create(api)
    log = await api.ok(
        "events/deliveries/list",
        {"tenantId": "acme", "subscriptionId": made["id"], "state": "dead"},
    )
    TypeAdapter(answers.DeliveryList).validate_python(log, strict=True)
    assert log == {"items": []}
