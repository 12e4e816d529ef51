"""The chaos harness, short: three kills of a live ``better-compute dev`` under load.

Why in the test suite: the invariants a crash must not break (every acknowledged create kept
with its id, one reservation per key, quota and budget ledgers equal to the reservations, no
overlap, nothing stuck, no 500, a server that recovers by itself and stops cleanly) are only
believable when checked against real kills, on every change. ``bench/chaos.py`` does the
killing and checking; this runs it as a person would, in a subprocess with a fixed seed, and
fails with its printed figures when any invariant fails.

Seed 11 kills, in order: the server with SIGKILL (a crash), then with Ctrl-C (it must exit 0
and stop its PostgreSQL: after a crash it used not to), then PostgreSQL's postmaster with SIGKILL
(dev must recover without help). It always uses dev's own embedded PostgreSQL, never
``DATABASE_URL``: killing PostgreSQL is part of the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "bench" / "chaos.py"


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_three_kills_under_load_keep_every_invariant(tmp_path: Path) -> None:
    figures = tmp_path / "chaos.json"
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    done = subprocess.run(
        [
            sys.executable,
            str(HARNESS),
            "--kills",
            "3",
            "--seed",
            "11",
            "--writers",
            "16",
            "--recovery-timeout",
            "15",
            "--shutdown-timeout",
            "8",
            "--op-timeout",
            "45",
            "--json",
            str(figures),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=260,
    )
    output = done.stdout + done.stderr
    assert figures.exists(), f"the harness wrote no figures (exit {done.returncode}):\n{output}"
    result = json.loads(figures.read_text())
    assert [k["kind"] for k in result["kills"]] == ["server-sigkill", "server-sigint", "pg-sigkill"]
    assert result["acked"].get("create", 0) > 0, output  # the load really ran
    assert result["failed"] == [], output
    assert done.returncode == 0, output
    assert result["status500"] == 0
