"""The node's Ed25519 key and the signed form of its allocation reports (attested bindings).

Why it exists: the operator relays what a node reports about an allocation, so on its own a
compromised operator could claim a binding the node never made. The node therefore signs each
report with a key only it holds (the guide's "attested bindings", purpose ``attested-report``),
and whoever checks a binding verifies the signature with the node's public key. ``converging``
signs every report it hands to the reporter; a verifier needs only ``verify``.

The format (also in docs/node-reports.md):

- **Key**: Ed25519, stored as an unencrypted PKCS#8 PEM file of mode 0600.
  ``NodeKey.load_or_create`` reads it, or generates one and creates the file atomically (a
  temporary file in the same directory, hard-linked into place, so two starting agents never end
  up with different keys). A key file readable by group or others is refused.
- **Key id**: ``ed25519:`` followed by the lowercase hex of the first 16 bytes of the SHA-256 of
  the raw 32-byte public key (32 hex digits), e.g. ``ed25519:3f9a…``.
- **Payload** (the canonical bytes): a JSON object with exactly the keys ``purpose``
  (``"attested-report"``), ``nodeName``, ``allocationId``, ``reservationId``, ``phase``
  (``Bound`` | ``Failed`` | ``Releasing`` | ``Released``), ``cdiDevices`` (list of strings),
  ``envFile`` (string, or null unless Bound), ``cgroupParent`` (the cgroup slice of a bound
  hold with limits, else null), ``pods`` (list of ``namespace/name``, sorted),
  ``since`` (epoch ms, or null unless Releasing) and ``reportedAt`` (RFC 3339 UTC with
  milliseconds, ``2026-12-02T14:00:00.000Z``); encoded with keys sorted, no whitespace
  (``","`` and ``":"`` separators), non-ASCII characters as UTF-8 rather than escapes.
- **Signature block** (the DeviceAllocation's ``status.signature``): ``{keyId, algorithm:
  "ed25519", payload: base64(payload), value: base64(Ed25519 signature of payload)}``, standard
  base64 with padding.

``verify`` checks the algorithm, the key id against the key, the signature over the payload
bytes exactly as received, that those bytes are canonical (so one report has one encoding) and
that the object has exactly the fields above, or those of the previous format without
``cgroupParent`` (an agent not yet upgraded signs them; read as null); any failure is
``SignatureError`` with the reason.

What it must never do: write the private key anywhere but its file, log it, or accept a report
it cannot verify.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from bettercompute.core import attestation

# The format lives in core.attestation, shared with every verifier; re-exported for callers.
ALGORITHM = attestation.ALGORITHM
PURPOSE = attestation.PURPOSE
PHASES = attestation.PHASES
REPORT_FIELDS = attestation.REPORT_FIELDS
canonical_bytes = attestation.canonical_bytes
key_id = attestation.key_id
PREVIOUS_REPORT_FIELDS = attestation.PREVIOUS_REPORT_FIELDS


class SigningError(Exception):
    """The node key cannot be loaded or stored; the message names the file and why."""


class SignatureError(Exception):
    """A signed report that does not verify; the message says which check failed."""


@dataclasses.dataclass(frozen=True)
class Report:
    """What a node says about one allocation, before it is signed."""

    node_name: str
    allocation_id: str
    reservation_id: str
    phase: str
    cdi_devices: tuple[str, ...] = ()
    env_file: str | None = None
    cgroup_parent: str | None = None
    pods: tuple[str, ...] = ()
    intruders: tuple[str, ...] = ()
    since: int | None = None
    reported_at: str = ""

    def document(self) -> dict[str, Any]:
        return {
            "purpose": PURPOSE,
            "nodeName": self.node_name,
            "allocationId": self.allocation_id,
            "reservationId": self.reservation_id,
            "phase": self.phase,
            "cdiDevices": list(self.cdi_devices),
            "envFile": self.env_file,
            "cgroupParent": self.cgroup_parent,
            "pods": sorted(self.pods),
            "intruders": sorted(self.intruders),
            "since": self.since,
            "reportedAt": self.reported_at,
        }


def rfc3339(epoch_ms: int) -> str:
    """``2026-12-02T14:00:00.000Z``: UTC, millisecond precision."""
    moment = datetime.datetime.fromtimestamp(epoch_ms / 1000, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{epoch_ms % 1000:03d}Z"


class NodeKey:
    """The node's private key, and what it signs."""

    def __init__(self, *, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self.public_key = private_key.public_key()
        self.key_id = key_id(self.public_key)

    @classmethod
    def generate(cls) -> NodeKey:
        return cls(private_key=Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: Path) -> NodeKey:
        try:
            mode = path.stat().st_mode
            data = path.read_bytes()
        except OSError as e:
            raise SigningError(f"node key {path}: cannot read: {e.strerror or e}") from e
        if mode & 0o077:
            raise SigningError(
                f"node key {path}: readable by others (mode {mode & 0o777:o}); chmod 600 it"
            )
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise SigningError(f"node key {path}: not an unencrypted PEM private key: {e}") from e
        if not isinstance(key, Ed25519PrivateKey):
            raise SigningError(f"node key {path}: not an Ed25519 key ({type(key).__name__})")
        return cls(private_key=key)

    @classmethod
    def load_or_create(cls, path: Path) -> NodeKey:
        """The key in ``path``; a new one, stored there with mode 0600, if there is none."""
        if path.exists():
            return cls.load(path)
        # link, not rename: if another agent stored its key first, keep that one.
        _store_private(path, cls.generate(), keep_existing=True)
        return cls.load(path)

    @classmethod
    def replace(cls, path: Path) -> NodeKey:
        """A new key in place of the one in ``path`` (mode 0600, atomically): the old one's
        certificates were revoked, and a key that may have leaked is not enrolled again."""
        _store_private(path, cls.generate(), keep_existing=False)
        return cls.load(path)

    def private_pem(self) -> bytes:
        return self._private_key.private_bytes(
            encoding=serialization.Encoding.PEM,
            format=serialization.PrivateFormat.PKCS8,
            encryption_algorithm=serialization.NoEncryption(),
        )

    def public_pem(self) -> bytes:
        return self.public_key.public_bytes(
            encoding=serialization.Encoding.PEM,
            format=serialization.PublicFormat.SubjectPublicKeyInfo,
        )

    def certificate_request(self, *, node_name: str, role: str) -> bytes:
        """A PEM certificate request for this key, naming ``node_name`` and ``role`` (the
        operator's CA answers it with the node certificate; see ``enrolling``)."""
        return attestation.certificate_request(self._private_key, node_name=node_name, role=role)

    def sign(self, report: Report) -> dict[str, str]:
        """The signature block of ``report``."""
        payload = canonical_bytes(report.document())
        return {
            "keyId": self.key_id,
            "algorithm": ALGORITHM,
            "payload": base64.b64encode(payload).decode("ascii"),
            "value": base64.b64encode(self._private_key.sign(payload)).decode("ascii"),
        }


def _store_private(path: Path, key: NodeKey, *, keep_existing: bool) -> None:
    """Write ``key`` to ``path`` with mode 0600, never half-written: through a temporary file in
    the same directory, then hard-linked into place (``keep_existing``: a key another agent
    stored first stays) or renamed over the old one."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:  # mkstemp creates it 0600
                f.write(key.private_pem())
                f.flush()
                os.fsync(f.fileno())
            if keep_existing:
                with contextlib.suppress(FileExistsError):
                    os.link(tmp, path)
            else:
                os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    except OSError as e:
        raise SigningError(f"node key {path}: cannot store: {e.strerror or e}") from e


def verify(*, signature: Mapping[str, Any], public_key: Ed25519PublicKey) -> dict[str, Any]:
    """The report a signature block carries, once every check passed (core.attestation)."""
    try:
        return attestation.verify_report(signature=signature, public_key=public_key)
    except attestation.AttestationError as e:
        raise SignatureError(e.reason) from e


def public_key_from_pem(data: bytes) -> Ed25519PublicKey:
    """A verifier's copy of a node's public key."""
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as e:
        raise SignatureError(f"public key: not a PEM public key: {e}") from e
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(f"public key: not Ed25519 ({type(key).__name__})")
    return key
