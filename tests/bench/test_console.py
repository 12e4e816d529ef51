"""``bench/console.py --small``: the console's bench runs end to end, as a person runs it.

Why in the test suite: the bench loads bookings with plain SQL, so a change to the tables or
to ``pools.timeline`` could break it silently; a smoke run keeps it working, and checks what
it measures is real (the timeline answered every booking it loaded, the list read them all,
Chromium drew the page). It runs on its own embedded PostgreSQL or ``DATABASE_URL``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.console.conftest import chromium_path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "console.py"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_console_bench_runs_small() -> None:
    args = [sys.executable, str(BENCH), "--small"]
    browser = chromium_path() is not None
    if not browser:
        print("\nbench/console.py --small runs without its Chromium line: no Chromium here")
        args.append("--no-browser")
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=220, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    loaded = int(re.search(r"^(\d+) bookings over", output, re.M).group(1))  # type: ignore[union-attr]
    assert loaded == 1000, output
    shown = re.search(r"pools\.timeline .* (\d+) bookings", output)
    assert shown is not None, output
    assert int(shown.group(1)) == loaded
    listed = re.search(r"\((\d+) of acme's reservations", output)
    assert listed is not None, output
    assert int(listed.group(1)) == loaded // 2
    if browser:
        assert re.search(r"drawn timeline\s+median\s+[\d.]+ ms", output), output
