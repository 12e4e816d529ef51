"""schemathesis against a live server, from our own OpenAPI document (issue 10, finding 8).

Every operation is called with data generated from the document, valid and invalid, and the
answers are checked: never a 5xx, every answer (status, content type, body) as the document
describes it, a request the document calls valid never refused with 400, and one it calls
invalid never accepted. The stateful run follows the document's links (create, then get,
extend, renew, release, cancel on the id it answered).

schemathesis calls the server synchronously (``requests``), so the server runs on its own event
loop in a thread, with a database pool of its own, on the test database. Bounded: a few dozen
examples per operation and a short stateful run, about half a minute in all.
"""

from __future__ import annotations

import asyncio
import json
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck, Phase, settings
from schemathesis.specs.openapi.checks import ignored_auth

from bettercompute.api import openapi
from bettercompute.api.app import make_app
from bettercompute.api.serving import Runner
from bettercompute.iam import identities
from bettercompute.service.reservations import ReservationService
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database
from tests.api.conftest import POOL, TOKENS, Api, build_world
from tests.support.policies import CountingPolicy

AUTH = {"Authorization": "Bearer token-of-alice"}
EXAMPLES = 25

# The event stream never ends by itself; tests/api/test_events.py tests it with an SSE client.
schema = schemathesis.openapi.from_dict(openapi.document()).exclude(
    path="/api/compute/events/watch"
)
# The stateful run follows the reservations' links; the webhook and confirmation operations (no
# links, covered by the stateless run) would take its few steps away from them.
STATEFUL = schema.exclude(path_regex=r"^/api/compute/(events|confirmations)/")
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)
#: Requests sent, for the report at the end of the module.
SENT = {"requests": 0}


