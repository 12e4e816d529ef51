"""The README's walkthrough and the command sequences of ``docs/confirmations.md`` and
``docs/events.md``, run in order against a fresh ``better-compute dev`` as a reader runs them.

Each test starts the real command (``better-compute dev`` on free ports, a state dir of its own),
pastes the ``export`` line the banner printed, and runs the page's blocks step by step in
``bash`` (``tests/docs/walkthrough.py`` reads them and says the conventions). A step fails the
test when it ends otherwise than its page says: any non-zero exit not marked ``# exits N``, a
marked one that does not, or an API error answered to a ``curl``.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.dev.test_running import free_port
from tests.docs import walkthrough
from tests.docs.walkthrough import Dev, Outcome, Shell, Step
from tests.support import epochs

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


@pytest.fixture
def dev() -> Iterator[Dev]:
    # A private directory outside pytest's tmp_path: the embedded PostgreSQL runs as its own
    # user (see tests/dev/test_running.py's state fixture).
    root = Path(tempfile.mkdtemp(prefix="bc-walkthrough-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("BETTER_COMPUTE_")}
    try:
        with walkthrough.started_dev(root / "state", free_port(), free_port(), env) as started:
            yield started
    finally:
        shutil.rmtree(root, ignore_errors=True)


def shell_after_dev(dev: Dev, home: Path, *, installed: bool = False) -> Shell:
    """A second terminal: a clean environment with the ``export`` line dev printed; with
    ``installed``, ``better-compute`` on the PATH as the docs pages take it to be (the README
    puts it there itself)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BETTER_COMPUTE_")}
    env.update({"HOME": str(home), "COLUMNS": "100", "NO_COLOR": "1"})
    if installed:
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    shell = Shell(ROOT, env)
    export = Step("dev's banner", dev.export_line())
    outcome = shell.run(export)
    assert walkthrough.failure(export, outcome) is None, outcome
    assert shell.env["BETTER_COMPUTE_URL"] == dev.url
    return shell


def run_all(shell: Shell, steps: list[Step]) -> list[tuple[Step, Outcome]]:
    ran = []
    for step in steps:
        outcome = shell.run(step)
        problem = walkthrough.failure(step, outcome)
        assert problem is None, problem + "\n--- the steps so far\n" + "\n".join(shell.transcript)
        ran.append((step, outcome))
    return ran


# What programs read, where the API's epoch milliseconds and '28800000ms' durations belong.
_FOR_PROGRAMS = re.compile(r"^curl |(-o|--output)[ =](json|yaml)\b|--query\b|\bmcp\b", re.M)


def epoch_ms_shown(ran: list[tuple[Step, Outcome]]) -> list[str]:
    """Each step whose output for people shows an epoch-ms time or a duration in ms."""
    return [
        f"{step.where}: {step.command}\n  shows {epochs.found(out.stdout + out.stderr)}"
        for step, out in ran
        if not _FOR_PROGRAMS.search(step.command) and epochs.found(out.stdout + out.stderr)
    ]


# Human commands beyond the walkthrough's, on what it left: every list, a released
# reservation, a decided confirmation, usage by day, the subscriptions.
MORE_FOR_PEOPLE = [
    "better-compute reservations list --tenant acme --all",
    "better-compute reservations get rsv_… --tenant acme",
    "better-compute confirmations list --tenant acme --state approved",
    "better-compute usage --tenant acme --from -1d --by day",
    "better-compute subscriptions list --tenant acme",
    "better-compute pools --tenant acme",
    "better-compute capacity --find --tenant acme --pool pool_h100 --gpus 8 --for 24h",
]


def steps_of(page: Path, *headings: str) -> list[Step]:
    return [s for h in headings for b in walkthrough.blocks(page, h) for s in walkthrough.steps(b)]


