"""The admission webhooks as the Kubernetes API server calls them: AdmissionReview JSON over HTTP.

Why it exists: most operator tests register no webhook configurations with the stand-in and
stamp Reservations by hand (``tests/operator/test_stand_in_admission.py`` runs these webhooks
through the stand-in's admission chain). Here the real operator's kopf webhook server (plain
HTTP on loopback, see ``running.kopf_settings``) gets ``admission.k8s.io/v1`` reviews on
``/stamp`` (mutating) and ``/check`` (validating), and the answers are read the way the API
server reads them: the ``response.uid`` echoed, ``allowed``, a base64 ``JSONPatch``,
``status.message``/``code``.

What it must never do: call the webhook functions directly; the wire is what is under test.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonpatch
import kmock
import pytest

from bettercompute.operator.running import started
from bettercompute.store.database import Database
from tests.operator.conftest import operator_config
from tests.support import kubeworld
from tests.support.database import _TABLES
from tests.support.kube import ApiServerStandIn
from tests.support.kubeserver import CRDS_DIR, KubeApi, write_kubeconfig
from tests.support.policies import CountingPolicy

REQUESTED_BY = "bcd.dev/requested-by"
REQUESTED_BY_GROUPS = "bcd.dev/requested-by-groups"
ALICE = {"username": "alice@acme", "uid": "u1", "groups": ["system:authenticated", "ml-team"]}
ALICE_GROUPS = json.dumps(sorted(ALICE["groups"]))


def _reservation(**spec: Any) -> dict[str, Any]:
    """A Reservation as a client sends it: no stamps yet (``spec`` fields replace the defaults)."""
    obj = kubeworld.reservation("train").obj()
    obj["metadata"]["annotations"] = {}
    obj["spec"].update(spec)
    return obj


def _stamped(obj: dict[str, Any], user: dict[str, Any] = ALICE) -> dict[str, Any]:
    stamped = copy.deepcopy(obj)
    stamped["metadata"].setdefault("annotations", {}).update(
        {REQUESTED_BY: user["username"], REQUESTED_BY_GROUPS: json.dumps(sorted(user["groups"]))}
    )
    return stamped


def _review(
    operation: str,
    obj: dict[str, Any],
    *,
    old: dict[str, Any] | None = None,
    user: dict[str, Any] = ALICE,
) -> dict[str, Any]:
    """An AdmissionReview request as kube-apiserver sends it for a Reservation."""
    meta = obj["metadata"]
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "bcd.dev", "version": "v1alpha1", "kind": "Reservation"},
            "resource": {"group": "bcd.dev", "version": "v1alpha1", "resource": "reservations"},
            "requestKind": {"group": "bcd.dev", "version": "v1alpha1", "kind": "Reservation"},
            "requestResource": {
                "group": "bcd.dev",
                "version": "v1alpha1",
                "resource": "reservations",
            },
            "name": meta["name"],
            "namespace": meta["namespace"],
            "operation": operation,
            "userInfo": copy.deepcopy(user),
            "object": obj,
            "oldObject": old,
            "dryRun": False,
            "options": {
                "apiVersion": "meta.k8s.io/v1",
                "kind": "CreateOptions" if operation == "CREATE" else "UpdateOptions",
            },
        },
    }


class Webhooks:
    """The operator's webhook server, spoken to as the API server does."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def call(self, path: str, review: dict[str, Any]) -> dict[str, Any]:
        answer = await self.client.post(path, json=review)
        assert answer.status_code == 200, answer.text
        body: dict[str, Any] = answer.json()
        assert body["apiVersion"] == "admission.k8s.io/v1"
        assert body["kind"] == "AdmissionReview"
        response: dict[str, Any] = body["response"]
        assert response["uid"] == review["request"]["uid"]
        return response

    async def stamp(self, obj: dict[str, Any], *, user: dict[str, Any] = ALICE) -> dict:
        """The mutating answer to a CREATE, and the object with its JSON patch applied."""
        response = await self.call("/stamp", _review("CREATE", obj, user=user))
        assert response["allowed"] is True
        assert "status" not in response
        assert response["patchType"] == "JSONPatch"
        ops = json.loads(base64.b64decode(response["patch"]))
        return {"ops": ops, "object": jsonpatch.apply_patch(obj, ops)}

    async def allowed(self, review: dict[str, Any]) -> None:
        response = await self.call("/check", review)
        assert response["allowed"] is True, response
        assert "status" not in response

    async def refused(self, review: dict[str, Any]) -> str:
        """The message of a validating refusal (code 422, as a real API server shows it)."""
        response = await self.call("/check", review)
        assert response["allowed"] is False, response
        assert response["status"]["code"] == 422
        message: str = response["status"]["message"]
        return message


