"""``events.subscriptions.{create,list,delete}`` and ``events.deliveries.list`` through the real
app on a real socket: the secret shown once, the tenancy of every call, bad input refused
naming the field (a URL no delivery could reach included), and the answers as their types say
(closed)."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

from bettercompute.core import answers
from bettercompute.core.egress import EgressPolicy
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


#: Hosts no delivery could ever reach without the operator's allowlist, written the ways a
#: resolver reads them (issue 26: refused when the subscription is made, not only per delivery).
INTERNAL = {
    "http://127.0.0.1:8080/hook": "127.0.0.1",
    "http://127.1/hook": "127.1",
    "http://2130706433/hook": "2130706433",
    "http://0x7f.0.0.1/hook": "0x7f.0.0.1",
    "http://user@127.0.0.1/hook": "127.0.0.1",
    "http://[::1]:8080/hook": "::1",
    "http://[::ffff:127.0.0.1]/hook": "::ffff:127.0.0.1",
    "http://[fe80::1%25eth0]/hook": "fe80::1%25eth0",
    "http://localhost:8080/hook": "localhost",
    "http://hooks.localhost/hook": "hooks.localhost",
    "http://0/hook": "0",
    "http://10.1.2.3/hook": "10.1.2.3",
    "http://192.168.0.10/hook": "192.168.0.10",
    "http://100.64.0.1/hook": "100.64.0.1",
    "http://169.254.10.10/hook": "169.254.10.10",
    "http://[fd00::1]/hook": "fd00::1",
}
METADATA_URL = "http://169.254.169.254/latest/meta-data/iam/security-credentials/"


async def _refused_url(api: Api, url: str) -> dict[str, Any]:
    err = await api.error(
        "events/subscriptions/create",
        {"tenantId": "acme", "url": url},
        status=400,
        code="INVALID_INPUT",
    )
    assert err["details"]["field"] == "url", (url, err)
    assert err["message"].startswith("url: "), (url, err)
    return err


async def test_a_url_no_delivery_could_reach_is_refused_when_made(api: Api):
    """An operator without an allowlist: an internal address in the URL is refused at once,
    naming the field and the host; a name is not resolved then (its deliveries are checked
    at every attempt), and a public address is taken."""
    api.service.webhook_allowlist = EgressPolicy()
    for url, host in INTERNAL.items():
        err = await _refused_url(api, url)
        assert f"{host} is not a public address" in err["message"], (url, err)
        assert err["details"]["host"] == host
    err = await _refused_url(api, METADATA_URL)
    assert "169.254.169.254 is a cloud metadata address" in err["message"]
    assert await api.rows("event_subscriptions") == 0
    # Names are taken as they are, whether or not they resolve now; so is a public address.
    for url in (URL, "https://receiver.invalid/hook", "http://8.8.8.8/hook"):
        assert (await create(api, url=url))["url"] == url


async def test_the_operators_allowlist_takes_internal_receivers_but_never_metadata(api: Api):
    api.service.webhook_allowlist = EgressPolicy.parse(["127.0.0.1", "10.0.0.0/8", "localhost"])
    for url in ("http://127.0.0.1:8080/hook", "http://10.1.2.3/hook", "http://localhost/hook"):
        assert (await create(api, url=url))["url"] == url
    for url in ("http://192.168.0.10/hook", "http://[::1]:8080/hook"):
        await _refused_url(api, url)
    api.service.webhook_allowlist = EgressPolicy.parse(["169.254.0.0/16"])
    assert (await create(api, url="http://169.254.10.10/hook"))["state"] == "active"
    await _refused_url(api, METADATA_URL)


async def test_a_service_not_told_the_allowlist_refuses_only_metadata_when_made(api: Api):
    """Where the allowlist is not known (``webhook_allowlist`` not given), the early check
    refuses only what no allowlist allows; every delivery still checks with the real one."""
    assert api.service.webhook_allowlist is None
    assert (await create(api, url="http://127.0.0.1:8080/hook"))["state"] == "active"
    await _refused_url(api, METADATA_URL)
    await _refused_url(api, "http://[::ffff:169.254.169.254]/latest/")
