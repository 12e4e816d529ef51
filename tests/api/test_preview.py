"""``capacity.preview`` over HTTP: whether a request would fit and where, booking nothing and
deciding nothing; the create's pre-check, pool visibility and class rules still apply."""

from __future__ import annotations

from typing import Any

from tests.api.conftest import POOL, Api, create_body

WRITTEN = ("reservations", "bookings", "allocations", "idempotency", "authz_resources", "outbox")


async def nothing_written(api: Api) -> dict[str, int]:
    return {table: await api.rows(table) for table in WRITTEN}


def preview_body(**overrides: Any) -> dict[str, Any]:
    body = create_body(**overrides)
    body.pop("idempotencyKey")
    return body


async def test_a_request_that_fits_names_nodes_and_devices_and_books_nothing(api: Api):
    before = await nothing_written(api)
    answer = await api.ok("capacity/preview", preview_body())
    assert answer["fits"] is True
    assert answer["message"] == "fits"
    assert answer["rejected"] == {}
    assert answer["poolId"] == POOL
    assert answer["during"]["end"] - answer["during"]["start"] == 8 * 3_600_000
    [node] = answer["nodeIds"]
    [devices] = answer["devices"]
    assert devices["nodeId"] == node
    assert len(devices["deviceIds"]) == 4
    assert all(d.startswith("GPU-") for d in devices["deviceIds"])
    assert await nothing_written(api) == before
    assert api.policy.creates == 0  # no decision


async def test_a_preview_with_an_idempotency_key_is_the_same_answer(api: Api):
    without = await api.ok("capacity/preview", preview_body())
    with_key = await api.ok("capacity/preview", create_body())
    assert with_key["fits"] is without["fits"] is True
    assert with_key["devices"] == without["devices"]
    assert await api.rows("reservations") == 0


async def test_a_request_that_does_not_fit_says_why(api: Api):
    answer = await api.ok(
        "capacity/preview",
        preview_body(devices=[{"class": "gpu", "count": 6, "topology": "nvlink-all"}]),
    )
    assert answer["fits"] is False
    assert answer["nodeIds"] == []
    assert answer["devices"] == []
    # NVLink domains of 4: no wait can help, and the answer says so.
    assert answer["never"] is True
    assert answer["message"] == (
        "never fits this pool: even with every device free, "
        "0 of 2 nodes fit: 2 no NVLink domain with 6 free gpu"
    )
    assert answer["rejected"] == {"topology": 2}
    gang = await api.ok(
        "capacity/preview", preview_body(devices=[{"class": "gpu", "count": 1}], gang={"size": 3})
    )
    assert gang["fits"] is False
    assert gang["rejected"] == {"gang": 1}
    assert await api.rows("bookings") == 0


async def test_a_preview_sees_bookings_in_its_window_only(api: Api):
    eight = [{"class": "gpu", "count": 8}]
    first = await api.ok("reservations/create", create_body(devices=eight, idempotencyKey="a"))
    await api.ok("reservations/create", create_body(devices=eight, idempotencyKey="b"))
    booked = await api.rows("bookings")
    assert booked == 16
    full = await api.ok("capacity/preview", preview_body(devices=[{"class": "gpu", "count": 1}]))
    assert full["fits"] is False
    assert full["rejected"] == {"capacity": 2}
    later = await api.ok(
        "capacity/preview",
        preview_body(devices=[{"class": "gpu", "count": 1}], start=first["during"]["end"]),
    )
    assert later["fits"] is True
    assert later["during"]["start"] == first["during"]["end"]
    assert await api.rows("bookings") == booked


async def test_preview_keeps_creates_rules(api: Api):
    denied = await api.error(
        "capacity/preview", preview_body(), status=403, code="ACCESS_DENIED", who="gina"
    )
    assert "acme" in denied["message"]
    await api.error(
        "capacity/preview", preview_body(poolId="pool_globex"), status=404, code="NOT_FOUND"
    )
    await api.error(
        "capacity/preview", preview_body(poolId="pool_none"), status=404, code="NOT_FOUND"
    )
    wrong_class = await api.error(
        "capacity/preview",
        preview_body(devices=[{"class": "slot", "count": 1}]),
        status=400,
        code="INVALID_INPUT",
    )
    assert wrong_class["details"]["field"] == "devices[0].class"
    k8s = await api.error(
        "capacity/preview", preview_body(binding="kubernetes"), status=400, code="INVALID_INPUT"
    )
    assert k8s["details"]["field"] == "binding"
    await api.error(
        "capacity/preview", preview_body(binding="instance"), status=400, code="UNSUPPORTED"
    )
    unknown = await api.error(
        "capacity/preview", preview_body(dryRun=True), status=400, code="INVALID_INPUT"
    )
    assert unknown["details"]["field"] == "dryRun"
    assert await api.rows("reservations") == 0