def test_the_readme_walkthrough_runs_on_a_fresh_dev(dev: Dev, tmp_path: Path) -> None:
    shell = shell_after_dev(dev, tmp_path)
    steps = steps_of(README, "A five-minute walkthrough")
    assert len(steps) >= 20, [s.command for s in steps]
    ran = run_all(shell, steps)
    # The demo is sized for the walkthrough: nothing it asked for is left waiting for room.
    answer = httpx.post(
        f"{dev.url}/api/compute/reservations/list",
        json={"tenantId": "acme", "scope": "all"},
        headers={
            "Authorization": f"Bearer {shell.env['BETTER_COMPUTE_TOKEN']}",
            "X-Better-Compute": "1",
        },
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    pending = [r for r in answer.json()["data"]["items"] if r["state"] == "pending"]
    assert pending == [], pending
    # The README tells the reader what dev prints: one export line.
    assert "with the `export` line `dev` printed" in README.read_text()
    # Times people read are RFC 3339 and durations have units, in tables, errors and details
    # alike (the CONFIRMATION_REQUIRED refusal's expiresAt among them), and in dev's banner.
    ran += run_all(shell, [Step("more", command) for command in MORE_FOR_PEOPLE])
    assert epoch_ms_shown(ran) == []
    banner = "\n".join(dev.printed[: dev.printed.index("Press Ctrl-C to stop.")])
    assert epochs.found(banner) == [], banner


def test_the_readme_kube_steps_need_dev_kube() -> None:
    # Listed, not run: they need `better-compute dev --kube` (a control plane of its own);
    # tests/dev/test_kube.py runs the same lines from that banner against it.
    steps = steps_of(README, "Kubernetes on your laptop: `dev --kube`")
    assert any(s.command.startswith("kubectl ") for s in steps)
    print("skipped, they need `better-compute dev --kube` (tests/dev/test_kube.py runs them):")
    for step in steps:
        print(f"  {step.where}: {step.command}")


def test_the_confirmation_and_subscription_pages_run_on_a_fresh_dev(
    dev: Dev, tmp_path: Path
) -> None:
    shell = shell_after_dev(dev, tmp_path, installed=True)
    pages = ROOT / "docs"
    steps = steps_of(pages / "confirmations.md", "Answering")
    steps += steps_of(pages / "events.md", "Subscriptions")
    assert len(steps) >= 6, [s.command for s in steps]
    run_all(shell, steps)


# --- the reading itself -----------------------------------------------------------------------

PAGE = """\
# A page

## Try it

```bash
export A=1
tool make --x 1 \\
  --y 2
# exits 6: Error CONFLICT: already there

# a comment about the next one, exits 9 is not a marker
tool get obj_…   # runs until Ctrl-C
```

```text
tool never-run
```

```console
$ tool list
 ID        STATE
 obj_1234abcd   ok
$ tool drop obj_…   # exits 4
```

## Elsewhere

```bash
tool not-this-section
```
"""


def test_steps_are_read_with_their_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    found = walkthrough.blocks(page, "Try it")
    assert [b.lang for b in found] == ["bash", "text", "console"]
    steps = [s for b in found for s in walkthrough.steps(b)]
    assert [s.command for s in steps] == [
        "export A=1",
        "tool make --x 1 \\\n--y 2",
        "tool get obj_…   # runs until Ctrl-C",
        "tool list",
        "tool drop obj_…   # exits 4",
    ]
    assert [(s.exits, s.error_code, s.until_ctrl_c) for s in steps] == [
        (0, None, False),
        (6, "CONFLICT", False),
        (0, None, True),
        (0, None, False),
        (4, None, False),
    ]
    assert steps[1].where == "page.md:7"  # where the command starts


def test_a_missing_section_is_an_error(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    with pytest.raises(AssertionError, match="no section 'Gone'"):
        walkthrough.blocks(page, "Gone")


def test_placeholders_take_the_last_id_printed_and_export_carries_on(tmp_path: Path) -> None:
    shell = Shell(tmp_path, {"PATH": os.environ["PATH"]})
    with pytest.raises(AssertionError, match="no step before printed one"):
        shell.substitute(Step("x", "echo rsv_…"))
    first = shell.run(Step("x", "export WHO=alice; echo rsv_0123456789abcdef"))
    assert first.rc == 0
    shell.run(Step("x", "echo rsv_fedcba9876543210 >&2"))
    shell.run(Step("x", "echo 'short: rsv_01234567'"))  # a table's prefix of the first
    echoed = shell.run(Step("x", 'echo "$WHO rsv_…"'))
    assert echoed.stdout.strip() == "alice rsv_0123456789abcdef"


def test_a_step_that_exits_otherwise_than_its_page_says_fails(tmp_path: Path) -> None:
    shell = Shell(tmp_path, {"PATH": os.environ["PATH"]})
    plain = Step("p:1", "exit 3")
    assert "it exited 3" in (walkthrough.failure(plain, shell.run(plain)) or "")
    marked = Step("p:2", "echo 'Error CONFLICT: no' >&2; exit 6", exits=6, error_code="CONFLICT")
    assert walkthrough.failure(marked, shell.run(marked)) is None
    wrong = Step("p:3", "echo 'Error NOT_FOUND' >&2; exit 6", exits=6, error_code="CONFLICT")
    assert "says Error CONFLICT" in (walkthrough.failure(wrong, shell.run(wrong)) or "")
    curl = Step("p:4", """echo '{"error": {"code": "QUOTA_EXCEEDED"}}'""")
    assert "answered an error" in (walkthrough.failure(curl, shell.run(curl)) or "")
    quick = Step("p:5", "true", until_ctrl_c=True)
    assert "ended before it was interrupted" in (walkthrough.failure(quick, shell.run(quick)) or "")
    served = Step("p:6", "sleep 30", until_ctrl_c=True)
    assert walkthrough.failure(served, shell.run(served)) is None


def test_epoch_ms_in_output_for_people_is_found_and_in_output_for_programs_is_not() -> None:
    details = Outcome(5, "", "details:\n  expiresAt: 1796534722946\n  duration: 1800000ms\n")
    told = epoch_ms_shown([(Step("p:1", "better-compute reserve --gpus 6"), details)])
    assert len(told) == 1
    assert "1796534722946" in told[0]
    assert "1800000ms" in told[0]
    for command in ("better-compute get rsv_… -o json", "curl -X POST …", "x --query during"):
        assert epoch_ms_shown([(Step("p:2", command), details)]) == []
    fine = Outcome(0, "during 2026-12-24T08:00:00Z → 2026-12-24T16:00:00Z (8h)", "")
    assert epoch_ms_shown([(Step("p:3", "better-compute get rsv_…"), fine)]) == []
