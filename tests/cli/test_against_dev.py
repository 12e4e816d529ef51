"""The README's walkthrough, run with the real CLI against a live `better-compute dev` stack:
its embedded PostgreSQL, reconciler, API and simulated nodes that bind and release."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

from bettercompute.dev import config as dev_config
from bettercompute.dev import running
from tests.cli.conftest import Result, run_cli


async def test_the_walkthrough_against_a_live_dev_stack(tmp_path: Path) -> None:
    # A private directory, not tmp_path: the embedded server runs as its own user and pytest
    # keeps its temp tree private to root.
    state = Path(tempfile.mkdtemp(prefix="bc-cli-dev-")) / "state"
    try:
        async with running.started(port=0, metrics_port=0, sim=2, state_dir=state) as dev:
            env = {"BETTER_COMPUTE_URL": dev.url, "BETTER_COMPUTE_TOKEN": dev.tokens["alice@acme"]}

            async def cli(*args: str) -> Result:
                return await run_cli(*args, home=tmp_path, env=env)

            reserved = await cli(
                "reserve",
                "--tenant",
                "acme",
                "--pool",
                "pool_h100",
                "--gpus",
                "4",
                "--for",
                "8h",
                "--nvlink",
                "--key",
                "train-1",
                "-o",
                "json",
            )
            assert reserved.rc == 0, reserved
            assert "train-1" in reserved.stderr  # the key is printed, to retry with
            rid = reserved.json()["id"]
            assert reserved.json()["state"] == "placed"

            # The simulated node binds its devices: the reservation becomes active.
            state_now = "placed"
            for _ in range(50):
                got = await cli("reservations", "get", rid, "--tenant", "acme", "-o", "json")
                state_now = got.json()["state"]
                if state_now == "active":
                    break
                await asyncio.sleep(0.2)
            assert state_now == "active"
            binding = await cli(
                "reservations", "get", rid, "--tenant", "acme", "--query", "binding", "-o", "json"
            )
            assert binding.rc == 0, binding
            devices = binding.json()["cdiDevices"]
            assert len(devices) == 4
            assert all(d.startswith("bcd.dev/gpu=GPU-") for d in devices)
            env_file = binding.json()["envFile"]
            assert await asyncio.to_thread(Path(env_file).is_file)
            # dev's simulated nodes are certified by its dev authority: the binding is attested.
            assert binding.json()["attested"] is True
            table = await cli("reservations", "get", rid, "--tenant", "acme")
            assert "attested: yes" in table.stdout, table

            extended = await cli("extend", rid, "--tenant", "acme", "--until", "+12h", "-o", "json")
            assert extended.rc == 0, extended
            assert extended.json()["extended"] is True

            conflict = await cli(
                "reserve",
                "--tenant",
                "acme",
                "--pool",
                "pool_h100",
                "--gpus",
                "2",
                "--for",
                "1h",
                "--key",
                "train-1",
            )
            assert conflict.rc == 6  # conflict (docs/cli.md#exit-codes)
            assert "CONFLICT" in conflict.stderr

            released = await cli("release", rid, "--tenant", "acme", "-o", "json")
            assert released.rc == 0, released
            assert released.json()["state"] == "released"
            assert released.json()["releaseReason"] == "release"
    finally:
        shutil.rmtree(state.parent, ignore_errors=True)


async def test_reserve_waits_for_the_pool_lease_placer_of_a_live_dev_stack(
    tmp_path: Path,
) -> None:
    # The demo world with its H100 pool placed by the pool-lease placer: `reserve --wait`
    # answers the reservation its batch placed, through dev's own placer loop.
    demo = dev_config.demo_path().read_text()
    assert "      maxPending: 24h\n" in demo
    config = tmp_path / "lease.yaml"
    config.write_text(
        demo.replace("      maxPending: 24h\n", "      maxPending: 24h\n      placer: pool-lease\n")
    )
    state = Path(tempfile.mkdtemp(prefix="bc-cli-dev-")) / "state"
    try:
        async with running.started(
            port=0, metrics_port=0, sim=1, state_dir=state, config=config
        ) as dev:
            env = {"BETTER_COMPUTE_URL": dev.url, "BETTER_COMPUTE_TOKEN": dev.tokens["alice@acme"]}
            reserved = await run_cli(
                "reserve",
                "--tenant",
                "acme",
                "--pool",
                "pool_h100",
                "--gpus",
                "4",
                "--for",
                "1h",
                "--key",
                "queued-1",
                "--timeout",
                "20s",
                "-o",
                "json",
                home=tmp_path,
                env=env,
            )
            assert reserved.rc == 0, reserved
            assert reserved.json()["state"] == "placed", reserved.json()
            assert reserved.json()["operation"]["state"] == "succeeded"
    finally:
        await asyncio.to_thread(shutil.rmtree, state.parent, ignore_errors=True)
