"""The chart on a real cluster (kind): installed, it places Reservations, hands a
``binding: kubernetes`` reservation's devices to the Pod that names it (its ``bcd.dev/gpu``
rewritten to the reservation's own resource) through the kubelet and containerd's CDI, refuses
the pods of another namespace, keeps the devices booked after a release until the Pod is gone,
and keeps or rotates its webhook certificate on upgrade as told.

Runs where Docker and kind (v0.27+) run; skips elsewhere with the reason. README.md ("Install
on a cluster (Helm)") says how to run it. The device plugin reads a simulated inventory (the
chart's default eight H100s) on the worker, so no GPU is needed.
"""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest
import yaml

from tests.e2e import clusters

EXAMPLES = clusters.ROOT / "examples"
NS = "ml"

# Building the image and creating the cluster take minutes (pytest-timeout counts fixtures).
pytestmark = pytest.mark.timeout(3600)


def _example(name: str, kind: str) -> dict[str, Any]:
    for document in yaml.safe_load_all((EXAMPLES / name).read_text(encoding="utf-8")):
        if document and document["kind"] == kind:
            return document
    raise AssertionError(f"no {kind} in examples/{name}")


def _status(o: dict[str, Any] | None) -> dict[str, Any]:
    return (o or {}).get("status") or {}


