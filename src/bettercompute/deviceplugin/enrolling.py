"""The node's certificate: asked for through the Kubernetes CSR API, kept, and renewed.

Why it exists: a signed report is only worth something when a verifier knows the signing key
is this node's. The node agent therefore asks the operator's CA, through a
``certificates.k8s.io/v1`` ``CertificateSigningRequest`` with signer ``bcd.dev/node-report``,
for a certificate binding its Ed25519 key (``signing.NodeKey``, which never leaves the node)
to its node name and the role ``node``. The API server records who asked (the agent's
node-bound service-account token), and the operator signs only for that node's own agent.

The cycle (``Enroller.run``):

1. a certificate saved beside the key that is still this key's and this node's, and not past
   its renewal time, is used as it is (a restart asks for nothing);
2. otherwise a CSR named ``bcd-node-<node>-<key id prefix>-<predecessor>-<attempt>``: the
   same node, key, previous certificate and attempt give the same name, so a restarted agent
   finds the request it made instead of making another;
3. it waits (watching that one object) for ``status.certificate``; checks that it is for this
   key, this node and the role ``node``; saves it (mode 0644, the key stays 0600) and hands it
   to the converger, which sends it with each report;
4. it sleeps until 2/3 of the certificate's lifetime and starts again at 2;
5. meanwhile it reads its GPUNode every ``check_s``: when the operator revoked the node's
   certificates (``bcd.dev/revoked-certificates-at``) after the one in use was issued, it
   replaces its key with a new one (``key_file``; a revoked key may have leaked, so it is never
   enrolled again) and enrols at once.

A ``Denied`` or ``Failed`` request, or a certificate that does not match, is logged and tried
again under the next attempt's name after a growing wait; an API error is retried the same
way. Nothing here ends the process.

What it must never do: send the private key anywhere (only the request, which holds the
public key), use a certificate that is not for its own key and node, or give up.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import datetime as dt
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from bettercompute import supervising
from bettercompute.core import attestation
from bettercompute.deviceplugin.signing import NodeKey, SigningError
from bettercompute.kube import names, resources
from bettercompute.kube.client import KubeClient, KubeError

log = logging.getLogger(__name__)

#: What a node certificate is asked for; the operator may give less.
LIFETIME = attestation.NODE_CERTIFICATE_LIFETIME
#: A certificate is renewed once this share of its lifetime has passed.
RENEW_AT = 2 / 3
#: Usages the request names: the certificate only signs reports.
USAGES = ("digital signature",)
#: The longest a wait for the operator lasts before the request is read again.
WAIT_SECONDS = 30.0
#: How often the node's GPUNode is read for a revocation.
CHECK_SECONDS = 60.0


class Refused(Exception):
    """The request was denied or failed, or its certificate is not this node's."""


@dataclasses.dataclass(frozen=True)
class Issued:
    """A certificate the node may use: the PEM as issued, and when to renew it."""

    pem: bytes
    certificate: x509.Certificate

    @property
    def not_before(self) -> dt.datetime:
        return self.certificate.not_valid_before_utc

    @property
    def not_after(self) -> dt.datetime:
        return self.certificate.not_valid_after_utc

    @property
    def renew_at(self) -> dt.datetime:
        return self.not_before + (self.not_after - self.not_before) * RENEW_AT

    @property
    def fingerprint(self) -> str:
        der = self.certificate.public_bytes(serialization.Encoding.DER)
        return hashlib.sha256(der).hexdigest()


def certificate_path(node_key: Path) -> Path:
    """Where the certificate of the key in ``node_key`` is kept: beside it."""
    return node_key.with_name("node-cert.pem")


def csr_name(*, node_name: str, key: NodeKey, predecessor: Issued | None, attempt: int) -> str:
    """The request's name: the same for the same node, key, previous certificate and attempt.

    A valid DNS subdomain (a node name is one), at most 253 characters."""
    key_part = key.key_id.split(":", 1)[-1][:12]
    before = predecessor.fingerprint[:8] if predecessor is not None else "first"
    tail = f"-{key_part}-{before}-{attempt}"
    return f"bcd-node-{node_name[: 253 - len('bcd-node-') - len(tail)]}{tail}".replace(".-", "-")


