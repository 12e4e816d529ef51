"""Noticing that the webhook server's certificate was renewed.

Why: kopf's webhook server reads its certificate once, at start. cert-manager (or the chart's
Helm-generated secret on upgrade) renews it in the mounted Secret, and a server still serving
the old one would fail every admission once it expires; with ``failurePolicy: Fail`` that
stops every Reservation being created. The operator therefore ends when the files change, and
Kubernetes starts it again with the new certificate (the chart runs two peered replicas behind
a PodDisruptionBudget, so admission stays up).

``expiry`` tells the metrics when the certificate runs out, for the alert that fires weeks
before it does.

What it must never do: act on a file it could not read (a Secret update swaps a symlink, and
a read in between may fail); it compares what it read last with what it reads now.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509

log = logging.getLogger(__name__)


def _digest(paths: Sequence[Path]) -> str | None:
    digest = hashlib.sha256()
    try:
        for path in paths:
            digest.update(path.read_bytes())
    except OSError:
        return None
    return digest.hexdigest()


def expiry(path: Path) -> float | None:
    """When the PEM certificate at ``path`` (the first of a chain) expires, in unix seconds;
    ``None`` when it cannot be read (the metric then stays unset, and nothing fails)."""
    try:
        certificate = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return None
    return certificate.not_valid_after_utc.timestamp()


async def changed(paths: Sequence[Path], *, interval_s: float = 30.0) -> None:
    """Return once the content of ``paths`` differs from what it was when called."""
    first = _digest(paths)
    while True:
        await asyncio.sleep(interval_s)
        now = _digest(paths)
        if now is None:
            continue
        if first is None:
            first = now
        elif now != first:
            return


async def exit_when_renewed(paths: Sequence[Path], *, interval_s: float = 30.0) -> None:
    """Return (ending the operator, which Kubernetes restarts) once the certificate changes."""
    await changed(paths, interval_s=interval_s)
    log.warning(
        "the webhook certificate in %s changed: stopping, so the restart serves the new one",
        ", ".join(map(str, paths)),
    )
