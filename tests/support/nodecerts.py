"""A test node-report authority, and certificates from it for the nodes tests run.

Why: with attested bindings a node's bound report counts only when its certificate chains to a
trusted authority. Tests that go through the operator or ``dev`` give their nodes genuine
certificates from this authority rather than switching verification off. Its certificates are
valid for twenty years so tests that move business time stay inside them; tests of expiry issue
their own short-lived ones.
"""

from __future__ import annotations

import datetime as dt

from bettercompute.core.attestation import (
    Attestation,
    CertificateAuthority,
    certificate_pem,
)
from bettercompute.deviceplugin.signing import NodeKey, Report

LONG = dt.timedelta(days=365 * 20)

AUTHORITY = CertificateAuthority.generate(
    now=dt.datetime.now(dt.UTC) - dt.timedelta(days=1), name="bcd test node-report CA"
)
TRUST = Attestation(authorities=(AUTHORITY.certificate,))


_KEYS: dict[str, tuple[NodeKey, str]] = {}


def node_identity(node_name: str) -> tuple[NodeKey, str]:
    """One key and certificate per node name for the whole test session (like a real node's,
    which outlive a test)."""
    if node_name not in _KEYS:
        key = NodeKey.generate()
        _KEYS[node_name] = (key, certify(node_name, key))
    return _KEYS[node_name]


def sign(node_name: str, report: Report) -> dict[str, str]:
    """The signature block ``node_name``'s agent would write for ``report``."""
    key, certificate = node_identity(node_name)
    return {**key.sign(report), "certificate": certificate}


def certify(
    node_name: str,
    key: NodeKey,
    *,
    authority: CertificateAuthority = AUTHORITY,
    now: dt.datetime | None = None,
    lifetime: dt.timedelta = LONG,
    role: str = "node",
) -> str:
    """A PEM certificate for ``key`` as ``node_name``'s, from ``authority``."""
    cert = authority.issue(
        public_key=key.public_key,
        node_name=node_name,
        role=role,
        now=now or dt.datetime.now(dt.UTC),
        lifetime=lifetime,
    )
    return certificate_pem(cert).decode("ascii")
