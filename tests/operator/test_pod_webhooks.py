"""Pods tied to their reservation, through the real operator and the API stand-in's admission.

The chart's own webhook configurations (rendered with defaults: both Reservation and pod
webhooks, their ``matchConditions`` and ``namespaceSelector``) are registered with the stand-in
and routed to the real operator's kopf webhook server; pods are created over HTTP as tenants'
users would, so every answer here is what ``kubectl apply`` would get. The stand-in stores
pods as a real API server would after admission: what it returns is what was stored.

Attack tests: a pod of another namespace tries every request that could reach a reservation's
devices (its label, the reservation's resource name directly, in an init container, more than
held, by changing its label or resources later, plain ``bcd.dev/gpu``) and never gets a pod
stored that asks them. The node side (only that reservation's ids advertised under its name)
is the device plugin's and is tested in ``tests/deviceplugin/``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import helm_python
import httpx
import pytest

from bettercompute.operator.running import Operator
from tests.chart import rendering
from tests.operator.conftest import World, apply_world, free_port
from tests.support import kubeworld
from tests.support.kubeobjects import GPUPOOLS, RESERVATIONS, Ref
from tests.support.kubeserver import KubeApi

PODS = Ref(group="", version="v1", plural="pods", namespaced=True)
ALICE = {"username": "alice@acme", "uid": "u1", "groups": ["system:authenticated"]}
MALLORY = {"username": "mallory@beta", "uid": "u2", "groups": ["system:authenticated"]}
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
_HANDLED = "kopf.bcd.dev/last-handled-configuration"


# --- the cluster -------------------------------------------------------------------------------


@pytest.fixture
async def operator(
    kube_api: KubeApi, start_operator: Callable[..., Any]
) -> AsyncIterator[Operator]:
    # kopf learns the resources it serves webhooks for from discovery, once, at start.
    kube_api.emulator.declare(PODS, kind="Pod", short_names=["po"], status_subresource=True)
    async with start_operator() as op:
        yield op


@pytest.fixture(scope="module")
def chart_webhooks() -> list[dict[str, Any]]:
    chart = helm_python.Chart.load(rendering.CHART)
    try:
        rendered = rendering.render(chart, {})
    finally:
        chart.close()
    return [
        *rendered.of("MutatingWebhookConfiguration"),
        *rendered.of("ValidatingWebhookConfiguration"),
    ]


async def _listening(port: int) -> None:
    """kopf starts its webhook server after discovery: wait until it accepts connections."""
    async with asyncio.timeout(15):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.close()
            await writer.wait_closed()
            return


def _route(kube: KubeApi, configurations: list[dict[str, Any]], base: str) -> None:
    for configuration in configurations:
        for webhook in configuration["webhooks"]:
            service = webhook["clientConfig"]["service"]
            kube.emulator.webhook_services[(service["namespace"], service["name"])] = base


def _state(*states: str) -> Callable[[dict[str, Any] | None], bool]:
    return lambda o: bool(o) and (o.get("status") or {}).get("state") in states


async def _reservation(kube: KubeApi, builder: kubeworld.ReservationBuilder, *states: str) -> dict:
    obj = builder.obj()
    await kube.create(obj)
    meta = obj["metadata"]
    # Until kopf has recorded the create as handled, a change (a release) could be taken for
    # part of it: wait for its record too.
    stored = await kube.wait_for(
        RESERVATIONS,
        meta["namespace"],
        meta["name"],
        lambda o: _state(*states)(o) and _HANDLED in (o or {})["metadata"].get("annotations", {}),
        timeout=10,
    )
    assert stored is not None
    return stored


class Cluster:
    """The world, its reservations and HTTP clients as two tenants' users."""

    def __init__(self, world: World, http: httpx.AsyncClient, train: dict[str, Any]) -> None:
        self.world = world
        self.kube = world.kube
        self.http = http
        self.train = train
        self.resource: str = train["status"]["resourceName"]

    async def send(
        self, token: str, method: str, path: str, body: Any, *, kind: str = MERGE_PATCH
    ) -> httpx.Response:
        headers = {
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json" if method == "POST" else kind,
        }
        return await self.http.request(method, path, content=json.dumps(body), headers=headers)

    async def create(self, pod: dict[str, Any], *, token: str = "t-alice") -> httpx.Response:
        namespace = pod["metadata"]["namespace"]
        return await self.send(token, "POST", PODS.path(namespace=namespace), pod)

    async def patch(
        self, namespace: str, name: str, body: Any, *, token: str = "t-alice"
    ) -> httpx.Response:
        kind = JSON_PATCH if isinstance(body, list) else MERGE_PATCH
        path = PODS.path(namespace=namespace, name=name)
        return await self.send(token, "PATCH", path, body, kind=kind)


