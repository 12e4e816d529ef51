"""The API stand-in keeps CertificateSigningRequests as a real API server does.

Each rule of ``tests/support/csrs.py`` has its own test over real HTTP (httpx as a plain
client, the caller named by its bearer token), since the operator's approval rule leans on
them: the requester is the caller's, the spec never changes, approval and the certificate each
go through their own subresource.
"""

from __future__ import annotations

import base64
import datetime
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID

from tests.support.csrs import CSRS
from tests.support.kubeserver import KubeApi

AGENT = "system:serviceaccount:better-compute:better-compute-node-agent"
NODE_EXTRA = {"authentication.kubernetes.io/node-name": ["gpu-1"]}


def request_pem(common_name: str = "gpu-1") -> bytes:
    key = Ed25519PrivateKey.generate()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, None)
    return csr.public_bytes(serialization.Encoding.PEM)


def csr(name: str, *, request: bytes | None = None, **spec: Any) -> dict[str, Any]:
    body = {
        "request": base64.b64encode(request or request_pem()).decode(),
        "signerName": "bcd.dev/node-report",
        "usages": ["digital signature"],
        **spec,
    }
    return {
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {"name": name},
        "spec": body,
    }


def certificate_b64() -> str:
    key = Ed25519PrivateKey.generate()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpu-1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, None)
    )
    return base64.b64encode(cert.public_bytes(serialization.Encoding.PEM)).decode()


@pytest.fixture
async def http(kube_api: KubeApi) -> AsyncIterator[httpx.AsyncClient]:
    kube_api.tokens["agent-token"] = {
        "username": AGENT,
        "uid": "sa-uid",
        "groups": ["system:serviceaccounts", "system:authenticated"],
        "extra": NODE_EXTRA,
    }
    async with httpx.AsyncClient(base_url=kube_api.url, timeout=5.0) as client:
        yield client


async def send(
    http: httpx.AsyncClient,
    method: str,
    path: str,
    body: Any = None,
    *,
    token: str = "agent-token",
    kind: str = "application/json",
) -> tuple[int, Any]:
    headers = {"Content-Type": kind, "Authorization": f"Bearer {token}"}
    content = None if body is None else json.dumps(body)
    response = await http.request(method, path, content=content, headers=headers)
    return response.status_code, response.json()


async def created(http: httpx.AsyncClient, name: str = "c1") -> dict[str, Any]:
    code, obj = await send(http, "POST", CSRS.path(), csr(name))
    assert code == 201, obj
    return obj


def approved(obj: dict[str, Any], kind: str = "Approved") -> dict[str, Any]:
    condition = {"type": kind, "status": "True", "reason": "Test", "message": "by the test"}
    return {**obj, "status": {"conditions": [condition]}}


async def test_create_records_the_caller_as_requester_whatever_the_body_claims(
    http: httpx.AsyncClient,
) -> None:
    forged = csr("c1", username="system:admin", groups=["system:masters"], extra={"x": ["y"]})
    forged["status"] = {"certificate": certificate_b64()}
    code, obj = await send(http, "POST", CSRS.path(), forged)
    assert code == 201, obj
    assert obj["spec"]["username"] == AGENT
    assert obj["spec"]["uid"] == "sa-uid"
    assert obj["spec"]["groups"] == ["system:serviceaccounts", "system:authenticated"]
    assert obj["spec"]["extra"] == NODE_EXTRA
    assert "status" not in obj


async def test_create_from_a_caller_without_extra_has_none(
    kube_api: KubeApi, http: httpx.AsyncClient
) -> None:
    kube_api.tokens["plain"] = {"username": "alice", "uid": "u1", "groups": ["dev"]}
    code, obj = await send(http, "POST", CSRS.path(), csr("c1", extra=NODE_EXTRA), token="plain")
    assert code == 201
    assert obj["spec"]["username"] == "alice"
    assert "extra" not in obj["spec"]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"request": base64.b64encode(b"not a pem").decode()}, "spec.request"),
        ({"request": "!!!"}, "spec.request"),
        (
            {"request": base64.b64encode(b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n").decode()},
            "spec.request",
        ),
        ({"signerName": "no-slash"}, "spec.signerName"),
        ({"usages": []}, "spec.usages"),
        ({"expirationSeconds": 599}, "spec.expirationSeconds"),
    ],
)
async def test_create_refuses_a_bad_spec_naming_the_field(
    http: httpx.AsyncClient, spec: dict[str, Any], field: str
) -> None:
    body = csr("c1")
    body["spec"].update(spec)
    code, answer = await send(http, "POST", CSRS.path(), body)
    assert code == 422
    assert field in answer["message"]


