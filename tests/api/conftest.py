"""The real API over a real socket: ``make_app`` on 127.0.0.1 with a random port, in front of a
``ReservationService`` on the test PostgreSQL, called with httpx.

``serve(...)`` starts an app behind ``api.serving.Runner``, and its metrics app
(``api.metrics_server``) on a port of its own, as ``dev`` and the operator do (a different
policy, authenticator, readiness check, body limit or HTTP limits when a test needs one; the
``/metrics`` counts are read afresh on each scrape unless a test asks otherwise). ``Api.client``
calls the API's port, ``Api.metrics`` the metrics port;
``api`` is the default one: Cedar's ``DEFAULT_POLICIES`` (counted), the static tokens of
alice@acme, bob@acme, gina@globex and root-ops@root, and a world with acme's pool of two 8-GPU
nodes and a quota of 16 H100s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web

from bettercompute.api.app import make_app
from bettercompute.api.metrics_server import make_metrics_app
from bettercompute.api.serving import HttpLimits, Runner
from bettercompute.core import ports
from bettercompute.iam import identities
from bettercompute.service.reservations import ReservationService
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database
from tests.support.policies import CountingPolicy
from tests.support.world import World

POOL = "pool_01kacme"
OTHER_POOL = "pool_globex"

CALLERS = {
    "alice": ports.Caller(identity_id="alice", tenant_id="acme"),
    "bob": ports.Caller(identity_id="bob", tenant_id="acme"),
    "gina": ports.Caller(identity_id="gina", tenant_id="globex"),
    "root-ops": ports.Caller(identity_id="root-ops", tenant_id="root"),
}
#: token -> caller; a test names the caller, ``Api.call`` sends that caller's token.
TOKENS = {f"token-of-{name}": who for name, who in CALLERS.items()}


def create_body(**overrides: Any) -> dict[str, Any]:
    """The guide's create example, in acme's pool."""
    body: dict[str, Any] = {
        "tenantId": "acme",
        "poolId": POOL,
        "devices": [{"class": "gpu", "count": 4, "topology": "nvlink-all"}],
        "duration": "8h",
        "idempotencyKey": "train-2026-09-24",
    }
    body.update(overrides)
    return body


@dataclass
class Api:
    base: str
    client: httpx.AsyncClient
    db: Database
    service: ReservationService
    policy: CountingPolicy
    #: The metrics port's client: ``/metrics`` is served there, never on ``base``.
    metrics: httpx.AsyncClient
    headers: dict[str, str] = field(default_factory=lambda: {"X-Better-Compute": "1"})

    async def call(
        self,
        operation: str,
        body: Any = None,
        *,
        who: str | None = "alice",
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """POST ``body`` (JSON) or raw ``content`` to ``/api/compute/<operation>`` as ``who``."""
        sent = dict(self.headers)
        if who is not None:
            sent["Authorization"] = f"Bearer token-of-{who}"
        sent.update(headers or {})
        path = f"/api/compute/{operation}"
        if content is not None:
            return await self.client.post(path, content=content, headers=sent)
        return await self.client.post(path, json=body, headers=sent)

    async def ok(self, operation: str, body: Any, *, who: str = "alice") -> dict[str, Any]:
        """The ``data`` of a call that must succeed."""
        response = await self.call(operation, body, who=who)
        assert response.status_code == 200, response.text
        data: dict[str, Any] = response.json()["data"]
        return data

    async def error(
        self, operation: str, body: Any, *, status: int, code: str, who: str | None = "alice"
    ) -> dict[str, Any]:
        """The ``error`` of a call that must be refused with ``status`` and ``code``."""
        response = await self.call(operation, body, who=who)
        assert response.status_code == status, response.text
        err: dict[str, Any] = response.json()["error"]
        assert err["code"] == code, err
        return err

    async def rows(self, table: str) -> int:
        async with self.db.connection() as conn:
            row = await (await conn.execute(f"SELECT count(*) AS n FROM {table}")).fetchone()
        assert row is not None
        return int(row["n"])


Serve = Callable[..., Awaitable[Api]]


async def build_world(db: Database) -> None:
    await (
        World(db)
        .tenant("acme")
        .tenant("globex")
        .tenant("root", root=True)
        .pool(POOL, owner="acme")
        .pool(OTHER_POOL, owner="globex")
        .nodes(POOL, 2)
        .nodes(OTHER_POOL, 1)
        .quota("acme", "gpu:H100", 16)
        .quota("globex", "gpu:H100", 8)
        .build()
    )


@pytest.fixture
async def serve(db: Database) -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []
    clients: list[httpx.AsyncClient] = []

    async def start(
        *,
        policy: CountingPolicy | None = None,
        authenticator: ports.Authenticator | None = None,
        ready: Callable[[], Awaitable[bool]] | None = None,
        max_body_bytes: int = 1_048_576,
        database: Database | None = None,
        metrics_token: str | None = None,
        metrics_max_age_seconds: float = 0.0,
        limits: HttpLimits | None = None,
    ) -> Api:
        policy = policy or CountingPolicy()
        store = database or db
        service = ReservationService(
            db=store, policy=policy, budget=DatabaseBudget(store), root_tenant_id="root"
        )
        app = make_app(
            service=service,
            authenticator=authenticator or identities.StaticTokenAuthenticator(TOKENS),
            ready=ready,
            max_body_bytes=max_body_bytes,
        )
        base = await listen(app, limits)
        metrics_app = make_metrics_app(
            app, token=metrics_token, max_age_seconds=metrics_max_age_seconds
        )
        metrics_base = await listen(metrics_app, limits)
        client = httpx.AsyncClient(base_url=base, timeout=30)
        metrics = httpx.AsyncClient(base_url=metrics_base, timeout=30)
        clients.extend((client, metrics))
        return Api(base=base, client=client, db=db, service=service, policy=policy, metrics=metrics)

    async def listen(app: web.Application, limits: HttpLimits | None) -> str:
        runner = Runner(app, limits=limits)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    try:
        yield start
    finally:
        for client in clients:
            await client.aclose()
        for runner in runners:
            await runner.cleanup()


@pytest.fixture
async def api(db: Database, serve: Serve) -> Api:
    await build_world(db)
    return await serve()
