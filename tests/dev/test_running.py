"""The dev stack end to end: its own embedded PostgreSQL on a temporary state dir, the real API
on a real socket, simulated nodes binding through the service, and the command as a process."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from bettercompute.dev import running
from bettercompute.dev.running import Dev, DevError
from bettercompute.deviceplugin import devicefiles
from tests.support import database

# The guide's "Reserve GPUs" HTTP example, in the demo's H100 pool.
GUIDE_BODY = {
    "tenantId": "acme",
    "poolId": "pool_h100",
    "devices": [{"class": "gpu", "count": 4, "topology": "nvlink-all"}],
    "duration": "8h",
    "idempotencyKey": "train-2026-09-24",
}


@pytest.fixture
def state() -> Iterator[Path]:
    """A state dir outside pytest's ``tmp_path``. Why: running as root, the embedded PostgreSQL
    runs as its own user and needs every parent directory searchable; pytest resets its
    base temp dir to mode 0700 whenever another pytest session starts on the machine."""
    root = Path(tempfile.mkdtemp(prefix="bc-dev-test-"))
    try:
        yield root / "state"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def call(dev: Dev, operation: str, body: dict[str, Any], *, who: str = "alice@acme") -> Any:
    async with httpx.AsyncClient(base_url=dev.url, timeout=10) as client:
        answer = await client.post(
            f"/api/compute/reservations/{operation}",
            json=body,
            headers={
                "Authorization": f"Bearer {dev.tokens[who]}",
                "X-Better-Compute": "1",
            },
        )
    assert answer.status_code == 200, answer.text
    return answer.json()["data"]


async def until(dev: Dev, rid: str, state: str, *, seconds: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while True:
        got: dict[str, Any] = await call(dev, "get", {"tenantId": "acme", "reservationId": rid})
        if got["state"] == state or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.1)


def exists(path: Path) -> bool:
    return path.exists()


async def eventually(check: Callable[[], Awaitable[bool]], *, seconds: float = 5.0) -> bool:
    """Whether ``check`` comes true within ``seconds`` (the agents poll every 0.3 s)."""
    for _ in range(int(seconds / 0.1)):
        if await check():
            return True
        await asyncio.sleep(0.1)
    return await check()


async def allocation_state(dev: Dev, allocation_id: str) -> str:
    async with dev.db.connection() as conn:
        row = await (
            await conn.execute("SELECT state FROM allocations WHERE id = %s", (allocation_id,))
        ).fetchone()
    assert row is not None
    return str(row["state"])


async def test_reserve_bind_release_and_restart_with_nothing_lost(state: Path) -> None:
    async with running.started(port=0, metrics_port=0, sim=2, state_dir=state) as dev:
        assert dev.url.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{dev.url}/readyz")).status_code == 200

        created = await call(dev, "create", GUIDE_BODY)
        assert created["state"] == "placed"
        active = await until(dev, created["id"], "active")
        assert active["state"] == "active"
        binding = active["binding"]
        [allocation_id] = binding["allocationIds"]
        assert len(binding["cdiDevices"]) == 4
        assert all(d.startswith("bcd.dev/gpu=GPU-") for d in binding["cdiDevices"])

        root = dev.node_root(binding["nodeId"])
        env_file = Path(binding["envFile"])
        assert env_file == root / "run" / "allocations" / f"{allocation_id}.env"
        env = devicefiles.read_env(env_file)
        assert env["BCD_ALLOCATION_ID"] == allocation_id
        assert env["BCD_RESERVATION_ID"] == created["id"]
        devices = [d.removeprefix("bcd.dev/gpu=") for d in binding["cdiDevices"]]
        assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(devices)
        spec = json.loads((root / "cdi" / f"bcd-{allocation_id}.json").read_text())
        assert (spec["cdiVersion"], spec["kind"]) == ("0.6.0", "bcd.dev/gpu")
        assert [d["name"] for d in spec["devices"]] == devices
        assert f"BCD_ALLOCATION_ID={allocation_id}" in spec["containerEdits"]["env"]

        # The demo's other identities: the platform's service account reads any tenant's
        # reservation; globex books acme's H100s through its offer.
        seen = await call(
            dev, "get", {"tenantId": "acme", "reservationId": created["id"]}, who="ops@root"
        )
        assert seen["id"] == created["id"]
        offered = await call(
            dev,
            "create",
            {**GUIDE_BODY, "tenantId": "globex", "devices": [{"class": "gpu", "count": 1}]},
            who="gina@globex",
        )
        assert offered["state"] == "placed"

        # One stack per state dir.
        with pytest.raises(DevError, match="already running on"):
            async with running.started(port=0, metrics_port=0, state_dir=state):
                pass

        # A second reservation stays active across the restart below.
        kept = await call(dev, "create", {**GUIDE_BODY, "idempotencyKey": "kept"})
        assert (await until(dev, kept["id"], "active"))["state"] == "active"

        released = await call(dev, "release", {"tenantId": "acme", "reservationId": created["id"]})
        assert released["state"] == "released"

        async def files_gone() -> bool:
            return not exists(env_file) and not exists(root / "cdi" / f"bcd-{allocation_id}.json")

        async def allocation_released() -> bool:
            return await allocation_state(dev, allocation_id) == "released"

        assert await eventually(files_gone)
        assert await eventually(allocation_released)

    async with running.started(port=0, metrics_port=0, sim=2, state_dir=state) as dev:
        again = await call(dev, "get", {"tenantId": "acme", "reservationId": created["id"]})
        assert again["state"] == "released"
        still = await call(dev, "get", {"tenantId": "acme", "reservationId": kept["id"]})
        assert still["state"] == "active"
        assert still["binding"] == (await until(dev, kept["id"], "active"))["binding"]
        assert exists(Path(still["binding"]["envFile"]))
        # The same key answers the stored reservation: nothing was placed twice.
        retried = await call(dev, "create", {**GUIDE_BODY, "idempotencyKey": "kept"})
        assert retried["id"] == kept["id"]


async def test_the_printed_examples_match_the_guide(state: Path) -> None:
    async with running.started(port=0, metrics_port=0, sim=0, state_dir=state) as dev:
        export, reserve, curl = running.try_it(dev)
    assert export == (
        f"export BETTER_COMPUTE_URL={dev.url} BETTER_COMPUTE_TOKEN={dev.tokens['alice@acme']}"
    )
    assert reserve == (
        "better-compute reserve --tenant acme --pool pool_h100 --gpus 4 --for 8h --nvlink"
    )
    words = shlex.split(curl.replace("\\\n", " "))
    assert words[:4] == ["curl", "-X", "POST", f"{dev.url}/api/compute/reservations/create"]
    headers = [words[i + 1] for i, w in enumerate(words) if w == "-H"]
    assert headers == [
        "Authorization: Bearer $BETTER_COMPUTE_TOKEN",
        "Content-Type: application/json",
        "X-Better-Compute: 1",
    ]
    assert json.loads(words[words.index("-d") + 1]) == GUIDE_BODY


async def test_a_port_in_use_is_a_clear_error_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(DevError) as caught:
            async with running.started(port=port, metrics_port=0, state_dir=tmp_path / "state"):
                pass
    assert f"port {port} on 127.0.0.1 is already in use" in str(caught.value)
    assert "--port" in str(caught.value)
    assert not (tmp_path / "state").exists()


async def test_a_metrics_port_in_use_is_a_clear_error_naming_its_option(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(DevError) as caught:
            async with running.started(port=0, metrics_port=port, state_dir=tmp_path / "state"):
                pass
    assert f"port {port} on 127.0.0.1 is already in use" in str(caught.value)
    assert f"--metrics-port {port + 1}" in str(caught.value)
    port = free_port()
    with pytest.raises(DevError, match="--port and --metrics-port are both"):
        async with running.started(port=port, metrics_port=port, state_dir=tmp_path / "state"):
            pass
    assert not (tmp_path / "state").exists()


async def test_metrics_are_served_on_their_own_port_never_on_the_apis(
    state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv("BETTER_COMPUTE_METRICS_TOKEN", "scrape-me")
    async with (
        running.started(port=0, metrics_port=port, sim=1, state_dir=state) as dev,
        httpx.AsyncClient(timeout=10) as client,
    ):
        assert (dev.metrics_port, dev.metrics_url) == (port, f"http://127.0.0.1:{port}")
        await call(dev, "create", GUIDE_BODY)
        tenant = {"Authorization": f"Bearer {dev.tokens['gina@globex']}", "X-Better-Compute": "1"}
        refused = await client.get(f"{dev.url}/metrics", headers=tenant)
        assert refused.status_code == 404
        assert "bettercompute_" not in refused.text
        assert (await client.get(f"{dev.url}/readyz")).status_code == 200
        assert (await client.get(f"{dev.metrics_url}/metrics", headers=tenant)).status_code == 401
        scraped = await client.get(
            f"{dev.metrics_url}/metrics", headers={"Authorization": "Bearer scrape-me"}
        )
        assert scraped.status_code == 200
        assert 'bettercompute_quota_used{resource="gpu:H100",tenant="acme"} 4.0' in scraped.text


async def test_fresh_empties_only_a_state_dir_it_made(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(DevError, match="refusing to empty"):
        async with running.started(port=0, metrics_port=0, state_dir=foreign, fresh=True):
            pass
    assert (foreign / "notes.txt").read_text() == "keep me"


# --- the command, as a process ----------------------------------------------------------------


def _command(port: int, state: Path, metrics_port: int = 0) -> list[str]:
    script = Path(sys.executable).with_name("better-compute")
    args = ["--port", str(port), "--metrics-port", str(metrics_port)]
    args += ["--state-dir", str(state), "--sim", "2"]
    if script.exists():
        return [str(script), "dev", *args]
    # Without the console script installed, the same entry point the CLI calls.
    code = (
        "import pathlib, sys; from bettercompute.dev.running import run; "
        f"run(port={port}, metrics_port={metrics_port}, "
        f"state_dir=pathlib.Path({str(state)!r}), sim=2)"
    )
    return [sys.executable, "-c", code]


@pytest.fixture
def dev_process(state: Path) -> Iterator[tuple[subprocess.Popen[str], str, str]]:
    port, metrics_port = free_port(), free_port()
    process = subprocess.Popen(
        _command(port, state, metrics_port),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    try:
        yield process, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_command_serves_until_sigint_then_exits_0(
    dev_process: tuple[subprocess.Popen[str], str, str],
) -> None:
    process, url, metrics_url = dev_process
    deadline = time.monotonic() + 60
    ready = False
    while time.monotonic() < deadline and process.poll() is None:
        try:
            ready = httpx.get(f"{url}/readyz", timeout=1).status_code == 200
        except httpx.TransportError:
            ready = False
        if ready:
            break
        time.sleep(0.2)
    assert ready, f"not ready; exit code {process.poll()}"
    # /metrics on the port --metrics-port named, and not on the API's.
    scraped = httpx.get(f"{metrics_url}/metrics", timeout=5)
    assert scraped.status_code == 200
    assert "bettercompute_quota_limit{" in scraped.text
    assert httpx.get(f"{url}/metrics", timeout=5).status_code == 404
    # The console on the API's port: / leads to its page.
    page = httpx.get(f"{url}/", timeout=5, follow_redirects=True)
    assert page.status_code == 200
    assert str(page.url) == f"{url}/console/"
    assert "Content-Security-Policy" in page.headers
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=10)
    assert process.returncode == 0, output
    assert url in output
    assert f"Metrics: {metrics_url}/metrics" in output
    assert f"Console: {url}/console/" in output
    assert "BETTER_COMPUTE_TOKEN=bcdev_alice_acme" in output
    assert "Traceback" not in output


@pytest.fixture
def scratch_database(pg_server_dsn: str) -> Iterator[str]:
    """A database of its own on the session's server, dropped afterwards."""
    name = "bettercompute_dev_scratch"
    yield database.fresh_database(pg_server_dsn, name)
    database.drop_database(pg_server_dsn, name)


