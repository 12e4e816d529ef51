"""The shell steps a page of ours shows, read out of its Markdown and run as a reader would.

Why it exists: the README's walkthrough and the command sequences in ``docs/`` are promises a
newcomer tests by pasting them. Read here, they are run by ``test_walkthrough.py`` against a
fresh ``better-compute dev``, so a step that stops working fails a test instead of a reader.

The conventions a page follows (the README states them above its walkthrough):

* The fenced ``bash``/``sh`` blocks of a section are shell lines; a ``console`` block's commands
  are its ``$ `` lines (the rest is output). A line ending in ``\\`` goes on on the next one.
* ``rsv_…``, ``cnf_…``, ``sub_01k…`` (any ``kind_…``, with or without a few characters before
  the ellipsis) stands for the id of that kind the steps before printed last.
* A comment ``# exits N: …`` on a command or on the comment lines right after it says the step
  ends with exit code N; with ``Error CODE`` in it, stderr must name that code. Every other
  step must exit 0.
* ``# runs until Ctrl-C`` says the step serves or follows until interrupted: it must still run
  after a few seconds, and end with 0 or 130 on SIGINT.

What it must never do: run a step some other way than a shell would (each runs in ``bash``,
with the environment the ``export`` steps before it left), or let a step's failure pass.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

RUNNABLE = ("bash", "sh", "console")
#: A step that takes longer than this is hung, not slow.
STEP_TIMEOUT_S = 90.0
#: How long a ``# runs until Ctrl-C`` step must keep running before it is interrupted.
RUNS_FOR_S = 3.0

_FENCE = re.compile(r"^```(\w*)\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
_EXITS = re.compile(r"#\s*exits (\d+)\b([^\n]*)")
_ERROR_CODE = re.compile(r"\bError ([A-Z][A-Z_]+)\b")
_UNTIL_CTRL_C = re.compile(r"#[^\n]*\bruns until Ctrl-C\b")
_PLACEHOLDER = re.compile(r"\b([a-z]+)_[0-9a-z]*…")
_ID = re.compile(r"\b([a-z]+)_([0-9a-z]{8,})\b")


@dataclass(frozen=True)
class Block:
    """A fenced block: where it starts (``page:line``), its language and its text."""

    where: str
    lang: str
    text: str


@dataclass
class Step:
    """One command a reader runs, with what the page says it ends with."""

    where: str
    command: str
    exits: int = 0
    error_code: str | None = None
    until_ctrl_c: bool = False

    def expect(self, comment: str) -> None:
        """Take the markers of a comment on or after the command."""
        marker = _EXITS.search(comment)
        if marker is not None:
            self.exits = int(marker.group(1))
            code = _ERROR_CODE.search(marker.group(2))
            self.error_code = code.group(1) if code else None
        if _UNTIL_CTRL_C.search(comment):
            self.until_ctrl_c = True


def blocks(page: Path, heading: str) -> list[Block]:
    """The fenced blocks under ``heading`` (its subsections included), in order."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    level = 0  # the heading's level while inside its section, else 0
    fence: tuple[int, str, list[str]] | None = None
    for number, line in enumerate(lines, start=1):
        opened = _FENCE.match(line)
        if fence is not None:
            if line.strip() == "```":
                start, lang, body = fence
                if level:
                    found.append(Block(f"{page.name}:{start}", lang, "\n".join(body)))
                fence = None
            else:
                fence[2].append(line)
            continue
        if opened is not None:
            fence = (number, opened.group(1), [])
            continue
        title = _HEADING.match(line)
        if title is not None:
            depth = len(title.group(1))
            if title.group(2) == heading:
                level = depth
            elif level and depth <= level:
                level = 0
    if not found:
        raise AssertionError(f"{page.name} has no section {heading!r} with fenced blocks")
    return found


def steps(block: Block) -> list[Step]:
    """The commands of a runnable block, each with the markers that follow it."""
    if block.lang not in RUNNABLE:
        return []
    page, first = block.where.rsplit(":", 1)
    found: list[Step] = []
    current: list[str] = []
    last: Step | None = None
    for offset, raw in enumerate(block.text.splitlines(), start=1):
        line = raw.strip()
        if current:
            current.append(line)
        elif block.lang == "console":
            if not line.startswith("$ "):
                continue  # output shown, not run
            current = [line[2:]]
        elif not line:
            last = None  # a blank line ends what a comment can say about a command
            continue
        elif line.startswith("#"):
            if last is not None:
                last.expect(line)
            continue
        else:
            current = [line]
        if current[-1].endswith("\\"):
            continue
        command = "\n".join(current)
        last = Step(f"{page}:{int(first) + offset - len(current) + 1}", command)
        last.expect(command)
        found.append(last)
        current = []
    return found


@dataclass
class Outcome:
    rc: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return f"exit {self.rc}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


