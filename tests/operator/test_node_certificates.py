"""The real operator signs node certificates through the CSR API, and only for a node's own agent.

The operator (kopf, PostgreSQL) runs against the API stand-in, which records each CSR's
requester from the caller's bearer token as a real API server does
(``tests/support/csrs.py``). Callers are entries of the stand-in's token table: the node
agent's service account with a token bound to one node, the same account bound to another
node or to none, and a person. The attack tests ask the way an attacker would and show that
nothing is ever signed; the last tests run the real node agent against the real operator.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID

from bettercompute.core import attestation
from bettercompute.deviceplugin.agent import Agent, started
from bettercompute.operator.running import Operator
from bettercompute.operator.running import started as operator_started
from bettercompute.store.database import Database
from tests.deviceplugin import agents
from tests.deviceplugin.conftest import Node
from tests.operator.conftest import World, apply_world, operator_config
from tests.support import kubeworld
from tests.support.csrs import CSRS
from tests.support.kubeobjects import GPUNODES, RESERVATIONS, SECRETS
from tests.support.kubeserver import KubeApi
from tests.support.policies import CountingPolicy

NS = kubeworld.OPERATOR_NAMESPACE
AGENT = f"system:serviceaccount:{NS}:better-compute-device-plugin"
NODE, OTHER = "h100-node-0", "h100-node-1"
NODE_NAME = "authentication.kubernetes.io/node-name"


@pytest.fixture
async def operator(
    kube_api: KubeApi, db: Database, policy: CountingPolicy
) -> AsyncIterator[Operator]:
    config = operator_config(kube_api, db, node_certificate_lifetime=dt.timedelta(days=2))
    async with operator_started(config, db=db, policy=policy) as op:
        await op.ready.wait()
        yield op


@pytest.fixture
async def world(kube_api: KubeApi, db: Database, operator: Operator) -> World:
    kube_api.tokens.update(
        {
            "agent-on-node": _user(AGENT, node=NODE),
            "agent-on-other": _user(AGENT, node=OTHER),
            "agent-unbound": _user(AGENT),
            "alice": _user("alice@example.com"),
        }
    )
    return await apply_world(kube_api, db, nodes=2)


def _user(username: str, *, node: str | None = None) -> dict[str, Any]:
    user: dict[str, Any] = {"username": username, "uid": f"uid-{username}", "groups": ["g"]}
    if node is not None:
        user["extra"] = {NODE_NAME: [node], "authentication.kubernetes.io/node-uid": ["u"]}
    return user


def request_pem(
    *, node: str = NODE, role: str = "node", key: Any = None, subject: x509.Name | None = None
) -> bytes:
    key = key or Ed25519PrivateKey.generate()
    name = subject or x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, node),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, role),
        ]
    )
    algorithm = None if isinstance(key, Ed25519PrivateKey) else hashes.SHA256()
    csr = x509.CertificateSigningRequestBuilder().subject_name(name).sign(key, algorithm)
    return csr.public_bytes(serialization.Encoding.PEM)


def csr_body(name: str, request: bytes, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {"name": name},
        "spec": {
            "request": base64.b64encode(request).decode(),
            "signerName": "bcd.dev/node-report",
            "usages": ["digital signature"],
            **spec,
        },
    }


async def ask(kube: KubeApi, token: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST the CSR as the caller of ``token``."""
    response = await kube._client.post(  # the stand-in's own HTTP client, another caller
        CSRS.path(), json=body, headers={"Authorization": f"Bearer {token}"}
    )
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


def decided(obj: dict[str, Any] | None) -> bool:
    status = (obj or {}).get("status") or {}
    kinds = {c["type"] for c in status.get("conditions") or ()}
    return bool(kinds & {"Denied", "Failed"}) or bool(status.get("certificate"))


async def outcome(kube: KubeApi, name: str) -> dict[str, Any]:
    found = await kube.wait_for(CSRS, None, name, decided)
    assert found is not None
    return found


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for c in (obj.get("status") or {}).get("conditions") or ():
        if c["type"] == kind:
            found: dict[str, Any] = c
            return found
    return None


async def authority(kube: KubeApi) -> x509.Certificate:
    secret = kube.stored(SECRETS, NS, "better-compute-node-ca")
    assert secret is not None
    return x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))


def verified_role(cert: x509.Certificate, ca: x509.Certificate, node: str) -> str:
    """The role of ``cert`` once the one verifier accepts it as ``node``'s, issued by ``ca``."""
    checked = attestation.verify_certificate(
        attestation.certificate_pem(cert),
        authorities=[ca],
        node_name=node,
        now=dt.datetime.now(dt.UTC),
        grace=attestation.OFFLINE_GRACE,
        revoked=lambda _: False,
    )
    (role,) = checked.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    return str(role.value)


