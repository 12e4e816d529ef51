"""PostgreSQL going away under the real API: stopped, frozen (SIGSTOP) and a one-second blip.

The stack is the one ``dev`` and the operator compose (the API over a real socket, the
reconciler and event delivery under the supervisor, ``/readyz`` asking the database), on an
embedded PostgreSQL of this module's own: the tests stop and freeze it, so never the session's.

While the database is away every request is answered within 3 s, with 503 ``UNAVAILABLE`` and
``Retry-After`` (never a 500), and ``/readyz`` says 503 within 1 s; once it is back everything
recovers by itself: ready again, a create succeeds, the reconciler and event delivery run again,
and every create acknowledged before or during the outage is still there.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from aiohttp import web

from bettercompute import supervising
from bettercompute.api.app import make_app
from bettercompute.core import ports
from bettercompute.core.errors import StoreError
from bettercompute.iam import identities, policies
from bettercompute.service.events import EventDelivery
from bettercompute.service.reconciling import Reconciler
from bettercompute.service.reservations import ReservationService
from bettercompute.store import batching
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database, Limits
from bettercompute.store.embedded import EmbeddedPostgres
from tests.support.world import World

POOL = "pool_outage"
TOKEN = "token-of-alice"
HEADERS = {"Authorization": f"Bearer {TOKEN}", "X-Better-Compute": "1"}
#: What the issue asks for, with no slack: a request's answer and a readiness probe's.
REQUEST_BOUND_S = 3.0
PROBE_BOUND_S = 1.0
HOUR_MS = 3_600_000
#: A start well ahead (epoch milliseconds, on the hour).
FAR_MS = (int(time.time() * 1000) // HOUR_MS + 24 * 20) * HOUR_MS


@dataclass
class Stack:
    pg: EmbeddedPostgres
    db: Database
    client: httpx.AsyncClient
    tasks: list[asyncio.Task[None]]
    #: Subjects of the outbox events delivered to this test's subscriber.
    delivered: list[str] = field(default_factory=list)

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """Every process of the server stopped (SIGSTOP), as a hung machine would be."""
        family = _family(self.pg)
        for each in family:
            each.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            for each in family:
                each.send_signal(signal.SIGCONT)

    async def restart(self) -> None:
        """Start PostgreSQL again, as ``dev``'s watchdog or a supervisor would."""
        deadline = time.monotonic() + 20
        while True:
            try:
                await asyncio.to_thread(self.pg.restart)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.3)


def _family(pg: EmbeddedPostgres) -> list[psutil.Process]:
    assert pg.pid is not None
    server = psutil.Process(pg.pid)
    return [server, *server.children(recursive=True)]


@pytest.fixture(scope="module")
async def stack() -> AsyncIterator[Stack]:
    root = Path(tempfile.mkdtemp(prefix="bc-outage-"))
    await asyncio.to_thread(root.chmod, 0o755)  # the server's own user must get in
    pg = await asyncio.to_thread(EmbeddedPostgres, root / "data", delete_on_stop=True)
    try:
        db = await Database.open(pg.dsn, min_size=2, max_size=10)
        await (
            World(db)
            .tenant("acme")
            .tenant("root", root=True)
            .pool(POOL, owner="acme")
            .nodes(POOL, 2)
            .quota("acme", "gpu:H100", 100_000)
            .build()
        )
        service = ReservationService(
            db=db,
            policy=policies.CedarPolicyEngine.from_text(policies.DEFAULT_POLICIES),
            budget=DatabaseBudget(db),
            root_tenant_id="root",
        )
        delivered: list[str] = []

        async def record(event: dict[str, Any]) -> None:
            delivered.append(str(event.get("subject")))

        events = EventDelivery(db, subscriber="outage-test", handler=record, poll_s=1.0)
        tasks = [
            supervising.restarting(Reconciler(db).run, name="reconciler"),
            supervising.restarting(events.run, name="events"),
        ]

        async def ready() -> bool:
            return not any(t.done() for t in tasks) and await db.reachable()

        app = make_app(
            service=service,
            authenticator=identities.StaticTokenAuthenticator(
                {TOKEN: ports.Caller(identity_id="alice", tenant_id="acme")}
            ),
            ready=ready,
        )
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        client = httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=30)
        try:
            yield Stack(pg=pg, db=db, client=client, tasks=tasks, delivered=delivered)
        finally:
            await client.aclose()
            await runner.cleanup()
            await supervising.cancel(tasks)
            await db.close()
    finally:
        await asyncio.to_thread(pg.stop)
        shutil.rmtree(root, ignore_errors=True)


