"""The routes without a credential: the OpenAPI document, health, readiness and metrics.

Metrics are served on a port of their own (``api.metrics_server``, ``Api.metrics``), never on
the API's (``Api.client``): their figures name every tenant."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

from bettercompute.api import errors
from bettercompute.core import requests
from bettercompute.core.errors import ErrorCode
from bettercompute.store.database import Database
from tests.api.conftest import POOL, Api, Serve, build_world, create_body

OPERATION_PATHS = {
    "/api/compute/reservations/create": "CreateInput",
    "/api/compute/reservations/get": "GetInput",
    "/api/compute/reservations/list": "ListInput",
    "/api/compute/reservations/release": "ReleaseInput",
    "/api/compute/reservations/cancel": "CancelInput",
    "/api/compute/reservations/extend": "ExtendInput",
    "/api/compute/reservations/renew": "RenewInput",
    "/api/compute/capacity/preview": "PreviewInput",
    "/api/compute/capacity/search": "SearchInput",
    "/api/compute/pools/list": "PoolsInput",
    "/api/compute/quotas/get": "QuotasInput",
    "/api/compute/usage/report": "UsageReportInput",
    "/api/compute/whoami": "WhoamiInput",
    "/api/compute/events/subscriptions/create": "SubscriptionCreateInput",
    "/api/compute/events/subscriptions/list": "SubscriptionListInput",
    "/api/compute/events/subscriptions/delete": "SubscriptionDeleteInput",
    "/api/compute/events/deliveries/list": "DeliveryListInput",
    "/api/compute/confirmations/list": "ConfirmationListInput",
    "/api/compute/confirmations/approve": "ConfirmationDecisionInput",
    "/api/compute/confirmations/deny": "ConfirmationDecisionInput",
    "/api/compute/pools/timeline": "TimelineInput",
    "/api/compute/reservations/history": "HistoryInput",
}


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for value in node.values() for r in refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in refs(value)]
    return []


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        node = node[part]
    return node


# --- OpenAPI -----------------------------------------------------------------------------------


async def test_the_openapi_document_describes_every_operation(api: Api):
    response = await api.client.get("/api/compute/openapi.json")  # no credential, no header
    assert response.status_code == 200
    doc = response.json()
    assert doc["openapi"] == "3.1.0"
    assert doc["info"]["title"] == "Better Compute"
    assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    header = doc["components"]["parameters"]["XBetterCompute"]
    assert (header["name"], header["in"], header["required"]) == (
        "X-Better-Compute",
        "header",
        True,
    )
    posts = {path for path, item in doc["paths"].items() if "post" in item}
    assert posts == set(OPERATION_PATHS)
    for path, schema_name in OPERATION_PATHS.items():
        post = doc["paths"][path]["post"]
        assert post["security"] == [{"bearer": []}]
        assert {"$ref": "#/components/parameters/XBetterCompute"} in post["parameters"]
        body = post["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{schema_name}"}
        ok = post["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok["required"] == ["data"]
        for status in ("400", "401", "403", "404", "409", "413", "429", "500"):
            error = resolve(doc, post["responses"][status]["$ref"])
            schema = error["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/Error"}
    # Every reference resolves.
    for ref in refs(doc):
        assert resolve(doc, ref) is not None


def test_only_answers_that_carry_retry_after_ask_a_generic_client_to_retry():
    # 429 and 503 are what HTTP libraries and proxies retry; only TOO_MANY_REQUESTS and
    # UNAVAILABLE use them, always with Retry-After (tests/api/test_fairness.py, test_http.py).
    assert not {429, 503} & set(errors.STATUS.values())
    assert errors.STATUS[ErrorCode.QUOTA_EXCEEDED] == 403
    assert errors.STATUS[ErrorCode.CAPACITY_UNAVAILABLE] == 409


async def test_the_openapi_document_says_which_code_each_status_carries(api: Api):
    doc = (await api.client.get("/api/compute/openapi.json")).json()
    said = {
        status: resolve(doc, ref)["description"]
        for status, ref in (
            (s, doc["paths"]["/api/compute/reservations/create"]["post"]["responses"][s]["$ref"])
            for s in ("403", "409", "429", "503")
        )
    }
    assert "QUOTA_EXCEEDED" in said["403"]
    assert "CAPACITY_UNAVAILABLE" in said["409"]
    assert "TOO_MANY_REQUESTS" in said["429"]
    assert "QUOTA_EXCEEDED" not in said["429"]
    assert "UNAVAILABLE" in said["503"]
    assert "CAPACITY_UNAVAILABLE" not in said["503"]


async def test_the_request_schemas_are_the_models(api: Api):
    doc = (await api.client.get("/api/compute/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    create = requests.CreateInput.model_json_schema(by_alias=True)
    assert schemas["CreateInput"]["required"] == create["required"]
    assert set(schemas["CreateInput"]["properties"]) == set(create["properties"])
    assert schemas["CreateInput"]["additionalProperties"] is False
    assert "class" in schemas["DeviceRequest"]["properties"]  # by alias
    assert "idempotencyKey" not in schemas["PreviewInput"]["required"]
    assert set(schemas["PreviewInput"]["properties"]) == set(create["properties"])
    assert schemas["Error"]["properties"]["error"] == {"$ref": "#/components/schemas/ErrorBody"}
    codes = schemas["ErrorBody"]["properties"]["code"]["enum"]
    assert set(codes) == set(errors.CODES)
    assert {"Reservation", "ReservationList", "ExtendResult", "Preview"} <= set(schemas)


# --- health and readiness ----------------------------------------------------------------------


async def test_healthz_and_readyz(api: Api):
    health = await api.client.get("/healthz")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    ready = await api.client.get("/readyz")
    assert (ready.status_code, ready.json()) == (200, {"status": "ready"})


async def test_readyz_awaits_the_readiness_check(db: Database, serve: Serve):
    state = {"ready": False}

    async def ready() -> bool:
        if state.get("explode"):
            raise RuntimeError("cannot tell")
        return state["ready"]

    api = await serve(ready=ready)
    assert (await api.client.get("/readyz")).status_code == 503
    assert (await api.client.get("/readyz")).json() == {"status": "not ready"}
    state["ready"] = True
    assert (await api.client.get("/readyz")).status_code == 200
    state["explode"] = True
    assert (await api.client.get("/readyz")).status_code == 503
    assert (await api.client.get("/healthz")).status_code == 200  # alive all along


# --- metrics -----------------------------------------------------------------------------------


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in the Prometheus text format, or None when absent."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(3) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(4))
    return None


async def test_the_api_port_serves_no_metrics_to_anyone(api: Api):
    await api.ok("reservations/create", create_body())
    # The figures exist, every tenant's among them, on the metrics port...
    figures = (await api.metrics.get("/metrics")).text
    assert sample(figures, "bettercompute_quota_used", tenant="acme", resource="gpu:H100") == 4
    assert sample(figures, "bettercompute_quota_limit", tenant="globex", resource="gpu:H100") == 8
    # ...and a tenant asking the API's port for them, however it asks, finds no such route.
    tenant = {**api.headers, "Authorization": "Bearer token-of-gina"}
    for method, headers in (("GET", tenant), ("GET", {}), ("POST", tenant), ("HEAD", tenant)):
        for path in ("/metrics", "/metrics/", "/api/compute/metrics"):
            answer = await api.client.request(method, path, headers=headers)
            assert answer.status_code == 404, (method, path, answer.status_code)
            assert "bettercompute_" not in answer.text
            assert "tenant=" not in answer.text
            if method != "HEAD":
                assert answer.json()["error"]["code"] == "NOT_FOUND"
    document = (await api.client.get("/api/compute/openapi.json")).json()
    assert not [path for path in document["paths"] if "metrics" in path]


async def test_the_metrics_port_serves_metrics_and_nothing_else(api: Api):
    for method, path in (
        ("GET", "/healthz"),
        ("GET", "/readyz"),
        ("GET", "/api/compute/openapi.json"),
        ("POST", "/api/compute/reservations/create"),
        ("GET", "/api/compute/events/watch?tenantId=acme"),
    ):
        headers = {**api.headers, "Authorization": "Bearer token-of-alice"}
        refused = await api.metrics.request(method, path, headers=headers, json=create_body())
        assert refused.status_code == 404, (method, path)
        assert refused.json()["error"]["code"] == "NOT_FOUND"
        assert refused.headers["Server"] == errors.SERVER
    wrong = await api.metrics.post("/metrics")
    assert wrong.status_code == 405
    assert wrong.json()["error"]["details"]["field"] == "method"
    assert (await api.metrics.get("/metrics")).headers["Server"] == errors.SERVER


async def test_metrics_count_operations_and_read_the_database(api: Api):
    before = await api.metrics.get("/metrics")
    assert before.status_code == 200
    assert before.headers["Content-Type"].startswith("text/plain")
    text = before.text
    for name in (
        "bettercompute_api_operations_total",
        "bettercompute_api_request_duration_seconds",
        "bettercompute_reservations",
        "bettercompute_work_queue_depth",
        "bettercompute_work_queue_due",
        "bettercompute_database_up",
        "bettercompute_decision_duration_seconds",
        "bettercompute_placement_duration_seconds",
        "bettercompute_gpus",
        "bettercompute_quota_used",
        "bettercompute_quota_limit",
        "bettercompute_reservation_wait_seconds",
    ):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert "_created" not in text  # no creation-timestamp series
    [build] = [line for line in text.splitlines() if line.startswith("bettercompute_build_info")]
    assert build.endswith(" 1.0")
    assert 'version="' in build
    created = "bettercompute_api_operations_total"
    assert sample(text, created, operation="reservations.create", outcome="placed") is None
    assert sample(text, "bettercompute_reservations", pool=POOL, state="placed") == 0
    assert sample(text, "bettercompute_database_up") == 1
    gpus = {"pool": POOL, "model": "H100"}
    assert sample(text, "bettercompute_gpus", **gpus, state="free") == 16
    assert sample(text, "bettercompute_gpus", **gpus, state="booked") == 0
    quota = {"tenant": "acme", "resource": "gpu:H100"}
    assert sample(text, "bettercompute_quota_limit", **quota) == 16
    assert sample(text, "bettercompute_quota_used", **quota) == 0

    await api.ok("reservations/create", create_body())
    await api.error(
        "reservations/get",
        {"tenantId": "acme", "reservationId": "rsv_x"},
        status=404,
        code="NOT_FOUND",
    )
    after = (await api.metrics.get("/metrics")).text
    assert sample(after, created, operation="reservations.create", outcome="placed") == 1
    assert sample(after, created, operation="reservations.get", outcome="NOT_FOUND") == 1
    assert sample(after, "bettercompute_reservations", pool=POOL, state="placed") == 1
    assert sample(after, "bettercompute_gpus", **gpus, state="booked") == 4
    assert sample(after, "bettercompute_gpus", **gpus, state="free") == 12
    assert sample(after, "bettercompute_quota_used", **quota) == 4
    # The wait that ended since the last scrape: one placement, observed once.
    waited = {"pool": POOL, "phase": "placed"}
    assert sample(after, "bettercompute_reservation_wait_seconds_count", **waited) == 1
    again = (await api.metrics.get("/metrics")).text
    assert sample(again, "bettercompute_reservation_wait_seconds_count", **waited) == 1
    assert (sample(after, "bettercompute_work_queue_depth") or 0) >= 1
    count = sample(
        after,
        "bettercompute_api_request_duration_seconds_count",
        route="/api/compute/reservations/create",
    )
    assert count == 1
    # The service told the app how long its decision and its placement took.
    decided = sample(
        after,
        "bettercompute_decision_duration_seconds_count",
        action="compute:reservations:create",
        decision="allow",
    )
    assert decided == 1
    placed = sample(after, "bettercompute_placement_duration_seconds_count", outcome="placed")
    assert placed == 1
    await api.client.post("/no/such/route")
    unmatched = (await api.metrics.get("/metrics")).text
    assert (
        sample(unmatched, "bettercompute_api_request_duration_seconds_count", route="unmatched")
        == 1
    )


async def test_each_app_has_its_own_registry(db: Database, serve: Serve):
    await build_world(db)
    first, second = await serve(), await serve()
    await first.ok("reservations/create", create_body())
    name = "bettercompute_api_operations_total"
    labels = {"operation": "reservations.create", "outcome": "placed"}
    assert sample((await first.metrics.get("/metrics")).text, name, **labels) == 1
    assert sample((await second.metrics.get("/metrics")).text, name, **labels) is None


async def test_metrics_survive_an_unreachable_database(db: Database, serve: Serve, pg_dsn: str):
    closed = await Database.open(pg_dsn, min_size=1, max_size=1, migrate=False)
    await closed.close()
    api = await serve(database=closed)
    response = await api.metrics.get("/metrics")
    assert response.status_code == 200
    assert sample(response.text, "bettercompute_database_up") == 0


async def test_readyz_answers_within_a_second_when_the_check_hangs(db: Database, serve: Serve):
    async def hangs() -> bool:
        await asyncio.sleep(30)
        return True

    api = await serve(ready=hangs)
    started = time.monotonic()
    ready = await api.client.get("/readyz")
    assert time.monotonic() - started < 1.2
    assert (ready.status_code, ready.json()) == (503, {"status": "not ready"})
    started = time.monotonic()
    assert (await api.client.get("/healthz")).status_code == 200
    assert time.monotonic() - started < 1


async def test_metrics_can_need_a_bearer_token(db: Database, serve: Serve):
    api = await serve(metrics_token="scrape-me")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic scrape-me"}):
        refused = await api.metrics.get("/metrics", headers=headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "ACCESS_DENIED"
        assert "bettercompute_" not in refused.text
    # A tenant's own bearer token is no metrics token.
    tenant = await api.metrics.get("/metrics", headers={"Authorization": "Bearer token-of-alice"})
    assert tenant.status_code == 401
    allowed = await api.metrics.get("/metrics", headers={"Authorization": "Bearer scrape-me"})
    assert allowed.status_code == 200
    assert sample(allowed.text, "bettercompute_database_up") == 1
    # Without a token configured, /metrics stays open (the default).
    open_api = await serve()
    assert (await open_api.metrics.get("/metrics")).status_code == 200


async def test_metrics_read_the_database_at_most_once_per_max_age(db: Database, serve: Serve):
    await build_world(db)
    api = await serve(metrics_max_age_seconds=60)
    placed = {"state": "placed"}
    scrapes = await asyncio.gather(*(api.metrics.get("/metrics") for _ in range(5)))
    assert {sample(s.text, "bettercompute_reservations", **placed) for s in scrapes} == {0}
    await api.ok("reservations/create", create_body())
    # The reservation is there, but a scrape within the minute shows the figures it read.
    cached = (await api.metrics.get("/metrics")).text
    assert sample(cached, "bettercompute_reservations", **placed) == 0
    # The counters kept in the process are live all the same.
    created = sample(
        cached,
        "bettercompute_api_operations_total",
        operation="reservations.create",
        outcome="placed",
    )
    assert created == 1
    fresh = await serve(metrics_max_age_seconds=0)
    assert (
        sample((await fresh.metrics.get("/metrics")).text, "bettercompute_reservations", **placed)
        == 1
    )
