"""The HTTP API the operator serves beside its handlers, with TokenReview authentication.

Why it exists: the CLI talks to a cluster through this API, and its callers are whoever the
Kubernetes API server vouches for (``operator/authenticating.py``). The tokens live in the
stand-in's TokenReview table; the calls go over a real socket to the running operator, and
what they did is read back from the store.

What it must never do: authenticate by any other means than the stand-in's TokenReview.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from bettercompute.operator.running import Operator
from bettercompute.store.database import Database
from tests.operator.conftest import World, apply_world, free_port
from tests.support.kubeserver import KubeApi

ALICE = {"username": "alice@acme", "uid": "u1", "groups": ["bcd.dev:tenant:acme", "ml-team"]}


def create_body(**overrides: Any) -> dict[str, Any]:
    """The guide's create example, in the world's pool."""
    body: dict[str, Any] = {
        "tenantId": "acme",
        "poolId": "h100",
        "devices": [{"class": "gpu", "count": 4, "topology": "nvlink-all"}],
        "duration": "8h",
        "idempotencyKey": "train-2026-09-24",
    }
    body.update(overrides)
    return body


class Client:
    """The operator's HTTP API, called with a bearer token as the CLI does."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def call(self, operation: str, body: Any, *, token: str) -> httpx.Response:
        return await self.http.post(
            f"/api/compute/{operation}",
            json=body,
            headers={
                "Authorization": f"Bearer {token}",
                "Content-Type": "application/json",
                "X-Better-Compute": "1",
            },
        )

    async def ok(self, operation: str, body: Any, *, token: str) -> dict[str, Any]:
        response = await self.call(operation, body, token=token)
        assert response.status_code == 200, response.text
        data: dict[str, Any] = response.json()["data"]
        return data

    async def error(self, operation: str, body: Any, *, token: str, status: int) -> dict:
        response = await self.call(operation, body, token=token)
        assert response.status_code == status, response.text
        error: dict[str, Any] = response.json()["error"]
        return error


async def _reservations(world: World) -> int:
    """Reservations stored, drafts included: a refused call must leave none."""
    async with world.db.connection() as conn:
        row = await (await conn.execute("SELECT count(*) AS n FROM reservations")).fetchone()
    assert row is not None
    return int(row["n"])


@pytest.fixture
async def client(operator: Operator, kube_api: KubeApi) -> AsyncIterator[Client]:
    kube_api.tokens["token-of-alice"] = ALICE
    async with httpx.AsyncClient(base_url=operator.url, timeout=5.0) as http:
        yield Client(http)


async def test_a_reviewed_token_creates_and_lists_reservations(
    world: World, client: Client, operator: Operator
):
    data = await client.ok("reservations/create", create_body(), token="token-of-alice")
    assert data["state"] == "placed"
    assert (data["tenantId"], data["poolId"]) == ("acme", "h100")
    assert data["ownerIdentityId"] == "alice@acme"
    listed = await client.ok(
        "reservations/list", {"tenantId": "acme", "scope": "mine"}, token="token-of-alice"
    )
    assert [r["id"] for r in listed["items"]] == [data["id"]]
    stored = await operator.runtime.service.snapshot(data["id"])
    assert stored is not None
    assert (stored["state"], stored["ownerIdentityId"]) == ("placed", "alice@acme")
    async with world.db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT count(*) AS n FROM bookings WHERE reservation_id = %s", (data["id"],)
            )
        ).fetchone()
    assert row is not None
    assert row["n"] == 4


async def test_an_unknown_token_is_401(world: World, client: Client, operator: Operator):
    error = await client.error(
        "reservations/create", create_body(), token="token-nobody-issued", status=401
    )
    assert error["code"] == "ACCESS_DENIED"
    assert "token" in error["message"]
    assert await _reservations(world) == 0