def check_issued(pem: bytes, *, key: NodeKey, node_name: str, now: dt.datetime) -> Issued:
    """``pem`` as a certificate this node may use; ``Refused`` saying why not."""
    try:
        chain = x509.load_pem_x509_certificates(pem)
    except ValueError as e:
        raise Refused(f"the certificate is not PEM: {e}") from e
    certificate = chain[0]
    raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
    try:
        theirs = certificate.public_key().public_bytes(*raw)
    except ValueError as e:
        raise Refused("the certificate's key is not Ed25519") from e
    if theirs != key.public_key.public_bytes(*raw):
        raise Refused("the certificate is not for this node's key")
    subject = certificate.subject
    common = [a.value for a in subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    roles = [a.value for a in subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    if common != [node_name]:
        raise Refused(f"the certificate names {common!r}, not node {node_name!r}")
    if roles != [attestation.ROLE_NODE]:
        raise Refused(f"the certificate's role is {roles!r}, not {attestation.ROLE_NODE!r}")
    issued = Issued(pem=pem, certificate=certificate)
    if issued.not_after <= now:
        raise Refused(f"the certificate expired at {issued.not_after.isoformat()}")
    return issued


def save(path: Path, pem: bytes) -> None:
    """Replace the certificate file atomically, mode 0644 (a certificate is public)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _conditions(obj: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    status = obj.get("status") or {}
    return {
        str(c.get("type")): c
        for c in status.get("conditions") or ()
        if isinstance(c, Mapping) and c.get("status") == "True"
    }


def outcome(obj: Mapping[str, Any]) -> bytes | None:
    """The issued PEM of a decided request, ``None`` while undecided; ``Refused`` when denied."""
    conditions = _conditions(obj)
    for kind in ("Denied", "Failed"):
        if kind in conditions:
            said = conditions[kind]
            raise Refused(f"{kind}: {said.get('reason') or ''}: {said.get('message') or ''}")
    encoded = (obj.get("status") or {}).get("certificate")
    if "Approved" not in conditions or not encoded:
        return None
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, TypeError) as e:
        raise Refused(f"status.certificate is not base64: {e}") from e


class Enroller:
    """Keeps the node holding a current certificate for its key (see the module docstring)."""

    def __init__(
        self,
        *,
        client: KubeClient,
        node_name: str,
        key: NodeKey,
        certificate_file: Path,
        on_certificate: Callable[[bytes], None] = lambda _: None,
        key_file: Path | None = None,
        on_key: Callable[[NodeKey], None] = lambda _: None,
        lifetime: dt.timedelta = LIFETIME,
        wait_s: float = WAIT_SECONDS,
        check_s: float = CHECK_SECONDS,
        backoff: supervising.Backoff | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.node_name = node_name
        self.key = key
        self.certificate_file = certificate_file
        self.on_certificate = on_certificate
        #: Where the key lives, to replace it after a revocation (None: never replaced).
        self.key_file = key_file
        self.on_key = on_key
        self.lifetime = lifetime
        self.wait_s = wait_s
        self.check_s = check_s
        self.backoff = backoff or supervising.Backoff(first_s=5.0, max_s=300.0)
        self.clock = clock
        #: The certificate in use, once there is one.
        self.current: Issued | None = None
        #: Set each time a new certificate is in use.
        self.renewed = asyncio.Event()

    def now(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self.clock(), tz=dt.UTC)

    async def run(self) -> None:
        """Hold a certificate and renew it, until cancelled."""
        self.current = await asyncio.to_thread(self._saved)
        if self.current is not None:
            self._use(self.current, from_disk=True)
        while True:
            if self.current is not None and await self._until_renewal_or_revocation():
                await self._replace_key()
            self._use(await self.obtain(), from_disk=False)

    async def _until_renewal_or_revocation(self) -> bool:
        """Wait until the certificate is due for renewal (False) or revoked (True)."""
        assert self.current is not None
        while True:
            if await self._revoked(self.current):
                return True
            left = (self.current.renew_at - self.now()).total_seconds()
            if left <= 0:
                return False
            await asyncio.sleep(min(left, self.check_s))

    async def _revoked(self, issued: Issued) -> bool:
        """Whether the operator revoked the node's certificates after ``issued`` was issued."""
        try:
            node = await self.client.get(resources.GPUNODES, self.node_name)
        except KubeError as e:
            log.warning("cannot read GPUNode %s for revocations: %s", self.node_name, e)
            return False
        annotations = ((node or {}).get("metadata") or {}).get("annotations") or {}
        stamp = annotations.get(names.REVOKED_CERTIFICATES_AT)
        if not stamp:
            return False
        try:
            revoked = dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
        except ValueError:
            what = names.REVOKED_CERTIFICATES_AT
            log.warning("GPUNode %s: %s=%r is not a time", self.node_name, what, stamp)
            return False
        if revoked.tzinfo is None:
            revoked = revoked.replace(tzinfo=dt.UTC)
        return attestation.issued_at(issued.certificate) <= revoked

    async def _replace_key(self) -> None:
        """A new key for the next certificate: the revoked one's may have leaked."""
        if self.key_file is None:
            log.warning("node certificates revoked; enrolling again with the same key")
            return
        while True:
            try:
                self.key = await asyncio.to_thread(NodeKey.replace, self.key_file)
                break
            except SigningError as e:
                log.error("node certificates revoked, but %s; retrying", e)
                await self.backoff.wait()
        self.on_key(self.key)
        log.warning("node certificates revoked: new node key %s, enrolling again", self.key.key_id)

    def _saved(self) -> Issued | None:
        """The certificate on disk, when it is still good to use."""
        try:
            pem = self.certificate_file.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("cannot read the node certificate %s: %s", self.certificate_file, e)
            return None
        try:
            return check_issued(pem, key=self.key, node_name=self.node_name, now=self.now())
        except Refused as e:
            log.info("not using the saved node certificate %s: %s", self.certificate_file, e)
            return None

    def _use(self, issued: Issued, *, from_disk: bool) -> None:
        self.current = issued
        self.on_certificate(issued.pem)
        self.renewed.set()
        self.renewed = asyncio.Event()
        log.info(
            "node certificate %s in use until %s (renewal at %s)%s",
            issued.fingerprint[:16],
            issued.not_after.isoformat(),
            issued.renew_at.isoformat(),
            " (kept from before)" if from_disk else "",
        )

    async def obtain(self) -> Issued:
        """A new certificate, however many requests and waits it takes."""
        attempt = 0
        predecessor = self.current
        while True:
            name = csr_name(
                node_name=self.node_name, key=self.key, predecessor=predecessor, attempt=attempt
            )
            try:
                pem = await self._decided(name)
                issued = check_issued(pem, key=self.key, node_name=self.node_name, now=self.now())
                await asyncio.to_thread(save, self.certificate_file, pem)
            except Refused as e:
                log.warning("node certificate request %s refused: %s; asking again", name, e)
                attempt += 1
            except (KubeError, OSError) as e:
                log.warning("node certificate request %s: %s; retrying", name, e)
            else:
                self.backoff.reset()
                return issued
            await self.backoff.wait()

    def _request_body(self, name: str) -> dict[str, Any]:
        request = self.key.certificate_request(node_name=self.node_name, role=attestation.ROLE_NODE)
        return {
            "apiVersion": "certificates.k8s.io/v1",
            "kind": "CertificateSigningRequest",
            "metadata": {"name": name, "labels": {names.NODE_LABEL: self.node_name}},
            "spec": {
                "request": base64.b64encode(request).decode("ascii"),
                "signerName": names.NODE_REPORT_SIGNER,
                "usages": list(USAGES),
                "expirationSeconds": int(self.lifetime.total_seconds()),
            },
        }

    async def _decided(self, name: str) -> bytes:
        """The certificate of request ``name`` (created when missing), once issued."""
        csrs = resources.CERTIFICATE_SIGNING_REQUESTS
        obj = await self.client.get(csrs, name)
        if obj is None:
            try:
                obj = await self.client.create(csrs, self._request_body(name))
                log.info("asked for a node certificate: CertificateSigningRequest %s", name)
            except KubeError as e:
                if e.status != 409:  # made by this agent before a restart: read it below
                    raise
        while True:
            if obj is None:
                obj = await self.client.get(csrs, name)
                if obj is None:
                    raise Refused(f"CertificateSigningRequest {name} was deleted")
            pem = outcome(obj)
            if pem is not None:
                return pem
            version = (obj.get("metadata") or {}).get("resourceVersion")
            obj = await self._next_change(name, version)

    async def _next_change(self, name: str, version: str | None) -> dict[str, Any] | None:
        """The request after its next change, or ``None`` to read it again (after at most
        ``wait_s``)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.wait_s):
                async for kind, obj in self.client.watch(
                    resources.CERTIFICATE_SIGNING_REQUESTS,
                    fields={"metadata.name": name},
                    resource_version=version,
                    timeout_s=max(1, int(self.wait_s)),
                ):
                    if kind in ("ADDED", "MODIFIED"):
                        return obj
                    if kind == "DELETED":
                        return None
        return None