def pod(
    name: str,
    namespace: str = "ml",
    *,
    label: str | None = None,
    init: dict[str, Any] | None = None,
    **limits: Any,
) -> dict[str, Any]:
    """A pod as a user writes it: one container with ``limits`` (``gpu=2`` is bcd.dev/gpu)."""
    names = {"gpu": "bcd.dev/gpu", "mig": "bcd.dev/gpu.mig", "cpu": "cpu"}
    main: dict[str, Any] = {"name": "main", "image": "trainer:1"}
    if limits:
        main["resources"] = {"limits": {names.get(k, k): str(v) for k, v in limits.items()}}
    spec: dict[str, Any] = {"containers": [main]}
    if init is not None:
        resources = {"limits": {names.get(k, k): str(v) for k, v in init.items()}}
        spec["initContainers"] = [{"name": "setup", "image": "setup:1", "resources": resources}]
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": {"app": name}}
    if label is not None:
        meta["labels"]["bcd.dev/reservation"] = label
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def refusal(response: httpx.Response, webhook: str = "check.pods.bcd.dev") -> str:
    """The reason of an admission refusal, as ``kubectl`` shows it."""
    assert response.status_code == 403, response.text
    message: str = response.json()["message"]
    prefix = f'admission webhook "{webhook}" denied the request: '
    assert message.startswith(prefix), message
    return message.removeprefix(prefix)


@pytest.fixture
async def cluster(
    kube_api: KubeApi, db: Any, operator: Operator, chart_webhooks: list[dict[str, Any]]
) -> AsyncIterator[Cluster]:
    world = await apply_world(kube_api, db, tenant_namespaces={"ml": "acme", "team-b": "beta"})
    # The tenant's reservations, stamped by hand before the webhooks are registered.
    train = await _reservation(
        kube_api, kubeworld.reservation("train").gpus(2).kubernetes(), "placed", "binding"
    )
    assert train["status"]["resourceName"].startswith("bcd.dev/rsv-")
    port = operator.runtime.config.webhook_port
    assert port is not None
    await _listening(port)
    _route(kube_api, chart_webhooks, f"http://127.0.0.1:{port}")
    for configuration in chart_webhooks:
        await kube_api.create(copy.deepcopy(configuration))
    kube_api.tokens["t-alice"] = ALICE
    kube_api.tokens["t-mallory"] = MALLORY
    async with httpx.AsyncClient(base_url=kube_api.url, timeout=15.0) as http:
        yield Cluster(world, http, train)


# --- the reservation's own pods ------------------------------------------------------------------


