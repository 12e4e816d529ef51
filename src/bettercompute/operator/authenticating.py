"""Bearer tokens checked by the Kubernetes API server (``TokenReview``), for the HTTP API that
the operator serves beside its handlers, so the CLI works against a cluster.

Identity: the reviewed user's ``username`` (stable for a service account and for users of an
OIDC issuer); a service account annotated ``bcd.dev/acting-for`` is an agent acting for that
person (``delegating``). Tenant: the first group named ``bcd.dev:tenant:<tenant>``; a user in
no such group is not a caller of any tenant (``None``: 401). The service's pre-check then
confines the caller to that tenant, as for every other door. Wrap it in ``iam.identities.
CachingAuthenticator`` so the API server is asked at most once per token every 30 seconds.

What it must never do: accept a token the API server did not vouch for, or turn an unreachable
API server into an anonymous caller; an error is ``None`` (401), logged.
"""

from __future__ import annotations

import logging

from bettercompute.core import ports
from bettercompute.kube.client import KubeClient, KubeError
from bettercompute.operator.delegating import Delegations

log = logging.getLogger(__name__)

TENANT_GROUP_PREFIX = "bcd.dev:tenant:"


class TokenReviewAuthenticator:
    """``ports.Authenticator`` over the API server's TokenReview."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        tenant_group_prefix: str = TENANT_GROUP_PREFIX,
        delegations: Delegations | None = None,
    ):
        self.kube = kube
        self.prefix = tenant_group_prefix
        self.delegations = delegations or Delegations(kube)

    async def authenticate(self, token: str) -> ports.Caller | None:
        try:
            review = await self.kube.token_review(token)
        except KubeError as e:
            log.warning("TokenReview failed: %s", e)
            return None
        if not review.get("authenticated"):
            return None
        user = review.get("user") or {}
        username = user.get("username")
        groups = [g for g in user.get("groups") or () if isinstance(g, str)]
        tenants = [g.removeprefix(self.prefix) for g in groups if g.startswith(self.prefix)]
        if not username or not tenants or not tenants[0]:
            return None
        kind: ports.CallerKind = (
            "service" if str(username).startswith("system:serviceaccount:") else "user"
        )
        caller = ports.Caller(
            identity_id=str(username), tenant_id=tenants[0], kind=kind, groups=tuple(groups)
        )
        try:
            # A service account annotated bcd.dev/acting-for is an agent for that person.
            return await self.delegations.caller(caller)
        except KubeError as e:
            log.warning("cannot read the delegation of %s: %s", username, e)
            return None
