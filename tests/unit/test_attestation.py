"""Node certificates and requests (core.attestation): what the authority issues verifies, and every
way to present someone else's certificate, an expired, revoked or self-made one is refused with
its reason."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID

from bettercompute.core import attestation
from bettercompute.core.attestation import (
    AttestationError,
    CertificateAuthority,
    certificate_pem,
    certificate_request,
    read_request,
    verify_certificate,
)

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
WEEK = timedelta(days=7)
GRACE = timedelta(hours=1)


def _never(_: x509.Certificate) -> bool:
    return False


@pytest.fixture(scope="module")
def authority() -> CertificateAuthority:
    return CertificateAuthority.generate(now=NOW - timedelta(days=1))


def _issue(ca: CertificateAuthority, node: str = "gpu-node-1", role: str = "node") -> bytes:
    key = Ed25519PrivateKey.generate()
    cert = ca.issue(public_key=key.public_key(), node_name=node, role=role, now=NOW, lifetime=WEEK)
    return certificate_pem(cert)


def _verify(pem: bytes, ca: CertificateAuthority, **overrides: object) -> x509.Certificate:
    arguments: dict[str, object] = {
        "authorities": [ca.certificate],
        "node_name": "gpu-node-1",
        "now": NOW,
        "grace": GRACE,
        "revoked": _never,
    }
    arguments.update(overrides)
    return verify_certificate(pem, **arguments)  # type: ignore[arg-type]


def test_an_issued_certificate_verifies_and_names_node_and_role(
    authority: CertificateAuthority,
) -> None:
    cert = _verify(_issue(authority), authority)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "gpu-node-1"
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "node"
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca is False
    assert cert.extensions.get_extension_for_class(x509.KeyUsage).value.digital_signature
    # a str PEM (as the DeviceAllocation status carries it) is the same certificate
    assert _verify(_issue(authority).decode(), authority).subject == cert.subject


def test_the_authority_round_trips_through_pem(authority: CertificateAuthority) -> None:
    again = CertificateAuthority.from_pem(authority.certificate_pem(), authority.key_pem())
    assert again.certificate == authority.certificate
    _verify(_issue(again), authority)


def test_a_mismatched_or_garbage_authority_is_refused(authority: CertificateAuthority) -> None:
    other = CertificateAuthority.generate(now=NOW)
    with pytest.raises(AttestationError, match="does not match"):
        CertificateAuthority.from_pem(authority.certificate_pem(), other.key_pem())
    with pytest.raises(AttestationError, match="not a PEM certificate"):
        CertificateAuthority.from_pem(b"nope", authority.key_pem())
    with pytest.raises(AttestationError, match="not an unencrypted PEM private key"):
        CertificateAuthority.from_pem(authority.certificate_pem(), b"nope")


def test_a_certificate_from_a_self_made_authority_is_refused(
    authority: CertificateAuthority,
) -> None:
    # Same name as ours, different key: only the signature tells them apart.
    forged = CertificateAuthority.generate(now=NOW)
    with pytest.raises(AttestationError) as caught:
        _verify(_issue(forged), authority)
    assert caught.value.reason == "certificate is not issued by a trusted authority"
    assert str(caught.value) == caught.value.reason


def test_the_authority_itself_is_not_a_node_certificate(authority: CertificateAuthority) -> None:
    with pytest.raises(AttestationError, match="is an authority, not a node certificate"):
        _verify(authority.certificate_pem(), authority)


def test_another_nodes_certificate_is_refused(authority: CertificateAuthority) -> None:
    with pytest.raises(AttestationError, match="for node 'gpu-node-2', not 'gpu-node-1'"):
        _verify(_issue(authority, node="gpu-node-2"), authority)


def test_a_non_workload_role_is_refused(authority: CertificateAuthority) -> None:
    _verify(_issue(authority, role="node-tenant"), authority)
    with pytest.raises(AttestationError, match="role 'gateway' may not sign"):
        _verify(_issue(authority, role="gateway"), authority)


def test_expiry_allows_the_grace_and_no_more(authority: CertificateAuthority) -> None:
    pem = _issue(authority)
    _verify(pem, authority, now=NOW + WEEK + GRACE - timedelta(seconds=1))
    with pytest.raises(AttestationError) as caught:
        _verify(pem, authority, now=NOW + WEEK + GRACE + timedelta(seconds=1))
    assert caught.value.reason == "certificate expired"
    with pytest.raises(AttestationError, match="not yet valid"):
        _verify(pem, authority, now=NOW - timedelta(hours=1))


def test_a_revoked_certificate_is_refused(authority: CertificateAuthority) -> None:
    pem = _issue(authority)
    serial = x509.load_pem_x509_certificate(pem).serial_number
    with pytest.raises(AttestationError) as caught:
        _verify(pem, authority, revoked=lambda cert: cert.serial_number == serial)
    assert caught.value.reason == "certificate revoked"


def test_garbage_is_not_a_certificate(authority: CertificateAuthority) -> None:
    with pytest.raises(AttestationError, match="not a PEM certificate"):
        _verify(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", authority)


def test_a_request_round_trips() -> None:
    key = Ed25519PrivateKey.generate()
    request = read_request(certificate_request(key, node_name="gpu-node-1"))
    assert (request.node_name, request.role) == ("gpu-node-1", attestation.ROLE_NODE)
    assert request.public_key == key.public_key()


def _csr(key: Ed25519PrivateKey, attributes: list[x509.NameAttribute]) -> bytes:
    from cryptography.hazmat.primitives import serialization

    built = x509.CertificateSigningRequestBuilder().subject_name(x509.Name(attributes))
    return built.sign(key, None).public_bytes(serialization.Encoding.PEM)


def test_a_request_with_extra_or_missing_subject_parts_is_refused() -> None:
    key = Ed25519PrivateKey.generate()
    extra = [
        x509.NameAttribute(NameOID.COMMON_NAME, "gpu-node-1"),
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "node"),
        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "x"),
    ]
    with pytest.raises(AttestationError, match="exactly CN and O"):
        read_request(_csr(key, extra))
    with pytest.raises(AttestationError, match="exactly CN and O"):
        read_request(_csr(key, [x509.NameAttribute(NameOID.COMMON_NAME, "gpu-node-1")]))
    with pytest.raises(AttestationError, match="not a PEM CSR"):
        read_request(b"garbage")


def test_a_request_with_a_non_ed25519_key_is_refused() -> None:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, "gpu-node-1"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "node"),
        ]
    )
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())
    with pytest.raises(AttestationError, match="not Ed25519"):
        read_request(csr.public_bytes(serialization.Encoding.PEM))


def _binding(reported_at: str) -> attestation.AttestedBinding:
    return attestation.AttestedBinding(
        payload=b"",
        signature=b"",
        key_id="",
        certificate_pem="",
        serial=1,
        cdi_devices=(),
        env_file=None,
        reported_at=reported_at,
    )


@pytest.mark.parametrize(
    ("now", "before", "lost", "replay"),
    [
        ("2026-12-04T12:00:01.000Z", "2026-12-04T12:00:00.000Z", True, False),
        ("2026-12-04T12:00:00.000Z", "2026-12-04T12:00:00.000Z", False, False),
        ("2026-12-04T12:00:00.000Z", "2026-12-04T12:00:00.000Z", True, True),
        ("2026-12-04T11:59:59.999Z", "2026-12-04T12:00:00.000Z", False, True),
        ("not a time", "not a time", True, True),
        ("not a time", "2026-12-04T12:00:00.000Z", False, False),
    ],
)
def test_a_replay_is_an_older_report_or_the_same_after_a_loss(
    now: str, before: str, lost: bool, replay: bool
) -> None:
    previous = attestation.canonical_bytes({"reportedAt": before})
    assert attestation.is_replay(_binding(now), previous, lost=lost) is replay
    assert attestation.is_replay(_binding(now), None, lost=lost) is False
