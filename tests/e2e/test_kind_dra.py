"""The DRA path on a real cluster (kind, Kubernetes 1.34 node images): the chart with
``dra.enabled``, a pool with ``policy.kubernetes: {api: dra}``, the operator's claim template
for a Reservation, and the example Job whose pod the real kubelet starts with the CDI devices
our node agent prepared; a release waits until the kubelet has unprepared the pod's claim.

Runs where Docker and kind (v0.27+) run, and skips elsewhere with the reason, as
``test_kind.py`` does; the real control plane's tests (tests/controlplane/test_real_dra.py)
prove the same path here with a kubelet stand-in.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e import clusters

EXAMPLES = clusters.ROOT / "examples"
NS = "ml"

pytestmark = pytest.mark.timeout(3600)


@pytest.fixture(scope="module")
def dra_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[clusters.Cluster]:
    reason = clusters.missing()
    if reason is not None:
        pytest.skip(f"the DRA end-to-end tests need Docker and kind: {reason}")
    workdir: Path = tmp_path_factory.mktemp("kind-dra")
    with clusters.kind_cluster(workdir, config=clusters.HERE / "kind-dra.yaml") as created:
        created.install({**clusters.values(), "dra": {"enabled": True}})
        yield created


def _example(name: str, kind: str) -> dict[str, Any]:
    for document in yaml.safe_load_all((EXAMPLES / name).read_text(encoding="utf-8")):
        if document and document["kind"] == kind:
            return dict(document)
    raise AssertionError(f"no {kind} in examples/{name}")


def _status(o: dict[str, Any] | None) -> dict[str, Any]:
    return (o or {}).get("status") or {}


def test_a_job_gets_its_reservations_devices_through_its_claim(dra_cluster: clusters.Cluster):
    cluster = dra_cluster
    cluster.apply(EXAMPLES / "namespace.yaml")
    cluster.apply(EXAMPLES / "gpuquota.yaml")
    cluster.apply(EXAMPLES / "gpupool-dra.yaml")
    cluster.wait_for(
        "gpupool", "h100-dra", None, lambda o: _status(o).get("nodes") == 1, what="given its node"
    )
    cluster.apply(EXAMPLES / "reservation-dra.yaml")
    active = cluster.wait_for(
        "rsv", "train-dra", NS, lambda o: _status(o).get("state") == "active", what="active"
    )
    assert _status(active)["claimTemplate"] == "train-dra"
    booked = sorted(d.split("=", 1)[1] for d in _status(active)["binding"]["cdiDevices"])

    job = copy.deepcopy(_example("job-dra.yaml", "Job"))
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["image"] = clusters.IMAGE
    container["imagePullPolicy"] = "Never"
    container["command"] = ["sh", "-c", "env; sleep 3600"]
    cluster.apply(job)
    pods = cluster.kubectl("get", "pods", "-n", NS, "-l", "job-name=train-dra", "-o", "name")
    pod = pods.split()[0].split("/", 1)[1]
    cluster.wait_for("pod", pod, NS, lambda o: _status(o).get("phase") == "Running", what="running")
    env = dict(
        line.split("=", 1)
        for line in cluster.kubectl("exec", "-n", NS, pod, "--", "env").splitlines()
        if "=" in line
    )
    # containerd applied our CDI devices: the spec's per-device edits name exactly the booking.
    assert sorted(v for k, v in env.items() if k.startswith("BCD_DEVICE_")) == booked

    cluster.kubectl(
        "patch", "rsv", "train-dra", "-n", NS, "--type", "merge", "-p", '{"spec":{"release":true}}'
    )
    cluster.wait_for(
        "rsv",
        "train-dra",
        NS,
        lambda o: any(
            c["type"] == "DevicesHeld" and c["status"] == "True"
            for c in _status(o).get("conditions") or ()
        ),
        what="DevicesHeld by the pod's claim",
    )
    cluster.kubectl("delete", "job", "train-dra", "-n", NS, "--wait=true", timeout=120)
    cluster.wait_for(
        "rsv",
        "train-dra",
        NS,
        lambda o: o is None or _status(o).get("state") == "released",
        what="released once the claim was unprepared",
    )
