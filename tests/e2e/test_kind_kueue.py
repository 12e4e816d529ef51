"""Kueue on a real cluster (kind): Kueue v0.14.0 installed from the Helm chart in its Go module,
our chart with ``kueue.admissionCheck.enabled``, the queues of ``examples/kueue-queues.yaml``
and the Job of ``examples/kueue-job.yaml`` in its Reservation. Kueue's own webhook suspends the
Job, its scheduler reserves the quota in ``bcd.dev/gpu``, our check turns ``Ready`` once the
reservation is active, Kueue starts the Job with our pod set updates, the real kubelet runs its
pod on the reservation's devices, and a release turns the check ``Rejected``.

Where Kueue comes from: the chart ``charts/kueue`` of the Go module ``sigs.k8s.io/kueue@v0.14.0``
(downloaded through the Go module proxy as ``tests/controlplane/kueue.py`` does, never from
anywhere else), installed with the values Kueue's release packaging sets
(``hack/helm-chart-package.sh``: the image ``registry.k8s.io/kueue/kueue:v0.14.0``), so it is
the release's chart. A kind run therefore needs Go (for the module) and a kind node that can
pull that image (or the image loaded into kind beforehand with ``kind load docker-image``).

Runs where Docker and kind (v0.27+) run, and skips elsewhere with the reason, as
``test_kind.py`` does; ``test_kueues_release_chart_renders_from_its_module`` runs everywhere Go
is. The real control plane's tests (``tests/controlplane/test_real_kueue.py``) prove the same
path here with Kueue's controller manager built from the same module.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from tests.controlplane import kueue as kq
from tests.e2e import clusters

EXAMPLES = clusters.ROOT / "examples"
NS = "ml"
KUEUE_NAMESPACE = "kueue-system"
#: What Kueue's release packaging writes into its chart's values for a release tag.
KUEUE_VALUES = {
    "controllerManager": {
        "manager": {
            "image": {
                "repository": "registry.k8s.io/kueue/kueue",
                "tag": kq.KUEUE_VERSION,
                "pullPolicy": "IfNotPresent",
            }
        }
    }
}

pytestmark = pytest.mark.timeout(3600)


def kueue_chart() -> Path:
    """Kueue's Helm chart in its Go module (``KueueUnavailable``: no Go, or no module)."""
    chart = kq.module_dir() / "charts" / "kueue"
    if not (chart / "Chart.yaml").is_file():
        raise kq.KueueUnavailable(f"no Helm chart at {chart}")
    return chart


def test_kueues_release_chart_renders_from_its_module() -> None:
    """What the kind test installs, rendered offline: Kueue's CRDs and its one controller
    Deployment, on the release image, with its webhooks (which suspend a queued Job)."""
    try:
        chart = helm_python.Chart.load(kueue_chart())
    except kq.KueueUnavailable as e:
        pytest.skip(f"Kueue's chart comes from its Go module: {e}")
    try:
        manifests = chart.render(
            KUEUE_VALUES, name="kueue", namespace=KUEUE_NAMESPACE, is_install=True
        )
    finally:
        chart.close()
    objects = [d for text in manifests.values() for d in yaml.safe_load_all(text) if d]
    crds = {o["metadata"]["name"] for o in objects if o["kind"] == "CustomResourceDefinition"}
    assert {"workloads.kueue.x-k8s.io", "admissionchecks.kueue.x-k8s.io"} <= crds
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    images = {c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert images == {f"registry.k8s.io/kueue/kueue:{kq.KUEUE_VERSION}"}
    assert {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"} <= {
        o["kind"] for o in objects
    }


@pytest.fixture(scope="module")
def kueue_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[clusters.Cluster]:
    reason = clusters.missing()
    if reason is not None:
        pytest.skip(f"the Kueue end-to-end test needs Docker and kind: {reason}")
    try:
        chart = kueue_chart()
    except kq.KueueUnavailable as e:
        pytest.skip(f"the Kueue end-to-end test installs Kueue's chart from its Go module: {e}")
    workdir: Path = tmp_path_factory.mktemp("kind-kueue")
    with clusters.kind_cluster(workdir) as created:
        # Kueue first: our operator turns its check controller on only if Kueue is served.
        with helm_python.Config(kubeconfig_path=created.kubeconfig) as helm:
            helm.install(
                chart,
                "kueue",
                KUEUE_VALUES,
                namespace=KUEUE_NAMESPACE,
                create_namespace=True,
                wait="watcher",
                timeout=600,
            )
        created.install({**clusters.values(), "kueue": {"admissionCheck": {"enabled": True}}})
        yield created


def _status(o: dict[str, Any] | None) -> dict[str, Any]:
    return (o or {}).get("status") or {}


def _condition(o: dict[str, Any] | None, kind: str) -> bool:
    return any(
        c["type"] == kind and c["status"] == "True" for c in _status(o).get("conditions") or ()
    )


def _check(workload: dict[str, Any] | None) -> dict[str, Any]:
    for entry in _status(workload).get("admissionChecks") or ():
        if entry["name"] == "bcd-reservation":
            return dict(entry)
    return {}


def _example(name: str, kind: str) -> dict[str, Any]:
    for document in yaml.safe_load_all((EXAMPLES / name).read_text(encoding="utf-8")):
        if document and document["kind"] == kind:
            return dict(document)
    raise AssertionError(f"no {kind} in examples/{name}")


def _apply_once_served(cluster: clusters.Cluster, manifest: Path | dict[str, Any]) -> None:
    """Apply through Kueue's webhooks, which answer a little after its Deployment is ready
    (its certificate rotator writes the certificate first)."""
    deadline = time.monotonic() + 180
    while True:
        try:
            cluster.apply(manifest)
            return
        except clusters.ClusterError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)  # bounded by the deadline above


