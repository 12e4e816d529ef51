"""The Kubernetes API stand-in answers as a real API server does, and kopf runs against it.

Each semantic the stand-in adds to kmock has its own test over real HTTP (httpx as a plain
client); the last test runs a tiny kopf operator in-process end to end.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import kopf
import pytest

from tests.support.kube import (
    DEVICEALLOCATIONS,
    EVENTS,
    GPUNODES,
    GPUPOOLS,
    KOPF_PEERINGS,
    NAMESPACES,
    RESERVATIONS,
    TOKEN_REVIEWS,
    Ref,
)
from tests.support.kubeserver import CRDS_DIR, KubeApi, operator_running

WIDGETS = Ref(group="test.bcd.dev", version="v1", plural="widgets", namespaced=True)
GADGETS = Ref(group="test.bcd.dev", version="v1", plural="gadgets", namespaced=False)
WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.bcd.dev"},
    "spec": {
        "group": "test.bcd.dev",
        "scope": "Namespaced",
        "names": {
            "plural": "widgets",
            "singular": "widget",
            "kind": "Widget",
            "shortNames": ["wd"],
        },
        "versions": [
            {"name": "v1", "served": True, "storage": True, "subresources": {"status": {}}},
            {"name": "v0", "served": False, "storage": False},
        ],
    },
}
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"


@pytest.fixture
async def api(kube_api: KubeApi) -> KubeApi:
    kube_api.emulator.declare_crd(WIDGET_CRD)
    kube_api.emulator.declare(GADGETS, kind="Gadget")  # no status subresource
    return kube_api


@pytest.fixture
async def http(api: KubeApi) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=api.url, timeout=5.0, verify=False) as client:
        yield client


def widget(name: str, *, namespace: str = "ns1", **fields: Any) -> dict[str, Any]:
    metadata = {"name": name, "namespace": namespace, **fields.pop("metadata", {})}
    return {"apiVersion": "test.bcd.dev/v1", "kind": "Widget", "metadata": metadata, **fields}


async def send(
    http: httpx.AsyncClient, method: str, path: str, body: Any = None, kind: str = MERGE_PATCH
) -> tuple[int, Any]:
    content = None if body is None else json.dumps(body)
    response = await http.request(method, path, content=content, headers={"Content-Type": kind})
    return response.status_code, response.json()


def version(obj: dict[str, Any]) -> int:
    return int(obj["metadata"]["resourceVersion"])


async def events(
    http: httpx.AsyncClient, path: str, *, count: int, **params: str
) -> list[tuple[str, str]]:
    """The first ``count`` watch events as (type, name), within two seconds."""
    seen: list[tuple[str, str]] = []
    async with http.stream("GET", path, params={"watch": "true", **params}) as response:
        assert response.status_code == 200
        async with asyncio.timeout(2):
            async for line in response.aiter_lines():
                event = json.loads(line)
                seen.append((event["type"], event["object"]["metadata"]["name"]))
                if len(seen) == count:
                    break
    return seen


async def test_create_answers_201_with_identity_and_namespace_from_the_url(
    http: httpx.AsyncClient,
) -> None:
    body = widget("w1", spec={"size": 1})
    del body["metadata"]["namespace"]
    code, created = await send(http, "POST", WIDGETS.path(namespace="ns1"), body)
    assert code == 201
    meta = created["metadata"]
    assert meta["namespace"] == "ns1"
    assert uuid.UUID(meta["uid"]).version == 4
    assert datetime.datetime.strptime(meta["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ")
    assert meta["generation"] == 1
    assert meta["resourceVersion"].isdigit()

    code, patched = await send(
        http,
        "PATCH",
        WIDGETS.path(namespace="ns1", name="w1"),
        {"spec": {"size": 2}, "metadata": {"uid": "forged"}},
    )
    assert code == 200
    assert patched["metadata"]["uid"] == meta["uid"]
    assert patched["metadata"]["creationTimestamp"] == meta["creationTimestamp"]


async def test_duplicate_name_is_409_and_a_disagreeing_namespace_is_400(
    http: httpx.AsyncClient,
) -> None:
    path = WIDGETS.path(namespace="ns1")
    assert (await send(http, "POST", path, widget("w1")))[0] == 201
    code, status = await send(http, "POST", path, widget("w1"))
    assert (code, status["kind"], status["reason"]) == (409, "Status", "AlreadyExists")
    code, status = await send(http, "POST", path, widget("w2", namespace="other"))
    assert (code, status["reason"]) == (400, "BadRequest")
    code, status = await send(http, "POST", path, widget("Not_A_Name"))
    assert (code, status["reason"]) == (422, "Invalid")


async def test_resource_version_is_global_and_bumped_by_every_write(
    http: httpx.AsyncClient,
) -> None:
    obj = (await send(http, "POST", WIDGETS.path(namespace="ns1"), widget("w1")))[1]
    path = WIDGETS.path(namespace="ns1", name="w1")
    versions = [version(obj)]
    other = (await send(http, "POST", WIDGETS.path(namespace="ns1"), widget("w2")))[1]
    versions.append(version(other))
    versions.append(version((await send(http, "PATCH", path, {"spec": {"a": 1}}))[1]))
    versions.append(version((await send(http, "PATCH", path + "/status", {"status": {"s": 1}}))[1]))
    finalize = [{"op": "add", "path": "/metadata/finalizers", "value": ["test/hold"]}]
    versions.append(version((await send(http, "PATCH", path, finalize, JSON_PATCH))[1]))
    code, marked = await send(http, "DELETE", path)
    assert code == 202
    assert marked["metadata"]["deletionTimestamp"]
    versions.append(version(marked))
    assert versions == sorted(set(versions)), versions
    # A write that changes nothing is no write, as on a real server.
    assert version((await send(http, "PATCH", path, {"spec": {"a": 1}}))[1]) == versions[-1]


async def test_generation_follows_spec_changes_only(http: httpx.AsyncClient) -> None:
    await send(http, "POST", WIDGETS.path(namespace="ns1"), widget("w1", spec={"a": 1}))
    path = WIDGETS.path(namespace="ns1", name="w1")
    steps = [
        (path + "/status", {"status": {"phase": "Ready"}}, 1),
        (path, {"metadata": {"labels": {"x": "y"}, "annotations": {"k": "v"}}}, 1),
        (path, {"spec": {"a": 2}}, 2),
        (path, {"data": {"other": "top-level field"}}, 3),
        (path + "/status", {"status": {"phase": "Gone"}}, 3),
    ]
    for url, body, generation in steps:
        code, obj = await send(http, "PATCH", url, body)
        assert (code, obj["metadata"]["generation"]) == (200, generation), body


async def test_json_patch_test_op_passes_on_the_current_version_and_fails_with_422(
    http: httpx.AsyncClient,
) -> None:
    obj = (await send(http, "POST", WIDGETS.path(namespace="ns1"), widget("w1")))[1]
    path = WIDGETS.path(namespace="ns1", name="w1")
    current = obj["metadata"]["resourceVersion"]
    add = {"op": "add", "path": "/metadata/finalizers", "value": ["kopf.zalando.org/x"]}
    stale = [{"op": "test", "path": "/metadata/resourceVersion", "value": "0"}, add]
    code, status = await send(http, "PATCH", path, stale, JSON_PATCH)
    assert (code, status["reason"]) == (422, "Invalid")
    fresh = [{"op": "test", "path": "/metadata/resourceVersion", "value": current}, add]
    code, patched = await send(http, "PATCH", path, fresh, JSON_PATCH)
    assert (code, patched["metadata"]["finalizers"]) == (200, ["kopf.zalando.org/x"])


async def test_stale_resource_version_on_merge_patch_and_put_is_409(
    http: httpx.AsyncClient,
) -> None:
    obj = (await send(http, "POST", WIDGETS.path(namespace="ns1"), widget("w1")))[1]
    path = WIDGETS.path(namespace="ns1", name="w1")
    old = obj["metadata"]["resourceVersion"]
    obj = (await send(http, "PATCH", path, {"spec": {"a": 1}}))[1]  # no version: no check
    code, status = await send(http, "PATCH", path, {"metadata": {"resourceVersion": old}})
    assert (code, status["reason"]) == (409, "Conflict")
    code, status = await send(
        http, "PUT", path, {**obj, "metadata": {**obj["metadata"], "resourceVersion": old}}
    )
    assert (code, status["reason"]) == (409, "Conflict")
    code, replaced = await send(http, "PUT", path, {**obj, "spec": {"b": 2}}, "application/json")
    assert (code, replaced["spec"], replaced["metadata"]["generation"]) == (200, {"b": 2}, 3)


@pytest.mark.parametrize(
    ("selector", "names"),
    [
        ("tier=gold", ["a"]),
        ("tier==gold", ["a"]),
        ("tier!=gold", ["b", "c"]),
        ("tier in (gold, silver)", ["a", "b"]),
        ("tier notin (gold)", ["b", "c"]),
        ("tier", ["a", "b"]),
        ("!tier", ["c"]),
        ("tier,zone=eu", ["b"]),
        ("tier in (gold,silver),!zone", ["a"]),
    ],
)
async def test_label_selector_on_list(
    http: httpx.AsyncClient, selector: str, names: list[str]
) -> None:
    labels = {"a": {"tier": "gold"}, "b": {"tier": "silver", "zone": "eu"}, "c": {"zone": "eu"}}
    for name, these in labels.items():
        await send(
            http, "POST", WIDGETS.path(namespace="ns1"), widget(name, metadata={"labels": these})
        )
    response = await http.get(WIDGETS.path(namespace="ns1"), params={"labelSelector": selector})
    assert [item["metadata"]["name"] for item in response.json()["items"]] == names


async def test_field_selector_and_namespaces_on_list(http: httpx.AsyncClient) -> None:
    for namespace, name in [("ns1", "a"), ("ns1", "b"), ("ns2", "a")]:
        await send(
            http, "POST", WIDGETS.path(namespace=namespace), widget(name, namespace=namespace)
        )
    everywhere = (
        await http.get(WIDGETS.path(), params={"fieldSelector": "metadata.name=a"})
    ).json()
    assert [i["metadata"]["namespace"] for i in everywhere["items"]] == ["ns1", "ns2"]
    assert everywhere["metadata"]["resourceVersion"] == "3"
    one = await http.get(
        WIDGETS.path(namespace="ns1"), params={"fieldSelector": "metadata.name!=a"}
    )
    assert [i["metadata"]["name"] for i in one.json()["items"]] == ["b"]
    bad = await http.get(WIDGETS.path(), params={"fieldSelector": "spec.size=1"})
    assert (bad.status_code, bad.json()["reason"]) == (400, "BadRequest")


async def test_watch_sends_only_matching_objects_and_their_label_transitions(
    http: httpx.AsyncClient,
) -> None:
    path = WIDGETS.path(namespace="ns1")
    params = {"watch": "true", "labelSelector": "team=ml"}
    async with http.stream("GET", path, params=params) as response:
        lines = response.aiter_lines()
        for name, team in [("quiet", "web"), ("loud", "ml")]:
            await send(http, "POST", path, widget(name, metadata={"labels": {"team": team}}))
        for name, team in [("quiet", "ml"), ("loud", "web")]:
            await send(http, "PATCH", f"{path}/{name}", {"metadata": {"labels": {"team": team}}})
        await send(http, "DELETE", f"{path}/quiet")
        async with asyncio.timeout(2):
            got = [json.loads(await anext(lines)) for _ in range(4)]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in got] == [
        ("ADDED", "loud"),
        ("ADDED", "quiet"),
        ("DELETED", "loud"),
        ("DELETED", "quiet"),
    ]


async def test_watch_resumes_after_a_resource_version(http: httpx.AsyncClient) -> None:
    path = WIDGETS.path(namespace="ns1")
    for name in ("a", "b"):
        await send(http, "POST", path, widget(name))
    listed = (await http.get(path)).json()["metadata"]["resourceVersion"]
    await send(http, "PATCH", f"{path}/b", {"spec": {"x": 1}})
    await send(http, "POST", path, widget("c"))
    assert await events(http, path, count=2, resourceVersion=listed) == [
        ("MODIFIED", "b"),
        ("ADDED", "c"),
    ]
    assert await events(http, path, count=3) == [("ADDED", "a"), ("ADDED", "b"), ("ADDED", "c")]


async def test_a_watch_from_before_a_compaction_is_gone(
    api: KubeApi, http: httpx.AsyncClient
) -> None:
    path = WIDGETS.path(namespace="ns1")
    await send(http, "POST", path, widget("a"))
    old = (await http.get(path)).json()["metadata"]["resourceVersion"]
    await send(http, "POST", path, widget("b"))
    api.emulator.compact()
    gone = await http.get(path, params={"watch": "true", "resourceVersion": old})
    assert (gone.status_code, gone.json()["reason"]) == (410, "Expired")
    # From the current version, and with a fresh list, watching works as before.
    now = (await http.get(path)).json()["metadata"]["resourceVersion"]
    await send(http, "POST", path, widget("c"))
    assert await events(http, path, count=1, resourceVersion=now) == [("ADDED", "c")]


async def test_watch_timeout_seconds_ends_the_stream(http: httpx.AsyncClient) -> None:
    started = time.monotonic()
    response = await http.get(WIDGETS.path(), params={"watch": "true", "timeoutSeconds": "1"})
    assert (response.status_code, response.text) == (200, "")
    assert 0.9 <= time.monotonic() - started < 2.5


async def test_watch_on_one_object_with_initial_events_ends_them_with_a_bookmark(
    http: httpx.AsyncClient,
) -> None:
    path = WIDGETS.path(namespace="ns1")
    for name in ("a", "b"):
        await send(http, "POST", path, widget(name))
    params = {"watch": "true", "sendInitialEvents": "true", "allowWatchBookmarks": "true"}
    async with http.stream("GET", f"{path}/b", params=params) as response:
        lines = response.aiter_lines()
        await send(http, "PATCH", f"{path}/a", {"spec": {"x": 1}})
        await send(http, "PATCH", f"{path}/b", {"spec": {"x": 1}})
        async with asyncio.timeout(2):
            got = [json.loads(await anext(lines)) for _ in range(3)]
    assert [e["type"] for e in got] == ["ADDED", "BOOKMARK", "MODIFIED"]
    assert got[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert got[2]["object"]["metadata"]["name"] == "b"


async def test_patch_types_and_finalizers_on_a_deleting_object(http: httpx.AsyncClient) -> None:
    path = WIDGETS.path(namespace="ns1", name="w1")
    await send(http, "POST", WIDGETS.path(namespace="ns1"), widget("w1"))
    strategic = "application/strategic-merge-patch+json"
    code, status = await send(http, "PATCH", path, {"spec": {"a": 1}}, strategic)
    assert (code, status["reason"]) == (415, "UnsupportedMediaType")  # custom resources
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}}
    await send(http, "POST", NAMESPACES.path(), namespace)
    body = {"metadata": {"labels": {"a": "b"}}}
    assert (await send(http, "PATCH", NAMESPACES.path(name="ml"), body, strategic))[0] == 200
    broken = [{"op": "remove", "path": "/spec/missing"}]
    assert (await send(http, "PATCH", path, broken, JSON_PATCH))[0] == 422
    await send(http, "PATCH", path, {"metadata": {"finalizers": ["test/a"]}})
    await send(http, "DELETE", path)
    code, status = await send(http, "PATCH", path, {"metadata": {"finalizers": ["test/a", "b/c"]}})
    assert (code, status["reason"]) == (422, "Invalid")


async def test_status_subresource_separates_spec_from_status(http: httpx.AsyncClient) -> None:
    created = await send(
        http,
        "POST",
        WIDGETS.path(namespace="ns1"),
        widget("w1", spec={"a": 1}, status={"forged": True}),
    )
    assert "status" not in created[1]
    path = WIDGETS.path(namespace="ns1", name="w1")
    await send(http, "PATCH", path + "/status", {"status": {"phase": "Ready"}})
    main = (await send(http, "PATCH", path, {"spec": {"a": 2}, "status": {"phase": "Hacked"}}))[1]
    assert (main["spec"], main["status"]) == ({"a": 2}, {"phase": "Ready"})
    sub = (
        await send(
            http,
            "PATCH",
            path + "/status",
            {
                "spec": {"a": 3},
                "metadata": {"labels": {"x": "y"}},
                "status": {"phase": "Done"},
            },
        )
    )[1]
    assert (sub["spec"], sub["status"]) == ({"a": 2}, {"phase": "Done"})
    assert "labels" not in sub["metadata"]


async def test_without_status_subresource_main_writes_change_status(
    http: httpx.AsyncClient,
) -> None:
    body = {"apiVersion": "test.bcd.dev/v1", "kind": "Gadget", "metadata": {"name": "g1"}}
    code, created = await send(http, "POST", GADGETS.path(), {**body, "status": {"on": True}})
    assert (code, created["status"], "namespace" in created["metadata"]) == (
        201,
        {"on": True},
        False,
    )
    patched = (await send(http, "PATCH", GADGETS.path(name="g1"), {"status": {"on": False}}))[1]
    assert patched["status"] == {"on": False}
    assert (await send(http, "PATCH", GADGETS.path(name="g1") + "/status", {}))[0] == 404


async def test_delete_with_finalizers_marks_then_removing_the_last_one_deletes(
    http: httpx.AsyncClient,
) -> None:
    path = WIDGETS.path(namespace="ns1")
    await send(http, "POST", path, widget("held", metadata={"finalizers": ["test/a", "test/b"]}))
    await send(http, "POST", path, widget("free"))
    listed = (await http.get(path)).json()["metadata"]["resourceVersion"]
    marked = (await send(http, "DELETE", f"{path}/held"))[1]
    assert marked["metadata"]["deletionTimestamp"]
    await send(http, "PATCH", f"{path}/held", {"metadata": {"finalizers": ["test/b"]}})
    assert (await http.get(f"{path}/held")).status_code == 200
    await send(http, "PATCH", f"{path}/held", {"metadata": {"finalizers": None}})
    assert (await send(http, "DELETE", f"{path}/free"))[0] == 200
    for name in ("held", "free"):
        assert (await http.get(f"{path}/{name}")).status_code == 404
    assert await events(http, path, count=5, resourceVersion=listed) == [
        ("MODIFIED", "held"),
        ("MODIFIED", "held"),
        ("MODIFIED", "held"),
        ("DELETED", "held"),
        ("DELETED", "free"),
    ]


async def test_token_review_answers_from_the_table(api: KubeApi, http: httpx.AsyncClient) -> None:
    api.tokens["t-alice"] = {"username": "alice@example.com", "uid": "u1", "groups": ["ml"]}
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview"}
    asking = {**review, "spec": {"token": "t-alice"}}
    code, known = await send(http, "POST", TOKEN_REVIEWS.path(), asking, "application/json")
    assert code == 201
    assert known["status"]["authenticated"] is True
    assert known["status"]["user"] == api.tokens["t-alice"]
    unknown = (await send(http, "POST", TOKEN_REVIEWS.path(), {**review, "spec": {"token": "x"}}))[
        1
    ]
    assert unknown["status"] == {"authenticated": False}


async def test_core_and_peering_resources_are_declared(http: httpx.AsyncClient) -> None:
    core = {r["name"]: r for r in (await http.get("/api/v1")).json()["resources"]}
    assert (core["namespaces"]["namespaced"], core["events"]["namespaced"]) == (False, True)
    peering = {r["name"]: r for r in (await http.get("/apis/kopf.dev/v1")).json()["resources"]}
    assert peering["kopfpeerings"]["namespaced"] is True
    assert peering["clusterkopfpeerings"]["namespaced"] is False
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}}
    assert (await send(http, "POST", NAMESPACES.path(), namespace))[0] == 201
    labelled = await send(
        http,
        "PATCH",
        NAMESPACES.path(name="ml"),
        {"metadata": {"labels": {"bcd.dev/tenant": "acme"}}},
    )
    assert labelled[1]["metadata"]["labels"] == {
        "bcd.dev/tenant": "acme",
        "kubernetes.io/metadata.name": "ml",
    }
    assert await events(http, NAMESPACES.path(), count=1) == [("ADDED", "ml")]
    event = {"apiVersion": "v1", "kind": "Event", "metadata": {"generateName": "kopf-event-"}}
    code, posted = await send(http, "POST", EVENTS.path(namespace="ml"), event)
    assert code == 201
    assert posted["metadata"]["name"].startswith("kopf-event-")
    peer = {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "p"}}
    assert (await send(http, "POST", KOPF_PEERINGS.path(namespace="ml"), peer))[0] == 201


async def test_every_namespace_carries_its_name_as_a_label_that_cannot_be_changed(
    http: httpx.AsyncClient,
) -> None:
    forged = {"kubernetes.io/metadata.name": "kube-system", "team": "a"}
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}}
    namespace["metadata"]["labels"] = forged
    code, created = await send(http, "POST", NAMESPACES.path(), namespace)
    assert code == 201
    assert created["metadata"]["labels"] == {"kubernetes.io/metadata.name": "ml", "team": "a"}
    path = NAMESPACES.path(name="ml")
    for patch in (
        {"metadata": {"labels": {"kubernetes.io/metadata.name": "kube-system"}}},
        {"metadata": {"labels": None}},
    ):
        code, patched = await send(http, "PATCH", path, patch)
        assert code == 200
        assert patched["metadata"]["labels"]["kubernetes.io/metadata.name"] == "ml"


async def test_declare_crd_reads_a_manifest(http: httpx.AsyncClient) -> None:
    listed = (await http.get("/apis/test.bcd.dev/v1")).json()["resources"]
    widgets = {r["name"]: r for r in listed}
    assert widgets["widgets"]["kind"] == "Widget"
    assert widgets["widgets"]["shortNames"] == ["wd"]
    assert widgets["widgets"]["namespaced"] is True
    assert "widgets/status" in widgets
    assert (await http.get("/apis/test.bcd.dev/v0/widgets")).status_code == 404  # not served


async def test_project_crds_are_declared_as_the_constants_name_them(
    http: httpx.AsyncClient,
) -> None:
    if not CRDS_DIR.is_dir():
        pytest.skip(f"{CRDS_DIR} does not exist yet: no project CRDs to check")
    listed = (await http.get("/apis/bcd.dev/v1alpha1")).json()["resources"]
    found = {r["name"]: r["namespaced"] for r in listed}
    for ref in (RESERVATIONS, GPUPOOLS, GPUNODES, DEVICEALLOCATIONS):
        assert found.get(ref.plural) == ref.namespaced, ref
        assert f"{ref.plural}/status" in found, ref


def test_declare_crds_refuses_what_it_cannot_read(api: KubeApi, tmp_path: Path) -> None:
    broken = {**WIDGET_CRD, "spec": {**WIDGET_CRD["spec"], "names": {"kind": "Widget"}}}
    with pytest.raises(ValueError, match=r"spec\.names\.plural"):
        api.emulator.declare_crd(broken)
    with pytest.raises(ValueError, match=r"no \*\.yaml"):
        api.emulator.declare_crds(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("kind: Kustomization\n")
    with pytest.raises(ValueError, match=r"kustomization\.yaml.*CustomResourceDefinition"):
        api.emulator.declare_crds(tmp_path)


async def test_wait_for_fails_with_the_last_object_shown(api: KubeApi) -> None:
    await api.create(widget("w1", spec={"a": 1}))
    with pytest.raises(pytest.fail.Exception, match='"a": 1'):
        await api.wait_for(WIDGETS, "ns1", "w1", lambda obj: obj is None, timeout=0.2)


async def test_kopf_operator_runs_end_to_end(api: KubeApi, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
    registry = kopf.OperatorRegistry()
    created: list[str] = []
    deleted: list[str] = []

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.create("test.bcd.dev", "v1", "widgets", registry=registry)
    def greet(name: str, patch: kopf.Patch, **_: Any) -> None:
        created.append(name)
        patch.status["greeting"] = f"hello {name}"

    @kopf.on.delete("test.bcd.dev", "v1", "widgets", registry=registry)
    def part(name: str, **_: Any) -> None:
        deleted.append(name)

    settings = kopf.OperatorSettings()
    settings.peering.standalone = True
    before = asyncio.all_tasks()
    async with operator_running(registry=registry, settings=settings):
        await api.create(widget("w1", spec={"a": 1}))
        greeted = await api.wait_for(
            WIDGETS, "ns1", "w1", lambda obj: bool(obj and obj.get("status", {}).get("greeting"))
        )
        assert greeted is not None
        assert created == ["w1"]
        assert greeted["status"]["greeting"] == "hello w1"  # only /status writes status here
        assert "kopf.zalando.org/KopfFinalizerMarker" in greeted["metadata"]["finalizers"]
        await api.delete(WIDGETS, "ns1", "w1")
        await api.wait_for(WIDGETS, "ns1", "w1", lambda obj: obj is None)
        assert deleted == ["w1"]
    leaked = [task for task in asyncio.all_tasks() - before if not task.done() and _kopfs(task)]
    assert leaked == []


def _kopfs(task: asyncio.Task[Any]) -> bool:
    """Whether kopf (or our code) runs the task: kopf names its tasks, and their coroutines are
    kopf's. Not the unnamed ``Event.wait`` that ``asyncio.wait_for`` wraps for the session
    database pool's scheduler, which may start one at any moment."""
    where = str(getattr(getattr(task.get_coro(), "cr_code", None), "co_filename", ""))
    return "kopf" in where or "/bettercompute/" in where or not task.get_name().startswith("Task-")