async def test_a_labelled_pod_gets_its_reservations_resource_in_every_container(
    cluster: Cluster,
) -> None:
    asked = pod("trainer", label="train", init={"gpu": 1}, gpu=2, cpu=4)
    created = await cluster.create(asked)
    assert created.status_code == 201, created.text
    assert "warning" not in created.headers
    stored = cluster.kube.stored(PODS, "ml", "trainer")
    assert stored == created.json()
    (setup,) = stored["spec"]["initContainers"]
    (main,) = stored["spec"]["containers"]
    assert setup["resources"]["limits"] == {cluster.resource: "1"}
    assert main["resources"]["limits"] == {"cpu": "4", cluster.resource: "2"}
    original = json.loads(stored["metadata"]["annotations"]["bcd.dev/original-resources"])
    assert original == {
        "initContainers": {"setup": {"limits": {"bcd.dev/gpu": "1"}}},
        "containers": {"main": {"limits": {"bcd.dev/gpu": "2"}}},
    }
    # The pod may ask its reservation's resource by name too, with the label.
    direct = await cluster.create(pod("direct", label="train", **{cluster.resource: 1}))
    assert direct.status_code == 201, direct.text
    # Later updates that leave its devices and label alone pass, even after a release.
    await cluster.kube.patch(RESERVATIONS, "ml", "train", {"spec": {"release": True}})
    await cluster.kube.wait_for(RESERVATIONS, "ml", "train", _state("released"))
    relabelled = await cluster.patch("ml", "trainer", {"metadata": {"labels": {"app": "x"}}})
    assert relabelled.status_code == 200, relabelled.text


async def test_more_devices_than_held_or_another_class_are_refused(cluster: Cluster) -> None:
    too_many = await cluster.create(pod("big", label="train", gpu=3))
    assert refusal(too_many) == (
        "asks 3 devices of Reservation 'train', which holds 2 per node (2 gpu); "
        "a pod runs on one node"
    )
    # Two app containers of 2 each: the pod asks 4 (an init container of 2 alone fits).
    two = pod("two", label="train", init={"gpu": 2}, gpu=2)
    two["spec"]["containers"].append(copy.deepcopy(two["spec"]["containers"][0]) | {"name": "b"})
    assert "asks 4 devices" in refusal(await cluster.create(two))
    mig = await cluster.create(pod("mig", label="train", mig=1))
    assert refusal(mig).startswith(
        "spec.containers[0]: asks bcd.dev/gpu.mig, which Reservation 'train' does not hold"
    )
    assert cluster.kube.stored(PODS, "ml", "big") is None


async def test_a_terminal_or_hold_reservation_gives_no_devices(cluster: Cluster) -> None:
    kube = cluster.kube
    await _reservation(kube, kubeworld.reservation("done").kubernetes(), "placed", "binding")
    await kube.patch(RESERVATIONS, "ml", "done", {"spec": {"release": True}})
    await kube.wait_for(RESERVATIONS, "ml", "done", _state("released"))
    released = await cluster.create(pod("late", label="done", gpu=1))
    assert refusal(released) == (
        "metadata.labels[bcd.dev/reservation]: Reservation 'done' is released: "
        "it holds no devices any more"
    )
    await _reservation(kube, kubeworld.reservation("kept"), "placed", "active")
    hold = await cluster.create(pod("holder", label="kept", gpu=1))
    assert refusal(hold).startswith(
        "metadata.labels[bcd.dev/reservation]: Reservation 'kept' has binding 'hold'"
    )


# --- attacks from another namespace ------------------------------------------------------------