def _workload_of(cluster: clusters.Cluster, job: str) -> dict[str, Any] | None:
    listed = json.loads(cluster.kubectl("get", "workloads", "-n", NS, "-o", "json"))
    for workload in listed["items"]:
        owners = workload["metadata"].get("ownerReferences") or ()
        if any(o["kind"] == "Job" and o["name"] == job for o in owners):
            return dict(workload)
    return None


def _wait_workload(cluster: clusters.Cluster, job: str, predicate: Any, *, what: str) -> Any:
    deadline = time.monotonic() + 180
    while True:
        seen = _workload_of(cluster, job)
        if seen is not None and predicate(seen):
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"Workload of Job {job}: not {what} within 180 s: {_status(seen)}")
        time.sleep(1)  # poll interval; the deadline above bounds the wait


def test_a_kueue_job_runs_in_its_reservation(kueue_cluster: clusters.Cluster) -> None:
    cluster = kueue_cluster
    worker = f"{cluster.name}-worker"
    cluster.apply(EXAMPLES / "namespace.yaml")
    cluster.apply(EXAMPLES / "gpuquota.yaml")
    cluster.apply(EXAMPLES / "gpupool.yaml")
    cluster.wait_for(
        "gpupool", "h100-train", None, lambda o: _status(o).get("nodes") == 1, what="given its node"
    )
    _apply_once_served(cluster, EXAMPLES / "kueue-queues.yaml")
    # Our operator marks its AdmissionCheck Active; Kueue then makes the ClusterQueue active.
    cluster.wait_for(
        "admissioncheck",
        "bcd-reservation",
        None,
        lambda o: _condition(o, "Active"),
        what="Active",
    )
    cluster.wait_for(
        "clusterqueue", "gpu-reservations", None, lambda o: _condition(o, "Active"), what="Active"
    )

    cluster.apply(_example("kueue-job.yaml", "Reservation"))
    # The example Job, on the image already on the node, small enough for a kind worker.
    job = copy.deepcopy(_example("kueue-job.yaml", "Job"))
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["image"] = clusters.IMAGE
    container["imagePullPolicy"] = "Never"
    container["command"] = ["sh", "-c", "sleep 3600"]
    container["resources"]["requests"].update({"cpu": "100m", "memory": "64Mi"})
    _apply_once_served(cluster, job)
    # Kueue's webhook suspended it; its scheduler counts the Job's own bcd.dev/gpu.
    assert cluster.get("job", "train-kueue", NS)["spec"]["suspend"] is True

    active = cluster.wait_for(
        "rsv", "train-kueue", NS, lambda o: _status(o).get("state") == "active", what="active"
    )
    resource = _status(active)["resourceName"]
    admitted = _wait_workload(
        cluster, "train-kueue", lambda o: _condition(o, "Admitted"), what="admitted"
    )
    entry = _check(admitted)
    assert entry["state"] == "Ready"
    assert entry["podSetUpdates"] == [
        {
            "name": "main",
            "labels": {"bcd.dev/reservation": "train-kueue"},
            "nodeSelector": {"kubernetes.io/hostname": worker},
        }
    ]
    usage = _status(admitted)["admission"]["podSetAssignments"][0]["resourceUsage"]
    assert usage["bcd.dev/gpu"] == "2"

    # Kueue started the Job; its pod runs on the worker with the reservation's own resource.
    pods = json.loads(
        cluster.kubectl("get", "pods", "-n", NS, "-l", "job-name=train-kueue", "-o", "json")
    )
    deadline = time.monotonic() + 180
    while not pods["items"]:
        assert time.monotonic() < deadline, "the Job made no pod within 180 s"
        time.sleep(1)  # poll interval; the deadline above bounds the wait
        pods = json.loads(
            cluster.kubectl("get", "pods", "-n", NS, "-l", "job-name=train-kueue", "-o", "json")
        )
    pod = pods["items"][0]["metadata"]["name"]
    running = cluster.wait_for(
        "pod", pod, NS, lambda o: _status(o).get("phase") == "Running", what="running"
    )
    assert running is not None
    requests = running["spec"]["containers"][0]["resources"]["requests"]
    assert requests.get(resource) == "2"
    assert "bcd.dev/gpu" not in requests
    assert running["spec"]["nodeName"] == worker

    # Released: the check is Rejected, saying why, and Kueue evicts the Workload.
    cluster.kubectl(
        "patch",
        "rsv",
        "train-kueue",
        "-n",
        NS,
        "--type",
        "merge",
        "-p",
        '{"spec":{"release":true}}',
    )
    rejected = _wait_workload(
        cluster, "train-kueue", lambda o: _check(o).get("state") == "Rejected", what="rejected"
    )
    assert "it holds no devices any more" in _check(rejected)["message"]
    cluster.kubectl("delete", "job", "train-kueue", "-n", NS, "--wait=true", timeout=120)