def _conditions(o: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The conditions that hold (a cleared one stays, as status "False")."""
    return {c["type"]: c for c in _status(o).get("conditions") or () if c["status"] == "True"}


def _state_in(*states: str):
    return lambda o: _status(o).get("state") in states


def _setup_tenancy(cluster: clusters.Cluster) -> None:
    cluster.apply(EXAMPLES / "namespace.yaml")
    cluster.apply(EXAMPLES / "gpuquota.yaml")
    cluster.apply(EXAMPLES / "gpupool.yaml")
    cluster.wait_for(
        "gpupool", "h100-train", None, lambda o: _status(o).get("nodes") == 1, what="given its node"
    )


def test_the_device_plugin_publishes_the_simulated_node(cluster: clusters.Cluster):
    worker = f"{cluster.name}-worker"
    gpunode = cluster.wait_for(
        "gpunode",
        worker,
        None,
        lambda o: _conditions(o).get("Ready", {}).get("status") == "True",
        what="Ready",
    )
    assert _status(gpunode)["gpus"] == 8
    assert gpunode["metadata"]["labels"]["bcd.dev/pool"] == "h100-train"
    _setup_tenancy(cluster)


def test_a_reservation_is_placed(cluster: clusters.Cluster):
    _setup_tenancy(cluster)
    cluster.apply(EXAMPLES / "reservation-nvlink.yaml")
    placed = cluster.wait_for(
        "rsv", "train-1", NS, _state_in("placed", "binding", "active"), what="placed"
    )
    assert _status(placed)["gpus"] == 4
    assert _status(placed)["nodes"] == f"{cluster.name}-worker"
    assert placed["metadata"]["annotations"]["bcd.dev/requested-by"]  # the webhook stamped it
    cluster.kubectl("delete", "rsv", "train-1", "-n", NS, "--wait=true", timeout=120)


def test_the_mig_reservation_is_admitted(cluster: clusters.Cluster):
    _setup_tenancy(cluster)
    cluster.apply(EXAMPLES / "gpupool-mig.yaml")
    cluster.apply(EXAMPLES / "reservation-mig.yaml")
    # No MIG node here: the operator takes it and says so in status, whatever it decides.
    seen = cluster.wait_for("rsv", "notebook-1", NS, lambda o: bool(_status(o)), what="handled")
    assert seen["metadata"]["annotations"]["bcd.dev/requested-by"]
    cluster.kubectl("delete", "rsv", "notebook-1", "-n", NS, "--wait=true", timeout=120)


def test_a_pod_gets_the_cdi_devices_of_its_reservation_and_release_waits_for_it(
    cluster: clusters.Cluster,
):
    _setup_tenancy(cluster)
    cluster.apply(_example("reservation-kubernetes.yaml", "Reservation"))
    active = cluster.wait_for("rsv", "infer-1", NS, _state_in("active"), what="active")
    rid = _status(active)["id"]
    booked = sorted(d.split("=", 1)[1] for d in _status(active)["binding"]["cdiDevices"])
    assert len(booked) == 2

    resource = _status(active)["resourceName"]
    assert resource.startswith("bcd.dev/rsv-")

    # The example's labelled Pod, on the image already on the node, printing what it was given.
    pod = copy.deepcopy(_example("pod-reservation.yaml", "Pod"))
    container = pod["spec"]["containers"][0]
    container["image"] = clusters.IMAGE
    container["imagePullPolicy"] = "Never"
    container["command"] = ["sh", "-c", "sleep 3600"]
    cluster.apply(pod)
    cluster.wait_for(
        "pod", "infer-1", NS, lambda o: _status(o).get("phase") == "Running", what="running"
    )
    # The pod webhook rewrote its bcd.dev/gpu to the reservation's resource, which the node
    # advertises (the kubelet adds it to the Node on its next status update).
    running = cluster.get("pod", "infer-1", NS)
    assert running is not None
    assert running["spec"]["containers"][0]["resources"]["limits"] == {resource: "2"}
    assert "bcd.dev/original-resources" in running["metadata"]["annotations"]
    node = cluster.get("node", running["spec"]["nodeName"])
    assert node is not None
    assert node["status"]["capacity"][resource] == "2"
    env = dict(
        line.split("=", 1)
        for line in cluster.kubectl("exec", "-n", NS, "infer-1", "--", "env").splitlines()
        if "=" in line
    )
    assert env["BCD_RESERVATION_ID"] == rid
    # The CDI spec's per-device edits (BCD_DEVICE_<i>=<id>): containerd applied the devices.
    assert sorted(v for k, v in env.items() if k.startswith("BCD_DEVICE_")) == booked
    assert sorted(env["NVIDIA_VISIBLE_DEVICES"].split(",")) == booked

    # Released while the Pod runs: DevicesHeld names it, until it is deleted.
    cluster.kubectl(
        "patch", "rsv", "infer-1", "-n", NS, "--type", "merge", "-p", '{"spec":{"release":true}}'
    )
    held = cluster.wait_for(
        "rsv",
        "infer-1",
        NS,
        lambda o: (
            ((_status(o).get("conditionDetails") or {}).get("DevicesHeld") or {}).get("pods")
            == [f"{NS}/infer-1"]
        ),
        what="DevicesHeld by its Pod",
    )
    assert _conditions(held)["DevicesHeld"]["status"] == "True"
    cluster.kubectl(
        "delete", "pod", "infer-1", "-n", NS, "--grace-period=1", "--wait=true", timeout=120
    )
    freed = cluster.wait_for(
        "rsv",
        "infer-1",
        NS,
        lambda o: "DevicesHeld" not in _conditions(o) and _status(o).get("state") == "released",
        what="released with nothing held",
    )
    assert _status(freed)["id"] == rid


def _refused(cluster: clusters.Cluster, pod: dict[str, Any]) -> str:
    """The API server's refusal of ``pod`` (kubectl's error output)."""
    with pytest.raises(clusters.ClusterError) as refused:
        cluster.apply(pod)
    message = str(refused.value)
    assert 'admission webhook "check.pods.bcd.dev" denied the request' in message, message
    return message


def test_a_pod_of_another_namespace_cannot_take_a_reservations_devices(
    cluster: clusters.Cluster,
):
    _setup_tenancy(cluster)
    reservation = copy.deepcopy(_example("reservation-kubernetes.yaml", "Reservation"))
    reservation["metadata"]["name"] = "infer-2"
    cluster.apply(reservation)
    placed = cluster.wait_for(
        "rsv",
        "infer-2",
        NS,
        lambda o: _state_in("placed", "binding", "active")(o) and "resourceName" in _status(o),
        what="placed with its resource",
    )
    resource = _status(placed)["resourceName"]
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-b"}})

    def pod(namespace: str, limits: dict[str, int], *, label: str | None = None) -> dict:
        obj = copy.deepcopy(_example("pod-reservation.yaml", "Pod"))
        obj["metadata"] = {"name": "thief", "namespace": namespace, "labels": {}}
        if label is not None:
            obj["metadata"]["labels"]["bcd.dev/reservation"] = label
        container = obj["spec"]["containers"][0]
        container.update(image=clusters.IMAGE, imagePullPolicy="Never", command=["sleep", "60"])
        container["resources"] = {"limits": limits}
        return obj

    gpu = "bcd.dev/gpu"
    labelled = pod("team-b", {gpu: 1}, label="infer-2")
    assert "Reservation 'infer-2' does not exist in namespace 'team-b'" in _refused(
        cluster, labelled
    )
    direct = pod("team-b", {resource: 1})
    assert "the resource of a Reservation in another namespace" in _refused(cluster, direct)
    too_many = pod(NS, {gpu: 3}, label="infer-2")
    assert "asks 3 devices of Reservation 'infer-2'" in _refused(cluster, too_many)
    assert cluster.get("pod", "thief", "team-b") is None

    # Plain bcd.dev/gpu without a label is admitted (with a warning) but no node offers it:
    # the pool shares nothing, so the scheduler cannot place it.
    cluster.apply(pod("team-b", {gpu: 1}))
    cluster.wait_for(
        "pod",
        "thief",
        "team-b",
        lambda o: _conditions(o).get("PodScheduled", {}).get("reason") == "Unschedulable",
        what="unschedulable",
        timeout_s=60,
    )
    cluster.kubectl("delete", "pod", "thief", "-n", "team-b", "--wait=true", timeout=120)
    cluster.kubectl("delete", "rsv", "infer-2", "-n", NS, "--wait=true", timeout=120)


def _certificate(cluster: clusters.Cluster) -> bytes:
    secret = cluster.get("secret", "bc-better-compute-webhook-tls", clusters.NAMESPACE)
    assert secret is not None
    return base64.b64decode(secret["data"]["tls.crt"])


def test_an_upgrade_keeps_the_webhook_certificate_unless_told_to_rotate(
    cluster: clusters.Cluster,
):
    _setup_tenancy(cluster)
    first = _certificate(cluster)
    cluster.install(clusters.values(), upgrade=True)
    assert _certificate(cluster) == first
    rotated = {**clusters.values(), "webhook": {"rotateOnUpgrade": True}}
    cluster.install(rotated, upgrade=True)
    assert _certificate(cluster) != first
    cluster.kubectl(
        "-n",
        clusters.NAMESPACE,
        "rollout",
        "status",
        "statefulset/bc-better-compute-operator",
        "--timeout=180s",
        timeout=200,
    )
    # The rolled pods serve the new certificate the new caBundle trusts: a create goes through.
    cluster.apply(EXAMPLES / "reservation-nvlink.yaml")
    cluster.wait_for("rsv", "train-1", NS, lambda o: bool(_status(o)), what="handled")
    cluster.kubectl("delete", "rsv", "train-1", "-n", NS, "--wait=true", timeout=120)