@pytest.fixture(scope="module")
async def webhooks(
    session_db: Database, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Webhooks]:
    """One operator for the module: the webhooks keep no state between reviews, and starting
    an operator per review would be most of the module's time. Its own stand-in, as
    ``kube_api`` makes one, and the session's database emptied as ``db`` empties it."""
    async with session_db.connection() as conn:
        await conn.execute(f"TRUNCATE {_TABLES} RESTART IDENTITY CASCADE")
    emulator = ApiServerStandIn()
    emulator.declare_crds(CRDS_DIR)
    async with emulator, kmock.Server(emulator, host="127.0.0.1") as server:
        url = str(server.url).rstrip("/")
        kubeconfig = write_kubeconfig(path=tmp_path_factory.mktemp("kube") / "config", url=url)
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as http:
            kube = KubeApi(url=url, emulator=emulator, kubeconfig=kubeconfig, client=http)
            config = operator_config(kube, session_db)
            async with started(config, db=session_db, policy=CountingPolicy()) as operator:
                await operator.ready.wait()
                port = operator.runtime.config.webhook_port
                base = f"http://127.0.0.1:{port}"
                async with httpx.AsyncClient(base_url=base, timeout=5.0) as client:
                    await _listening(client, port=port)
                    yield Webhooks(client)
        crashes = [e for e in emulator.errors if not isinstance(e, kmock.KubernetesError)]
        assert not crashes, f"the API stand-in crashed while serving: {crashes!r}"