async def timed(call: Awaitable[httpx.Response]) -> tuple[httpx.Response, float]:
    began = time.monotonic()
    response = await call
    return response, time.monotonic() - began


def create(stack: Stack, key: str, *, start: int | None = None) -> Awaitable[httpx.Response]:
    body: dict[str, Any] = {
        "tenantId": "acme",
        "poolId": POOL,
        "devices": [{"class": "gpu", "count": 1}],
        "duration": "1h",
        "idempotencyKey": key,
    }
    if start is not None:
        body["start"] = start
    return stack.client.post("/api/compute/reservations/create", json=body, headers=HEADERS)


def get(stack: Stack, rid: str) -> Awaitable[httpx.Response]:
    body = {"tenantId": "acme", "reservationId": rid}
    return stack.client.post("/api/compute/reservations/get", json=body, headers=HEADERS)


def assert_unavailable(response: httpx.Response, seconds: float, *, slack: float = 0.0) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "UNAVAILABLE", response.text
    assert int(response.headers["Retry-After"]) > 0
    assert seconds < REQUEST_BOUND_S + slack, f"answered after {seconds:.2f} s (slack {slack:.2f})"


class LoopStalls:
    """The longest time this test's event loop could not run anything, and the longest a plain
    thread of this process could not (``starved``).

    Client, server, reconciler and PostgreSQL's restart share one loop and a small machine: a
    stall of the loop delays the client's reading of an answer the server already sent, which
    a client of its own would not see. Only that stall is forgiven, never the server's time.
    A thread beside the loop tells the two causes apart: a call that blocks the loop (a
    synchronous read, a sleep) lets the thread run on, while a machine too busy to schedule
    this process stalls both alike.
    """

    def __init__(self) -> None:
        self.longest = 0.0
        self.starved = 0.0
        self._task: asyncio.Task[None] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="loop-stalls", daemon=True)

    async def _watch(self) -> None:
        while True:
            began = time.monotonic()
            await asyncio.sleep(0.01)
            self.longest = max(self.longest, time.monotonic() - began - 0.01)

    def _tick(self) -> None:
        while True:
            began = time.monotonic()
            if self._stop.wait(0.01):
                return
            self.starved = max(self.starved, time.monotonic() - began - 0.01)

    @property
    def blocked(self) -> float:
        """How much longer the loop stalled than the machine starved the whole process."""
        return max(0.0, self.longest - self.starved)

    def __enter__(self) -> LoopStalls:
        self._task = asyncio.get_running_loop().create_task(self._watch())
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()
        self._stop.set()
        self._thread.join()


async def assert_not_ready(stack: Stack) -> None:
    response, seconds = await timed(stack.client.get("/readyz"))
    assert response.status_code == 503, response.text
    assert seconds < PROBE_BOUND_S, f"/readyz answered after {seconds:.2f} s"


async def eventually(check: Callable[[], Awaitable[bool]], *, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.2)
    return await check()


async def ready_again(stack: Stack) -> bool:
    async def ready() -> bool:
        return (await stack.client.get("/readyz")).status_code == 200

    return await eventually(ready, seconds=15)


async def acknowledged(stack: Stack, key: str) -> str:
    response = await create(stack, key)
    assert response.status_code == 200, response.text
    return str(response.json()["data"]["id"])


async def assert_recovered(stack: Stack, *, kept: list[str], key: str) -> None:
    """Ready again by itself; a create succeeds and the reconciler and event delivery take it
    up; nothing acknowledged was lost."""
    assert await ready_again(stack), "not ready again within 15 s of the database's return"
    rid = await acknowledged(stack, key)

    async def reconciled() -> bool:
        # The reconciler takes a reservation that starts now from placed to binding.
        return (await get(stack, rid)).json()["data"]["state"] == "binding"

    assert await eventually(reconciled, seconds=10), "the reconciler did not run again"

    async def announced() -> bool:
        return f"reservation/{rid}" in stack.delivered

    assert await eventually(announced, seconds=10), "event delivery did not run again"
    for each in kept:
        response = await get(stack, each)
        assert response.status_code == 200, response.text
        assert response.json()["data"]["id"] == each
    assert not any(t.done() for t in stack.tasks)


