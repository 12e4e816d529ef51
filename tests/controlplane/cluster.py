"""The real Kubernetes control plane of the tests: ``bettercompute.dev.controlplane.plane``
(the one copy, which ``better-compute dev --kube`` runs too), with the tests' own users.

Why a module here: the tests play tenants' users with static tokens (``USERS``), and build
the binary first when it is missing or stale (``build.build``); the product does neither
(``dev`` names the build command instead). Everything else is the product's.

What it must never do: start anything beyond loopback, or leave a process after ``running``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator, Mapping
from pathlib import Path

from bettercompute.dev.controlplane import pki, plane
from bettercompute.dev.controlplane.plane import (
    ISSUER,
    SERVICE_CLUSTER_IP_RANGE,
    STARTUP_S,
    ApiError,
    ControlPlaneError,
    Process,
    free_port,
    object_path,
)
from tests.controlplane import build

__all__ = [
    "ISSUER",
    "SERVICE_CLUSTER_IP_RANGE",
    "STARTUP_S",
    "USERS",
    "ApiError",
    "ControlPlane",
    "ControlPlaneError",
    "Process",
    "free_port",
    "object_path",
]

#: Static-token users: name → groups. Tenants' users are ordinary users in the
#: ``system:authenticated`` group (added by the API server); RBAC in their namespaces is what
#: the chart's tenant roles give them.
USERS: Mapping[str, tuple[str, ...]] = {
    "alice@acme": ("acme-users",),
    "bob@globex": ("globex-users",),
    "mallory@globex": ("globex-users",),
}


class ControlPlane(plane.ControlPlane):
    @classmethod
    @contextlib.contextmanager
    def running(  # type: ignore[override]
        cls,
        *,
        binary: Path | None = None,
        root: Path | None = None,
        users: Mapping[str, tuple[str, ...]] | None = None,
        lifetime: dt.timedelta = pki.LIFETIME,
        audit: bool = False,
    ) -> Iterator[ControlPlane]:
        """The tests' cluster: ``USERS`` unless ``users`` says, the binary built if needed."""
        with super().running(
            binary=binary or build.build(quiet=False),
            root=root,
            users=USERS if users is None else users,
            lifetime=lifetime,
            audit=audit,
        ) as started:
            assert isinstance(started, ControlPlane)
            yield started
