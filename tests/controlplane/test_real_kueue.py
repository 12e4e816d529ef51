"""Our Kueue AdmissionCheck controller on the real control plane, with Kueue's own CRDs.

Two ways, both with Kueue v0.14.0's CRDs from its Go module (``tests/controlplane/kueue.py``):

- playing Kueue, for the scenarios the real Kueue cannot be made to reach on demand: as the
  admin the tests create the AdmissionCheck, ClusterQueue and LocalQueue, the Job a user
  writes, and the Workload Kueue makes for it, and write the ``Pending`` entries Kueue's
  workload controller adds; then they assert only what our operator writes: the check's
  state, message and ``podSetUpdates``, the AdmissionCheck's ``Active`` condition, and that
  the entry of another controller's check is never touched;
- with Kueue's real controller manager, built from the same Go module (``build.build_kueue``;
  ``docs/kueue.md``, "Real Kueue", says what it needs here): a Job goes through Kueue's
  admission with our check, is started with our pod set updates, and its pod is rewritten to
  the reservation's devices by our pod webhook.

The reservation becomes active the real way: the node agent, under the chart's account, binds
the operator's DeviceAllocation (``test_real_node_agent.py``'s helpers).

Attack: tenant globex's Workload naming tenant acme's Reservation never gets ``Ready`` (it
does not with the namespace check of ``kueuechecks.decide`` removed: ``own`` = ``candidates``
leaves it Pending, then Ready once acme's reservation is active).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from bettercompute.operator.running import Operator
from tests.chart import rendering
from tests.controlplane import build, install
from tests.controlplane import kueue as kq
from tests.controlplane.cluster import ApiError, ControlPlane, free_port
from tests.controlplane.plugin import Cluster
from tests.controlplane.scenarios import (
    RESERVATIONS,
    call,
    pool_with_nodes,
    reservation,
    state_is,
    tenant_namespace,
    wait_for,
)
from tests.controlplane.test_real_node_agent import (  # noqa: F401 - fixtures used by name
    agent_running,
    agent_token,
    nodes,
    standing,
    tenant,
)
from tests.deviceplugin.conftest import NODE, Node

MERGE = {"content_type": "application/merge-patch+json"}
CHECK = "bcd-reservation"
#: Another controller's check on the same ClusterQueue: its entry must stay as Kueue wrote it.
OTHER_CHECK = "provisioning"
ON = {"kueue": {"admissionCheck": {"enabled": True}}}


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def workloads(ns: str) -> str:
    return f"{kq.PREFIX}/namespaces/{ns}/workloads"


@pytest.fixture(scope="module")
def kueue_crds(control_plane: ControlPlane, chart: install.Installed) -> Iterator[None]:
    """Kueue's CRDs installed, and the chart installed again with ``kueue.admissionCheck``
    on (its operator RBAC for Kueue); both undone after the module."""
    try:
        definitions = kq.crds()
    except kq.KueueUnavailable as e:
        pytest.skip(f"Kueue's CRDs are not available: {e}")
    install.install_crds(control_plane, definitions)
    install.install(control_plane, webhook_port=chart.webhook_port, values=ON)
    yield
    install.install(control_plane, webhook_port=chart.webhook_port)
    for crd in definitions:
        with contextlib.suppress(ApiError):
            control_plane.request(
                "DELETE",
                f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}",
            )


def _check(obj: dict[str, Any] | None, name: str = CHECK) -> dict[str, Any]:
    for entry in ((obj or {}).get("status") or {}).get("admissionChecks") or ():
        if entry["name"] == name:
            return dict(entry)
    return {}


def check_is(state: str, name: str = CHECK) -> Callable[[dict[str, Any] | None], bool]:
    return lambda o: _check(o, name).get("state") == state


def check_says(state: str, text: str) -> Callable[[dict[str, Any] | None], bool]:
    """Our controller wrote ``state`` with ``text`` in its message (Kueue's own Pending has
    an empty message)."""
    return lambda o: check_is(state)(o) and text in _check(o).get("message", "")


async def queues(plane: ControlPlane, namespaces: tuple[str, ...]) -> None:
    """What an admin sets up for Kueue: our check, another controller's, a flavor, a
    ClusterQueue listing both checks and counting bcd.dev/gpu, a LocalQueue per namespace."""
    for obj in (
        kq.admission_check(CHECK),
        kq.admission_check(OTHER_CHECK, controller="kueue.x-k8s.io/provisioning-request"),
        kq.resource_flavor(),
        kq.cluster_queue("gpus", checks=[CHECK, OTHER_CHECK]),
        *(kq.local_queue(ns, "team", cluster_queue="gpus") for ns in namespaces),
    ):
        await call(plane, "POST", kq.collection(obj), obj)


async def submitted(plane: ControlPlane, workload: dict[str, Any]) -> str:
    """Create the Workload and add its ClusterQueue's checks as Pending, as Kueue does; its
    path."""
    meta = workload["metadata"]
    await call(plane, "POST", workloads(meta["namespace"]), workload)
    path = f"{workloads(meta['namespace'])}/{meta['name']}"
    await call(
        plane,
        "PATCH",
        f"{path}/status",
        kq.pending_checks([CHECK, OTHER_CHECK], now=_now()),
        **MERGE,
    )
    return path


async def cleanup_kueue(plane: ControlPlane) -> None:
    for plural in ("clusterqueues", "admissionchecks", "resourceflavors"):
        listed = await asyncio.to_thread(plane.get, f"{kq.PREFIX}/{plural}")
        for obj in (listed or {"items": []})["items"]:
            path = f"{kq.PREFIX}/{plural}/{obj['metadata']['name']}"
            with contextlib.suppress(ApiError):
                await call(plane, "PATCH", path, {"metadata": {"finalizers": None}}, **MERGE)
                await call(plane, "DELETE", path)


async def metric(op: Operator) -> str:
    async with httpx.AsyncClient(base_url=op.metrics_url, timeout=5.0) as scraper:
        answer = await scraper.get("/metrics")
    return answer.text


# --- without Kueue ---------------------------------------------------------------------------


async def test_without_kueues_crds_the_controller_is_off_and_the_rest_works(
    cluster: Cluster, start_real_operator: Callable[..., Any]
) -> None:
    """Asked for, on a cluster without Kueue: a log line and the metric, never a failed
    start; Reservations are admitted as ever. (First in the module: before ``kueue_crds``.)"""
    plane = cluster.plane
    served = await asyncio.to_thread(plane.get, f"/apis/{kq.API}")
    assert served is None, "Kueue's CRDs are installed: this test must run before kueue_crds"
    await tenant_namespace(plane, "ml", tenant="acme", user="alice@acme")
    async with start_real_operator(kueue_admission_check=True, kueue_resync_s=0.5) as op:
        await pool_with_nodes(plane)
        assert op.runtime.kueue is None
        assert 'bettercompute_kueue_admission_checks{state="kueue-missing"} 1.0' in (
            await metric(op)
        )
        body = reservation("train", "ml", gpus=1, binding="kubernetes")
        await call(plane, "POST", RESERVATIONS.format(ns="ml"), body, token=tenant(cluster))
        await wait_for(
            plane, f"{RESERVATIONS.format(ns='ml')}/train", state_is("placed", "binding")
        )


# --- with Kueue's CRDs -------------------------------------------------------------------------


@pytest.mark.usefixtures("kueue_crds")
async def test_the_kueue_examples_are_accepted_by_the_api_server(cluster: Cluster) -> None:
    """examples/kueue-*.yaml, sent with dryRun=All: Kueue's schema and CEL rules, and ours."""
    plane = cluster.plane
    await tenant_namespace(plane, "ml", tenant="acme", user="alice@acme")
    sent = set()
    for name, obj in rendering.load_examples():
        if not name.startswith("kueue-"):
            continue
        if obj["apiVersion"] == kq.API:
            path = kq.collection(obj)
        elif obj["kind"] == "Job":
            path = f"/apis/batch/v1/namespaces/{obj['metadata']['namespace']}/jobs"
        else:
            continue  # the Reservation: its webhook needs an operator (test_examples.py)
        await call(plane, "POST", f"{path}?dryRun=All", obj)
        sent.add(obj["kind"])
    assert sent == {"AdmissionCheck", "ResourceFlavor", "ClusterQueue", "LocalQueue", "Job"}