async def test_spec_and_status_never_change_through_the_main_resource(
    http: httpx.AsyncClient,
) -> None:
    obj = await created(http)
    changed = approved(obj)
    changed["spec"] = {**obj["spec"], "username": "system:admin", "request": "eA=="}
    changed["metadata"] = {**obj["metadata"], "labels": {"a": "b"}}
    code, stored = await send(http, "PUT", CSRS.path(name="c1"), changed)
    assert code == 200
    assert stored["spec"] == obj["spec"]
    assert "status" not in stored
    assert stored["metadata"]["labels"] == {"a": "b"}


async def test_approval_subresource_sets_conditions_only(http: httpx.AsyncClient) -> None:
    obj = await created(http)
    body = approved(obj)
    body["status"]["certificate"] = certificate_b64()
    code, stored = await send(http, "PUT", CSRS.path(name="c1", subresource="approval"), body)
    assert code == 200, stored
    assert [c["type"] for c in stored["status"]["conditions"]] == ["Approved"]
    assert "certificate" not in stored["status"]


async def test_approval_cannot_be_removed_or_joined_by_denied(http: httpx.AsyncClient) -> None:
    obj = await created(http)
    path = CSRS.path(name="c1", subresource="approval")
    code, stored = await send(http, "PUT", path, approved(obj))
    assert code == 200
    code, answer = await send(http, "PUT", path, {**stored, "status": {"conditions": []}})
    assert (code, "may not remove a Approved" in answer["message"]) == (422, True)
    both = approved(stored)
    both["status"]["conditions"].append({"type": "Denied", "status": "True"})
    code, answer = await send(http, "PUT", path, both)
    assert (code, "mutually exclusive" in answer["message"]) == (422, True)


async def test_status_sets_the_certificate_only_once_and_only_when_approved(
    http: httpx.AsyncClient,
) -> None:
    obj = await created(http)
    status_path = CSRS.path(name="c1", subresource="status")
    unapproved = {**obj, "status": {"certificate": certificate_b64()}}
    code, answer = await send(http, "PUT", status_path, unapproved)
    assert (code, "only be set on an approved" in answer["message"]) == (422, True)

    code, stored = await send(
        http, "PUT", CSRS.path(name="c1", subresource="approval"), approved(obj)
    )
    first = certificate_b64()
    code, stored = await send(
        http, "PUT", status_path, {**stored, "status": {**stored["status"], "certificate": first}}
    )
    assert code == 200, stored
    assert stored["status"]["certificate"] == first
    again = {**stored, "status": {**stored["status"], "certificate": certificate_b64()}}
    code, answer = await send(http, "PUT", status_path, again)
    assert (code, "may not modify existing certificate" in answer["message"]) == (422, True)

    garbage = await created(http, "c2")
    code, garbage = await send(
        http, "PUT", CSRS.path(name="c2", subresource="approval"), approved(garbage)
    )
    code, answer = await send(
        http,
        "PUT",
        CSRS.path(name="c2", subresource="status"),
        {**garbage, "status": {**garbage["status"], "certificate": "bm90IGEgY2VydA=="}},
    )
    assert (code, "status.certificate" in answer["message"]) == (422, True)


async def test_status_cannot_approve_or_drop_approval(http: httpx.AsyncClient) -> None:
    obj = await created(http)
    status_path = CSRS.path(name="c1", subresource="status")
    failed = {"type": "Failed", "status": "True", "reason": "Test", "message": ""}
    self_approved = approved(obj)
    self_approved["status"]["conditions"].append(failed)
    code, stored = await send(http, "PUT", status_path, self_approved)
    assert code == 200
    assert [c["type"] for c in stored["status"]["conditions"]] == ["Failed"]

    code, stored = await send(
        http, "PUT", CSRS.path(name="c1", subresource="approval"), approved(stored)
    )
    code, stored = await send(http, "PUT", status_path, {**stored, "status": {}})
    assert code == 200
    assert [c["type"] for c in stored["status"]["conditions"]] == ["Approved"]


async def test_csrs_are_cluster_scoped_with_both_subresources(http: httpx.AsyncClient) -> None:
    listing = (await http.get("/apis/certificates.k8s.io/v1")).json()["resources"]
    names = {r["name"]: r for r in listing}
    assert names["certificatesigningrequests"]["namespaced"] is False
    assert "certificatesigningrequests/approval" in names
    assert "certificatesigningrequests/status" in names
    await created(http)
    code, _ = await send(http, "PATCH", CSRS.path(name="c1", subresource="nothing"), {})
    assert code == 404