async def test_the_node_agent_gets_a_certificate_for_its_own_node(
    kube_api: KubeApi, world: World
) -> None:
    key = Ed25519PrivateKey.generate()
    await ask(kube_api, "agent-on-node", csr_body("good", request_pem(key=key)))
    obj = await outcome(kube_api, "good")
    approved = condition(obj, "Approved")
    assert approved is not None
    assert approved["reason"] == "NodeAgent"
    pem = base64.b64decode(obj["status"]["certificate"])
    cert = x509.load_pem_x509_certificate(pem)
    ca = await authority(kube_api)
    assert verified_role(cert, ca, NODE) == "node"
    assert cert.public_key() == key.public_key()
    life = cert.not_valid_after_utc - dt.datetime.now(dt.UTC)
    # Asked for no lifetime: the operator's longest (2 days in this test's operator).
    assert dt.timedelta(days=2) - dt.timedelta(minutes=1) < life <= dt.timedelta(days=2)


async def test_the_lifetime_is_what_the_node_asks_at_most_the_configured_one(
    kube_api: KubeApi, world: World
) -> None:
    await ask(kube_api, "agent-on-node", csr_body("short", request_pem(), expirationSeconds=3600))
    await ask(
        kube_api, "agent-on-node", csr_body("long", request_pem(), expirationSeconds=30 * 86400)
    )
    for name, most in (("short", dt.timedelta(hours=1)), ("long", dt.timedelta(days=2))):
        obj = await outcome(kube_api, name)
        now = dt.datetime.now(dt.UTC)  # after it was signed: it cannot end later than most
        cert = x509.load_pem_x509_certificate(base64.b64decode(obj["status"]["certificate"]))
        assert most - dt.timedelta(minutes=1) < cert.not_valid_after_utc - now <= most


async def _denied(kube: KubeApi, name: str, reason: str) -> dict[str, Any]:
    obj = await outcome(kube, name)
    denied = condition(obj, "Denied")
    assert denied is not None, obj
    assert denied["reason"] == reason
    assert "certificate" not in (obj.get("status") or {})
    assert condition(obj, "Approved") is None
    return obj


async def test_attack_a_csr_for_another_nodes_name_is_denied(
    kube_api: KubeApi, world: World
) -> None:
    await ask(kube_api, "agent-on-node", csr_body("steal", request_pem(node=OTHER)))
    obj = await _denied(kube_api, "steal", "OtherNode")
    assert OTHER in condition(obj, "Denied")["message"]  # type: ignore[index]


async def test_attack_a_csr_from_a_user_who_is_not_the_agent_is_denied(
    kube_api: KubeApi, world: World
) -> None:
    await ask(kube_api, "alice", csr_body("person", request_pem()))
    await _denied(kube_api, "person", "NotNodeAgent")
    # A cluster admin's kubeconfig is no node agent either, whatever the body claims.
    await ask(kube_api, "admin", csr_body("admin", request_pem(), username=AGENT))
    await _denied(kube_api, "admin", "NotNodeAgent")


async def test_attack_the_agents_token_bound_to_another_node_is_denied(
    kube_api: KubeApi, world: World
) -> None:
    await ask(kube_api, "agent-on-other", csr_body("elsewhere", request_pem(node=NODE)))
    await _denied(kube_api, "elsewhere", "OtherNode")
    forged = csr_body("forged-extra", request_pem(), extra={NODE_NAME: [NODE]})
    await ask(kube_api, "agent-unbound", forged)  # the API server drops the body's extra
    await _denied(kube_api, "forged-extra", "NotNodeBound")


async def test_attack_a_role_other_than_node_is_denied(kube_api: KubeApi, world: World) -> None:
    await ask(kube_api, "agent-on-node", csr_body("tenant", request_pem(role="node-tenant")))
    await _denied(kube_api, "tenant", "WrongRole")
    await ask(kube_api, "agent-on-node", csr_body("usage", request_pem(), usages=["server auth"]))
    await _denied(kube_api, "usage", "BadUsages")


