"""Node certificates and signed node reports: the pure checks behind attested bindings.

Why it exists: a binding only counts when the node itself says so. Each node signs its reports
with its own Ed25519 key, and a certificate issued by the node-report authority binds that key to
the node's name and role. Everything here is the arithmetic of that trust: issuing and reading
certificates and certificate requests, checking a certificate against the trusted authorities,
and checking a signed report (the format is in docs/node-reports.md). The node agent, the
operator, the service and ``dev`` all use these same functions, so there is one verifier.

What it must never do: any I/O or clock read (callers pass ``now``), log or return key material
other than what it is asked to encode, or accept a certificate or report it could not check.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

ROLE_NODE = "node"
# Roles whose certificates may sign workload (allocation) reports.
WORKLOAD_ROLES = frozenset({"node", "node-tenant"})

# Defaults the operator and the node agent share (documented in docs/node-reports.md).
NODE_CERTIFICATE_LIFETIME = timedelta(days=7)
OFFLINE_GRACE = timedelta(hours=1)

# A certificate's notBefore is this much before its issue: a verifier whose clock is slightly
# behind the issuer's must not see "not yet valid". ``issued_at`` undoes it for revocation.
ISSUE_BACKDATE = timedelta(minutes=1)

ALGORITHM = "ed25519"
PURPOSE = "attested-report"
PHASES = ("Bound", "Failed", "Releasing", "Released")
REPORT_FIELDS = frozenset(
    {
        "purpose",
        "nodeName",
        "allocationId",
        "reservationId",
        "phase",
        "cdiDevices",
        "envFile",
        "cgroupParent",
        "pods",
        "intruders",
        "since",
        "reportedAt",
    }
)
#: What older agents sign, still verified during a rolling upgrade: before ``intruders`` (it
#: reads as none), and before ``cgroupParent`` too (it reads as null).
PREVIOUS_REPORT_FIELDS = (
    REPORT_FIELDS - {"intruders"},
    REPORT_FIELDS - {"intruders", "cgroupParent"},
)


class AttestationError(Exception):
    """A certificate, request or signed report that does not check out; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


def _name(node_name: str, role: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, node_name),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, role),
        ]
    )


def certificate_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class CertificateAuthority:
    """The node-report authority: its self-signed certificate and Ed25519 key."""

    certificate: x509.Certificate
    key: Ed25519PrivateKey

    @classmethod
    def generate(
        cls,
        *,
        now: datetime,
        name: str = "bcd node-report CA",
        lifetime: timedelta = timedelta(days=3650),
    ) -> CertificateAuthority:
        key = Ed25519PrivateKey.generate()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        public_key = key.public_key()
        certificate = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + lifetime)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .sign(key, None)
        )
        return cls(certificate=certificate, key=key)

    @classmethod
    def from_pem(cls, certificate_pem: bytes, key_pem: bytes) -> CertificateAuthority:
        try:
            certificate = x509.load_pem_x509_certificate(certificate_pem)
        except ValueError as e:
            raise AttestationError(f"CA certificate: not a PEM certificate: {e}") from e
        try:
            key = serialization.load_pem_private_key(key_pem, password=None)
        except (ValueError, TypeError) as e:
            raise AttestationError(f"CA key: not an unencrypted PEM private key: {e}") from e
        if not isinstance(key, Ed25519PrivateKey):
            raise AttestationError(f"CA key: not an Ed25519 key ({type(key).__name__})")
        if certificate.public_key() != key.public_key():
            raise AttestationError("CA key: does not match the CA certificate")
        return cls(certificate=certificate, key=key)

    def certificate_pem(self) -> bytes:
        return certificate_pem(self.certificate)

    def key_pem(self) -> bytes:
        return self.key.private_bytes(
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
        now: datetime,
        lifetime: timedelta,
    ) -> x509.Certificate:
        """A leaf certificate binding ``public_key`` to ``node_name`` (CN) and ``role`` (O)."""
        return (
            x509.CertificateBuilder()
            .subject_name(_name(node_name, role))
            .issuer_name(self.certificate.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - ISSUE_BACKDATE)
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
            .sign(self.key, None)
        )


@dataclass(frozen=True)
class NodeRequest:
    """What a node's certificate request asks for, once checked."""

    node_name: str
    role: str
    public_key: Ed25519PublicKey


def certificate_request(key: Ed25519PrivateKey, *, node_name: str, role: str = ROLE_NODE) -> bytes:
    """A PEM certificate request for ``key``, subject CN=node_name, O=role."""
    request = x509.CertificateSigningRequestBuilder().subject_name(_name(node_name, role))
    return request.sign(key, None).public_bytes(serialization.Encoding.PEM)


