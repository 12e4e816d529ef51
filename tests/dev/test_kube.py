"""``better-compute dev --kube`` as a person runs it: a process that starts the dev stack and a
real Kubernetes control plane, prints how to reach it, and leaves nothing behind on Ctrl-C.

The test does what the banner says: it exports the printed ``KUBECONFIG``, runs the printed
``kubectl`` (the real one, of the same build as the API server) with the printed ``apply``
line, and watches ``kubectl get rsv`` until the Reservation is placed by the real operator,
through the chart's real webhooks, on a simulated node. Then SIGINT: the command exits 0, and
no process it started (etcd, the API server, the controller-manager, the scheduler, the
operator, PostgreSQL) is left.

Skips, saying why, only where the control plane's binary is not built
(``.venv/bin/python -m tests.controlplane.build``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from bettercompute.dev import running
from bettercompute.dev.controlplane import binary
from tests.dev.test_running import free_port

ROOT = Path(__file__).resolve().parents[2]
#: Starting it all on a busy two-core machine: the stack, four control-plane processes, the
#: operator.
READY_S = 240.0
PLACED = ("placed", "binding", "active")


@pytest.fixture(scope="module")
def kube_binary() -> Path:
    try:
        return binary.find()
    except binary.BinaryMissing as e:
        pytest.skip(f"the control plane is not built: {e}")


def _command(port: int, state: Path) -> list[str]:
    args = ["dev", "--kube", "--port", str(port), "--state-dir", str(state), "--sim", "1"]
    if "metrics_port" in inspect.signature(running.run).parameters:
        args[2:2] = ["--metrics-port", "0"]
    script = Path(sys.executable).with_name("better-compute")
    if script.exists():
        return [str(script), *args]
    return [sys.executable, "-c", "from bettercompute.cli.app import main; main()", *args]


class Dev:
    def __init__(self, state: Path, log: Path) -> None:
        self.state, self.log = state, log
        with log.open("w") as out:
            self.process = subprocess.Popen(
                _command(free_port(), state),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={
                    **{k: v for k, v in os.environ.items() if k != binary.ENV},
                    "COLUMNS": "200",
                    "PYTHONUNBUFFERED": "1",
                },
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self) -> str:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            text = self.output()
            if "Press Ctrl-C to stop." in text:
                return text
            assert self.process.poll() is None, f"dev exited:\n{text}"
            time.sleep(0.5)
        raise AssertionError(f"dev --kube not ready within {READY_S:.0f} s:\n{self.output()}")


def family(dev: Dev) -> list[psutil.Process]:
    """Every process of the command: its descendants, and whatever names its state dir (the
    embedded PostgreSQL is a daemon, not a child)."""
    found = {p.pid: p for p in psutil.Process(dev.process.pid).children(recursive=True)}
    found.update({p.pid: p for p in on_state(dev.state)})
    return list(found.values())


def on_state(state: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if str(state) in " ".join(proc.info["cmdline"] or ()) and alive(proc):
                found.append(proc)
    return found


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def dev(tmp_path: Path, kube_binary: Path) -> Iterator[Dev]:
    started = Dev(tmp_path / "state", tmp_path / "dev.log")
    try:
        yield started
    finally:
        # Whatever happened, nothing of it outlives the test.
        if started.process.poll() is None:
            for proc in family(started):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            started.process.kill()
            started.process.wait()
        for proc in on_state(started.state):
            with contextlib.suppress(psutil.Error):
                proc.kill()


def kubectl(path: Path, kubeconfig: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(path), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "KUBECONFIG": kubeconfig},
    )


@pytest.mark.timeout(600)
def test_dev_kube_serves_kubectl_and_leaves_nothing_behind(dev: Dev) -> None:
    banner = dev.wait_ready()
    exported = re.search(r"^export KUBECONFIG=(\S+) PATH=(\S+):\$PATH$", banner, re.MULTILINE)
    shown = re.search(r"^kubectl:\s+(\S+)$", banner, re.MULTILINE)
    assert exported, banner
    assert shown, banner
    kubeconfig = exported.group(1)
    tool = Path(shown.group(1))
    assert tool.parent == Path(exported.group(2))
    assert tool.name == "kubectl"
    assert Path(kubeconfig).is_file()

    # The simulated nodes are Nodes, with what their devices give.
    node = kubectl(
        tool, kubeconfig, "get", "node", "sim-h100-00", "-o", r"jsonpath={.status.allocatable}"
    )
    assert node.returncode == 0, node.stderr
    assert '"bcd.dev/gpu":"8"' in node.stdout

    # The printed apply line, as printed: the example namespace and Reservation.
    (apply_line,) = [line for line in banner.splitlines() if line.startswith("kubectl apply ")]
    applied = kubectl(tool, kubeconfig, *shlex.split(apply_line)[1:])
    assert applied.returncode == 0, applied.stderr
    assert "reservation.bcd.dev/train-1 created" in applied.stdout

    deadline = time.monotonic() + 90
    listed = None
    while time.monotonic() < deadline:
        listed = kubectl(tool, kubeconfig, "get", "rsv", "-n", "ml")
        rows = [line.split() for line in listed.stdout.splitlines()]
        if len(rows) == 2 and rows[1][1] in PLACED:
            break
        time.sleep(0.5)
    assert listed is not None
    header, row = (line.split() for line in listed.stdout.splitlines())
    # The CRD's printer columns, as kubectl shows them.
    assert header == ["NAME", "STATE", "READY", "GPUS", "POOL", "NODE(S)", "START", "END", "AGE"]
    assert row[0] == "train-1", listed.stdout
    assert row[1] in PLACED, listed.stdout
    assert (row[3], row[4]) == ("4", "pool_h100")
    assert "sim-h100-00" in row[5]

    processes = family(dev)
    names = {" ".join(p.cmdline()[:2]) for p in processes if alive(p)}
    assert any("kube-apiserver" in n for n in names), names
    assert any("better-compute-operator" in n or "operator()" in n for n in names), names

    dev.process.send_signal(signal.SIGINT)
    code = dev.process.wait(timeout=60)
    output = dev.output()
    assert code == 0, output
    assert "Stopped." in output
    assert "Traceback" not in output
    left = [p for p in processes if alive(p)] + on_state(dev.state)
    assert not left, [(p.pid, p.cmdline()) for p in left]
    assert not (dev.state / "kube").exists()


def test_a_missing_binary_is_one_line_naming_the_build_command(tmp_path: Path) -> None:
    """Nothing starts (not even the state dir is made): the error says how to build it."""
    state = tmp_path / "state"
    command = _command(free_port(), state)
    command[command.index("--kube") + 1 : command.index("--kube") + 1] = [
        "--kube-binary",
        str(tmp_path / "no-such-binary"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("Error: --kube-binary names ")
    assert binary.BUILD_COMMAND in line
    assert not state.exists()


def test_without_a_build_the_error_says_where_it_looked_and_how_to_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(binary, "checkouts", lambda: [tmp_path])
    with pytest.raises(binary.BinaryMissing) as raised:
        binary.find(environ={})
    message = str(raised.value)
    assert str(tmp_path / binary.RELATIVE) in message
    assert f"`{binary.BUILD_COMMAND}`" in message
    with pytest.raises(binary.BinaryMissing, match=r"\$BCD_KUBE_BINARY names"):
        binary.find(environ={binary.ENV: str(tmp_path / "elsewhere")})
