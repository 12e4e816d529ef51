"""Node certificates: the CA that issues them, the node's request, and the certificate's rules.

INTERIM COPY: branch i12-attest owns this module; this is the smallest form of its agreed API
that the CSR work (enrolling and signing) needs, so that work builds and is tested before the
real module lands. On merge, take i12-attest's file whole.

Why it exists: a node signs its allocation reports with its own Ed25519 key, and a verifier
needs to know which node that key belongs to and whether it may still be trusted. A
certificate from the operator's CA says so: subject CN = the node's name, O = its role
(``node``), a validity window, a serial to revoke it by.

Pure: no I/O, no clock (``now`` is passed in); what it must never do: accept a request or a
certificate it could not check, or hand out the CA's key except through ``key_pem``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLE_NODE = "node"
#: Roles whose certificates may sign workload reports.
WORKLOAD_ROLES = frozenset({ROLE_NODE, "node-tenant"})
CA_NAME = "better-compute node CA"
CA_LIFETIME = dt.timedelta(days=3650)


class AttestationError(Exception):
    """A request or certificate that does not pass; ``reason`` says which check failed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class NodeRequest:
    """What a node's certificate request asks for, once its self-signature verified."""

    node_name: str
    role: str
    public_key: Ed25519PublicKey


def _one(name: x509.Name, oid: x509.ObjectIdentifier, what: str) -> str:
    values = name.get_attributes_for_oid(oid)
    if len(values) != 1:
        raise AttestationError(f"the subject must have exactly one {what}, not {len(values)}")
    value = values[0].value
    if not isinstance(value, str) or not value:
        raise AttestationError(f"the subject's {what} is empty")
    return value


def certificate_request(key: Ed25519PrivateKey, *, node_name: str, role: str = ROLE_NODE) -> bytes:
    """The PEM certificate request for ``node_name`` in ``role`` (CN, O), signed by ``key``."""
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, node_name),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, role),
        ]
    )
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, None)
    return csr.public_bytes(serialization.Encoding.PEM)


def read_request(csr_pem: bytes) -> NodeRequest:
    """The node and role a PEM request asks for; ``AttestationError`` unless it is a well-formed
    request with an Ed25519 key whose self-signature verifies."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as e:
        raise AttestationError(f"not a PEM certificate request: {e}") from e
    key = csr.public_key()
    if not isinstance(key, Ed25519PublicKey):
        raise AttestationError(f"the key must be Ed25519, not {type(key).__name__}")
    if not csr.is_signature_valid:
        raise AttestationError("the request's self-signature does not verify")
    return NodeRequest(
        node_name=_one(csr.subject, NameOID.COMMON_NAME, "common name (CN)"),
        role=_one(csr.subject, NameOID.ORGANIZATION_NAME, "organization (O)"),
        public_key=key,
    )


class CertificateAuthority:
    """The CA's certificate and key; issues node certificates."""

    def __init__(self, certificate: x509.Certificate, key: Ed25519PrivateKey) -> None:
        self.certificate = certificate
        self._key = key

    @classmethod
    def generate(cls, *, now: dt.datetime) -> CertificateAuthority:
        key = Ed25519PrivateKey.generate()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + CA_LIFETIME)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, None)
        )
        return cls(certificate, key)

    @classmethod
    def from_pem(cls, cert_pem: bytes, key_pem: bytes) -> CertificateAuthority:
        try:
            certificate = x509.load_pem_x509_certificate(cert_pem)
            key = serialization.load_pem_private_key(key_pem, password=None)
        except ValueError as e:
            raise AttestationError(f"the CA certificate or key is not PEM: {e}") from e
        if not isinstance(key, Ed25519PrivateKey):
            raise AttestationError("the CA key must be Ed25519")
        return cls(certificate, key)

    def certificate_pem(self) -> bytes:
        return certificate_pem(self.certificate)

    def key_pem(self) -> bytes:
        return self._key.private_bytes(
            encoding=serialization.Encoding.PEM,
            format=serialization.PrivateFormat.PKCS8,
            encryption_algorithm=serialization.NoEncryption(),
        )

    def issue(
        self,
        *,
        public_key: Ed25519PublicKey,
        node_name: str,
        role: str,
        now: dt.datetime,
        lifetime: dt.timedelta,
    ) -> x509.Certificate:
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.COMMON_NAME, node_name),
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, role),
            ]
        )
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.certificate.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + lifetime)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(self._key, None)
        )


def verify_certificate(
    certificate: x509.Certificate, *, authority: x509.Certificate, node_name: str
) -> str:
    """The certificate's role, once it is the CA's and names ``node_name``."""
    try:
        certificate.verify_directly_issued_by(authority)
    except (ValueError, TypeError, InvalidSignature) as e:
        raise AttestationError(f"not issued by the node CA: {e}") from e
    if _one(certificate.subject, NameOID.COMMON_NAME, "common name (CN)") != node_name:
        raise AttestationError(f"the certificate is not node {node_name!r}'s")
    return _one(certificate.subject, NameOID.ORGANIZATION_NAME, "organization (O)")


def certificate_pem(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)
