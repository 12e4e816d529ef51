"""The built-in budget under concurrency: creates and extends checked at the same moment never
admit more GPU-hours than the budget, and the ones refused answer ``SPEND_LIMIT_REACHED``.

The budget counts used + still-booked hours (``bc_budget_state``): nothing here is bound, so
everything admitted is booked from now on, and the wall clock running during a test takes a
little off it; figures are compared to within a few seconds' worth."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bettercompute.core.errors import ComputeError
from bettercompute.service.reservations import ReservationService
from bettercompute.store import inventory
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.store.test_admission import acme, create_input, expect
from tests.store.test_extend import extend_input
from tests.support.placers import PLACERS, placer_policy

METER = {"admission": {"budgetCheck": "meter"}}
#: 4 GPUs for 36 hours: three fit in 500 GPU-hours, four do not.
ASK = {"devices": [{"class": "gpu", "count": 4}], "duration": "36h"}


async def spent(db: Database) -> float:
    async with db.connection() as conn:
        row = await (await conn.execute("SELECT spent FROM bc_budget_state('acme')")).fetchone()
    assert row is not None
    return float(row["spent"])


@pytest.mark.parametrize("placer", PLACERS)
async def test_parallel_creates_never_overrun_the_budget(
    db: Database, make_service: Any, placer: str
):
    # With the pool-lease placer the admitted are queued, their whole duration counted.
    await acme(db, gpus=64, nodes=4, policy=placer_policy(placer, **METER))
    await inventory.set_budget(db, tenant_id="acme", gpu_hours=500, window_seconds=86_400 * 7)
    # Two replicas: an in-process lock could not serialise them; the database must.
    replicas = [make_service(), make_service()]

    async def one(i: int) -> Any:
        try:
            return await replicas[i % 2].create(
                caller(f"user{i}"), create_input(idempotencyKey=f"b{i}", **ASK)
            )
        except ComputeError as e:
            return e

    results = await asyncio.gather(*(one(i) for i in range(8)))
    admitted = [r for r in results if isinstance(r, dict)]
    refused = [r for r in results if isinstance(r, ComputeError)]
    assert len(admitted) == 3, results
    assert {e.code.value for e in refused} == {"SPEND_LIMIT_REACHED"}
    assert all("GPU-hours" in e.message for e in refused)
    assert await spent(db) == pytest.approx(3 * 144, abs=0.05)
    # A refused draft stays: its key is decided again once the budget allows it.
    await inventory.set_budget(db, tenant_id="acme", gpu_hours=2000, window_seconds=86_400 * 7)
    again = await one(next(i for i, r in enumerate(results) if isinstance(r, ComputeError)))
    assert again["state"] in ("placed", "pending")


@pytest.mark.parametrize("placer", PLACERS)
async def test_one_after_another_the_fourth_is_refused(
    db: Database, service: ReservationService, placer: str
):
    await acme(db, gpus=64, nodes=4, policy=placer_policy(placer, **METER))
    await inventory.set_budget(db, tenant_id="acme", gpu_hours=500, window_seconds=86_400)
    for i in range(3):
        await service.create(caller(), create_input(idempotencyKey=f"s{i}", **ASK))
    err = await expect(
        "SPEND_LIMIT_REACHED",
        service.create(caller(), create_input(idempotencyKey="s3", **ASK)),
    )
    assert err.message.startswith(
        "the tenant's budget of 500 GPU-hours per window is spent (0.000 used, 43"
    )
    assert err.message.endswith(" booked, 144.000 asked)")
    assert isinstance(err.details["resetsAt"], int)


async def test_parallel_extends_never_overrun_the_budget(db: Database, make_service: Any):
    # Only 'drain' checks extends against the budget.
    await acme(db, gpus=64, nodes=4)
    await inventory.set_offer(db, pool_id="pool_a", tenant_id="acme", on_budget_exceeded="drain")
    await inventory.set_budget(db, tenant_id="acme", gpu_hours=100, window_seconds=86_400)
    replicas = [make_service(), make_service()]
    views = [
        await replicas[0].create(
            caller(),
            create_input(idempotencyKey=f"x{i}", devices=[{"class": "gpu", "count": 4}]),
        )
        for i in range(2)
    ]
    # 2 × 4 GPUs × 8 h = 64 GPU-hours spent; each extend by 8 h adds 32: one more fits.

    async def extend(i: int) -> Any:
        try:
            return await replicas[i].extend(
                caller(), extend_input(views[i]["id"], f"e{i}", by="8h")
            )
        except ComputeError as e:
            return e

    results = await asyncio.gather(extend(0), extend(1))
    extended = [r for r in results if isinstance(r, dict) and r["extended"]]
    refused = [r for r in results if isinstance(r, ComputeError)]
    assert len(extended) == 1, results
    assert [e.code.value for e in refused] == ["SPEND_LIMIT_REACHED"]
    assert await spent(db) <= 100