async def _listening(client: httpx.AsyncClient, *, port: int | None) -> None:
    """kopf starts its webhook server once discovery is done: wait until it listens."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0
    while True:
        try:
            await client.get("/")
            return
        except httpx.TransportError:
            if loop.time() > deadline:
                pytest.fail(f"the webhook server on port {port} did not listen within 5 s")
            await asyncio.sleep(0.02)


# --- the mutating webhook: stamps ------------------------------------------------------------


async def test_the_stamp_adds_the_requesting_user_and_groups(webhooks: Webhooks):
    obj = _reservation()
    del obj["metadata"]["annotations"]  # kubectl sends none at all
    stamped = await webhooks.stamp(obj)
    annotations = stamped["object"]["metadata"]["annotations"]
    assert annotations == {REQUESTED_BY: "alice@acme", REQUESTED_BY_GROUPS: ALICE_GROUPS}
    assert json.loads(annotations[REQUESTED_BY_GROUPS]) == ["ml-team", "system:authenticated"]
    assert stamped["object"]["spec"] == obj["spec"]  # only the stamps change


async def test_the_stamp_keeps_other_annotations(webhooks: Webhooks):
    obj = _reservation()
    obj["metadata"]["annotations"] = {"team/cost-centre": "cc-42", "bcd.dev/renew": "r0"}
    stamped = await webhooks.stamp(obj)
    assert stamped["object"]["metadata"]["annotations"] == {
        "team/cost-centre": "cc-42",
        "bcd.dev/renew": "r0",
        REQUESTED_BY: "alice@acme",
        REQUESTED_BY_GROUPS: ALICE_GROUPS,
    }
    paths = {op["path"] for op in stamped["ops"]}
    assert paths == {
        "/metadata/annotations/bcd.dev~1requested-by",
        "/metadata/annotations/bcd.dev~1requested-by-groups",
    }


async def test_the_stamp_overwrites_a_forged_one(webhooks: Webhooks):
    forged = _stamped(_reservation(), {"username": "root-ops@root", "groups": ["admins"]})
    stamped = await webhooks.stamp(forged)
    annotations = stamped["object"]["metadata"]["annotations"]
    assert annotations[REQUESTED_BY] == "alice@acme"
    assert annotations[REQUESTED_BY_GROUPS] == ALICE_GROUPS
    assert {op["op"] for op in stamped["ops"]} == {"replace"}


async def test_a_stamped_create_passes_the_validating_webhook(webhooks: Webhooks):
    stamped = await webhooks.stamp(_reservation())
    await webhooks.allowed(_review("CREATE", stamped["object"]))


# --- the validating webhook: who asked --------------------------------------------------------


async def test_a_create_with_another_users_stamp_is_refused(webhooks: Webhooks):
    forged = _stamped(_reservation(), {"username": "bob@acme", "groups": ALICE["groups"]})
    message = await webhooks.refused(_review("CREATE", forged))
    assert message.startswith(f"metadata.annotations[{REQUESTED_BY}]:")
    assert "alice@acme" in message


async def test_a_create_with_forged_groups_is_refused(webhooks: Webhooks):
    forged = _stamped(_reservation(), {"username": "alice@acme", "groups": ["system:masters"]})
    message = await webhooks.refused(_review("CREATE", forged))
    assert message.startswith(f"metadata.annotations[{REQUESTED_BY_GROUPS}]:")


async def test_an_unstamped_create_is_refused(webhooks: Webhooks):
    message = await webhooks.refused(_review("CREATE", _reservation()))
    assert REQUESTED_BY in message


# --- the validating webhook: the spec ---------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "field", "reason"),
    [
        ({"devices": [{"class": "gpu", "count": 0}]}, "spec.devices[0].count:", ""),
        ({"devices": [{"class": "mig", "count": 1}]}, "spec.devices[0]:", "profile"),
        ({"colour": "blue"}, "spec.colour:", ""),
        ({"duration": "forever"}, "spec.duration:", ""),
        (
            {"until": "2030-03-17T17:46:40Z", "extendBy": "1h", "extendKey": "k"},
            "spec.until:",
            "not both",
        ),
        ({"extendBy": "1h"}, "spec.extendKey:", "required"),
        ({"release": "yes"}, "spec.release:", "true or false"),
        ({"start": "next week"}, "spec.start:", "RFC 3339"),
        ({"until": "2030-03-17 17:46", "extendKey": "k"}, "spec.until:", "RFC 3339"),
    ],
    ids=[
        "count-0",
        "mig-no-profile",
        "unknown-field",
        "bad-duration",
        "until-and-by",
        "no-key",
        "release-not-bool",
        "start-not-rfc3339",
        "until-not-rfc3339",
    ],
)
async def test_an_invalid_spec_is_refused_naming_the_field(
    webhooks: Webhooks, spec: dict[str, Any], field: str, reason: str
):
    message = await webhooks.refused(_review("CREATE", _stamped(_reservation(**spec))))
    assert message.startswith(field), message
    assert reason in message, message
    assert len(message) > len(field) + 3, message  # a reason follows the field


async def test_a_valid_create_with_every_optional_field_is_allowed(webhooks: Webhooks):
    obj = _reservation(
        devices=[{"class": "gpu", "count": 4, "topology": "nvlink-all"}],
        duration="8h",
        binding="kubernetes",
        leaseSeconds=600,
        idempotencyKey="train-1",
    )
    await webhooks.allowed(_review("CREATE", _stamped(obj)))


# --- the validating webhook: updates ----------------------------------------------------------


def _update(old: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """``old`` with ``spec`` keys replaced (``None`` removes one) and ``annotations`` merged."""
    new = copy.deepcopy(old)
    for key, value in changes.pop("annotations", {}).items():
        new["metadata"]["annotations"][key] = value
    for key, value in changes.items():
        if value is None:
            new["spec"].pop(key, None)
        else:
            new["spec"][key] = value
    new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
    return new


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"devices": [{"class": "gpu", "count": 8}]}, "spec.devices"),
        ({"poolId": "other"}, "spec.poolId"),
        ({"duration": "2h"}, "spec.duration"),
        ({"idempotencyKey": "again"}, "spec.idempotencyKey"),
        ({"annotations": {REQUESTED_BY: "bob@acme"}}, f"metadata.annotations[{REQUESTED_BY}]"),
        (
            {"annotations": {REQUESTED_BY_GROUPS: '["system:masters"]'}},
            f"metadata.annotations[{REQUESTED_BY_GROUPS}]",
        ),
    ],
    ids=["devices", "pool", "duration", "key", "requested-by", "groups"],
)
async def test_an_update_of_an_immutable_field_is_refused(
    webhooks: Webhooks, changes: dict[str, Any], field: str
):
    old = _stamped(_reservation())
    message = await webhooks.refused(_review("UPDATE", _update(old, **changes), old=old))
    assert message.startswith(f"{field}: is immutable"), message


async def test_an_update_removing_a_stamp_is_refused(webhooks: Webhooks):
    old = _stamped(_reservation())
    new = copy.deepcopy(old)
    del new["metadata"]["annotations"][REQUESTED_BY]
    message = await webhooks.refused(_review("UPDATE", new, old=old))
    assert message.startswith(f"metadata.annotations[{REQUESTED_BY}]: is immutable")


@pytest.mark.parametrize(
    "changes",
    [
        {"extendBy": "2h", "extendKey": "ext-1"},
        {"until": "2030-03-17T17:46:40Z", "extendKey": "ext-2"},
        {"release": True},
        {"annotations": {"bcd.dev/renew": "2026-12-02T14:00:00Z"}},
    ],
    ids=["extend-by", "extend-until", "release", "renew"],
)
async def test_an_update_of_the_mutable_fields_is_allowed(
    webhooks: Webhooks, changes: dict[str, Any]
):
    old = _stamped(_reservation())
    # Another user may change it (a teammate extends): the stamp is the creator's, kept as is.
    await webhooks.allowed(
        _review(
            "UPDATE", _update(old, **changes), old=old, user={"username": "bob@acme", "groups": []}
        )
    )


async def test_an_update_with_invalid_extend_fields_is_refused(webhooks: Webhooks):
    old = _stamped(_reservation())
    message = await webhooks.refused(_review("UPDATE", _update(old, extendBy="2h"), old=old))
    assert message.startswith("spec.extendKey:"), message
    message = await webhooks.refused(
        _review("UPDATE", _update(old, extendBy="soon", extendKey="k"), old=old)
    )
    assert message.startswith("spec.extendBy:"), message


async def test_the_operators_own_updates_are_allowed(webhooks: Webhooks):
    """kopf's finalizer and progress annotations are UPDATEs too; they must pass."""
    old = _stamped(_reservation())
    new = copy.deepcopy(old)
    new["metadata"]["finalizers"] = ["bcd.dev/release"]
    new["metadata"]["annotations"]["kopf.bcd.dev/last-handled-configuration"] = "{}"
    await webhooks.allowed(
        _review("UPDATE", new, old=old, user={"username": "system:serviceaccount:bcd:op"})
    )


