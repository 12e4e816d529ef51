"""Where the control plane's binary is, or one clear error saying how to build it.

Why it exists: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kubectl come
from one Go program in the checkout (``tests/controlplane/main.go``, built from Kubernetes' own
Go modules by ``python -m tests.controlplane.build`` into ``.cache/controlplane/``). ``dev
--kube`` and the tests look for it in the same places: the path given (``--kube-binary`` or
``BCD_KUBE_BINARY``), else ``.cache/controlplane/controlplane`` of the checkout this package
runs from, else of the current directory.

What it must never do: download or build anything (building needs Go and minutes: the person
decides), or name a path that is not there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The variable naming the binary (``--kube-binary`` wins over it).
ENV = "BCD_KUBE_BINARY"
#: Where the build writes it, relative to a checkout.
RELATIVE = Path(".cache") / "controlplane" / "controlplane"
#: The names the one binary answers to (it reads its first argument, or the name it runs as).
COMMANDS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
#: The command that builds it, run in the checkout with its virtualenv.
BUILD_COMMAND = ".venv/bin/python -m tests.controlplane.build"


class BinaryMissing(Exception):
    """No control-plane binary where it was looked for; the message says how to build one."""


def checkouts() -> list[Path]:
    """The checkout this package runs from (an editable install), then the current directory:
    each a directory with ``pyproject.toml``, nearest first."""
    found: list[Path] = []
    here = Path(__file__).resolve()
    # src/bettercompute/dev/controlplane/binary.py → the checkout is four levels up from src.
    for candidate in (here.parents[4], Path.cwd().resolve()):
        if (candidate / "pyproject.toml").is_file() and candidate not in found:
            found.append(candidate)
    return found


def find(given: Path | None = None, *, environ: Mapping[str, str] | None = None) -> Path:
    """The binary: ``given``, else ``$BCD_KUBE_BINARY``, else a checkout's build output."""
    env = os.environ if environ is None else environ
    named = given if given is not None else (Path(env[ENV]) if env.get(ENV) else None)
    if named is not None:
        path = named.expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return path.resolve()
        source = "--kube-binary" if given is not None else f"${ENV}"
        raise BinaryMissing(
            f"{source} names {path}, which is not an executable file; build the control plane "
            f"in a checkout of better-compute with `{BUILD_COMMAND}` (Go 1.24 or newer; it "
            f"writes {RELATIVE}), or name the binary it built"
        )
    roots = checkouts()
    for root in roots:
        path = root / RELATIVE
        if path.is_file() and os.access(path, os.X_OK):
            return path
    where = " or ".join(str(root / RELATIVE) for root in roots) or str(RELATIVE)
    raise BinaryMissing(
        f"no Kubernetes control plane at {where}: build it once in the checkout with "
        f"`{BUILD_COMMAND}` (Go 1.24 or newer; cold 7-10 minutes, nothing but Go modules is "
        f"downloaded), or give its path with --kube-binary or ${ENV}"
    )


def command(binary: Path, name: str) -> Path:
    """The path that runs ``binary`` as ``name`` (``kubectl``): the build's link beside it."""
    link = binary.parent / name
    if link.exists() and link.resolve() == binary.resolve():
        return link
    raise FileNotFoundError(link)