async def test_attack_a_non_ed25519_or_malformed_request_is_denied(
    kube_api: KubeApi, world: World
) -> None:
    p256 = request_pem(key=ec.generate_private_key(ec.SECP256R1()))
    await ask(kube_api, "agent-on-node", csr_body("p256", p256))
    await _denied(kube_api, "p256", "BadRequest")

    two_names = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, NODE),
            x509.NameAttribute(NameOID.COMMON_NAME, OTHER),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "node"),
        ]
    )
    await ask(kube_api, "agent-on-node", csr_body("two", request_pem(subject=two_names)))
    await _denied(kube_api, "two", "BadRequest")

    # A request whose self-signature is another key's: the API server parses it, we do not
    # sign it. Built by swapping the signed body's key for another's.
    honest = x509.load_pem_x509_csr(request_pem())
    stranger = Ed25519PrivateKey.generate().public_key()
    der = honest.public_bytes(serialization.Encoding.DER)
    mine = honest.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    theirs = stranger.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    swapped = x509.load_der_x509_csr(der.replace(mine, theirs))
    bad_sig = swapped.public_bytes(serialization.Encoding.PEM)
    await ask(kube_api, "agent-on-node", csr_body("bad-sig", bad_sig))
    await _denied(kube_api, "bad-sig", "BadRequest")

    # Garbage the API server itself refuses never reaches the signer; stored past it (as an
    # older or laxer server might have let it through), it is still denied.
    garbage = csr_body("garbage", b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n")
    garbage["spec"].update(username=AGENT, extra={NODE_NAME: [NODE]})
    kube_api.emulator.put_raw(CSRS, garbage)
    await _denied(kube_api, "garbage", "BadRequest")


async def test_a_node_without_a_gpunode_is_denied(kube_api: KubeApi, world: World) -> None:
    kube_api.tokens["agent-on-ghost"] = _user(AGENT, node="ghost")
    await ask(kube_api, "agent-on-ghost", csr_body("ghost", request_pem(node="ghost")))
    await _denied(kube_api, "ghost", "NoSuchNode")


async def test_a_request_someone_else_approved_is_still_not_signed(
    kube_api: KubeApi, world: World
) -> None:
    """An admin's approval is not the signer's rule: the signer marks it Failed."""
    created = await ask(kube_api, "alice", csr_body("admin-approved", request_pem()))
    approval = {"type": "Approved", "status": "True", "reason": "Admin", "message": "ok"}
    # Approved before the operator sees it: stored past HTTP in one write.
    kube_api.emulator.put_raw(CSRS, {**created, "status": {"conditions": [approval]}})
    obj = await outcome(kube_api, "admin-approved")
    failed = condition(obj, "Failed")
    assert failed is not None
    assert failed["reason"] == "NotNodeAgent"
    assert "certificate" not in obj["status"]


async def test_other_signers_are_left_alone(kube_api: KubeApi, world: World) -> None:
    body = csr_body("kubelet", request_pem(), signerName="kubernetes.io/kubelet-serving")
    await ask(kube_api, "agent-on-node", body)
    await ask(kube_api, "agent-on-node", csr_body("ours", request_pem()))
    await outcome(kube_api, "ours")  # the operator has seen both by now
    assert kube_api.stored(CSRS, None, "kubelet").get("status") is None  # type: ignore[union-attr]


async def _revoked_before(db: Database, node: str) -> dt.datetime | None:
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT revoked_before FROM node_certificate_revocations WHERE node_id = %s",
                (node,),
            )
        ).fetchone()
    return None if row is None else row["revoked_before"]


async def _revoked_after(
    db: Database, node: str, after: dt.datetime | None, within_s: float = 5.0
) -> dt.datetime:
    """The node's revocation cut-off once it is later than ``after`` (the store's row)."""
    async with asyncio.timeout(within_s):
        while True:
            cut = await _revoked_before(db, node)
            if cut is not None and (after is None or cut > after):
                return cut
            await asyncio.sleep(0.02)


async def test_deleting_a_gpunode_or_annotating_it_revokes_its_certificates(
    kube_api: KubeApi, world: World, db: Database
) -> None:
    annotate = {"metadata": {"annotations": {"bcd.dev/revoke-certificates": "2026-12-04"}}}
    await kube_api.patch(GPUNODES, None, NODE, annotate)
    first = await _revoked_after(db, NODE, None)
    marked = await kube_api.wait_for(
        GPUNODES,
        None,
        NODE,
        lambda o: (
            (o or {}).get("metadata", {}).get("annotations", {}).get("bcd.dev/revoked-certificates")
            == "2026-12-04"
        ),
    )
    assert marked is not None
    # ... and when, for the node's agent to know its certificate is older (it enrols again).
    at = marked["metadata"]["annotations"]["bcd.dev/revoked-certificates-at"]
    assert dt.datetime.fromisoformat(at.replace("Z", "+00:00")) >= first.replace(microsecond=0)
    # Any other write to the GPUNode (the same value still there) revokes nothing more.
    await kube_api.patch(GPUNODES, None, NODE, {"metadata": {"labels": {"touched": "yes"}}})
    await asyncio.sleep(0.3)
    assert await _revoked_before(db, NODE) == first
    annotate["metadata"]["annotations"]["bcd.dev/revoke-certificates"] = "again"
    await kube_api.patch(GPUNODES, None, NODE, annotate)
    await _revoked_after(db, NODE, first)

    assert await _revoked_before(db, OTHER) is None
    await kube_api.delete(GPUNODES, None, OTHER)
    await _revoked_after(db, OTHER, None)


