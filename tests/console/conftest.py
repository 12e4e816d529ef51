"""The console's browser tests: a real `better-compute dev` (as a process, on the test
session's PostgreSQL) and a real Chromium driven by Playwright.

Why it exists: what the console promises (a 401 shows the sign-in page, another tenant's
bookings never reach the browser, names stay text) is only true in a browser, against the
server that really serves the pages. Browsers cannot be downloaded here, so Playwright
launches Debian's Chromium (``/usr/bin/chromium``, or ``BCD_CHROMIUM``); never
``playwright install``.

Without Chromium or Playwright the tests skip with the reason, except where
``BCD_CONSOLE_REQUIRE_BROWSER=1`` (``.ci/run`` sets it): there they fail.

``BCD_CONSOLE_SCREENSHOTS=1`` writes each view's screenshot to ``docs/images/console/``
(the docs show them); unset, nothing in the tree changes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import database

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "docs" / "images" / "console"
TOKENS = {
    "alice": "bcdev_alice_acme",
    "bob": "bcdev_bob_acme",
    "gina": "bcdev_gina_globex",
    "ops": "bcdev_ops_root",
    "assistant": "bcdev_assistant_acme",
}
TENANT = {"alice": "acme", "bob": "acme", "gina": "globex", "ops": "root", "assistant": "acme"}


def chromium_path() -> str | None:
    given = os.environ.get("BCD_CHROMIUM")
    if given:
        return given if Path(given).exists() else None
    return shutil.which("chromium") or (
        "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None
    )


def _missing(reason: str) -> None:
    if os.environ.get("BCD_CONSOLE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (BCD_CONSOLE_REQUIRE_BROWSER=1: the browser tests may not skip)")
    print(f"\nconsole browser tests skipped: {reason}")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Dev:
    """The running `better-compute dev` and a bearer-token client for setting the scene."""

    url: str
    process: subprocess.Popen[str]

    async def call(
        self, operation: str, body: dict[str, Any], *, who: str = "alice"
    ) -> httpx.Response:
        async with httpx.AsyncClient(timeout=30) as client:
            return await client.post(
                f"{self.url}/api/compute/{operation}",
                json=body,
                headers={"Authorization": f"Bearer {TOKENS[who]}", "X-Better-Compute": "1"},
            )

    async def data(self, operation: str, body: dict[str, Any], *, who: str = "alice") -> Any:
        answer = await self.call(operation, body, who=who)
        assert answer.status_code == 200, (operation, answer.status_code, answer.text)
        return answer.json()["data"]

    async def reserve(
        self,
        *,
        who: str = "alice",
        gpus: int = 1,
        hours: float = 2,
        start_in_hours: float | None = None,
        key: str | None = None,
        pool: str = "pool_h100",
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "tenantId": TENANT[who],
            "poolId": pool,
            "devices": [{"class": "gpu", "count": gpus}],
            "duration": int(hours * 3600_000),
            "idempotencyKey": key or f"test-{uuid.uuid4().hex[:10]}",
        }
        if start_in_hours is not None:
            body["start"] = int(time.time() * 1000 + start_in_hours * 3600_000)
        made: dict[str, Any] = await self.data("reservations/create", body, who=who)
        return made


@pytest.fixture(scope="session")
def dev(pg_server_dsn: str) -> Iterator[Dev]:
    """`better-compute dev --sim 2` on a database of its own on the session's server."""
    name = f"bettercompute_console_{uuid.uuid4().hex[:8]}"
    dsn = database.fresh_database(pg_server_dsn, name)
    # A private directory: the nodes' files are the dev process's own.
    state = Path(tempfile.mkdtemp(prefix="bc-console-"))
    port = free_port()
    script = Path(sys.executable).with_name("better-compute")
    args = ["dev", "--port", str(port), "--metrics-port", "0", "--sim", "2"]
    args += ["--state-dir", str(state / "state"), "--database-url", dsn]
    command = (
        [str(script), *args]
        if script.exists()
        else [sys.executable, "-c", "from bettercompute.cli.app import main; main()", *args]
    )
    log = (state / "dev.log").open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError(f"dev never got ready: {(state / 'dev.log').read_text()}")
        yield Dev(url=url, process=process)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()
        database.drop_database(pg_server_dsn, name)
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="session")
async def browser() -> AsyncIterator[Any]:
    """Debian's Chromium under Playwright's asyncio API (the tests share the session's event
    loop; the sync API would run a second one). Headless; --no-sandbox only as root."""
    path = chromium_path()
    if path is None:
        where = os.environ.get("BCD_CHROMIUM") or "/usr/bin/chromium"
        _missing(f"no Chromium at {where} (apt-get install chromium, or set BCD_CHROMIUM)")
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        _missing("Playwright for Python is not installed (pip install -e '.[test]')")
    manager = await async_playwright().start()
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    launched = await manager.chromium.launch(executable_path=path, args=args, headless=True)
    try:
        yield launched
    finally:
        await launched.close()
        await manager.stop()


Page = Any


OpenConsole = Callable[..., Awaitable[Page]]


@pytest.fixture
async def open_console(browser: Any, dev: Dev) -> AsyncIterator[OpenConsole]:
    """A fresh browser profile (1280×800) signed in as someone through the sign-in page, at a
    view; ``None``: not signed in."""
    contexts: list[Any] = []

    async def open_as(who: str | None, view: str = "#/timeline") -> Page:
        context = await browser.new_context(
            viewport={"width": 1280, "height": 800}, base_url=dev.url
        )
        contexts.append(context)
        page = await context.new_page()
        page.set_default_timeout(20_000)
        if who is None:
            await page.goto(f"/console/{view}")
            return page
        await page.goto("/console/signin")
        await page.fill("#token", TOKENS[who])
        await page.click("button[type=submit]")
        await page.wait_for_selector("#who strong")
        if view != "#/timeline":
            await page.goto(f"/console/{view}")
            await page.reload()  # a fresh page at that view: no flag of the one before
        return page

    yield open_as
    for context in contexts:
        await context.close()


async def screenshot(page: Page, view: str) -> None:
    """The view's screenshot for the docs, only when BCD_CONSOLE_SCREENSHOTS=1."""
    if os.environ.get("BCD_CONSOLE_SCREENSHOTS") != "1":
        return
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(SCREENSHOTS / f"{view}.png"))