def _single(name: x509.Name, oid: x509.ObjectIdentifier, label: str) -> str:
    values = name.get_attributes_for_oid(oid)
    if len(values) != 1 or not isinstance(values[0].value, str) or not values[0].value:
        raise AttestationError(f"subject must have exactly one non-empty {label}")
    return values[0].value


def read_request(csr_pem: bytes) -> NodeRequest:
    """The node and role a certificate request names; it must be self-signed Ed25519 with only
    CN and O in its subject."""
    try:
        request = x509.load_pem_x509_csr(csr_pem)
    except ValueError as e:
        raise AttestationError(f"certificate request: not a PEM CSR: {e}") from e
    public_key = request.public_key()
    if not isinstance(public_key, Ed25519PublicKey):
        raise AttestationError(
            f"certificate request: key is not Ed25519 ({type(public_key).__name__})"
        )
    if not request.is_signature_valid:
        raise AttestationError("certificate request: signature does not verify")
    oids = {attribute.oid for attribute in request.subject}
    if oids != {NameOID.COMMON_NAME, NameOID.ORGANIZATION_NAME} or len(request.subject) != 2:
        raise AttestationError("certificate request: subject must be exactly CN and O")
    node_name = _single(request.subject, NameOID.COMMON_NAME, "CN")
    role = _single(request.subject, NameOID.ORGANIZATION_NAME, "O")
    return NodeRequest(node_name=node_name, role=role, public_key=public_key)


def issued_at(cert: x509.Certificate) -> datetime:
    """When the authority issued ``cert`` (its notBefore, less the backdating ``issue`` adds)."""
    return cert.not_valid_before_utc + ISSUE_BACKDATE


@dataclass(frozen=True)
class Revocations:
    """A node's revoked certificates: all issued at or before ``before``, and ``serials``."""

    before: datetime | None = None
    serials: frozenset[int] = frozenset()

    def __call__(self, cert: x509.Certificate) -> bool:
        if cert.serial_number in self.serials:
            return True
        return self.before is not None and issued_at(cert) <= self.before


def load_certificate(certificate_pem: bytes | str) -> x509.Certificate:
    data = certificate_pem.encode("ascii") if isinstance(certificate_pem, str) else certificate_pem
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as e:
        raise AttestationError("certificate: not a PEM certificate") from e


def _issued_by(cert: x509.Certificate, authorities: Sequence[x509.Certificate]) -> bool:
    for authority in authorities:
        try:
            cert.verify_directly_issued_by(authority)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return True
    return False


def _is_authority(cert: x509.Certificate) -> bool:
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return False
    return constraints.ca


def verify_certificate(
    certificate_pem: bytes | str,
    *,
    authorities: Sequence[x509.Certificate],
    node_name: str,
    now: datetime,
    grace: timedelta,
    revoked: Callable[[x509.Certificate], bool],
    roles: frozenset[str] = WORKLOAD_ROLES,
) -> x509.Certificate:
    """The certificate, once it is issued by one of ``authorities`` to ``node_name`` in one of
    ``roles``, valid at ``now`` (or expired less than ``grace`` ago) and not ``revoked``."""
    cert = load_certificate(certificate_pem)
    if not isinstance(cert.public_key(), Ed25519PublicKey):
        raise AttestationError("certificate key is not Ed25519")
    if not _issued_by(cert, authorities):
        raise AttestationError("certificate is not issued by a trusted authority")
    if _is_authority(cert):
        raise AttestationError("certificate is an authority, not a node certificate")
    try:
        subject_node = _single(cert.subject, NameOID.COMMON_NAME, "CN")
        role = _single(cert.subject, NameOID.ORGANIZATION_NAME, "O")
    except AttestationError as e:
        raise AttestationError(f"certificate {e}") from e
    if subject_node != node_name:
        raise AttestationError(f"certificate is for node {subject_node!r}, not {node_name!r}")
    if role not in roles:
        raise AttestationError(f"certificate role {role!r} may not sign these reports")
    if now < cert.not_valid_before_utc:
        raise AttestationError("certificate not yet valid")
    if now > cert.not_valid_after_utc + grace:
        raise AttestationError("certificate expired")
    if revoked(cert):
        raise AttestationError("certificate revoked")
    return cert


# --- signed reports -------------------------------------------------------------------------