async def test_a_user_in_no_tenant_group_is_401(
    world: World, client: Client, kube_api: KubeApi, operator: Operator
):
    kube_api.tokens["token-of-carol"] = {
        "username": "carol@acme",
        "uid": "u3",
        "groups": ["system:authenticated", "ml-team", "bcd.dev:tenants:acme"],
    }
    error = await client.error(
        "reservations/create", create_body(), token="token-of-carol", status=401
    )
    assert error["code"] == "ACCESS_DENIED"
    assert await _reservations(world) == 0


async def test_a_caller_of_one_tenant_cannot_act_in_another(
    world: World, client: Client, operator: Operator
):
    error = await client.error(
        "reservations/create",
        create_body(tenantId="globex"),
        token="token-of-alice",
        status=403,
    )
    assert error["code"] == "ACCESS_DENIED"
    listed = await client.call(
        "reservations/list", {"tenantId": "globex", "scope": "all"}, token="token-of-alice"
    )
    assert listed.status_code == 403, listed.text
    assert await _reservations(world) == 0


async def test_a_service_account_token_is_a_service_caller(
    world: World, client: Client, kube_api: KubeApi, operator: Operator
):
    kube_api.tokens["token-of-ci"] = {
        "username": "system:serviceaccount:ml:ci",
        "uid": "u4",
        "groups": ["system:serviceaccounts", "bcd.dev:tenant:acme"],
    }
    data = await client.ok("reservations/create", create_body(), token="token-of-ci")
    assert data["ownerIdentityId"] == "system:serviceaccount:ml:ci"
    assert data["tenantId"] == "acme"


async def test_the_probes_answer_once_ready_and_readyz_follows_the_parts(operator: Operator):
    async with httpx.AsyncClient(base_url=operator.url, timeout=5.0) as http:
        health = await http.get("/healthz")
        ready = await http.get("/readyz")
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
        # A part of the operator that stopped makes it not ready; alive it still is.
        events = next(t for t in operator.tasks if t.get_name() == "events")
        events.cancel()
        await asyncio.gather(events, return_exceptions=True)
        ready = await http.get("/readyz")
        assert (ready.status_code, ready.json()) == (503, {"status": "not ready"})
        assert (await http.get("/healthz")).status_code == 200


async def test_metrics_are_served_on_the_metrics_port_and_never_on_the_apis(
    kube_api: KubeApi, db: Database, start_operator: Any, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("BETTER_COMPUTE_METRICS_TOKEN", "scrape-me")
    port = free_port()
    kube_api.tokens["token-of-alice"] = ALICE
    async with (
        start_operator(metrics_port=port) as operator,
        httpx.AsyncClient(base_url=operator.url, timeout=5.0) as http,
        httpx.AsyncClient(base_url=operator.metrics_url, timeout=5.0) as scraper,
    ):
        assert operator.metrics_url == f"http://127.0.0.1:{port}"
        await apply_world(kube_api, db)
        await Client(http).ok("reservations/create", create_body(), token="token-of-alice")
        # A tenant on the API's port: no such route, and no figure of anyone's.
        for headers in ({"Authorization": "Bearer token-of-alice"}, {}):
            refused = await http.get("/metrics", headers=headers)
            assert refused.status_code == 404
            assert refused.json()["error"]["code"] == "NOT_FOUND"
            assert "bettercompute_" not in refused.text
        # The metrics port: the token it was given, and then every figure.
        for headers in ({}, {"Authorization": "Bearer token-of-alice"}):
            assert (await scraper.get("/metrics", headers=headers)).status_code == 401
        scraped = await scraper.get("/metrics", headers={"Authorization": "Bearer scrape-me"})
        assert scraped.status_code == 200
        assert 'bettercompute_quota_used{resource="gpu:H100",tenant="acme"} 4.0' in scraped.text
        # The probes stay on the API's port (the chart's probes call them there).
        assert (await http.get("/readyz")).status_code == 200
        assert (await scraper.get("/readyz")).status_code == 404