async def test_a_given_database_is_used_instead_of_an_embedded_one(
    tmp_path: Path, scratch_database: str
) -> None:
    state = tmp_path / "state"
    async with running.started(
        port=0, metrics_port=0, sim=1, state_dir=state, database_url=scratch_database
    ) as dev:
        created = await call(dev, "create", GUIDE_BODY)
        assert (await until(dev, created["id"], "active"))["state"] == "active"
    # Nothing embedded was started: the reservation lives in the given database.
    assert not (state / "pg").exists()
    with psycopg.connect(scratch_database) as conn:
        row = conn.execute(
            "SELECT state FROM reservations WHERE id = %s", (created["id"],)
        ).fetchone()
    assert row is not None
    assert row[0] == "active"


async def test_fresh_is_refused_with_a_given_database(tmp_path: Path) -> None:
    with pytest.raises(DevError, match="--fresh empties only"):
        async with running.started(
            port=0,
            metrics_port=0,
            state_dir=tmp_path / "s",
            fresh=True,
            database_url="postgresql:///nothing",
        ):
            pass


async def test_a_node_key_others_can_read_stops_dev_with_one_line(state: Path) -> None:
    async with running.started(port=0, metrics_port=0, sim=1, state_dir=state) as dev:
        node = dev.nodes[0]
        key = dev.node_root(node.id) / "node-key.pem"
        assert key.stat().st_mode & 0o777 == 0o600
    key.chmod(0o644)  # as a careless copy or restore leaves it
    with pytest.raises(DevError) as refused:
        async with running.started(port=0, metrics_port=0, sim=1, state_dir=state):
            pass
    message = str(refused.value)
    assert message.startswith(f"simulated node {node.name}: node key {key}: readable by others")
    assert "\n" not in message