async def test_postgres_stopped(stack: Stack) -> None:
    kept = [await acknowledged(stack, "before-stop")]
    await asyncio.to_thread(stack.pg.kill_fast)
    try:
        answers = await asyncio.gather(
            timed(create(stack, "during-stop-1")),
            timed(create(stack, "during-stop-2")),
            timed(get(stack, kept[0])),
        )
        for response, seconds in answers:
            assert_unavailable(response, seconds)
        # Again, now that the pool knows its connections are gone.
        assert_unavailable(*await timed(create(stack, "during-stop-3")))
        await assert_not_ready(stack)
    finally:
        await stack.restart()
    await assert_recovered(stack, kept=kept, key="after-stop")


async def test_postgres_frozen(stack: Stack) -> None:
    kept = [await acknowledged(stack, "before-freeze")]
    with stack.frozen():
        answers = await asyncio.gather(
            timed(create(stack, "during-freeze-1")),
            timed(create(stack, "during-freeze-2")),
            timed(get(stack, kept[0])),
        )
        for response, seconds in answers:
            assert_unavailable(response, seconds)
        await assert_not_ready(stack)
        assert_unavailable(*await timed(create(stack, "during-freeze-3")))
    await assert_recovered(stack, kept=kept, key="after-freeze")
    # No connection cut while the server was frozen went back into the pool half-used.
    for _ in range(12):
        async with stack.db.connection() as conn:
            await conn.execute("SELECT 1")


async def test_a_one_second_blip_under_load(stack: Stack) -> None:
    answers: list[tuple[str, httpx.Response, float]] = []
    stop = asyncio.Event()

    async def client(number: int) -> None:
        for i in range(1000):
            if stop.is_set():
                return
            key = f"blip-{number}-{i}"
            # Each in an hour of its own, next year: the load leaves room for "after-blip".
            start = FAR_MS + (number * 1000 + i) * HOUR_MS
            response, seconds = await timed(create(stack, key, start=start))
            answers.append((key, response, seconds))

    clients = [asyncio.create_task(client(n)) for n in range(4)]
    with LoopStalls() as stalls:
        try:
            await asyncio.sleep(0.5)
            await asyncio.to_thread(stack.pg.kill_fast)
            await asyncio.sleep(1.0)
            await stack.restart()
            assert await ready_again(stack)
            await asyncio.sleep(0.5)
        finally:
            stop.set()
            await asyncio.gather(*clients)
    # On a quiet machine the stalls are milliseconds; a second of the loop's own would hide a
    # real breach. A busy machine that starves the whole process (a CI runner with its other
    # core taken) is not the loop's doing: that part is told apart and forgiven.
    assert stalls.blocked < 1.0, (
        f"the test's loop stalled {stalls.longest:.2f} s, the process {stalls.starved:.2f} s"
    )
    statuses = {response.status_code for _, response, _ in answers}
    assert 503 in statuses, statuses
    assert 200 in statuses, statuses
    for key, response, seconds in answers:
        if response.status_code != 200:
            assert_unavailable(response, seconds, slack=stalls.longest)
        assert seconds < REQUEST_BOUND_S + stalls.longest, (key, seconds, stalls.longest)
    kept = [str(r.json()["data"]["id"]) for _, r, _ in answers if r.status_code == 200]
    await assert_recovered(stack, kept=kept, key="after-blip")


async def test_a_connection_use_is_cut_at_its_bound_and_never_reused(stack: Stack) -> None:
    began = time.monotonic()
    with stack.frozen(), pytest.raises(StoreError, match=r"did not answer within 0\.5 s"):
        async with stack.db.connection(within_s=0.5) as conn:
            await conn.execute("SELECT 1")
    assert time.monotonic() - began < 1.5
    assert await eventually(stack.db.reachable, seconds=10)
    for _ in range(12):
        async with stack.db.connection() as conn:
            await conn.execute("SELECT 1")


async def test_a_batch_is_bounded_as_a_batch_and_a_request_as_a_request(stack: Stack) -> None:
    """One frozen second and a half: an interactive use (0.5 s bound here) is cut and answers
    at once, while a placement batch, bounded as a batch (10 s here), waits it out and
    commits. With one number for both, either requests wait as long as batches or batches
    die with requests (as they did on a loaded machine, at 2.5 s)."""
    db = await Database.open(stack.pg.dsn, limits=Limits(use_s=0.5, batch_s=10.0))
    try:
        epoch = await batching.take_lease(
            db, pool_id=POOL, holder="bounds", ttl=dt.timedelta(minutes=5)
        )
        assert epoch is not None
        with stack.frozen():
            batch = asyncio.create_task(
                batching.place_batch(db, pool_id=POOL, holder="bounds", epoch=epoch, max_batch=8)
            )
            began = time.monotonic()
            with pytest.raises(StoreError, match=r"within 0\.5 s"):
                async with db.connection() as conn:
                    await conn.execute("SELECT 1")
            assert time.monotonic() - began < 1.2
            await asyncio.sleep(1.5)
            assert not batch.done()
        placed = await asyncio.wait_for(batch, 10)
        assert placed is not None
    finally:
        await db.close()


