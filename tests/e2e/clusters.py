"""A kind cluster with the image loaded and PostgreSQL running, for the end-to-end tests.

Why it exists: the chart tests prove the rendered objects offline; only a real cluster proves
that they work together (the webhooks' TLS, RBAC, the kubelet's device-plugin handshake,
containerd applying the CDI devices). This module drives the tools a person would: ``docker
build``, ``kind``, ``kubectl``, and Helm through ``helm_python`` (no helm binary needed).

Who calls it: ``tests/e2e/conftest.py`` (the ``cluster`` fixture) and ``tests/e2e/test_kind.py``.

What it must never do: run where a tool is missing (``missing()`` says why, and the tests skip
with that reason), leave a cluster behind (unless ``BCD_E2E_KEEP=1`` asks for it to debug), or
wait without a deadline. Waits poll ``kubectl get`` with a deadline: a cluster has no event this
process can subscribe to more simply.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CHART = ROOT / "charts" / "better-compute"
IMAGE = "better-compute:e2e"
#: The Dockerfile's node-agent target, named as the chart expects: <repository>-node.
NODE_IMAGE = "better-compute-node:e2e"
POSTGRES_IMAGE = "postgres:17-alpine"
KIND_AT_LEAST = (0, 27)
RELEASE = "bc"
NAMESPACE = "better-compute"


class ClusterError(Exception):
    """A tool failed; the message holds its command and output."""


def missing() -> str | None:
    """Why the e2e tests cannot run on this machine, or None when they can."""
    docker = shutil.which("docker")
    if docker is None:
        return "no docker CLI on PATH"
    try:
        info = subprocess.run(
            [docker, "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "docker info did not answer within 30 s"
    if info.returncode != 0:
        said = (info.stderr.strip().splitlines() or ["no output"])[-1]
        return f"no running Docker engine (docker info: {said})"
    kind = shutil.which("kind")
    if kind is None:
        return "no kind CLI on PATH (https://kind.sigs.k8s.io, v0.27 or later)"
    version = subprocess.run([kind, "version"], capture_output=True, text=True, check=False)
    found = re.search(r"v(\d+)\.(\d+)", version.stdout)
    if found is None or (int(found[1]), int(found[2])) < KIND_AT_LEAST:
        return f"kind v0.27 or later is needed (containerd 2 applies CDI), found {version.stdout!r}"
    if shutil.which("kubectl") is None:
        return "no kubectl on PATH"
    return None


def run(*args: str, timeout: float = 600, stdin: str | None = None, env: Any = None) -> str:
    """A command's standard output; ClusterError with its output when it fails."""
    try:
        done = subprocess.run(
            list(args),
            capture_output=True,
            text=True,
            timeout=timeout,
            input=stdin,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"{' '.join(args)}: no result within {timeout} s") from e
    if done.returncode != 0:
        raise ClusterError(f"{' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return done.stdout


@dataclass
class Cluster:
    name: str
    kubeconfig: Path

    def kubectl(self, *args: str, stdin: str | None = None, timeout: float = 120) -> str:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        return run("kubectl", *args, stdin=stdin, timeout=timeout, env=env)

    def apply(self, manifest: str | Path | dict[str, Any]) -> None:
        if isinstance(manifest, Path):
            self.kubectl("apply", "-f", str(manifest))
        else:
            text = manifest if isinstance(manifest, str) else json.dumps(manifest)
            self.kubectl("apply", "-f", "-", stdin=text)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        args = ["get", kind, name, "-o", "json", "--ignore-not-found"]
        if namespace:
            args += ["-n", namespace]
        text = self.kubectl(*args)
        return json.loads(text) if text.strip() else None

    def wait_for(
        self,
        kind: str,
        name: str,
        namespace: str | None,
        predicate: Callable[[dict[str, Any] | None], bool],
        *,
        what: str,
        timeout_s: float = 180,
    ) -> dict[str, Any] | None:
        """The object once ``predicate`` holds for it (None: gone); fails after ``timeout_s``
        showing the last object seen."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen = self.get(kind, name, namespace)
            if predicate(seen):
                return seen
            if time.monotonic() > deadline:
                shown = json.dumps((seen or {}).get("status"), indent=1)[:3000]
                raise AssertionError(f"{kind}/{name}: not {what} within {timeout_s} s: {shown}")
            time.sleep(1)  # poll interval; the deadline above bounds the wait

    def helm(self) -> helm_python.Config:
        return helm_python.Config(kubeconfig_path=self.kubeconfig, namespace=NAMESPACE)

    def install(self, values: dict[str, Any], *, upgrade: bool = False) -> None:
        with self.helm() as helm:
            if upgrade:
                helm.upgrade(
                    CHART, RELEASE, values, namespace=NAMESPACE, wait="watcher", timeout=300
                )
            else:
                helm.install(
                    CHART,
                    RELEASE,
                    values,
                    namespace=NAMESPACE,
                    create_namespace=True,
                    wait="watcher",
                    timeout=300,
                )


def values() -> dict[str, Any]:
    """The chart's values on kind: the local image, the e2e PostgreSQL, a simulated node."""
    return {
        "image": {
            "repository": IMAGE.split(":")[0],
            "tag": IMAGE.split(":")[1],
            "pullPolicy": "Never",
        },
        "database": {"url": "postgresql://postgres:e2e@postgres.bcd-db.svc:5432/postgres"},
        "devicePlugin": {
            "nodeSelector": {"bcd.dev/gpu-node": "true"},
            "simulatedInventory": {"enabled": True},
        },
    }


@contextlib.contextmanager
def kind_cluster(workdir: Path, *, config: Path = HERE / "kind.yaml") -> Iterator[Cluster]:
    """Build the image, create the cluster (``config``: kind's cluster file, whose nodes may
    name their node image), load the images, start PostgreSQL; delete the cluster afterwards
    unless BCD_E2E_KEEP=1."""
    run("docker", "build", "-t", IMAGE, "--build-arg", "VERSION=e2e", str(ROOT), timeout=1800)
    run(
        "docker",
        "build",
        "--target",
        "node-agent",
        "-t",
        NODE_IMAGE,
        "--build-arg",
        "VERSION=e2e",
        str(ROOT),
        timeout=1800,
    )
    try:
        run("docker", "image", "inspect", POSTGRES_IMAGE)
    except ClusterError:
        run("docker", "pull", POSTGRES_IMAGE, timeout=600)
    name = f"bcd-e2e-{os.getpid()}"
    kubeconfig = workdir / "kubeconfig"
    run(
        "kind",
        "create",
        "cluster",
        "--name",
        name,
        "--config",
        str(config),
        "--kubeconfig",
        str(kubeconfig),
        "--wait",
        "180s",
        timeout=900,
    )
    try:
        for image in (IMAGE, NODE_IMAGE, POSTGRES_IMAGE):
            run("kind", "load", "docker-image", image, "--name", name, timeout=600)
        cluster = Cluster(name=name, kubeconfig=kubeconfig)
        cluster.apply(HERE / "postgres.yaml")
        cluster.kubectl(
            "-n",
            "bcd-db",
            "rollout",
            "status",
            "deployment/postgres",
            "--timeout=180s",
            timeout=200,
        )
        yield cluster
    finally:
        if os.environ.get("BCD_E2E_KEEP") != "1":
            run("kind", "delete", "cluster", "--name", name, timeout=300)
