"""The operator outlives its database: PostgreSQL stopped under it, then started again.

The real operator (kopf, the reconciler, the projector, the allocation sync, event delivery,
the HTTP API) against the Kubernetes API stand-in, on an embedded PostgreSQL of this test's own
(it is stopped, so never the session's). While the database is away no part of the operator
ends and ``/readyz`` says 503 within a second; once it is back the operator is ready again by
itself and a new Reservation is placed.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from bettercompute.operator.running import started
from bettercompute.store.database import Database
from bettercompute.store.embedded import EmbeddedPostgres
from tests.operator.conftest import apply_world, operator_config
from tests.support import kubeworld
from tests.support.kubeobjects import RESERVATIONS
from tests.support.kubeserver import KubeApi
from tests.support.policies import CountingPolicy


@pytest.fixture
async def own_database() -> AsyncIterator[tuple[EmbeddedPostgres, Database]]:
    root = Path(tempfile.mkdtemp(prefix="bc-operator-outage-"))
    await asyncio.to_thread(root.chmod, 0o755)  # the server's own user must get in
    pg = await asyncio.to_thread(EmbeddedPostgres, root / "data", delete_on_stop=True)
    try:
        db = await Database.open(pg.dsn, min_size=2, max_size=10)
        try:
            yield pg, db
        finally:
            await db.close()
    finally:
        await asyncio.to_thread(pg.stop)
        shutil.rmtree(root, ignore_errors=True)


async def readyz(url: str) -> tuple[int, float]:
    began = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as client:
        status = (await client.get(f"{url}/readyz")).status_code
    return status, time.monotonic() - began


def placed(obj: dict) -> bool:  # type: ignore[type-arg]
    return bool(obj) and (obj.get("status") or {}).get("state") == "placed"


async def test_the_operator_survives_its_database_going_away(
    kube_api: KubeApi, own_database: tuple[EmbeddedPostgres, Database]
) -> None:
    pg, db = own_database
    config = operator_config(kube_api, db)
    async with started(config, db=db, policy=CountingPolicy()) as op:
        await op.ready.wait()
        await apply_world(kube_api, db)
        await kube_api.create(kubeworld.reservation("before").gpus(2).obj())
        await kube_api.wait_for(RESERVATIONS, "ml", "before", placed, timeout=5)

        await asyncio.to_thread(pg.kill_fast)
        status, seconds = await readyz(op.url)
        assert status == 503
        assert seconds < 1.0
        # Applied while the database is away: its handler fails and is tried again in
        # seconds, not after kopf's minute of backoff.
        await kube_api.create(kubeworld.reservation("during").gpus(2).obj())
        # Every loop meets the outage: reconciler and delivery poll, the listeners reconnect.
        await asyncio.sleep(3)
        assert not [t.get_name() for t in op.tasks if t.done()]
        assert not op.kopf_task.done()
        status, seconds = await readyz(op.url)
        assert status == 503
        assert seconds < 1.0

        deadline = time.monotonic() + 20
        while True:
            try:
                await asyncio.to_thread(pg.restart)
                break
            except OSError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.3)
        deadline = time.monotonic() + 15
        while (await readyz(op.url))[0] != 200:
            assert time.monotonic() < deadline, "not ready again within 15 s"
            await asyncio.sleep(0.2)
        await kube_api.create(kubeworld.reservation("after").gpus(2).obj())
        await kube_api.wait_for(RESERVATIONS, "ml", "after", placed, timeout=10)
        await kube_api.wait_for(RESERVATIONS, "ml", "during", placed, timeout=20)
        before = kube_api.stored(RESERVATIONS, "ml", "before")
        assert await op.runtime.service.snapshot(before["status"]["id"]) is not None
