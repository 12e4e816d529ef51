"""The cluster's certificates and keys: ``bettercompute.dev.controlplane.pki``, the one copy
(``better-compute dev --kube`` makes its cluster with it too); the names tests use.
"""

from __future__ import annotations

from bettercompute.dev.controlplane.pki import LIFETIME, Authority, Pair, service_account_keys

__all__ = ["LIFETIME", "Authority", "Pair", "service_account_keys"]