class LiveServer:
    """The API on 127.0.0.1:<random>, served from a thread with its own loop and pool."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="schemathesis-server")
        self._runner: Runner | None = None
        self._db: Database | None = None

    def __enter__(self) -> LiveServer:
        self._thread.start()
        assert self._started.wait(30), "the live server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._started.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._db = await Database.open(self.dsn, min_size=1, max_size=8, migrate=False)
        service = ReservationService(
            db=self._db,
            policy=CountingPolicy(),
            budget=DatabaseBudget(self._db),
            root_tenant_id="root",
        )
        app = make_app(service=service, authenticator=identities.StaticTokenAuthenticator(TOKENS))
        self._runner = Runner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._db is not None:
            await self._db.close()


@pytest.fixture
async def world(db: Database) -> Database:
    await build_world(db)
    return db


@pytest.fixture
def live(world: Database, pg_dsn: str) -> Iterator[LiveServer]:
    with LiveServer(pg_dsn) as server:
        yield server


def _half(body: dict[str, Any]) -> bool:
    return zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode()) % 2 == 1


def _in_acme(case: Any) -> None:
    # Most generated tenant ids are refused at the tenant pre-check (403) after validation;
    # half the valid bodies go to alice's own tenant (and a create to its pool) instead, so
    # they reach the service, the database and the placer.
    body = case.body
    # Which half is decided by the body itself, never by the case's random id: the stateful
    # run replays drawn cases, and a replay must get the same answer, or hypothesis reports
    # FlakyStrategyDefinition (a rule enabled once and not on the replay).
    if isinstance(body, dict) and isinstance(body.get("tenantId"), str) and _half(body):
        body["tenantId"] = "acme"
        if isinstance(body.get("poolId"), str) and isinstance(body.get("devices"), list):
            # acme's pool books whole GPUs and has no Kubernetes or node profiles: a request
            # for anything else is refused for the pool's sake (400, state the document
            # cannot know), so the redirected request asks for what the pool offers.
            body["poolId"] = POOL
            body["binding"] = "hold"
            body.pop("node", None)
            for device in body["devices"]:
                if isinstance(device, dict):
                    device["class"] = "gpu"
                    device.pop("profile", None)


@schema.parametrize()
@SETTINGS
def test_every_operation_answers_as_documented(case: Any, live: LiveServer) -> None:
    if case.meta is not None and case.meta.generation.mode.is_positive:
        _in_acme(case)
    SENT["requests"] += 1
    case.call_and_validate(base_url=live.url, headers=AUTH, timeout=10)


def test_stateful_runs_follow_the_links(live: LiveServer) -> None:
    answered: list[tuple[str, int]] = []

    class Calls(STATEFUL.as_state_machine()):  # type: ignore[misc]
        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"base_url": live.url, "timeout": 10}

        def before_call(self, case: Any) -> None:
            # The state machine sends neither the required header the document declares nor
            # the credential given as a call argument; they go into the case itself.
            case.headers = {**(case.headers or {}), **AUTH, "X-Better-Compute": "1"}
            _in_acme(case)
            SENT["requests"] += 1

        def validate_response(self, response: Any, case: Any, **kwargs: Any) -> None:
            # ignored_auth replays the case without its credential, which now lives in the
            # case; the stateless test above checks authentication.
            case.validate_response(response, excluded_checks=[ignored_auth])

        def after_call(self, response: Any, case: Any) -> None:
            answered.append((case.operation.path, response.status_code))

        def setup(self) -> None:
            # Every scenario starts from the same state: what the ones before it booked is
            # released, so acme's quota and GPUs are free again. Otherwise a replayed prefix
            # meets a fuller pool, a create that was admitted is refused, the links it fed
            # are empty, and hypothesis reports FlakyStrategyDefinition.
            _release_everything_of_acme(live.url)

    # No shrinking: the state machine's steps depend on the server's answers, so replaying a
    # failure to shrink it can draw differently and hypothesis then reports only
    # FlakyStrategyDefinition, hiding the failure itself. Unshrunk, the failure is reported.
    Calls.run(
        settings=settings(
            SETTINGS,
            max_examples=15,
            stateful_step_count=6,
            phases=[Phase.explicit, Phase.reuse, Phase.generate],
        )
    )
    ok = sum(status == 200 for _, status in answered)
    print(
        f"\nschemathesis sent {SENT['requests']} requests in this module "
        f"({len(answered)} stateful, {ok} of them answered 200)"
    )
    # The links led somewhere: a reservation created in a run was then found by its id.
    followed = {path for path, status in answered if status == 200}
    assert "/api/compute/reservations/create" in followed, answered
    assert followed & {
        f"/api/compute/reservations/{verb}"
        for verb in ("get", "extend", "renew", "release", "cancel")
    }, answered


def _release_everything_of_acme(url: str) -> None:
    headers = {**AUTH, "X-Better-Compute": "1"}
    page: dict[str, Any] = {"tenantId": "acme", "limit": 200}
    with httpx.Client(base_url=url, headers=headers, timeout=10) as http:
        while True:
            answer = http.post("/api/compute/reservations/list", json=page)
            answer.raise_for_status()
            listed = answer.json()["data"]
            for item in listed["items"]:
                if item["state"] in ("placed", "pending", "binding", "active"):
                    http.post(
                        "/api/compute/reservations/release",
                        json={"tenantId": "acme", "reservationId": item["id"]},
                    ).raise_for_status()
            if not listed["nextCursor"]:
                return
            page["cursor"] = listed["nextCursor"]


DOCUMENT = openapi.document()


def _valid_by_document(operation: str, body: dict[str, Any]) -> bool:
    schemas = DOCUMENT["components"]["schemas"]
    name = {"reservations/list": "ListInput", "reservations/extend": "ExtendInput"}[operation]
    validator = jsonschema.Draft202012Validator(
        {**schemas[name], "$defs": schemas},
    )
    return validator.is_valid(body)


@pytest.mark.parametrize(
    ("operation", "body", "status"),
    [
        # The examples: schemathesis found the document and the server disagreeing.
        ("reservations/list", {"tenantId": "acme", "limit": 168.0}, 200),
        ("reservations/list", {"tenantId": "acme", "limit": 168.5}, 400),
        ("reservations/list", {"tenantId": "acme", "state": "nonsense"}, 400),
        ("reservations/extend", {"by": None, "until": None}, 400),
        ("reservations/extend", {"by": "2h", "until": 1}, 400),
        ("reservations/extend", {"by": "0h"}, 400),
        ("reservations/extend", {"by": 7_200_000.0, "until": None}, 404),
    ],
)
async def test_the_document_and_the_server_agree(
    api: Api, operation: str, body: dict[str, Any], status: int
):
    if operation == "reservations/extend":
        body = {"tenantId": "acme", "reservationId": "rsv_x", "idempotencyKey": "k", **body}
    response = await api.call(operation, body)
    assert response.status_code == status, response.text
    # 404: valid, but no such reservation.
    assert _valid_by_document(operation, body) == (status != 400)
