"""The signer's approval rule (``operator.nodecerts.judge``), one row per way to fail it.

Pure: no API. The operator against the API stand-in, where the API server fills the requester,
is ``tests/operator/test_node_certificates.py``; this table pins each reason on its own.
"""

from __future__ import annotations

import base64
import datetime as dt
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID

from bettercompute.core import attestation
from bettercompute.operator import nodecerts

AGENT = nodecerts.agent_username("better-compute", "better-compute-device-plugin")
NODE = "gpu-node-1"


def _request(**subject: str) -> str:
    key = Ed25519PrivateKey.generate()
    pem = attestation.certificate_request(
        key, node_name=subject.get("node", NODE), role=subject.get("role", "node")
    )
    return base64.b64encode(pem).decode()


def _rsa_request() -> str:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, NODE),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "node"),
        ]
    )
    csr = x509.CertificateSigningRequestBuilder().subject_name(name).sign(key, hashes.SHA256())
    return base64.b64encode(csr.public_bytes(serialization.Encoding.PEM)).decode()


def _csr(**spec: Any) -> dict[str, Any]:
    base = {
        "request": _request(),
        "signerName": "bcd.dev/node-report",
        "usages": ["digital signature"],
        "username": AGENT,
        "extra": {nodecerts.NODE_NAME_EXTRA: [NODE]},
    }
    return {"metadata": {"name": "c"}, "spec": {**base, **spec}}


def test_the_nodes_own_agent_is_approved() -> None:
    verdict = nodecerts.judge(_csr(), agent=AGENT)
    assert verdict.approve
    assert verdict.reason == "NodeAgent"
    assert verdict.request is not None
    assert (verdict.request.node_name, verdict.request.role) == (NODE, "node")


CASES = [
    ("not base64", _csr(request="%%%"), "BadRequest"),
    ("not a request", _csr(request=base64.b64encode(b"hello").decode()), "BadRequest"),
    ("an RSA key", _csr(request=_rsa_request()), "BadRequest"),
    ("another usage", _csr(usages=["digital signature", "client auth"]), "BadUsages"),
    ("no usage", _csr(usages=[]), "BadUsages"),
    ("another role", _csr(request=_request(role="node-tenant")), "WrongRole"),
    ("a person", _csr(username="alice"), "NotNodeAgent"),
    (
        "another namespace's account",
        _csr(username=AGENT.replace(":better-compute:", ":x:")),
        "NotNodeAgent",
    ),
    ("no node binding", _csr(extra={}), "NotNodeBound"),
    ("bound to another node", _csr(extra={nodecerts.NODE_NAME_EXTRA: ["gpu-node-2"]}), "OtherNode"),
    ("bound to two nodes", _csr(extra={nodecerts.NODE_NAME_EXTRA: [NODE, NODE]}), "OtherNode"),
    ("another node's name", _csr(request=_request(node="gpu-node-2")), "OtherNode"),
]


@pytest.mark.parametrize(("case", "csr", "reason"), CASES, ids=[c[0] for c in CASES])
def test_anything_else_is_denied_with_its_reason(
    case: str, csr: dict[str, Any], reason: str
) -> None:
    verdict = nodecerts.judge(csr, agent=AGENT)
    assert not verdict.approve
    assert verdict.reason == reason
    assert verdict.message


@pytest.mark.parametrize(
    ("asked", "expected"),
    [
        (None, dt.timedelta(days=7)),
        (3600, dt.timedelta(hours=1)),
        (30 * 86400, dt.timedelta(days=7)),
    ],
)
def test_the_lifetime_is_the_asked_one_at_most_the_longest(
    asked: int | None, expected: dt.timedelta
) -> None:
    csr = _csr() if asked is None else _csr(expirationSeconds=asked)
    assert nodecerts.lifetime_of(csr, longest=dt.timedelta(days=7)) == expected
