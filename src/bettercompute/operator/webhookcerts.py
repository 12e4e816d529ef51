"""The admission webhooks' TLS certificate, made, shared and rotated by the operator itself.

Why it exists: with ``failurePolicy: Fail`` an expired webhook certificate stops every
Reservation from being created or changed. A certificate Helm generates is renewed only by the
next ``helm upgrade``; this module renews it long before it expires, without a restart.

How:

- A certificate authority and a serving certificate signed by it live in one ``kubernetes.io/tls``
  Secret in the operator's namespace (``tls.crt``, ``tls.key``, ``ca.crt``, ``ca.key``). The
  first replica to start creates it; a replica that loses the race (409) takes the winner's.
  Renewal replaces the Secret at the resourceVersion it read, so of two replicas renewing at
  once one writes and the other reads that one back: the Secret is the single writer's record.
- The serving certificate is renewed once a third of its lifetime is left (a year by default:
  about four months ahead); the authority, ten years by default, likewise. A renewed authority
  is published beside the old one (``ca.crt`` holds both until the old one expires), so a
  client that still holds the old bundle trusts the new certificate's chain either way.
- ``ca.crt`` goes into ``clientConfig.caBundle`` of every webhook of the named
  Mutating- and ValidatingWebhookConfigurations, written only where it differs.
- The server's ``ssl.SSLContext`` loads the new pair in place: handshakes from then on present
  it; connections already open keep theirs. No restart, no moment without a listener.

What it must never do: log a key, write anything but its own Secret and the caBundle of the
configurations it is given, or replace a Secret another writer changed since it was read.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import logging
import os
import ssl
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from bettercompute.core.tls import issue, new_authority
from bettercompute.kube import resources
from bettercompute.kube.client import KubeClient, KubeError

log = logging.getLogger(__name__)

Clock = Callable[[], dt.datetime]

SERVING_LIFETIME = dt.timedelta(days=365)
CA_LIFETIME = dt.timedelta(days=3650)
#: Renew once this share of a certificate's lifetime is left.
RENEW_AT_REMAINING = 1 / 3


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class Bundle:
    """What the Secret holds: the serving pair, the authority's pair, and the CA bundle
    (the current authority first, then one still trusted while it lasts)."""

    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes
    ca_key_pem: bytes
    ca_bundle: bytes

    def serving(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)

    def authority(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.ca_pem)


# --- making certificates: ``core.tls`` (new_authority, issue) ------------------------------------


def due(certificate: x509.Certificate, *, now: dt.datetime) -> bool:
    """Whether a certificate is to be renewed: a third of its lifetime or less is left."""
    start, end = certificate.not_valid_before_utc, certificate.not_valid_after_utc
    return end - now <= (end - start) * RENEW_AT_REMAINING


def _certificates(pem: bytes) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError:
        return []


def renewed(
    current: Bundle | None,
    *,
    names: Sequence[str],
    now: dt.datetime,
    serving_lifetime: dt.timedelta = SERVING_LIFETIME,
    ca_lifetime: dt.timedelta = CA_LIFETIME,
) -> Bundle | None:
    """The bundle to store instead of ``current``, or ``None`` when ``current`` stands: a new
    one when there is none, a new authority when it is due, a new serving certificate when it
    is due, names a name it lacks, or was not signed by the current authority."""
    if current is not None:
        try:
            authority, serving = current.authority(), current.serving()
        except ValueError:
            current = None  # unreadable: start again
    if current is None:
        ca_pem, ca_key_pem = new_authority(now=now, lifetime=ca_lifetime)
        cert_pem, key_pem = issue(
            ca_pem=ca_pem, ca_key_pem=ca_key_pem, names=names, now=now, lifetime=serving_lifetime
        )
        return Bundle(cert_pem, key_pem, ca_pem, ca_key_pem, ca_pem)
    ca_pem, ca_key_pem, bundle = current.ca_pem, current.ca_key_pem, current.ca_bundle
    fresh_authority = due(authority, now=now)
    if fresh_authority:
        ca_pem, ca_key_pem = new_authority(now=now, lifetime=ca_lifetime)
    # The CA bundle: the current authority, and any other still valid (the one it replaced).
    kept = [
        ca_pem,
        *(
            c.public_bytes(serialization.Encoding.PEM)
            for c in [*_certificates(bundle), authority]
            if c.not_valid_after_utc > now
        ),
    ]
    ca_bundle = b"".join(dict.fromkeys(kept))
    covered = set(_names_of(serving)) >= set(names)
    if not fresh_authority and not due(serving, now=now) and covered and ca_bundle == bundle:
        return None
    if fresh_authority or due(serving, now=now) or not covered:
        cert_pem, key_pem = issue(
            ca_pem=ca_pem, ca_key_pem=ca_key_pem, names=names, now=now, lifetime=serving_lifetime
        )
    else:
        cert_pem, key_pem = current.cert_pem, current.key_pem
    return Bundle(cert_pem, key_pem, ca_pem, ca_key_pem, ca_bundle)


def _names_of(certificate: x509.Certificate) -> list[str]:
    try:
        sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [
        *sans.get_values_for_type(x509.DNSName),
        *(str(a) for a in sans.get_values_for_type(x509.IPAddress)),
    ]


# --- the Secret --------------------------------------------------------------------------------


def bundle_of(secret: dict[str, Any] | None) -> Bundle | None:
    """The bundle a Secret holds; ``None`` for a missing or incomplete one."""
    data = (secret or {}).get("data") or {}
    try:
        fields = {
            key: base64.b64decode(data[key], validate=True)
            for key in ("tls.crt", "tls.key", "ca.crt", "ca.key")
        }
    except (KeyError, TypeError, ValueError):
        return None
    authorities = _certificates(fields["ca.crt"])
    if not authorities:
        return None
    return Bundle(
        cert_pem=fields["tls.crt"],
        key_pem=fields["tls.key"],
        ca_pem=authorities[0].public_bytes(serialization.Encoding.PEM),
        ca_key_pem=fields["ca.key"],
        ca_bundle=fields["ca.crt"],
    )


def secret_manifest(bundle: Bundle, *, name: str, namespace: str) -> dict[str, Any]:
    def b64(value: bytes) -> str:
        return base64.b64encode(value).decode("ascii")

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/component": "webhook-certificate"},
        },
        "data": {
            "tls.crt": b64(bundle.cert_pem),
            "tls.key": b64(bundle.key_pem),
            "ca.crt": b64(bundle.ca_bundle),
            "ca.key": b64(bundle.ca_key_pem),
        },
    }


class WebhookCertificates:
    """Keeps one Secret's certificate current, the server's context loaded with it, and the
    webhook configurations trusting its authority."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        namespace: str,
        secret_name: str,
        names: Sequence[str],
        configurations: Sequence[str],
        clock: Clock = utc_now,
        serving_lifetime: dt.timedelta = SERVING_LIFETIME,
        ca_lifetime: dt.timedelta = CA_LIFETIME,
    ) -> None:
        if not names:
            raise ValueError("the webhook certificate needs at least one name")
        self.kube = kube
        self.namespace = namespace
        self.secret_name = secret_name
        self.names = list(names)
        self.configurations = list(configurations)
        self.clock = clock
        self.serving_lifetime = serving_lifetime
        self.ca_lifetime = ca_lifetime
        self.context = ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH)
        self.current: Bundle | None = None
        self._files = Path(tempfile.mkdtemp(prefix="bcd-webhook-"))
        self._generation = 0
        self.rotations = 0

    @property
    def where(self) -> str:
        return f"Secret {self.namespace}/{self.secret_name}"

    async def ensure(self) -> Bundle:
        """The Secret's bundle, made or renewed when due (the Secret's single writer wins)."""
        for _ in range(5):
            secret = await self.kube.get(
                resources.SECRETS, self.secret_name, namespace=self.namespace
            )
            stored = bundle_of(secret)
            wanted = renewed(
                stored,
                names=self.names,
                now=self.clock(),
                serving_lifetime=self.serving_lifetime,
                ca_lifetime=self.ca_lifetime,
            )
            if wanted is None:
                assert stored is not None
                return stored
            manifest = secret_manifest(wanted, name=self.secret_name, namespace=self.namespace)
            try:
                if secret is None:
                    await self.kube.create(resources.SECRETS, manifest, namespace=self.namespace)
                else:
                    manifest["metadata"]["resourceVersion"] = (secret.get("metadata") or {}).get(
                        "resourceVersion"
                    )
                    written = await self.kube.replace(
                        resources.SECRETS, self.secret_name, manifest, namespace=self.namespace
                    )
                    if written is None:
                        continue  # deleted meanwhile: make it again
            except KubeError as e:
                if e.status == 409:
                    continue  # another replica wrote first: read theirs
                raise
            log.info("%s: a webhook certificate valid until %s", self.where, _end(wanted))
            return wanted
        raise KubeError(status=409, reason="Conflict", message=f"{self.where}: kept changing")

    def load(self, bundle: Bundle) -> None:
        """The server presents ``bundle`` from its next handshake on.

        Each pair gets files of its own: the first pair's files are what kopf's server was
        started with, and kopf restarts its listener when those change, which an in-place
        load makes needless."""
        cert, key = self._pair_files(self._generation)
        descriptor = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(bundle.key_pem)
        cert.write_bytes(bundle.cert_pem)
        self.context.load_cert_chain(str(cert), str(key))
        if self._generation > 1:  # the one before, unless it is kopf's first pair
            for old in self._pair_files(self._generation - 1):
                with contextlib.suppress(OSError):
                    old.unlink()
        self._generation += 1

    def _pair_files(self, generation: int) -> tuple[Path, Path]:
        return self._files / f"tls-{generation}.crt", self._files / f"tls-{generation}.key"

    async def publish(self, bundle: Bundle) -> None:
        """``caBundle`` of every webhook of the named configurations, where it differs."""
        ca_bundle = base64.b64encode(bundle.ca_bundle).decode("ascii")
        for resource in (resources.MUTATING_WEBHOOKS, resources.VALIDATING_WEBHOOKS):
            for name in self.configurations:
                for _ in range(5):
                    found = await self.kube.get(resource, name)
                    if found is None:
                        break
                    hooks = found.get("webhooks") or []
                    if all(
                        (h.get("clientConfig") or {}).get("caBundle") == ca_bundle for h in hooks
                    ):
                        break
                    for hook in hooks:
                        hook.setdefault("clientConfig", {})["caBundle"] = ca_bundle
                    try:
                        await self.kube.replace(resource, name, found)
                        break
                    except KubeError as e:
                        if e.status != 409:
                            raise

    async def refresh(self) -> bool:
        """Ensure, load and publish; ``True`` when the certificate served changed."""
        bundle = await self.ensure()
        changed = self.current is None or bundle.cert_pem != self.current.cert_pem
        if changed:
            self.load(bundle)
            if self.current is not None:
                self.rotations += 1
                log.info("the webhook server presents a renewed certificate from now on")
        await self.publish(bundle)
        self.current = bundle
        return changed

    async def run(self, *, interval_s: float = 3600.0) -> None:
        """Refresh every ``interval_s`` (another replica's renewal is picked up too)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.refresh()
            except KubeError as e:
                log.warning("%s: could not refresh the webhook certificate: %s", self.where, e)

    def close(self) -> None:
        for path in self._files.glob("tls-*"):
            with contextlib.suppress(OSError):
                path.unlink()
        with contextlib.suppress(OSError):
            self._files.rmdir()

    def files(self) -> tuple[Path, Path]:
        """The first pair's files, for kopf's server to load at start into ``context``."""
        return self._pair_files(0)


def _end(bundle: Bundle) -> str:
    return bundle.serving().not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ")
