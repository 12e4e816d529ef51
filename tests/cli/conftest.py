"""The CLI against a live server: the real HTTP API on a free port of 127.0.0.1, served inside the
test's event loop over the real PostgreSQL, and the real ``better-compute`` run as a subprocess.

The subprocess runs without blocking the loop (``asyncio.create_subprocess_exec``), so the API
answers while the CLI waits. Each run gets a clean environment: its own ``HOME`` (no config file
unless a test writes one) and no ``BETTER_COMPUTE_*`` variable unless the test gives it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
from aiohttp import web

from bettercompute.api.app import make_app
from bettercompute.core.pools import CAP_DEVICES_LIMITS
from bettercompute.iam.identities import StaticTokenAuthenticator
from bettercompute.service.reservations import ReservationService
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.kubectl.test_plugin import (  # noqa: F401 - fixtures: test_vocabulary runs kubectl bcd
    chart_webhooks,
    operator,
    plugin,
    world,
)
from tests.support.world import World

ALICE = "alice-token"
BOB = "bob-token"
#: A run of the CLI that takes longer than this is hung, not slow.
RUN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Result:
    rc: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)

    def __str__(self) -> str:  # shown by a failing assert
        return f"rc={self.rc}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


async def run_cli(
    *args: str, home: Path, env: Mapping[str, str] | None = None, timeout_s: float = RUN_TIMEOUT_S
) -> Result:
    """Run ``python -m bettercompute.cli.app ARGS`` and collect what it printed."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BETTER_COMPUTE_")}
    clean.update({"HOME": str(home), "COLUMNS": "200", "NO_COLOR": "1"})
    clean.update(env or {})
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bettercompute.cli.app",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=clean,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return Result(process.returncode, out.decode(), err.decode())


class Cli(Protocol):
    def __call__(
        self, *args: str, env: Mapping[str, str] | None = None, token: str | None = ALICE
    ) -> Awaitable[Result]: ...


@dataclass(frozen=True)
class Server:
    url: str
    service: ReservationService

    async def call(self, operation: str, body: dict[str, Any], *, token: str = ALICE) -> Any:
        """The same API, called directly over HTTP: what the CLI must print unchanged."""
        async with httpx.AsyncClient() as http:
            response = await http.post(
                f"{self.url}/api/compute/{operation}",
                json=body,
                headers={"Authorization": f"Bearer {token}", "X-Better-Compute": "1"},
            )
        envelope = response.json()
        assert "data" in envelope, envelope
        return envelope["data"]


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on a free port of 127.0.0.1; answers the runner and the base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


@pytest.fixture
async def server(db: Database, service: ReservationService) -> AsyncIterator[Server]:
    """The real API over a world: tenant acme owns pool_a (2 nodes of 8 H100, 64 CPUs and
    512 GiB each, a per-GPU share of 1 CPU and 8 GiB) and pool_k (for ``binding: kubernetes``,
    no nodes yet), with a quota of 16 H100, 100 CPUs and 1000 GiB."""
    await (
        World(db)
        .tenant("acme")
        .tenant("globex")
        .tenant("root", root=True)
        .pool("pool_a", owner="acme", policy={"perGpu": {"vcpu": 1, "memoryGiB": 8}})
        .pool("pool_k", owner="acme", policy={"kubernetes": True})
        .nodes(
            "pool_a",
            2,
            host={"vcpu": 64, "memoryGiB": 512},
            labels={CAP_DEVICES_LIMITS: ("true", "system")},
        )
        .quota("acme", "gpu:H100", 16)
        .quota("acme", "vcpu", 100)
        .quota("acme", "memoryGiB", 1000)
        .build()
    )
    authenticator = StaticTokenAuthenticator(
        {ALICE: caller("alice", "acme"), BOB: caller("bob", "acme")}
    )
    runner, url = await serve(make_app(service=service, authenticator=authenticator))
    try:
        yield Server(url=url, service=service)
    finally:
        await runner.cleanup()


@pytest.fixture
def cli(server: Server, tmp_path: Path) -> Cli:
    """Runs the CLI against ``server`` as alice (``token=None``: no token at all)."""

    async def run(
        *args: str, env: Mapping[str, str] | None = None, token: str | None = ALICE
    ) -> Result:
        given = {"BETTER_COMPUTE_URL": server.url}
        if token is not None:
            given["BETTER_COMPUTE_TOKEN"] = token
        given.update(env or {})
        return await run_cli(*args, home=tmp_path, env=given)

    return run
