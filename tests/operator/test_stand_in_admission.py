"""The API stand-in's admission chain answers as a real API server does, one test per semantic.

Webhooks here are a small aiohttp server in the test (``Hooks``) that records every
AdmissionReview and answers as each test tells it; the stand-in calls it over real HTTP. The
CRD tests use a ``Thing`` CRD whose schema and CEL rules exercise each check. The last tests
run the real operator's webhooks, registered with the chart's own webhook configurations.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import ipaddress
import json
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp.web
import helm_python
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bettercompute.operator.running import Operator
from tests.chart import rendering
from tests.operator.conftest import World
from tests.support import kubeworld
from tests.support.admission import MUTATING_WEBHOOKS, VALIDATING_WEBHOOKS
from tests.support.kube import NAMESPACES, RESERVATIONS, Ref
from tests.support.kubeserver import KubeApi

THINGS = Ref(group="test.bcd.dev", version="v1", plural="things", namespaced=True)
GIZMOS = Ref(group="test.bcd.dev", version="v1", plural="gizmos", namespaced=False)
THING_SCHEMA = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "required": ["size"],
            "x-kubernetes-validations": [
                {
                    "rule": "self.size <= 5 || self.colour == 'red'",
                    "message": "only red things may be larger than 5",
                }
            ],
            "properties": {
                "size": {"type": "integer", "minimum": 1, "maximum": 10},
                "colour": {"type": "string", "enum": ["red", "blue"]},
                "label": {"type": "string", "pattern": "^[a-z]+$"},
                "mode": {
                    "type": "string",
                    "x-kubernetes-validations": [
                        {"rule": "self == oldSelf", "message": "mode is immutable"}
                    ],
                },
                "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
        },
        "status": {
            "type": "object",
            "properties": {"phase": {"type": "string", "enum": ["Ready", "Failed"]}},
        },
    },
}
THING_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "things.test.bcd.dev"},
    "spec": {
        "group": "test.bcd.dev",
        "scope": "Namespaced",
        "names": {"plural": "things", "singular": "thing", "kind": "Thing"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": THING_SCHEMA},
            }
        ],
    },
}
ALICE = {"username": "alice@acme", "uid": "u-alice", "groups": ["system:authenticated", "ml"]}
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
Answer = Callable[[dict[str, Any]], dict[str, Any]]


# --- a webhook server the tests program ------------------------------------------------------


class Hooks:
    """Webhooks at ``url + "/<path>"``: each answers with ``answers[path](request)`` (the
    review's ``request``; the uid is echoed here) and keeps every request in ``seen[path]``."""

    def __init__(self) -> None:
        self.url = ""
        self.answers: dict[str, Answer] = {}
        self.seen: dict[str, list[dict[str, Any]]] = {}
        self.order: list[str] = []
        self.delay: dict[str, float] = {}

    async def serve(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        path = request.match_info["path"]
        review = await request.json()
        self.seen.setdefault(path, []).append(review["request"])
        self.order.append(path)
        if path in self.delay:
            await asyncio.sleep(self.delay[path])
        response = {**self.answers[path](review["request"]), "uid": review["request"]["uid"]}
        body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}
        return aiohttp.web.json_response({**body, "response": response})


@contextlib.asynccontextmanager
async def serving(tls: ssl.SSLContext | None = None) -> AsyncIterator[Hooks]:
    served = Hooks()
    app = aiohttp.web.Application()
    app.router.add_post("/{path}", served.serve)
    runner = aiohttp.web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
    await site.start()
    port = runner.addresses[0][1]
    served.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    try:
        yield served
    finally:
        await runner.cleanup()


@pytest.fixture
async def hooks() -> AsyncIterator[Hooks]:
    async with serving() as served:
        yield served


def certificate(
    name: str, *, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A CA (no issuer) or a server certificate for 127.0.0.1 signed by ``issuer``."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is not None:
        address = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
        builder = builder.add_extension(x509.SubjectAlternativeName([address]), critical=False)
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256()), key


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def allow(**extra: Any) -> Answer:
    return lambda request: {"allowed": True, **extra}


def deny(message: str = "", code: int | None = None) -> Answer:
    status: dict[str, Any] = {"message": message} if message else {}
    if code is not None:
        status["code"] = code
    return lambda request: {"allowed": False, "status": status}


def patching(make_ops: Callable[[dict[str, Any]], list[dict[str, Any]]]) -> Answer:
    def answer(request: dict[str, Any]) -> dict[str, Any]:
        ops = base64.b64encode(json.dumps(make_ops(request)).encode()).decode()
        return {"allowed": True, "patchType": "JSONPatch", "patch": ops}

    return answer


def hook(name: str, client: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """One webhook of a configuration; by default on Things, CREATE and UPDATE."""
    rule = {
        "apiGroups": ["test.bcd.dev"],
        "apiVersions": ["v1"],
        "operations": fields.pop("operations", ["CREATE", "UPDATE"]),
        "resources": fields.pop("resources", ["things"]),
    }
    return {
        "name": name,
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",
        "clientConfig": client,
        "rules": [rule],
        **fields,
    }


def configuration(kind: str, name: str, *webhooks: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": f"{kind}WebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": list(webhooks),
    }


def thing(name: str, *, namespace: str = "ns1", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "test.bcd.dev/v1",
        "kind": "Thing",
        "metadata": {"name": name, "namespace": namespace, "labels": {}},
        "spec": {"size": 1, **spec},
    }


# --- the client side -------------------------------------------------------------------------


@pytest.fixture
async def api(kube_api: KubeApi) -> KubeApi:
    kube_api.emulator.declare_crd(THING_CRD)
    kube_api.emulator.declare(GIZMOS, kind="Gizmo")
    kube_api.tokens["t-alice"] = ALICE
    return kube_api


class Client:
    """Plain HTTP to the stand-in, as one caller (a bearer token)."""

    def __init__(self, http: httpx.AsyncClient, token: str | None) -> None:
        self.http = http
        self.token = token

    async def send(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        kind: str = MERGE_PATCH,
        params: dict[str, str] | None = None,
    ) -> httpx.Response:
        headers = {"Content-Type": "application/json" if method == "POST" else kind}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        content = None if body is None else json.dumps(body)
        return await self.http.request(
            method, path, content=content, headers=headers, params=params
        )

    async def create(self, obj: dict[str, Any], **params: str) -> httpx.Response:
        ref = {"Thing": THINGS, "Gizmo": GIZMOS, "Namespace": NAMESPACES}.get(obj["kind"])
        if ref is None:
            ref = RESERVATIONS
        namespace = obj["metadata"].get("namespace") if ref.namespaced else None
        return await self.send("POST", ref.path(namespace=namespace), obj, params=params or None)

    async def register(self, obj: dict[str, Any]) -> None:
        ref = MUTATING_WEBHOOKS if obj["kind"].startswith("Mutating") else VALIDATING_WEBHOOKS
        response = await self.send("POST", ref.path(), obj)
        assert response.status_code == 201, response.text

    async def patch_thing(
        self, name: str, body: Any, *, status: bool = False, **params: str
    ) -> httpx.Response:
        path = THINGS.path(namespace="ns1", name=name, subresource="status" if status else "")
        kind = JSON_PATCH if isinstance(body, list) else MERGE_PATCH
        return await self.send("PATCH", path, body, kind=kind, params=params or None)


@pytest.fixture
async def client(api: KubeApi) -> AsyncIterator[Client]:
    async with httpx.AsyncClient(base_url=api.url, timeout=10.0) as http:
        yield Client(http, "t-alice")


def url(hooks: Hooks, path: str) -> dict[str, Any]:
    return {"url": f"{hooks.url}/{path}"}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- webhooks: order, patches, refusals ------------------------------------------------------


async def test_mutating_webhooks_run_in_name_order_then_validating_and_patches_are_stored(
    api: KubeApi, client: Client, hooks: Hooks
) -> None:
    hooks.answers["first"] = patching(
        lambda r: [{"op": "add", "path": "/metadata/labels/first", "value": "1"}]
    )
    # The second sees the first's patch: it copies the label it finds into another.
    hooks.answers["second"] = patching(
        lambda r: [
            {
                "op": "add",
                "path": "/metadata/labels/second",
                "value": "saw-" + r["object"]["metadata"]["labels"].get("first", "nothing"),
            }
        ]
    )
    hooks.answers["check"] = allow()
    # Registered in the opposite order of their names: the names decide. The second is matched
    # on the object the first has patched: it selects the label the first adds.
    await client.register(configuration("Validating", "a-check", hook("c.t", url(hooks, "check"))))
    first_only = {"matchLabels": {"first": "1"}}
    await client.register(
        configuration(
            "Mutating", "b-second", hook("s.t", url(hooks, "second"), objectSelector=first_only)
        )
    )
    await client.register(configuration("Mutating", "a-first", hook("f.t", url(hooks, "first"))))

    response = await client.create(thing("t1"))

    assert response.status_code == 201, response.text
    assert hooks.order == ["first", "second", "check"]
    expected = {"first": "1", "second": "saw-1"}
    assert hooks.seen["check"][0]["object"]["metadata"]["labels"] == expected
    assert response.json()["metadata"]["labels"] == expected
    assert api.stored(THINGS, "ns1", "t1")["metadata"]["labels"] == expected


async def test_a_refusal_answers_with_the_webhooks_code_and_message_and_stores_nothing(
    api: KubeApi, client: Client, hooks: Hooks
) -> None:
    hooks.answers["no"] = deny("no things today", code=403)
    hooks.answers["mute"] = deny()  # no status at all: 400 and "without explanation"
    await client.register(configuration("Validating", "v", hook("no.test", url(hooks, "no"))))

    response = await client.create(thing("t1"))

    assert response.status_code == 403
    body = response.json()
    assert (body["kind"], body["reason"]) == ("Status", "Forbidden")
    assert body["message"] == 'admission webhook "no.test" denied the request: no things today'
    assert api.stored(THINGS, "ns1", "t1") is None

    await client.register(configuration("Mutating", "m", hook("mute.test", url(hooks, "mute"))))
    response = await client.create(thing("t2"))
    assert response.status_code == 400
    assert response.json()["reason"] == "BadRequest"
    assert response.json()["message"] == (
        'admission webhook "mute.test" denied the request without explanation'
    )
    assert api.stored(THINGS, "ns1", "t2") is None


async def test_an_update_runs_the_chain_and_a_refused_one_changes_nothing(
    api: KubeApi, client: Client, hooks: Hooks
) -> None:
    hooks.answers["big"] = lambda r: (
        {"allowed": r["object"]["spec"]["size"] < 4, "status": {"message": "too big"}}
    )
    await client.register(configuration("Validating", "v", hook("big.test", url(hooks, "big"))))
    assert (await client.create(thing("t1"))).status_code == 201
    before = api.stored(THINGS, "ns1", "t1")

    refused = await client.patch_thing("t1", {"spec": {"size": 5}})
    assert refused.status_code == 400
    assert "too big" in refused.json()["message"]
    assert api.stored(THINGS, "ns1", "t1") == before
    allowed = await client.patch_thing("t1", [{"op": "replace", "path": "/spec/size", "value": 3}])
    assert allowed.status_code == 200, allowed.text
    assert api.stored(THINGS, "ns1", "t1")["spec"]["size"] == 3
    assert [r["operation"] for r in hooks.seen["big"]] == ["CREATE", "UPDATE", "UPDATE"]


# --- which webhooks are called ----------------------------------------------------------------


async def test_match_conditions_true_false_and_an_error_under_each_failure_policy(
    api: KubeApi, client: Client, hooks: Hooks
) -> None:
    hooks.answers["red"] = deny("no red things")
    red_only = [{"name": "red", "expression": "object.spec.colour == 'red'"}]
    await client.register(
        configuration(
            "Validating", "v", hook("red.test", url(hooks, "red"), matchConditions=red_only)
        )
    )
    assert (await client.create(thing("blue", colour="blue"))).status_code == 201
    assert "red" not in hooks.seen  # false: not called
    refused = await client.create(thing("red", colour="red"))
    assert refused.status_code == 400
    assert "no red things" in refused.json()["message"]  # true: called

    # ``object.spec.missing`` does not exist: evaluating fails.
    broken = [{"name": "broken", "expression": "object.spec.missing == 'x'"}]
    hooks.answers["broken"] = allow()
    ignoring = hook(
        "broken.test", url(hooks, "broken"), matchConditions=broken, failurePolicy="Ignore"
    )
    await client.register(configuration("Validating", "w", ignoring))
    assert (await client.create(thing("b2", colour="blue"))).status_code == 201
    assert "broken" not in hooks.seen  # Ignore: skipped

    failing = hook("broken2.test", url(hooks, "broken"), matchConditions=broken)
    await client.register(configuration("Validating", "x", failing))
    response = await client.create(thing("b3", colour="blue"))
    assert response.status_code == 500
    message = response.json()["message"]
    assert message.startswith('Internal error occurred: failed calling webhook "broken2.test"')
    assert "match condition 'broken'" in message
    assert "broken" not in hooks.seen
    assert api.stored(THINGS, "ns1", "b3") is None


async def test_failure_policy_fail_refuses_and_ignore_admits_when_a_webhook_is_dead_or_slow(
    api: KubeApi, client: Client, hooks: Hooks
) -> None:
    dead = {"url": f"http://127.0.0.1:{closed_port()}/nobody"}
    await client.register(
        configuration("Mutating", "m", hook("dead-ignored.test", dead, failurePolicy="Ignore"))
    )
    assert (await client.create(thing("t1"))).status_code == 201

    await client.register(configuration("Validating", "v", hook("dead.test", dead)))  # Fail
    response = await client.create(thing("t2"))
    assert response.status_code == 500
    assert response.json()["message"].startswith(
        'Internal error occurred: failed calling webhook "dead.test": failed to call webhook'
    )
    assert api.stored(THINGS, "ns1", "t2") is None

    # Slower than its timeoutSeconds: failed like a dead one.
    hooks.answers["slow"] = allow()
    hooks.delay["slow"] = 3.0
    slow = hook("slow.test", url(hooks, "slow"), timeoutSeconds=1)
    await client.register(configuration("Validating", "w", slow))
    removed = await client.send("DELETE", VALIDATING_WEBHOOKS.path(name="v"))
    assert removed.status_code == 200  # only the slow one is left to fail
    response = await client.create(thing("t3"))
    assert response.status_code == 500  # an answer after 3 s would have admitted it
    assert "slow.test" in response.json()["message"]
    assert "context deadline exceeded" in response.json()["message"]


async def test_rules_name_the_operation_and_the_resource_or_its_subresource(
    api: KubeApi, client: Client, hooks: Hooks
) -> None:
    hooks.answers["main"] = allow()
    hooks.answers["status"] = allow()
    await client.register(
        configuration(
            "Validating",
            "v",
            hook("main.test", url(hooks, "main"), operations=["UPDATE"]),
            hook("status.test", url(hooks, "status"), resources=["things/status"]),
        )
    )
    assert (await client.create(thing("t1"))).status_code == 201
    assert hooks.seen == {}  # CREATE is not named by one, the main resource not by the other

    assert (await client.patch_thing("t1", {"spec": {"size": 2}})).status_code == 200
    assert (await client.patch_thing("t1", {"status": {"phase": "Ready"}}, status=True)).is_success
    assert [r.get("subResource") for r in hooks.seen["main"]] == [None]
    [status_write] = hooks.seen["status"]
    assert status_write["subResource"] == "status"
    assert status_write["object"]["status"] == {"phase": "Ready"}


async def test_namespace_selector_reads_the_namespaces_labels_and_cluster_objects_always_match(
    api: KubeApi, client: Client, hooks: Hooks
) -> None:
    hooks.answers["guard"] = deny("guarded")
    selector = {"matchExpressions": [{"key": "team", "operator": "In", "values": ["a"]}]}
    guard = hook("guard.test", url(hooks, "guard"), namespaceSelector=selector)
    guard["rules"][0]["resources"] = ["things", "gizmos"]
    await client.register(configuration("Validating", "v", guard))
    for name, labels in (("watched", {"team": "a"}), ("free", {"team": "b"})):
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        namespace["metadata"]["labels"] = labels
        assert (await client.create(namespace)).status_code == 201

    assert (await client.create(thing("t1", namespace="watched"))).status_code == 400
    assert (await client.create(thing("t1", namespace="free"))).status_code == 201
    assert (await client.create(thing("t1", namespace="absent"))).status_code == 201
    gizmo = {"apiVersion": "test.bcd.dev/v1", "kind": "Gizmo", "metadata": {"name": "g1"}}
    assert (await client.create(gizmo)).status_code == 400  # cluster-scoped: always matches


async def test_object_selector_matches_the_new_or_the_old_labels(
    api: KubeApi, client: Client, hooks: Hooks
) -> None:
    hooks.answers["guard"] = deny("guarded")
    selector = {"matchExpressions": [{"key": "guarded", "operator": "Exists"}]}
    guard = hook("guard.test", url(hooks, "guard"), objectSelector=selector, operations=["UPDATE"])
    await client.register(configuration("Validating", "v", guard))
    plain = await client.create(thing("plain"))
    labelled = thing("labelled")
    labelled["metadata"]["labels"] = {"guarded": "yes"}
    assert plain.status_code == 201
    assert (await client.create(labelled)).status_code == 201  # CREATE is not in the rules

    assert (await client.patch_thing("plain", {"spec": {"size": 2}})).status_code == 200
    adding = await client.patch_thing("plain", {"metadata": {"labels": {"guarded": "1"}}})
    assert adding.status_code == 400  # the new object matches
    removing = await client.patch_thing("labelled", {"metadata": {"labels": {"guarded": None}}})
    assert removing.status_code == 400  # the old object matches
    assert api.stored(THINGS, "ns1", "labelled")["metadata"]["labels"] == {"guarded": "yes"}


async def test_core_pods_and_their_status_are_matched_by_the_core_group(
    api: KubeApi, client: Client, hooks: Hooks
) -> None:
    # Pods are not among the stand-in's own resources; a test declares them as here.
    pods = Ref(group="", version="v1", plural="pods", namespaced=True)
    api.emulator.declare(pods, kind="Pod", status_subresource=True)
    hooks.answers["pods"] = patching(
        lambda r: [{"op": "add", "path": "/metadata/labels", "value": {"seen": "yes"}}]
    )
    rule = {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"]}
    webhook = hook("pods.test", url(hooks, "pods"))
    webhook["rules"] = [{**rule, "resources": ["pods", "pods/status"], "scope": "Namespaced"}]
    await client.register(configuration("Mutating", "m", webhook))
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p1"}, "spec": {}}
    created = await client.send("POST", pods.path(namespace="ml"), pod)
    assert created.status_code == 201, created.text
    assert created.json()["metadata"]["labels"] == {"seen": "yes"}
    status = await client.send(
        "PATCH", pods.path(namespace="ml", name="p1", subresource="status"), {"status": {}}
    )
    assert status.status_code == 200, status.text
    first, second = hooks.seen["pods"]
    assert first["kind"] == {"group": "", "version": "v1", "kind": "Pod"}
    assert first["resource"] == {"group": "", "version": "v1", "resource": "pods"}
    assert (first["namespace"], first["object"]["metadata"]["namespace"]) == ("ml", "ml")
    assert second["subResource"] == "status"


# --- what the webhook is told and what it says back -----------------------------------------


async def test_the_review_carries_the_caller_the_object_and_the_request(
    api: KubeApi, client: Client, hooks: Hooks
) -> None:
    hooks.answers["see"] = allow()
    await client.register(configuration("Validating", "v", hook("see.test", url(hooks, "see"))))
    assert (await client.create(thing("t1"))).status_code == 201
    assert (await client.patch_thing("t1", {"spec": {"size": 2}})).status_code == 200
    stranger = Client(client.http, "a-token-nobody-registered")
    assert (await stranger.patch_thing("t1", {"spec": {"size": 3}})).status_code == 200
    anonymous = Client(client.http, None)
    assert (await anonymous.patch_thing("t1", {"spec": {"size": 4}})).status_code == 200

    create, update, by_stranger, by_nobody = hooks.seen["see"]
    assert create["userInfo"] == ALICE
    assert by_stranger["userInfo"]["username"] == "stand-in-admin"
    assert by_nobody["userInfo"] == {
        "username": "system:anonymous",
        "groups": ["system:unauthenticated"],
    }
    gvk = {"group": "test.bcd.dev", "version": "v1", "kind": "Thing"}
    gvr = {"group": "test.bcd.dev", "version": "v1", "resource": "things"}
    assert (create["kind"], create["resource"], create["requestKind"]) == (gvk, gvr, gvk)
    assert (create["name"], create["namespace"], create["operation"]) == ("t1", "ns1", "CREATE")
    assert create["object"]["spec"] == {"size": 1}
    assert create["oldObject"] is None
    assert create["dryRun"] is False
    assert create["options"] == {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
    assert update["operation"] == "UPDATE"
    assert update["options"]["kind"] == "PatchOptions"
    assert (update["oldObject"]["spec"], update["object"]["spec"]) == ({"size": 1}, {"size": 2})
    assert len({create["uid"], update["uid"], by_stranger["uid"]}) == 3


async def test_webhook_warnings_come_back_as_warning_headers(
    api: KubeApi, client: Client, hooks: Hooks
) -> None:
    hooks.answers["warn"] = allow(warnings=["mind the gap", "twice, with a comma"])
    await client.register(configuration("Validating", "v", hook("warn.test", url(hooks, "warn"))))
    response = await client.create(thing("t1"))
    assert response.status_code == 201
    assert response.headers["Warning"] == ('299 - "mind the gap", 299 - "twice, with a comma"')
    quiet = await client.send("GET", THINGS.path(namespace="ns1", name="t1"))
    assert "Warning" not in quiet.headers


async def test_a_service_reference_goes_where_the_test_maps_it(
    api: KubeApi, client: Client, hooks: Hooks
) -> None:
    hooks.answers["svc"] = deny("from the service")
    service = {"service": {"namespace": "hooks", "name": "guard", "path": "/svc", "port": 443}}
    await client.register(configuration("Validating", "v", hook("svc.test", service)))
    unmapped = await client.create(thing("t1"))
    assert unmapped.status_code == 500  # Fail: a Service nobody serves
    assert "hooks/guard" in unmapped.json()["message"]

    api.emulator.webhook_services[("hooks", "guard")] = hooks.url
    mapped = await client.create(thing("t1"))
    assert mapped.status_code == 400
    assert mapped.json()["message"].endswith("denied the request: from the service")


async def test_an_https_webhook_is_trusted_only_through_its_ca_bundle(
    api: KubeApi, client: Client, tmp_path: Path
) -> None:
    ca = certificate("webhook-ca")
    server, server_key = certificate("127.0.0.1", issuer=ca)
    stranger_ca, _ = certificate("another-ca")
    (tmp_path / "server.pem").write_bytes(pem(server))
    (tmp_path / "server.key").write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(tmp_path / "server.pem", tmp_path / "server.key")
    async with serving(tls) as secure:
        secure.answers["tls"] = deny("over TLS")
        target = f"{secure.url}/tls"
        wrong = {"url": target, "caBundle": base64.b64encode(pem(stranger_ca)).decode()}
        await client.register(configuration("Validating", "v", hook("tls.test", wrong)))
        refused = await client.create(thing("t1"))
        assert refused.status_code == 500  # the server's certificate is not the bundle's
        assert 'failed calling webhook "tls.test"' in refused.json()["message"]
        assert "tls" not in secure.seen

        right = {"url": target, "caBundle": base64.b64encode(pem(ca[0])).decode()}
        await client.register(configuration("Validating", "w", hook("tls2.test", right)))
        assert (await client.send("DELETE", VALIDATING_WEBHOOKS.path(name="v"))).is_success
        answered = await client.create(thing("t1"))
        assert answered.status_code == 400
        assert answered.json()["message"].endswith("denied the request: over TLS")


# --- the CRD's schema and rules ---------------------------------------------------------------


async def test_a_schema_violation_is_422_naming_each_field(api: KubeApi, client: Client) -> None:
    bad = thing("t1", size=0, colour="green", label="Not-Lower")
    response = await client.create(bad)
    assert response.status_code == 422
    body = response.json()
    assert body["reason"] == "Invalid"
    assert body["message"].startswith('Thing.test.bcd.dev "t1" is invalid: [')
    causes = {c["field"]: c for c in body["details"]["causes"]}
    assert set(causes) == {"spec.size", "spec.colour", "spec.label"}
    assert causes["spec.size"]["reason"] == "FieldValueInvalid"
    assert causes["spec.size"]["message"].startswith("Invalid value: 0: must be >= 1")
    assert causes["spec.colour"]["reason"] == "FieldValueNotSupported"
    assert api.stored(THINGS, "ns1", "t1") is None

    missing = thing("t2")
    del missing["spec"]["size"]
    response = await client.create(missing)
    assert response.status_code == 422
    required, not_checked = response.json()["details"]["causes"]
    assert required == {
        "reason": "FieldValueRequired",
        "message": "Required value",
        "field": "spec.size",
    }
    # As the API server: CEL rules do not run on an object missing what they read.
    assert not_checked["field"] == "<nil>"
    assert "some validation rules were not checked" in not_checked["message"]


async def test_unknown_fields_are_pruned_with_a_warning_or_refused_when_strict(
    api: KubeApi, client: Client
) -> None:
    sent = thing("t1", bogus=True, extra={"anything": {"goes": 1}})
    response = await client.create(sent)
    assert response.status_code == 201
    assert response.headers["Warning"] == '299 - "unknown field \\"spec.bogus\\""'
    stored = api.stored(THINGS, "ns1", "t1")
    assert stored["spec"] == {"size": 1, "extra": {"anything": {"goes": 1}}}

    strict = await client.create(thing("t2", bogus=True), fieldValidation="Strict")
    assert strict.status_code == 400
    assert 'unknown field "spec.bogus"' in strict.json()["message"]
    assert api.stored(THINGS, "ns1", "t2") is None


async def test_a_cel_rule_violation_is_422_with_the_rules_message(
    api: KubeApi, client: Client
) -> None:
    assert (await client.create(thing("red", size=7, colour="red"))).status_code == 201
    response = await client.create(thing("blue", size=7, colour="blue"))
    assert response.status_code == 422
    [cause] = response.json()["details"]["causes"]
    assert cause["field"] == "spec"
    assert cause["message"] == 'Invalid value: "object": only red things may be larger than 5'
    assert response.json()["message"] == (
        'Thing.test.bcd.dev "blue" is invalid: spec: Invalid value: "object":'
        " only red things may be larger than 5"
    )
    repaint = await client.patch_thing("red", {"spec": {"colour": "blue"}})
    assert repaint.status_code == 422  # rules run on updates too


async def test_a_transition_rule_compares_with_the_old_value(api: KubeApi, client: Client) -> None:
    assert (await client.create(thing("t1"))).status_code == 201
    # No old value: a rule naming oldSelf does not run, so mode may be set once.
    assert (await client.patch_thing("t1", {"spec": {"mode": "fast"}})).status_code == 200
    changed = await client.patch_thing("t1", {"spec": {"mode": "slow"}})
    assert changed.status_code == 422
    [cause] = changed.json()["details"]["causes"]
    assert (cause["field"], cause["message"]) == (
        "spec.mode",
        'Invalid value: "string": mode is immutable',
    )
    assert (await client.patch_thing("t1", {"spec": {"size": 3}})).status_code == 200
    assert api.stored(THINGS, "ns1", "t1")["spec"] == {"size": 3, "mode": "fast"}


async def test_a_status_write_checks_the_status_against_its_schema(
    api: KubeApi, client: Client
) -> None:
    assert (await client.create(thing("t1"))).status_code == 201
    wrong = await client.patch_thing("t1", {"status": {"phase": "Sleeping"}}, status=True)
    assert wrong.status_code == 422
    assert wrong.json()["details"]["causes"][0]["field"] == "status.phase"
    right = await client.patch_thing("t1", {"status": {"phase": "Ready", "odd": 1}}, status=True)
    assert right.status_code == 200
    assert right.headers["Warning"] == '299 - "unknown field \\"status.odd\\""'
    assert api.stored(THINGS, "ns1", "t1")["status"] == {"phase": "Ready"}


async def test_an_update_may_keep_what_the_schema_refuses_but_not_change_it(
    api: KubeApi, client: Client
) -> None:
    # Past admission, as if written under an older CRD: size 50 is above today's maximum.
    api.emulator.put_raw(THINGS, thing("old", size=50))
    assert api.stored(THINGS, "ns1", "old")["spec"]["size"] == 50

    relabel = await client.patch_thing("old", {"metadata": {"labels": {"seen": "yes"}}})
    assert relabel.status_code == 200, relabel.text  # ratcheting: size is unchanged
    resize = await client.patch_thing("old", {"spec": {"size": 60}})
    assert resize.status_code == 422
    assert resize.json()["details"]["causes"][0]["field"] == "spec.size"

    # A required field missing since then: an unchanged spec may stay without it.
    bare = thing("bare")
    del bare["spec"]["size"]
    api.emulator.put_raw(THINGS, bare)
    relabel = await client.patch_thing("bare", {"metadata": {"labels": {"seen": "yes"}}})
    assert relabel.status_code == 200, relabel.text
    recolour = await client.patch_thing("bare", {"spec": {"colour": "red"}})
    assert recolour.status_code == 422
    assert recolour.json()["details"]["causes"][0]["field"] == "spec.size"


# --- the real operator's Reservation webhooks, registered from the chart ---------------------


@pytest.fixture(scope="module")
def chart_webhooks() -> list[dict[str, Any]]:
    """The chart's Mutating- and ValidatingWebhookConfiguration, rendered with defaults."""
    chart = helm_python.Chart.load(rendering.CHART)
    try:
        rendered = rendering.render(chart, {})
    finally:
        chart.close()
    return [
        *rendered.of("MutatingWebhookConfiguration"),
        *rendered.of("ValidatingWebhookConfiguration"),
    ]


async def _webhooks_listen(port: int) -> None:
    """kopf starts its webhook server after discovery: wait until it accepts connections."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15.0
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if loop.time() > deadline:
                pytest.fail(f"the operator's webhooks did not listen on {port} within 15 s")
            await asyncio.sleep(0.05)
            continue
        writer.close()
        await writer.wait_closed()
        return


async def _register_chart_webhooks(
    kube: KubeApi, operator: Operator, chart_webhooks: list[dict[str, Any]]
) -> None:
    """The chart's webhook configurations, pointed at the running operator's webhook server."""
    port = operator.runtime.config.webhook_port
    assert port is not None
    await _webhooks_listen(port)
    for configuration_obj in chart_webhooks:
        service = configuration_obj["webhooks"][0]["clientConfig"]["service"]
        kube.emulator.webhook_services[(service["namespace"], service["name"])] = (
            f"http://127.0.0.1:{port}"
        )
        await kube.create(copy.deepcopy(configuration_obj))


async def test_the_real_operator_stamps_and_checks_reservations_through_the_chain(
    world: World, operator: Operator, chart_webhooks: list[dict[str, Any]]
) -> None:
    kube = world.kube
    await _register_chart_webhooks(kube, operator, chart_webhooks)
    kube.tokens["t-alice"] = ALICE
    async with httpx.AsyncClient(base_url=kube.url, timeout=15.0) as http:
        alice = Client(http, "t-alice")
        unstamped = kubeworld.reservation("train").obj()
        # The client claims to be someone else: the mutating webhook stamps the real caller.
        unstamped["metadata"]["annotations"] = {"bcd.dev/requested-by": "root@acme"}
        created = await alice.create(unstamped)
        assert created.status_code == 201, created.text
        annotations = created.json()["metadata"]["annotations"]
        assert annotations["bcd.dev/requested-by"] == "alice@acme"
        assert json.loads(annotations["bcd.dev/requested-by-groups"]) == sorted(ALICE["groups"])
        stored = kube.stored(RESERVATIONS, "ml", "train")
        assert stored["metadata"]["annotations"]["bcd.dev/requested-by"] == "alice@acme"

        path = RESERVATIONS.path(namespace="ml", name="train")
        forged = {"metadata": {"annotations": {"bcd.dev/requested-by": "bob@acme"}}}
        refused = await alice.send("PATCH", path, forged)
        assert refused.status_code == 422, refused.text
        assert refused.json()["message"].startswith(
            'admission webhook "check.reservations.bcd.dev" denied the request:'
            " metadata.annotations[bcd.dev/requested-by]: is immutable"
        )
        # The CRD's own rule refuses a changed pool before any validating webhook is asked.
        moved = await alice.send("PATCH", path, {"spec": {"poolId": "elsewhere"}})
        assert moved.status_code == 422, moved.text
        assert moved.json()["details"]["causes"][0]["field"] == "spec.poolId"
        assert "poolId is immutable" in moved.json()["message"]

        # Attacks: the same forgery by every other write path gets nowhere.
        for _ in range(10):  # the operator may write the object meanwhile (409): read again
            replaced = copy.deepcopy(kube.stored(RESERVATIONS, "ml", "train"))
            replaced["metadata"]["annotations"]["bcd.dev/requested-by"] = "bob@acme"
            put = await alice.send("PUT", path, replaced)
            if put.status_code != 409:
                break
        assert put.status_code == 422, put.text  # a replace is an UPDATE the check sees
        op = {"op": "replace", "path": "/metadata/annotations/bcd.dev~1requested-by"}
        json_patch = await alice.send("PATCH", path, [{**op, "value": "bob@acme"}], kind=JSON_PATCH)
        assert json_patch.status_code == 422, json_patch.text
        # A /status write changes the status only: the forged annotation is dropped.
        status = await alice.send("PATCH", f"{path}/status", {**forged, "status": {}})
        assert status.status_code == 200, status.text
        unknown_caller = Client(http, None)  # anonymous: stamped as system:anonymous, not bob
        sneaky = kubeworld.reservation("sneaky").obj()
        sneaky["metadata"]["annotations"] = {"bcd.dev/requested-by": "bob@acme"}
        anonymous = await unknown_caller.create(sneaky)
        assert anonymous.status_code == 201, anonymous.text
        annotations = anonymous.json()["metadata"]["annotations"]
        assert annotations["bcd.dev/requested-by"] == "system:anonymous"
    after = kube.stored(RESERVATIONS, "ml", "train")
    assert after["spec"]["poolId"] == "h100"
    assert after["metadata"]["annotations"]["bcd.dev/requested-by"] == "alice@acme"


async def test_the_chain_stamps_who_answered_a_confirmation(
    world: World, operator: Operator, chart_webhooks: list[dict[str, Any]]
) -> None:
    """The chart's mutating webhook runs on an update that answers a confirmation (its
    matchConditions) and stamps the real caller in bcd.dev/confirmed-by, whatever the caller
    wrote there; an unstamped forgery by another write path is refused."""
    kube = world.kube
    await _register_chart_webhooks(kube, operator, chart_webhooks)
    kube.tokens["t-alice"] = ALICE
    kube.tokens["t-bob"] = {"username": "bob@acme", "uid": "u2", "groups": ["ml-team"]}
    async with httpx.AsyncClient(base_url=kube.url, timeout=15.0) as http:
        alice, bob = Client(http, "t-alice"), Client(http, "t-bob")
        created = await alice.create(kubeworld.reservation("train").obj())
        assert created.status_code == 201, created.text
        path = RESERVATIONS.path(namespace="ml", name="train")
        # bob answers, writing alice's name as the answerer: the stamp says bob.
        forged = {"bcd.dev/confirmation": "approve", "bcd.dev/confirmed-by": "alice@acme"}
        answered = await bob.send("PATCH", path, {"metadata": {"annotations": forged}})
        assert answered.status_code == 200, answered.text
        annotations = kube.stored(RESERVATIONS, "ml", "train")["metadata"]["annotations"]
        assert annotations["bcd.dev/confirmed-by"] == "bob@acme"
        # alice changes the answer: the stamp follows the caller.
        mine = {"metadata": {"annotations": {"bcd.dev/confirmation": "deny"}}}
        answered = await alice.send("PATCH", path, mine)
        assert answered.status_code == 200, answered.text
        annotations = kube.stored(RESERVATIONS, "ml", "train")["metadata"]["annotations"]
        assert annotations["bcd.dev/confirmed-by"] == "alice@acme"
        # Moving the stamp alone (no new answer) is refused by the validating webhook.
        moved = {"metadata": {"annotations": {"bcd.dev/confirmed-by": "bob@acme"}}}
        refused = await bob.send("PATCH", path, moved)
        assert refused.status_code == 422, refused.text
        assert "bcd.dev/confirmed-by]: is set by the webhook" in refused.json()["message"]
