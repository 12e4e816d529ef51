"""actionlint, built from its Go module into ``.cache/actionlint/<version>/``, for the workflow
tests (``python -m tests.release.actionlint`` builds it ahead).

Why built, not downloaded: like the control plane (``tests/controlplane/build.py``), only Go
modules are fetched, through Go's module proxy and checked against its checksum database; a
build is reused while its version stands, and Go's build cache makes a rebuild take seconds.
CI (``.ci/run``) and the release workflow pay for the first build once per cache.

What it must never do: fetch a prebuilt binary, or write outside ``.cache/actionlint`` (and
Go's own caches).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE = "github.com/rhysd/actionlint/cmd/actionlint"
#: Pinned: a newer actionlint may judge the same workflow differently.
VERSION = "v1.7.12"
BINARY = ROOT / ".cache" / "actionlint" / VERSION / "actionlint"


class BuildError(RuntimeError):
    """Go is missing or the build failed; the message says which."""


def build(*, quiet: bool = True) -> Path:
    """The actionlint binary of ``VERSION``, built on first use."""
    if BINARY.is_file():
        return BINARY
    go = shutil.which("go")
    if go is None:
        raise BuildError(f"Go is not installed: actionlint is built from {MODULE}@{VERSION}")
    BINARY.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"building actionlint {VERSION} into {BINARY}", file=sys.stderr, flush=True)
    env = {**os.environ, "GOBIN": str(BINARY.parent), "CGO_ENABLED": "0"}
    result = subprocess.run(
        [go, "install", "-trimpath", f"{MODULE}@{VERSION}"],
        cwd=BINARY.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if result.returncode != 0 or not BINARY.is_file():
        raise BuildError(f"go install failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return BINARY


if __name__ == "__main__":
    print(build(quiet=False))