@dataclass
class Shell:
    """Runs steps one after another as one terminal would: the environment ``export`` leaves
    carries on, and ids printed by a step fill the ``kind_…`` placeholders of later ones."""

    cwd: Path
    env: dict[str, str]
    ids: dict[str, list[str]] = field(default_factory=dict)
    transcript: list[str] = field(default_factory=list)

    def substitute(self, step: Step) -> str:
        def one(match: re.Match[str]) -> str:
            kind = match.group(1)
            seen = self.ids.get(kind)
            if not seen:
                raise AssertionError(
                    f"{step.where}: {kind}_… stands for the last {kind}_ id printed, "
                    "and no step before printed one"
                )
            return seen[-1]

        return _PLACEHOLDER.sub(one, step.command)

    def remember(self, text: str) -> None:
        for match in _ID.finditer(text):
            kind, value = match.group(1), match.group(0)
            seen = self.ids.setdefault(kind, [])
            # A table may show a short prefix of an id printed in full before: keep the full one.
            full = next((s for s in reversed(seen) if s.startswith(value)), value)
            seen.append(full)

    def run(self, step: Step) -> Outcome:
        command = self.substitute(step)
        self.transcript.append(f"$ {command}")
        outcome = self._interrupted(step, command) if step.until_ctrl_c else self._run(command)
        self.remember(outcome.stdout + "\n" + outcome.stderr)
        self.transcript.append(f"  → exit {outcome.rc}")
        return outcome

    def _run(self, command: str) -> Outcome:
        # The environment the command leaves is written to a file of its own, so that the
        # next step starts where this one ended (an `export` line, as in a terminal).
        with tempfile.NamedTemporaryFile(prefix="walkthrough-env-") as env_file:
            script = f'{command}\n__rc=$?\nenv -0 > "{env_file.name}"\nexit $__rc\n'
            done = subprocess.run(
                ["bash", "-c", script],
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=STEP_TIMEOUT_S,
                check=False,
            )
            left = Path(env_file.name).read_text()
        if left:
            self.env = dict(entry.split("=", 1) for entry in left.split("\0") if "=" in entry)
        return Outcome(done.returncode, done.stdout, done.stderr)

    def _interrupted(self, step: Step, command: str) -> Outcome:
        process = subprocess.Popen(
            ["bash", "-c", command],
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        time.sleep(RUNS_FOR_S)
        running = process.poll() is None
        if running:
            os.killpg(process.pid, signal.SIGINT)
        try:
            out, err = process.communicate(timeout=STEP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
        if not running:
            err += f"\n[{step.where}: ended before it was interrupted]"
            return Outcome(process.returncode or 1, out, err)
        # Ctrl-C is how such a step ends: 0 (stopped cleanly), 130 (interrupted) or the signal
        # itself (what a shell reports as 130) are all it.
        stopped = process.returncode in (0, 130, -signal.SIGINT)
        return Outcome(0 if stopped else process.returncode, out, err)


def failure(step: Step, outcome: Outcome) -> str | None:
    """Why ``outcome`` is not what the page says ``step`` does, or None."""
    if outcome.rc != step.exits:
        said = f"exits {step.exits}" if step.exits else "nothing, so it must exit 0"
        return f"{step.where}: the page says {said}; it exited {outcome.rc}\n{outcome}"
    if step.error_code and f"Error {step.error_code}" not in outcome.stderr:
        return f"{step.where}: the page says Error {step.error_code}; it printed\n{outcome}"
    if step.exits == 0 and _error_answer(outcome.stdout):
        # curl exits 0 whatever the API answers: its answer says whether the step worked.
        return f"{step.where}: the API answered an error\n{outcome}"
    return None


def _error_answer(stdout: str) -> bool:
    text = stdout.strip()
    if not text.startswith('{"error"'):
        return False
    try:
        return "error" in json.loads(text)
    except ValueError:
        return False


@dataclass
class Dev:
    """A ``better-compute dev`` process and what it printed."""

    process: subprocess.Popen[str]
    url: str
    printed: list[str] = field(repr=False)

    def export_line(self) -> str:
        """The one ``export`` line of the banner, which the README tells a reader to paste."""
        banner = self.printed[: self.printed.index("Press Ctrl-C to stop.") + 1]
        lines = [line for line in banner if line.startswith("export ")]
        assert len(lines) == 1, f"dev printed {len(lines)} export lines:\n" + "\n".join(banner)
        return lines[0]


def dev_command(*args: str) -> list[str]:
    """The installed ``better-compute`` beside this interpreter, as the README runs it."""
    script = Path(sys.executable).with_name("better-compute")
    if script.exists():
        return [str(script), "dev", *args]
    return [sys.executable, "-m", "bettercompute.cli.app", "dev", *args]


@contextlib.contextmanager
def started_dev(
    state: Path, port: int, metrics_port: int, env: Mapping[str, str], *, timeout_s: float = 120.0
) -> Iterator[Dev]:
    """Start ``better-compute dev`` and yield it once it printed its banner; stop it after."""
    args = ["--port", str(port), "--metrics-port", str(metrics_port), "--state-dir", str(state)]
    process = subprocess.Popen(
        dev_command(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(env),
    )
    printed: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        # Read to the end: dev logs on, and a full pipe would stop it.
        assert process.stdout is not None
        for line in process.stdout:
            printed.append(line.rstrip("\n"))
            if line.startswith("Press Ctrl-C to stop."):
                ready.set()
        ready.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        if not ready.wait(timeout_s) or process.poll() is not None:
            raise AssertionError("dev was not ready:\n" + "\n".join(printed))
        yield Dev(process, f"http://127.0.0.1:{port}", printed)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        reader.join(timeout=5)
