"""The supervisor's policy for the loops of ``dev`` and the operator: a loop that fails is
logged at ERROR with its traceback and started again; only cancellation ends it."""

from __future__ import annotations

import asyncio
import logging

import pytest

from bettercompute import supervising


async def test_a_failing_loop_is_logged_and_started_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs = 0
    third = asyncio.Event()

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise RuntimeError(f"bug number {runs}")
        third.set()
        await asyncio.Event().wait()  # runs until cancelled

    with caplog.at_level(logging.INFO, logger="bettercompute.supervising"):
        task = supervising.restarting(
            loop, name="looper", backoff=supervising.Backoff(first_s=0.01, max_s=0.02)
        )
        async with asyncio.timeout(5):
            await third.wait()
        assert not task.done()
        await supervising.cancel([task])
    assert task.cancelled()
    assert runs == 3
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == ["looper failed; restarting it"] * 2
    assert all(r.exc_info and "bug number" in str(r.exc_info[1]) for r in errors)


async def test_a_loop_that_returns_is_an_error_and_runs_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs = 0
    second = asyncio.Event()

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs == 2:
            second.set()

    task = supervising.restarting(
        loop, name="returner", backoff=supervising.Backoff(first_s=0.01, max_s=0.01)
    )
    async with asyncio.timeout(5):
        await second.wait()
    await supervising.cancel([task])
    assert "returner returned, which it never should; restarting it" in caplog.text


def test_backoff_grows_with_jitter_up_to_its_bound() -> None:
    backoff = supervising.Backoff(first_s=0.2, max_s=5.0)
    delays = [backoff.next_delay() for _ in range(10)]
    assert 0.1 <= delays[0] <= 0.2
    assert 0.2 <= delays[1] <= 0.4
    assert all(2.5 <= d <= 5.0 for d in delays[6:])
    backoff.reset()
    assert backoff.next_delay() <= 0.2