async def test_the_stamp_ignores_an_update(webhooks: Webhooks):
    """An UPDATE that answers no confirmation is allowed unchanged."""
    old = _stamped(_reservation())
    new = _update(old, release=True)
    response = await webhooks.call(
        "/stamp", _review("UPDATE", new, old=old, user={"username": "bob@acme", "groups": []})
    )
    assert response["allowed"] is True
    assert "patch" not in response


# --- answering a confirmation: bcd.dev/confirmation and who set it ---------------------------

CONFIRMATION = "bcd.dev/confirmation"
CONFIRMED_BY = "bcd.dev/confirmed-by"
AGENT = {"username": "system:serviceaccount:team-a:trainer", "groups": ["system:serviceaccounts"]}


def _answered(old: dict[str, Any], answer: str, **more: str) -> dict[str, Any]:
    new = copy.deepcopy(old)
    new["metadata"]["annotations"].update({CONFIRMATION: answer, **more})
    return new


async def test_the_stamp_records_who_answered_a_confirmation(webhooks: Webhooks):
    old = _stamped(_reservation(), user=AGENT)
    new = _answered(old, "approve")
    response = await webhooks.call("/stamp", _review("UPDATE", new, old=old, user=ALICE))
    ops = json.loads(base64.b64decode(response["patch"]))
    stamped = jsonpatch.apply_patch(new, ops)
    assert stamped["metadata"]["annotations"][CONFIRMED_BY] == "alice@acme"
    # The stamped answer then passes the validating webhook, as alice's.
    await webhooks.allowed(_review("UPDATE", stamped, old=old, user=ALICE))


async def test_a_forged_answerer_is_overwritten_and_refused_when_unstamped(webhooks: Webhooks):
    """The agent writes the person's name beside its own answer: the mutating webhook puts
    the agent's own name there, and an answer that skipped it is refused."""
    old = _stamped(_reservation(), user=AGENT)
    forged = _answered(old, "approve", **{CONFIRMED_BY: "alice@acme"})
    response = await webhooks.call("/stamp", _review("UPDATE", forged, old=old, user=AGENT))
    ops = json.loads(base64.b64decode(response["patch"]))
    stamped = jsonpatch.apply_patch(forged, ops)
    assert stamped["metadata"]["annotations"][CONFIRMED_BY] == AGENT["username"]
    message = await webhooks.refused(_review("UPDATE", forged, old=old, user=AGENT))
    assert message.startswith(f"metadata.annotations[{CONFIRMED_BY}]: must be the requesting")


async def test_an_answer_cannot_be_given_at_create_nor_its_stamp_changed_later(
    webhooks: Webhooks,
):
    created = _stamped(_reservation(), user=AGENT)
    created["metadata"]["annotations"].update({CONFIRMATION: "approve", CONFIRMED_BY: "alice"})
    message = await webhooks.refused(_review("CREATE", created, user=AGENT))
    assert message.startswith(f"metadata.annotations[{CONFIRMATION}]: cannot be set"), message
    old = _answered(_stamped(_reservation(), user=AGENT), "approve", **{CONFIRMED_BY: "alice@acme"})
    moved = copy.deepcopy(old)
    moved["metadata"]["annotations"][CONFIRMED_BY] = "mallory@acme"
    message = await webhooks.refused(_review("UPDATE", moved, old=old, user=AGENT))
    assert message.startswith(f"metadata.annotations[{CONFIRMED_BY}]: is set by the webhook")


async def test_an_answer_other_than_approve_or_deny_is_refused(webhooks: Webhooks):
    old = _stamped(_reservation(), user=AGENT)
    new = _answered(old, "yes please", **{CONFIRMED_BY: "alice@acme"})
    message = await webhooks.refused(_review("UPDATE", new, old=old, user=ALICE))
    assert message.startswith(f"metadata.annotations[{CONFIRMATION}]: must be one of approve, deny")