@pytest.mark.usefixtures("kueue_crds")
async def test_a_kueue_workload_runs_in_its_reservation(
    cluster: Cluster,
    start_real_operator: Callable[..., Any],
    nodes: dict[str, dict[str, Any]],  # noqa: F811 - the fixture imported above
    standing: Node,  # noqa: F811
) -> None:
    plane = cluster.plane
    alice = tenant(cluster)
    await tenant_namespace(plane, "ml", tenant="acme", user="alice@acme")
    await tenant_namespace(plane, "team-b", tenant="globex", user="mallory@globex")
    await queues(plane, ("ml", "team-b"))
    rsv = f"{RESERVATIONS.format(ns='ml')}/train"
    try:
        async with start_real_operator(kueue_admission_check=True, kueue_resync_s=0.5) as op:
            await pool_with_nodes(plane, nodes=0, tenants=("acme", "globex"))
            assert 'bettercompute_kueue_admission_checks{state="running"} 1.0' in (await metric(op))
            # Our AdmissionCheck is marked Active (Kueue admits nothing through an inactive
            # one); the other controller's is not ours to mark.
            ours = await wait_for(
                plane,
                f"{kq.PREFIX}/admissionchecks/{CHECK}",
                lambda o: any(
                    c["type"] == "Active" and c["status"] == "True"
                    for c in ((o or {}).get("status") or {}).get("conditions") or ()
                ),
            )
            assert ours is not None
            other = await asyncio.to_thread(plane.get, f"{kq.PREFIX}/admissionchecks/{OTHER_CHECK}")
            assert not (other.get("status") or {}).get("conditions")

            # The reservation, before any node: pending.
            body = reservation("train", "ml", gpus=2, binding="kubernetes")
            await call(plane, "POST", RESERVATIONS.format(ns="ml"), body, token=alice)
            await wait_for(plane, rsv, state_is("pending"))

            # alice's Job names it in an annotation; Kueue's Workload does not carry it (only
            # labels in labelKeysToCopy are copied): our controller reads the owner Job.
            job = await call(
                plane,
                "POST",
                "/apis/batch/v1/namespaces/ml/jobs",
                kq.job("ml", "trainer", gpus=2, annotations={"bcd.dev/reservation": "train"}),
            )
            fits = await submitted(plane, kq.workload("ml", "job-trainer", gpus=2, owner=job))
            pending = await wait_for(plane, fits, check_says("Pending", "'train' is pending"))
            assert "it has no window yet" in _check(pending)["message"]
            assert "podSetUpdates" not in _check(pending)
            # Too big for the reservation (3 per pod, it holds 2 per node): never fits.
            big = await submitted(
                plane,
                kq.workload(
                    "ml", "too-big", gpus=3, template_labels={"bcd.dev/reservation": "train"}
                ),
            )
            rejected = await wait_for(plane, big, check_is("Rejected"))
            assert "asks 3 bcd.dev/gpu per pod" in _check(rejected)["message"]
            # ATTACK: globex's Workload names acme's Reservation by its name.
            stolen = await submitted(
                plane,
                kq.workload("team-b", "steal", gpus=1, labels={"bcd.dev/reservation": "train"}),
            )
            refused = await wait_for(plane, stolen, check_is("Rejected"))
            assert "not in namespace 'team-b'" in _check(refused)["message"]
            missing = await submitted(
                plane,
                kq.workload("ml", "typo", gpus=1, labels={"bcd.dev/reservation": "trian"}),
            )
            gone = await wait_for(plane, missing, check_is("Rejected"))
            assert "'trian' does not exist in namespace 'ml'" in _check(gone)["message"]

            # The node agent joins, binds the DeviceAllocation: active, and the check Ready
            # with the label our pod webhooks read and the reservation's node.
            token = await agent_token(cluster, nodes[NODE])
            async with agent_running(cluster, standing, token):
                await wait_for(plane, rsv, state_is("active"), timeout_s=60)
                ready = await wait_for(plane, fits, check_is("Ready"), timeout_s=30)
                assert ready is not None
                entry = _check(ready)
                assert "Reservation 'train' is active until" in entry["message"]
                assert entry["podSetUpdates"] == [
                    {
                        "name": "main",
                        "labels": {"bcd.dev/reservation": "train"},
                        "nodeSelector": {"kubernetes.io/hostname": NODE},
                    }
                ]
                # Another controller's entry: exactly as Kueue wrote it.
                assert _check(ready, OTHER_CHECK)["state"] == "Pending"
                assert _check(ready, OTHER_CHECK)["message"] == ""
                # The attacker's stays Rejected now that the reservation is active.
                assert check_is("Rejected")(await asyncio.to_thread(plane.get, stolen))

                # A pod made from the updates (as Kueue starts the job) is rewritten by our
                # pod webhook to the reservation's own devices.
                active = await asyncio.to_thread(plane.get, rsv)
                template = kq.pod_template(gpus=2, labels=entry["podSetUpdates"][0]["labels"])
                pod = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": "trainer-0", **template["metadata"]},
                    "spec": {
                        **template["spec"],
                        "nodeSelector": entry["podSetUpdates"][0]["nodeSelector"],
                    },
                }
                made = await call(plane, "POST", "/api/v1/namespaces/ml/pods", pod, token=alice)
                requests = made["spec"]["containers"][0]["resources"]["requests"]
                assert requests == {active["status"]["resourceName"]: "2"}
                await call(
                    plane, "DELETE", "/api/v1/namespaces/ml/pods/trainer-0?gracePeriodSeconds=0"
                )
                ready_since = entry["lastTransitionTime"]

        # Operator restart: a Workload submitted while it was away gets its answer, the ready
        # one keeps its entry unchanged (no new transition).
        later = await submitted(
            plane,
            kq.workload("ml", "later", gpus=1, template_labels={"bcd.dev/reservation": "train"}),
        )
        async with start_real_operator(kueue_admission_check=True, kueue_resync_s=0.5):
            await wait_for(plane, later, check_is("Ready"), timeout_s=30)
            again = await asyncio.to_thread(plane.get, fits)
            assert _check(again)["state"] == "Ready"
            assert _check(again)["lastTransitionTime"] == ready_since

            # Released by alice: the check is Rejected, saying why (Kueue then evicts it).
            await call(plane, "PATCH", rsv, {"spec": {"release": True}}, token=alice, **MERGE)
            released = await wait_for(plane, fits, check_is("Rejected"), timeout_s=30)
            message = _check(released)["message"]
            assert "Reservation 'train' is releas" in message
            assert "it holds no devices any more" in message
            assert "podSetUpdates" not in _check(released)
    finally:
        await cleanup_kueue(plane)


