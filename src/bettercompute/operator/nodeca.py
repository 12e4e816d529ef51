"""The node-report certificate authority: kept in a Secret, created once, shared by replicas.

Why it exists: attested bindings trust a node's report only when the node's certificate chains
to this authority (core.attestation). The operator keeps the authority in a ``kubernetes.io/tls``
Secret (``tls.crt``, ``tls.key``) in its own namespace. The first replica to start creates it;
a replica that loses the race (409) reads the winner's back, so every replica trusts the same
authority. A platform team can instead point the operator at a Secret it made itself (for
example one cert-manager issued with an Ed25519 key); then the operator only reads it.

What it must never do: log the key, write the Secret anywhere but its own namespace, or replace
an existing authority (that would silently distrust every node certificate).
"""

from __future__ import annotations

import base64
import datetime as dt
from typing import Any

from bettercompute.core.attestation import AttestationError, CertificateAuthority
from bettercompute.kube import resources
from bettercompute.kube.client import KubeClient, KubeError


class NodeAuthorityError(Exception):
    """The authority's Secret is there but unusable; the message names it and why."""


def _decoded(secret: dict[str, Any], field: str, where: str) -> bytes:
    value = (secret.get("data") or {}).get(field)
    if not isinstance(value, str) or not value:
        raise NodeAuthorityError(f"{where}: has no data[{field!r}]")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError as e:
        raise NodeAuthorityError(f"{where}: data[{field!r}] is not base64") from e


def _read(secret: dict[str, Any], where: str) -> CertificateAuthority:
    try:
        return CertificateAuthority.from_pem(
            _decoded(secret, "tls.crt", where), _decoded(secret, "tls.key", where)
        )
    except AttestationError as e:
        raise NodeAuthorityError(f"{where}: {e.reason}") from e


def secret_manifest(
    authority: CertificateAuthority, *, name: str, namespace: str
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/component": "node-report-ca"},
        },
        "data": {
            "tls.crt": base64.b64encode(authority.certificate_pem()).decode("ascii"),
            "tls.key": base64.b64encode(authority.key_pem()).decode("ascii"),
        },
    }


async def load_or_create_ca(
    client: KubeClient,
    namespace: str,
    secret_name: str,
    *,
    create: bool = True,
    now: dt.datetime | None = None,
) -> CertificateAuthority:
    """The authority in Secret ``namespace/secret_name``; a new one stored there if there is
    none (unless ``create`` is off: then a missing Secret is an error)."""
    where = f"Secret {namespace}/{secret_name}"
    existing = await client.get(resources.SECRETS, secret_name, namespace=namespace)
    if existing is not None:
        return _read(existing, where)
    if not create:
        raise NodeAuthorityError(f"{where}: not found (it is expected to exist)")
    authority = CertificateAuthority.generate(now=now or dt.datetime.now(dt.UTC))
    try:
        await client.create(
            resources.SECRETS,
            secret_manifest(authority, name=secret_name, namespace=namespace),
            namespace=namespace,
        )
    except KubeError as e:
        if e.status != 409:
            raise
        # Another replica created it first: trust that one, never ours.
        winner = await client.get(resources.SECRETS, secret_name, namespace=namespace)
        if winner is None:
            raise NodeAuthorityError(f"{where}: created by someone else, then gone") from e
        return _read(winner, where)
    return authority