async def test_attack_a_pod_of_another_namespace_cannot_reach_the_reservation(
    cluster: Cluster,
) -> None:
    resource = cluster.resource
    # 1. Its label names the Reservation: there is none of that name in its own namespace.
    labelled = await cluster.create(pod("steal", "team-b", label="train", gpu=1), token="t-mallory")
    assert refusal(labelled) == (
        "metadata.labels[bcd.dev/reservation]: Reservation 'train' does not exist in "
        "namespace 'team-b'"
    )
    # 2. It asks the reservation's resource directly: in a container, in an init container
    #    only, in requests only, with or without a label.
    direct = pod("steal", "team-b", **{resource: 1})
    init_only = pod("steal", "team-b", init={resource: 1}, cpu=1)
    requests_only = pod("steal", "team-b", cpu=1)
    requests_only["spec"]["containers"][0]["resources"]["requests"] = {resource: "1"}
    with_label = pod("steal", "team-b", label="train", **{resource: 2})
    for attempt in (direct, init_only, requests_only, with_label):
        answer = await cluster.create(attempt, token="t-mallory")
        assert refusal(answer) == (
            f"asks {resource}, the resource of a Reservation in another namespace: "
            "a pod may use only the reservations of its own namespace"
        )
    # 3. A made-up reservation resource.
    made_up = await cluster.create(
        pod("steal", "team-b", **{"bcd.dev/rsv-aaaaaaaaaaaaaaaaaaaaaaaa": 1}), token="t-mallory"
    )
    assert refusal(made_up).endswith("which is no Reservation's resource")
    assert cluster.kube.stored(PODS, "team-b", "steal") is None

    # 4. Plain bcd.dev/gpu without a label is created (it can only get shared devices) with a
    #    warning, as no pool shares its devices; then it tries to change into a thief.
    plain = await cluster.create(pod("plain", "team-b", gpu=1), token="t-mallory")
    assert plain.status_code == 201, plain.text
    assert "no GPUPool shares its devices" in plain.headers["warning"]
    assert plain.json()["spec"]["containers"][0]["resources"]["limits"] == {"bcd.dev/gpu": "1"}
    add_label = {"metadata": {"labels": {"bcd.dev/reservation": "train"}}}
    answer = await cluster.patch("team-b", "plain", add_label, token="t-mallory")
    assert refusal(answer).startswith(
        "metadata.labels[bcd.dev/reservation]: cannot change on a pod that asks bcd devices"
    )
    limits = "/spec/containers/0/resources/limits"
    swap = [{"op": "replace", "path": limits, "value": {resource: "1"}}]
    answer = await cluster.patch("team-b", "plain", swap, token="t-mallory")
    assert "the resource of a Reservation in another namespace" in refusal(answer)
    stored = cluster.kube.stored(PODS, "team-b", "plain")
    assert stored["spec"]["containers"][0]["resources"]["limits"] == {"bcd.dev/gpu": "1"}
    assert "bcd.dev/reservation" not in stored["metadata"]["labels"]


async def test_attack_the_tenants_own_pods_cannot_move_to_another_reservation(
    cluster: Cluster,
) -> None:
    created = await cluster.create(pod("trainer", label="train", gpu=1))
    assert created.status_code == 201, created.text
    for change in ({"bcd.dev/reservation": "other"}, {"bcd.dev/reservation": None}):
        answer = await cluster.patch("ml", "trainer", {"metadata": {"labels": change}})
        assert "cannot change on a pod that asks bcd devices (it was 'train')" in refusal(answer)
    # Without the label, the reservation's resource is refused even in its own namespace.
    unlabelled = await cluster.create(pod("sneak", **{cluster.resource: 1}))
    assert refusal(unlabelled).startswith(f"asks {cluster.resource} without the label")


