"""Build the real Kubernetes control plane for the tests: ``python -m tests.controlplane.build``.

Why it exists: the tests run our operator, webhooks and RBAC against the real kube-apiserver,
kube-controller-manager, kube-scheduler and an embedded etcd, and the docs use the real
``kubectl``. All five come from one Go program in this directory (``main.go``), built from
Kubernetes' own Go modules (``go.mod`` pins the release) through the Go module proxy. Nothing
is downloaded but Go modules; the Go build cache makes a second build take seconds.

Kueue's controller manager (``test_real_kueue.py``) is a second binary, ``kueue-manager``,
built the same way from Kueue's Go module, pinned by ``kueue/go.mod`` (``build_kueue``; cold,
minutes: ``main`` builds it, so CI's build step does, before any test's timeout runs).

The control plane is linked with its release as its version (``-X`` of
``k8s.io/component-base/version``): without it the API server reports
``v0.0.0-master+$Format:%H$``, which Kueue cannot parse, and it exits.

What it must never do: fetch a prebuilt binary, or write outside ``.cache/controlplane`` (and
Go's own caches).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bettercompute.dev.controlplane.binary import COMMANDS, RELATIVE

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
#: Where ``better-compute dev --kube`` looks for it (``bettercompute.dev.controlplane.binary``).
BINARY = ROOT / RELATIVE
OUTPUT = BINARY.parent


class BuildError(RuntimeError):
    """The Go build failed, or Go is missing; the message says which and what to do."""


def kubernetes_version() -> str:
    """The Kubernetes release ``go.mod`` pins (``v1.34.4``)."""
    for line in (HERE / "go.mod").read_text().splitlines():
        words = line.split()
        if words[:1] == ["k8s.io/kubernetes"] and len(words) >= 2:
            return words[1]
    raise BuildError("tests/controlplane/go.mod pins no k8s.io/kubernetes version")


#: Kueue's controller manager, built from ``kueue/go.mod``.
KUEUE_DIR = HERE / "kueue"
KUEUE_BINARY = OUTPUT / "kueue-manager"


def go_sources() -> list[Path]:
    # This file too: it sets the link flags.
    return sorted([*HERE.glob("*.go"), HERE / "go.mod", HERE / "go.sum", Path(__file__)])


def version_flags() -> str:
    """``-X`` flags that make every component report the pinned release."""
    version = kubernetes_version()
    major, minor = version.removeprefix("v").split(".")[:2]
    flags = []
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {package}.gitVersion={version}",
            f"-X {package}.gitMajor={major}",
            f"-X {package}.gitMinor={minor}",
        ]
    return " ".join(flags)


def up_to_date() -> bool:
    """The binary exists and is newer than every Go source and the module files."""
    if not BINARY.is_file():
        return False
    built = BINARY.stat().st_mtime
    return all(path.stat().st_mtime <= built for path in go_sources())


def build(*, force: bool = False, quiet: bool = False) -> Path:
    """Build (or reuse) the binary and link each command name to it; the binary's path."""
    if not force and up_to_date():
        _link_commands()
        return BINARY
    go = shutil.which("go")
    if go is None:
        raise BuildError(
            "Go is not installed: the real control plane is built from Kubernetes' Go modules "
            "(Go 1.24 or newer, with the Go module proxy reachable)"
        )
    OUTPUT.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if not quiet:
        print(
            f"building the Kubernetes {kubernetes_version()} control plane into {BINARY} "
            "(cold: several minutes; with Go's build cache: seconds)",
            file=sys.stderr,
            flush=True,
        )
    partial = BINARY.with_suffix(".partial")
    # -trimpath and no symbol tables: a smaller binary, and the same bytes from any checkout.
    command = [
        go,
        "build",
        "-trimpath",
        f"-ldflags=-s -w {version_flags()}",
        "-o",
        str(partial),
        ".",
    ]
    env = {**os.environ, "CGO_ENABLED": "0"}
    result = subprocess.run(command, cwd=HERE, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"go build failed ({result.returncode}):\n{result.stderr[-4000:]}")
    partial.replace(BINARY)
    _link_commands()
    if not quiet:
        print(f"built in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return BINARY


def build_kueue(*, quiet: bool = False) -> Path:
    """Build (or reuse) Kueue's controller manager; its path."""
    sources = [KUEUE_DIR / "go.mod", KUEUE_DIR / "go.sum"]
    if KUEUE_BINARY.is_file() and all(
        p.stat().st_mtime <= KUEUE_BINARY.stat().st_mtime for p in sources
    ):
        return KUEUE_BINARY
    go = shutil.which("go")
    if go is None:
        raise BuildError("Go is not installed: Kueue is built from its Go module")
    OUTPUT.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(
            f"building Kueue's controller manager into {KUEUE_BINARY} (cold: minutes)",
            file=sys.stderr,
            flush=True,
        )
    partial = KUEUE_BINARY.with_suffix(".partial")
    command = [
        go,
        "build",
        "-trimpath",
        "-ldflags=-s -w",
        "-o",
        str(partial),
        "sigs.k8s.io/kueue/cmd/kueue",
    ]
    env = {**os.environ, "CGO_ENABLED": "0"}
    result = subprocess.run(command, cwd=KUEUE_DIR, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(
            f"go build of Kueue failed ({result.returncode}):\n{result.stderr[-4000:]}"
        )
    partial.replace(KUEUE_BINARY)
    return KUEUE_BINARY


def _link_commands() -> None:
    for name in COMMANDS:
        link = OUTPUT / name
        if not link.is_symlink():
            link.unlink(missing_ok=True)
            link.symlink_to(BINARY.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.controlplane.build",
        description="Build kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and "
        "etcd from Kubernetes' Go modules into .cache/controlplane/ (one binary, five names), "
        "and Kueue's controller manager from Kueue's Go module (kueue-manager).",
    )
    parser.add_argument("--force", action="store_true", help="build even when up to date")
    args = parser.parse_args(argv)
    try:
        path = build(force=args.force)
        # Here rather than in the test that runs it: a cold build outlasts a test's timeout.
        kueue = build_kueue()
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    print(kueue)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