# --- the real agent and the real operator ----------------------------------------------------


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    async with agents.standing_node() as standing:
        yield standing


@contextlib.asynccontextmanager
async def agent_running(kube: KubeApi, node: Node, token: str) -> AsyncIterator[Agent]:
    config = agents.agent_config(kube=kube, node=node, api_token=token)
    async with started(config) as running:
        yield running


async def _until(condition: Callable[[], bool], within: float = 5.0) -> None:
    async with asyncio.timeout(within):
        while True:
            if condition():
                return
            await asyncio.sleep(0.02)


async def test_the_real_agent_enrols_with_the_real_operator(
    kube_api: KubeApi, operator: Operator, node: Node
) -> None:
    kube_api.tokens["node-token"] = _user(AGENT, node=agents.NODE)
    await kube_api.create(kubeworld.namespace(NS, tenant=None))
    async with agent_running(kube_api, node, "node-token") as agent:
        await _until(lambda: agent.certificate_pem is not None)
        assert agent.certificate_pem is not None
        cert = x509.load_pem_x509_certificate(agent.certificate_pem)
        ca = await authority(kube_api)
        assert verified_role(cert, ca, agents.NODE) == "node"
        assert cert.public_key() == agent.plugin.converger.key.public_key


async def test_an_agent_with_another_nodes_token_never_gets_a_certificate(
    kube_api: KubeApi, operator: Operator, node: Node
) -> None:
    kube_api.tokens["stolen-token"] = _user(AGENT, node="someone-else")
    await kube_api.create(kubeworld.namespace(NS, tenant=None))
    async with agent_running(kube_api, node, "stolen-token") as agent:

        def denials() -> list[dict[str, Any]]:
            listed = kube_api.emulator._snapshot(CSRS.resource, None, lambda _: True)
            return [o for o in listed if condition(o, "Denied")]

        await _until(lambda: bool(denials()))
        assert agent.certificate_pem is None
        assert [condition(o, "Denied")["reason"] for o in denials()] == ["OtherNode"]  # type: ignore[index]
        listed = kube_api.emulator._snapshot(CSRS.resource, None, lambda _: True)
        assert not [o for o in listed if (o.get("status") or {}).get("certificate")]


async def test_a_failed_write_is_tried_again_not_left_pending(
    kube_api: KubeApi, world: World
) -> None:
    """kopf calls an event handler once; the signer itself retries an API that failed."""
    path = "put /apis/certificates.k8s.io/v1/certificatesigningrequests/flaky/status"
    failing = kube_api.emulator[path][:1] << 503
    await ask(kube_api, "agent-on-node", csr_body("flaky", request_pem()))
    obj = await outcome(kube_api, "flaky")
    assert obj["status"]["certificate"]
    assert len(failing) == 1


async def test_the_enrolled_agents_own_certificate_makes_its_binding_count(
    kube_api: KubeApi, db: Database, operator: Operator, node: Node
) -> None:
    """The whole chain, nothing certified by the test: the agent asks, the operator signs with
    the CA its verifier trusts, the agent's signed report carries the certificate, and the
    reservation becomes active on that report alone."""
    kube_api.tokens["node-token"] = _user(AGENT, node=agents.NODE)
    await kube_api.create(kubeworld.namespace("ml", tenant="acme"))
    await kube_api.create(kubeworld.namespace(NS, tenant=None))
    await kube_api.create(kubeworld.gpuquota("acme", {"gpu:H100": 64}))
    await kube_api.create(kubeworld.gpupool("h100"))
    async with agent_running(kube_api, node, "node-token") as agent:
        await _until(lambda: agent.certificate_pem is not None)
        await kube_api.create(kubeworld.reservation("train").gpus(2).kubernetes().obj())
        active = await kube_api.wait_for(
            RESERVATIONS,
            "ml",
            "train",
            lambda o: (o or {}).get("status", {}).get("state") == "active",
            timeout=10.0,
        )
    assert active is not None
    assert active["status"]["binding"]["nodeId"] == agents.NODE
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT bound_certificate FROM allocations WHERE reservation_id = %s",
                (active["status"]["id"],),
            )
        ).fetchone()
    assert row is not None
    assert row["bound_certificate"] == agent.certificate_pem.decode("ascii")  # type: ignore[union-attr]