@pytest.mark.usefixtures("kueue_crds")
async def test_a_ready_workload_is_told_before_its_reservation_ends(
    cluster: Cluster,
    start_real_operator: Callable[..., Any],
    nodes: dict[str, dict[str, Any]],  # noqa: F811 - the fixture imported above
    standing: Node,  # noqa: F811
) -> None:
    """The pool's spot notice is the lead time: with ``noticeSeconds: 3600`` a 30-minute
    reservation ends within it as soon as it is active, so the Ready Workload gets our
    condition (Kueue's, played here, kept) and one Warning Event with the end time, and no
    second Event after more passes or an operator restart."""
    plane = cluster.plane
    await tenant_namespace(plane, "ml", tenant="acme", user="alice@acme")
    await queues(plane, ("ml",))
    rsv = f"{RESERVATIONS.format(ns='ml')}/train"
    events = (
        "/api/v1/namespaces/ml/events?fieldSelector="
        "involvedObject.kind%3DWorkload,reason%3DReservationEnding"
    )
    try:
        async with start_real_operator(kueue_admission_check=True, kueue_resync_s=0.5):
            await pool_with_nodes(plane, nodes=0)
            await call(
                plane,
                "PATCH",
                "/apis/bcd.dev/v1alpha1/gpupools/h100",
                {"spec": {"policy": {"spot": {"noticeSeconds": 3600}}}},
                **MERGE,
            )
            body = reservation("train", "ml", gpus=2, binding="kubernetes", duration="30m")
            await call(plane, "POST", RESERVATIONS.format(ns="ml"), body, token=tenant(cluster))
            await wait_for(plane, rsv, state_is("pending"))
            told = await submitted(
                plane,
                kq.workload("ml", "told", gpus=2, template_labels={"bcd.dev/reservation": "train"}),
            )
            await wait_for(plane, told, check_says("Pending", "'train' is pending"))
            # Kueue's own condition, as its scheduler writes it: it must stay.
            reserved = {
                "type": "QuotaReserved",
                "status": "True",
                "reason": "QuotaReserved",
                "message": "Quota reserved in ClusterQueue gpus",
                "lastTransitionTime": _now(),
            }
            await call(
                plane, "PATCH", f"{told}/status", {"status": {"conditions": [reserved]}}, **MERGE
            )
            assert not items(await asyncio.to_thread(plane.get, events))

            token = await agent_token(cluster, nodes[NODE])
            async with agent_running(cluster, standing, token):
                active = await wait_for(plane, rsv, state_is("active"), timeout_s=60)
                assert active is not None
                ending = await wait_for(
                    plane, told, condition_is("bcd.dev/ReservationEnding", "True"), timeout_s=30
                )
                assert ending is not None
                assert check_is("Ready")(ending)
                conditions = {c["type"]: c for c in ending["status"]["conditions"]}
                assert conditions["QuotaReserved"] == reserved
                ours = conditions["bcd.dev/ReservationEnding"]
                end = active["status"]["endTime"]
                assert ours["reason"] == "WindowEnds"
                assert f"Reservation 'train' ends at {end}" in ours["message"]
                assert "notice 3600 s" in ours["message"]
                (event,) = items(
                    await wait_for(plane, events, lambda o: bool(items(o)), timeout_s=10)
                )
                assert event["type"] == "Warning"
                assert event["message"] == ours["message"]
                assert event["involvedObject"]["name"] == "told"
                await asyncio.sleep(2)  # several passes
        async with start_real_operator(kueue_admission_check=True, kueue_resync_s=0.5):
            await asyncio.sleep(3)
        assert len(items(await asyncio.to_thread(plane.get, events))) == 1
    finally:
        await cleanup_kueue(plane)