async def test_attack_a_tenant_writing_its_reservations_status_cannot_take_anothers_devices(
    cluster: Cluster, start_operator: Callable[..., Any], chart_webhooks: list[dict[str, Any]]
) -> None:
    """A tenant allowed to write its own Reservation's status names the victim's resource (and
    id) there. An operator that trusted status took the first Reservation showing a resource
    as its owner: after a restart (its watch listing the thief's namespace first) it admitted
    the thief's pod onto the victim's devices. Ownership now comes from the store alone."""
    kube, victim = cluster.kube, cluster.resource
    # Another namespace (of the same tenant: pods never cross namespaces either way).
    await kube.create(kubeworld.namespace("lab", tenant="acme"))
    mine = await _reservation(
        kube,
        kubeworld.reservation("mine", "lab").gpus(1).kubernetes(),
        "placed",
        "binding",
    )
    own = mine["status"]["resourceName"]
    assert own != victim

    async def forge(**status: Any) -> None:
        await kube.patch(RESERVATIONS, "lab", "mine", {"status": status}, status=True)

    await forge(resourceName=victim)
    # The restart: a fresh operator (its watch and indexes built from what the server lists)
    # answers the webhooks.
    async with start_operator(webhook_port=free_port()) as restarted:
        port = restarted.runtime.config.webhook_port
        await _listening(port)
        _route(kube, chart_webhooks, f"http://127.0.0.1:{port}")
        await forge(resourceName=victim)
        # 1. The label names its own Reservation, whose status names the victim's resource.
        labelled = await cluster.create(pod("thief", "lab", label="mine", gpu=1), token="t-mallory")
        assert labelled.status_code == 201, labelled.text
        (main,) = labelled.json()["spec"]["containers"]
        assert main["resources"]["limits"] == {own: "1"}  # its own devices, never the victim's
        # 2. It asks the victim's resource by name, under its own Reservation's label.
        direct = await cluster.create(
            pod("thief-2", "lab", label="mine", **{victim: 1}), token="t-mallory"
        )
        assert refusal(direct) == (
            f"asks {victim}, the resource of a Reservation in another namespace: "
            "a pod may use only the reservations of its own namespace"
        )
        # 3. Its status names the victim's reservation id too: then it is no reservation the
        #    operator admitted for this object, and hands out nothing.
        await forge(resourceName=victim, id=cluster.train["status"]["id"], state="active")
        forged = await cluster.create(pod("thief-3", "lab", label="mine", gpu=1), token="t-mallory")
        assert "is not admitted yet" in refusal(forged)
        for name in ("thief", "thief-2", "thief-3"):
            stored = kube.stored(PODS, "lab", name) or {}
            for container in (stored.get("spec") or {}).get("containers", []):
                assert victim not in container["resources"]["limits"], name


async def test_no_warning_once_a_pool_shares_its_devices(cluster: Cluster) -> None:
    shared = kubeworld.gpupool("shared-a10", model="A10")
    shared["spec"]["policy"]["podAccess"] = "shared"
    await cluster.kube.create(shared)
    await cluster.kube.wait_for(
        GPUPOOLS, None, "shared-a10", lambda o: bool((o or {}).get("status", {}).get("conditions"))
    )
    created = await cluster.create(pod("plain", gpu=1))
    assert created.status_code == 201, created.text
    assert "warning" not in created.headers


# --- scope and outages ---------------------------------------------------------------------------


async def test_out_of_scope_pods_are_untouched_and_an_outage_blocks_only_bcd_pods(
    cluster: Cluster, chart_webhooks: list[dict[str, Any]]
) -> None:
    kube = cluster.kube
    # kube-system is excluded by the chart: its pods never reach the operator (a cluster admin's
    # namespace; the docs say so).
    await kube.create(kubeworld.namespace("kube-system", tenant=None))
    system = await cluster.create(pod("dns", "kube-system", **{cluster.resource: 1}))
    assert system.status_code == 201, system.text
    assert "annotations" not in system.json()["metadata"]
    # A pod that asks no bcd device is not sent at all.
    plain = await cluster.create(pod("web", cpu=1))
    assert plain.status_code == 201, plain.text
    assert plain.json()["spec"]["containers"][0]["resources"] == {"limits": {"cpu": "1"}}

    # The operator cannot be reached: in-scope pods are refused (failurePolicy Fail), others
    # are still created.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = int(s.getsockname()[1])
    _route(kube, chart_webhooks, f"http://127.0.0.1:{closed}")
    refused = await cluster.create(pod("trainer", label="train", gpu=1))
    assert refused.status_code == 500, refused.text
    assert 'failed calling webhook "rewrite.pods.bcd.dev"' in refused.json()["message"]
    for attempt in (pod("steal", "team-b", **{cluster.resource: 1}), pod("plain-gpu", gpu=1)):
        assert (await cluster.create(attempt, token="t-mallory")).status_code == 500
    web = await cluster.create(pod("web-2", cpu=1))
    assert web.status_code == 201, web.text
    unrelated_update = await cluster.patch("ml", "web", {"metadata": {"labels": {"v": "2"}}})
    assert unrelated_update.status_code == 200, unrelated_update.text
    assert kube.stored(PODS, "ml", "trainer") is None
