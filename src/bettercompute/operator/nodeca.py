"""The node CA's certificate and key, kept in a Secret of the operator's namespace.

INTERIM COPY: branch i12-attest owns this module (``load_or_create_ca``); this is the smallest
form of it that the CSR signer needs to run and be tested before that module lands. On merge,
take i12-attest's file whole.

Why a Secret: every operator replica must sign with the same CA, and the verifier of node
reports must trust it after a restart. The first replica to find no Secret creates it; one
that loses that race (409) reads the winner's. A Secret created by cert-manager (``tls.crt``,
``tls.key``) is used as it is.

What it must never do: log the key, or replace a CA that exists (every node certificate would
stop verifying at once).
"""

from __future__ import annotations

import base64
import datetime as dt
from typing import Any

from bettercompute.core import attestation
from bettercompute.kube import resources
from bettercompute.kube.client import KubeClient, KubeError


def _decoded(secret: dict[str, Any], field: str) -> bytes:
    value = (secret.get("data") or {}).get(field)
    if not isinstance(value, str):
        raise attestation.AttestationError(f"the node CA Secret has no data.{field}")
    return base64.b64decode(value)


async def load_or_create_ca(
    client: KubeClient, namespace: str, secret_name: str
) -> attestation.CertificateAuthority:
    """The CA in ``namespace/secret_name``, created there when there is none."""
    secret = await client.get(resources.SECRETS, secret_name, namespace=namespace)
    if secret is None:
        authority = attestation.CertificateAuthority.generate(now=dt.datetime.now(dt.UTC))
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": secret_name, "namespace": namespace},
            "type": "kubernetes.io/tls",
            "data": {
                "tls.crt": base64.b64encode(authority.certificate_pem()).decode(),
                "tls.key": base64.b64encode(authority.key_pem()).decode(),
            },
        }
        try:
            await client.create(resources.SECRETS, body, namespace=namespace)
            return authority
        except KubeError as e:
            if e.status != 409:
                raise
        secret = await client.get(resources.SECRETS, secret_name, namespace=namespace)
        if secret is None:
            raise attestation.AttestationError(f"the node CA Secret {secret_name} vanished")
    return attestation.CertificateAuthority.from_pem(
        _decoded(secret, "tls.crt"), _decoded(secret, "tls.key")
    )