def canonical_bytes(document: Mapping[str, Any]) -> bytes:
    """One report, one encoding: keys sorted, no whitespace, UTF-8 as itself, no NaN."""
    return json.dumps(
        document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(
        encoding=serialization.Encoding.Raw, format=serialization.PublicFormat.Raw
    )
    return f"{ALGORITHM}:{hashlib.sha256(raw).digest()[:16].hex()}"


def _decode(block: Mapping[str, Any], field: str) -> bytes:
    value = block.get(field)
    if not isinstance(value, str):
        raise AttestationError(f"signature.{field}: must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as e:
        raise AttestationError(f"signature.{field}: not valid base64: {e}") from e


def verify_report(*, signature: Mapping[str, Any], public_key: Ed25519PublicKey) -> dict[str, Any]:
    """The report a signature block carries, once every check passed (docs/node-reports.md)."""
    if signature.get("algorithm") != ALGORITHM:
        raise AttestationError(
            f"signature.algorithm: {signature.get('algorithm')!r} is not ed25519"
        )
    if signature.get("keyId") != key_id(public_key):
        raise AttestationError(f"signature.keyId: {signature.get('keyId')!r} is not this key")
    payload = _decode(signature, "payload")
    value = _decode(signature, "value")
    try:
        public_key.verify(value, payload)
    except InvalidSignature as e:
        raise AttestationError("signature.value: does not verify over the payload") from e
    try:
        document = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise AttestationError(f"signature.payload: not UTF-8 JSON: {e}") from e
    if not isinstance(document, dict) or set(document) not in (
        REPORT_FIELDS,
        *PREVIOUS_REPORT_FIELDS,
    ):
        raise AttestationError(f"signature.payload: must be an object with {sorted(REPORT_FIELDS)}")
    try:
        canonical = canonical_bytes(document)
    except ValueError as e:
        raise AttestationError(f"signature.payload: {e}") from e
    if canonical != payload:
        raise AttestationError("signature.payload: not in canonical form")
    if document["purpose"] != PURPOSE:
        raise AttestationError(f"signature.payload.purpose: {document['purpose']!r}")
    if document["phase"] not in PHASES:
        raise AttestationError(f"signature.payload.phase: {document['phase']!r}")
    document.setdefault("cgroupParent", None)
    document.setdefault("intruders", [])
    return document


# --- attested bindings ----------------------------------------------------------------------

UNSIGNED = "unsigned report"
NO_CERTIFICATE = "the report carries no node certificate"
NOT_THIS_BINDING = "the signed report is not this allocation bound"
STALE = "stale report: not newer than the binding last accepted"
#: The reason a signed report of another phase (or allocation) is refused as a ``phase`` one.
NOT_THIS_REPORT = "the signed report is not this allocation {phase}"
STALE_REPORT = "stale report: not newer than the report last accepted"


def not_this(phase: str) -> str:
    """The reason a signature over anything but "this allocation is ``phase``" is refused."""
    return NOT_THIS_BINDING if phase == "Bound" else NOT_THIS_REPORT.format(phase=phase.lower())


@dataclass(frozen=True)
class AttestedBinding:
    """A bound report that checked out: what the node signed, exactly as received."""

    payload: bytes
    signature: bytes
    key_id: str
    certificate_pem: str
    serial: int
    cdi_devices: tuple[str, ...]
    env_file: str | None
    reported_at: str = ""
    #: The cgroup slice the node names for a hold with limits (kept only when it is exactly
    #: that allocation's own slice: the store decides).
    cgroup_parent: str | None = None
    #: Pods (``namespace/name``) holding the devices, and those of them outside the
    #: Reservation's namespace, as the node saw them (a ``kubernetes`` binding).
    pods: tuple[str, ...] = ()
    intruders: tuple[str, ...] = ()
    #: The phase the node signed (``Bound`` for a binding; any of ``PHASES``).
    phase: str = "Bound"
    #: ``Releasing``: when the release began (epoch ms), as signed.
    since: int | None = None


#: A signed report of any phase that checked out (the name says what it first was for).
AttestedReport = AttestedBinding


def _moment(reported_at: object) -> datetime | None:
    if not isinstance(reported_at, str):
        return None
    try:
        moment = datetime.fromisoformat(reported_at)
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else None


def is_stale(reported_at: str, previous: object) -> bool:
    """Whether a signed report's ``reportedAt`` is before ``previous`` (that of the last report
    accepted for the allocation); never when either is not an instant."""
    now, then = _moment(reported_at), _moment(previous)
    return now is not None and then is not None and now < then


def reported_at(payload: bytes | None) -> str | None:
    """The signed ``reportedAt`` of stored signed bytes, if any."""
    if payload is None:
        return None
    try:
        value = json.loads(payload.decode("utf-8")).get("reportedAt")
    except (UnicodeDecodeError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def is_replay(binding: AttestedBinding, previous_payload: bytes | None, *, lost: bool) -> bool:
    """Whether ``binding`` is an old signed report played again: its ``reportedAt`` is before
    that of the last bound report accepted for the allocation (``previous_payload``), or the
    same report once the binding was lost since. A node's genuine report of now is never one."""
    if previous_payload is None:
        return False
    try:
        previous = json.loads(previous_payload.decode("utf-8")).get("reportedAt")
    except (UnicodeDecodeError, ValueError, AttributeError):
        return False
    now, then = _moment(binding.reported_at), _moment(previous)
    if now is None or then is None:
        # Not comparable as instants: only the very same report can be told apart.
        return lost and binding.reported_at == previous
    return now < then or (lost and now == then)


@dataclass(frozen=True)
class Attestation:
    """The trust a binding needs: certificates chained to ``authorities``, expired at most
    ``grace`` ago."""

    authorities: tuple[x509.Certificate, ...]
    grace: timedelta = OFFLINE_GRACE

    def verify_binding(
        self,
        signature: Mapping[str, Any] | None,
        *,
        node_name: str,
        allocation_id: str,
        reservation_id: str,
        now: datetime,
        revoked: Callable[[x509.Certificate], bool],
    ) -> AttestedBinding:
        """The binding a signature block attests, once it is signed by a current, unrevoked
        certificate of ``node_name`` and says exactly "this allocation is bound"."""
        return self.verify_report(
            signature,
            phase="Bound",
            node_name=node_name,
            allocation_id=allocation_id,
            reservation_id=reservation_id,
            now=now,
            revoked=revoked,
        )

    def verify_report(
        self,
        signature: Mapping[str, Any] | None,
        *,
        phase: str,
        node_name: str,
        allocation_id: str,
        reservation_id: str,
        now: datetime,
        revoked: Callable[[x509.Certificate], bool],
    ) -> AttestedReport:
        """The report a signature block attests, once it is signed by a current, unrevoked
        certificate of ``node_name`` and says exactly "this allocation is ``phase``": a
        ``Failed`` or ``Released`` report changes what is booked as much as a ``Bound`` one
        does, so each is held to the same proof."""
        if not signature or not signature.get("value") or not signature.get("payload"):
            raise AttestationError(UNSIGNED)
        certificate = signature.get("certificate")
        if not isinstance(certificate, str) or not certificate:
            raise AttestationError(NO_CERTIFICATE)
        cert = verify_certificate(
            certificate,
            authorities=self.authorities,
            node_name=node_name,
            now=now,
            grace=self.grace,
            revoked=revoked,
        )
        public_key = cert.public_key()
        assert isinstance(public_key, Ed25519PublicKey)  # verify_certificate checked it
        document = verify_report(signature=signature, public_key=public_key)
        expected = {
            "nodeName": node_name,
            "allocationId": allocation_id,
            "reservationId": reservation_id,
            "phase": phase,
        }
        if any(document[field] != value for field, value in expected.items()):
            raise AttestationError(not_this(phase))
        cdi_devices = document["cdiDevices"]
        env_file = document["envFile"]
        if not isinstance(cdi_devices, list) or not all(isinstance(d, str) for d in cdi_devices):
            raise AttestationError("signature.payload.cdiDevices: must be a list of strings")
        if env_file is not None and not isinstance(env_file, str):
            raise AttestationError("signature.payload.envFile: must be a string or null")
        cgroup_parent = document["cgroupParent"]
        if cgroup_parent is not None and not isinstance(cgroup_parent, str):
            raise AttestationError("signature.payload.cgroupParent: must be a string or null")
        pods, intruders = document["pods"], document["intruders"]
        for field, value in (("pods", pods), ("intruders", intruders)):
            if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
                raise AttestationError(f"signature.payload.{field}: must be a list of strings")
        since = document["since"]
        if since is not None and (not isinstance(since, int) or isinstance(since, bool)):
            raise AttestationError("signature.payload.since: must be an integer or null")
        return AttestedBinding(
            payload=_decode(signature, "payload"),
            signature=_decode(signature, "value"),
            key_id=str(signature["keyId"]),
            certificate_pem=certificate,
            serial=cert.serial_number,
            cdi_devices=tuple(cdi_devices),
            env_file=env_file,
            reported_at=str(document["reportedAt"]),
            cgroup_parent=cgroup_parent,
            pods=tuple(pods),
            intruders=tuple(intruders),
            phase=phase,
            since=since,
        )