# --- the real Kueue ------------------------------------------------------------------------------


@pytest.fixture
def real_kueue(cluster: Cluster, kueue_crds: None) -> Iterator[subprocess.Popen[bytes]]:
    """Kueue's controller manager, built from its Go module, as the cluster admin, for one
    test; afterwards the finalizers it put on Workloads are removed (no Kueue is left to)."""
    try:
        binary = build.build_kueue()
    except build.BuildError as e:
        pytest.skip(f"Kueue's controller manager cannot be built here: {e}")
    plane = cluster.plane
    for obj in (
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": kq.KUEUE_NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": kq.KUEUE_CERT_SECRET, "namespace": kq.KUEUE_NAMESPACE},
        },
    ):
        plane.apply(obj)
    root = plane.root / "kueue"
    kq.write_webhook_pair(root / "certs")
    config = root / "config.yaml"
    config.write_text(kq.manager_config(cert_dir=root / "certs", webhook_port=free_port()))
    log = (root / "kueue.log").open("wb")
    process = subprocess.Popen(
        [
            str(binary),
            f"--config={config}",
            f"--kubeconfig={plane.admin_kubeconfig()}",
            # Its visibility API server wants in-cluster credentials.
            "--feature-gates=VisibilityOnDemand=false",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        print(
            f"Kueue's log (exit {process.returncode}):\n"
            + "\n".join((root / "kueue.log").read_text(errors="replace").splitlines()[-30:])
        )
        listed = plane.get(f"{kq.PREFIX}/workloads") or {"items": []}
        for obj in listed["items"]:
            meta = obj["metadata"]
            with contextlib.suppress(ApiError):
                plane.request(
                    "PATCH",
                    f"{workloads(meta['namespace'])}/{meta['name']}",
                    {"metadata": {"finalizers": None}},
                    content_type="application/merge-patch+json",
                )
        with contextlib.suppress(ApiError):
            plane.request("DELETE", f"/api/v1/namespaces/{kq.KUEUE_NAMESPACE}")


# A cold build of Kueue (the fixture's, when ``python -m tests.controlplane.build`` did not run
# first) takes minutes on two cores.
@pytest.mark.timeout(900)
async def test_a_job_goes_through_real_kueue_admission_with_our_check(
    cluster: Cluster,
    start_real_operator: Callable[..., Any],
    real_kueue: subprocess.Popen[bytes],
    nodes: dict[str, dict[str, Any]],  # noqa: F811 - the fixture imported above
    standing: Node,  # noqa: F811
) -> None:
    """End to end with Kueue's own controller manager: it makes the Workload of alice's Job and
    adds our check as Pending; our operator answers; once the node agent activates the
    reservation the check is Ready, Kueue admits the Workload and starts the Job with our pod
    set updates, the controller-manager makes its pod, and our pod webhook rewrites it to the
    reservation's devices. ClusterQueue quota is counted in the job's own bcd.dev/gpu."""
    plane = cluster.plane
    await tenant_namespace(plane, "ml", tenant="acme", user="alice@acme")
    for obj in (
        kq.admission_check(CHECK),
        kq.resource_flavor(),
        kq.cluster_queue("gpus", checks=[CHECK], gpus=4),
        kq.local_queue("ml", "team", cluster_queue="gpus"),
    ):
        await call(plane, "POST", kq.collection(obj), obj)
    rsv = f"{RESERVATIONS.format(ns='ml')}/train"
    try:
        async with start_real_operator(kueue_admission_check=True, kueue_resync_s=0.5):
            await pool_with_nodes(plane, nodes=0)
            body = reservation("train", "ml", gpus=2, binding="kubernetes")
            await call(plane, "POST", RESERVATIONS.format(ns="ml"), body, token=tenant(cluster))
            await wait_for(plane, rsv, state_is("pending"))
            # Created suspended: Kueue's webhook, which would suspend it, is not registered.
            job = kq.job("ml", "trainer", gpus=2, annotations={})
            job["spec"]["template"]["metadata"]["labels"] = {"bcd.dev/reservation": "train"}
            await call(plane, "POST", "/apis/batch/v1/namespaces/ml/jobs", job)

            def the_workload(o: dict[str, Any] | None) -> bool:
                return any(check_says("Pending", "'train' is pending")(w) for w in items(o))

            listed = await wait_for(plane, workloads("ml"), the_workload, timeout_s=60)
            (made,) = items(listed)
            path = f"{workloads('ml')}/{made['metadata']['name']}"
            # Kueue reserved the quota in bcd.dev/gpu as the Job asks it; not admitted yet.
            reserved = await wait_for(plane, path, condition_is("QuotaReserved", "True"))
            usage = reserved["status"]["admission"]["podSetAssignments"][0]["resourceUsage"]
            assert usage == {"bcd.dev/gpu": "2"}
            assert not condition_is("Admitted", "True")(reserved)
            assert (await call(plane, "GET", "/apis/batch/v1/namespaces/ml/jobs/trainer"))["spec"][
                "suspend"
            ]

            token = await agent_token(cluster, nodes[NODE])
            async with agent_running(cluster, standing, token):
                active = await wait_for(plane, rsv, state_is("active"), timeout_s=60)
                assert active is not None
                await wait_for(plane, path, condition_is("Admitted", "True"), timeout_s=60)
                started = await wait_for(
                    plane,
                    "/apis/batch/v1/namespaces/ml/jobs/trainer",
                    lambda o: bool(o) and not (o or {})["spec"].get("suspend"),
                )
                template = started["spec"]["template"]
                assert template["metadata"]["labels"]["bcd.dev/reservation"] == "train"
                assert template["spec"]["nodeSelector"] == {"kubernetes.io/hostname": NODE}
                pods = await wait_for(
                    plane,
                    "/api/v1/namespaces/ml/pods?labelSelector=job-name%3Dtrainer",
                    lambda o: bool(items(o)),
                )
                (pod,) = items(pods)
                requests = pod["spec"]["containers"][0]["resources"]["requests"]
                assert requests == {active["status"]["resourceName"]: "2"}
    finally:
        await cleanup_kueue(plane)


def items(listed: dict[str, Any] | None) -> list[dict[str, Any]]:
    return list((listed or {}).get("items") or ())


def condition_is(kind: str, status: str) -> Callable[[dict[str, Any] | None], bool]:
    return lambda o: any(
        c["type"] == kind and c["status"] == status
        for c in ((o or {}).get("status") or {}).get("conditions") or ()
    )