def test_limits_come_from_the_environment_and_a_bad_one_is_named() -> None:
    limits = Limits.from_environ({"BCD_DB_TIMEOUT_S": "1.5", "BCD_DB_CONNECT_TIMEOUT_S": "1"})
    assert limits.use_s == 1.5
    assert limits.connect_s == 2  # libpq's least
    assert Limits.from_environ({}) == Limits()
    by_kind = Limits.from_environ({"BCD_DB_BATCH_TIMEOUT_S": "20", "BCD_DB_BULK_TIMEOUT_S": "600"})
    assert (by_kind.use_s, by_kind.batch_s, by_kind.bulk_s) == (2.5, 20.0, 600.0)
    with pytest.raises(ValueError, match="BCD_DB_TIMEOUT_S must be a number of seconds"):
        Limits.from_environ({"BCD_DB_TIMEOUT_S": "soon"})
    with pytest.raises(ValueError, match="BCD_DB_STATEMENT_TIMEOUT_S"):
        Limits.from_environ({"BCD_DB_STATEMENT_TIMEOUT_S": "-1"})


async def test_the_server_side_limits_ride_on_every_connection(stack: Stack) -> None:
    params = Limits(statement_s=7).connect_params("postgresql://u@db.example/x?keepalives=0")
    assert "keepalives" not in params  # the DSN's own choice wins
    assert params["tcp_user_timeout"] == 10_000
    assert "-c statement_timeout=7000" in params["options"]
    async with stack.db.connection() as conn:
        row = await (await conn.execute("SHOW statement_timeout")).fetchone()
        assert row == {"statement_timeout": "30s"}
        row = await (await conn.execute("SHOW client_connection_check_interval")).fetchone()
        assert row == {"client_connection_check_interval": "1s"}


class FreezingPolicy:
    """The default Cedar policies, except that the first extend decision freezes PostgreSQL
    (as if the database hung right after the extend took its hold) and the server is thawed
    ``frozen_s`` later, in the background."""

    def __init__(self, stack: Stack, *, frozen_s: float):
        self.engine = policies.CedarPolicyEngine.from_text(policies.DEFAULT_POLICIES)
        self.stack = stack
        self.frozen_s = frozen_s
        self.thawed = asyncio.Event()
        self._froze = False

    async def decide(self, request: ports.DecisionRequest) -> ports.Decision:
        if request.action == ports.EXTEND and not self._froze:
            self._froze = True
            family = _family(self.stack.pg)
            for each in family:
                each.send_signal(signal.SIGSTOP)

            async def thaw() -> None:
                await asyncio.sleep(self.frozen_s)
                for each in family:
                    each.send_signal(signal.SIGCONT)
                self.thawed.set()

            asyncio.get_running_loop().create_task(thaw())
        return await self.engine.decide(request)


async def test_a_hold_the_database_hung_on_is_given_back_once_it_answers(stack: Stack) -> None:
    # The hold's holder session stays alive through a freeze, so only giving the hold back
    # frees it; the request could not, since the database hung longer than the request's own
    # bound and that of giving back (2.5 s each). The retry must not wait out the hold's 60 s
    # age limit.
    policy = FreezingPolicy(stack, frozen_s=6.0)
    service = ReservationService(
        db=stack.db, policy=policy, budget=DatabaseBudget(stack.db), root_tenant_id="root"
    )
    alice = ports.Caller(identity_id="alice", tenant_id="acme")
    rid = await acknowledged(stack, "hold-through-a-freeze")
    got = (await get(stack, rid)).json()["data"]
    extend = {
        "tenantId": "acme",
        "reservationId": rid,
        "until": got["during"]["end"] + 3_600_000,
        "idempotencyKey": "extend-through-a-freeze",
    }
    with pytest.raises(StoreError):
        await service.extend(alice, extend)
    await asyncio.wait_for(policy.thawed.wait(), timeout=10)
    began = time.monotonic()
    while True:
        try:
            answer = await service.extend(alice, extend)
            break
        except StoreError:
            # The pool is still reconnecting after the thaw; a client would retry too.
            assert time.monotonic() - began < 10
            await asyncio.sleep(0.2)
    assert answer["extended"] is True
    assert time.monotonic() - began < 10  # not the 60 s age limit of a hold
