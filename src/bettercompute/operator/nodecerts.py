"""The signer of node certificates: CertificateSigningRequests for ``bcd.dev/node-report``.

Why it exists: a node's signed reports count only when its key is vouched for, and the one
party that can tell whether a key belongs to a node is the API server, which records who made
each CSR. The operator therefore approves and signs a request only when all of these hold
(``judge``, pure):

- the request (``spec.request``) is a well-formed PKCS#10 request with an Ed25519 key whose
  self-signature verifies, naming one node (CN) and the role ``node`` (O);
- its usages are ``digital signature`` only;
- the requester (``spec.username``, which the API server fills) is the node agent's service
  account, ``system:serviceaccount:<namespace>:<agent service account>``;
- that token was bound to the very node the request names: the API server's
  ``spec.extra["authentication.kubernetes.io/node-name"]`` is exactly ``[<CN>]`` (projected
  service-account tokens carry it since Kubernetes 1.30 and on every kubelet from 1.32), so
  one node's agent cannot ask for another node's name;
- a GPUNode of that name exists (asked of the API when the rest passed).

Anything else is denied with a reason condition (``Denied`` through ``/approval``) and never
signed. Approval is the ``Approved`` condition through ``/approval``; signing puts the PEM
certificate the node CA issues in ``status.certificate`` through ``/status``, valid for the
lifetime the node asked (``spec.expirationSeconds``), at most the configured one. A request
someone else approved is signed only when it passes the same rule; otherwise it gets a
``Failed`` condition.

Revocation (``revoke``): a GPUNode deleted, or annotated ``bcd.dev/revoke-certificates`` with
a value not yet handled, revokes every certificate of the node (``Revocation`` port: the
service keeps the certificates); the handled value is recorded in
``bcd.dev/revoked-certificates`` so an operator restart does not revoke again, and the time in
``bcd.dev/revoked-certificates-at``, from which the node's agent learns to enrol again with a
new key.

What it must never do: sign a request that did not pass ``judge``, or sign twice.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime as dt
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from bettercompute import supervising
from bettercompute.core import attestation
from bettercompute.kube import names, resources
from bettercompute.kube.client import KubeClient, KubeError

log = logging.getLogger(__name__)

#: The API server records a node-bound token's node under this ``extra`` key.
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
#: The only usage a node certificate is for: signing reports.
USAGES = frozenset({"digital signature"})
LIFETIME = attestation.NODE_CERTIFICATE_LIFETIME
#: How often one request is read and answered again after a conflict or a passing failure.
ATTEMPTS = 8
#: Statuses worth trying again (besides 5xx): no answer, too many requests.
TRANSIENT = frozenset({0, 429})
REVOKE_ANNOTATION = names.REVOKE_CERTIFICATES
REVOKED_ANNOTATION = names.REVOKED_CERTIFICATES


def agent_username(namespace: str, service_account: str) -> str:
    """The user name the API server gives the node agent's service-account token."""
    return f"system:serviceaccount:{namespace}:{service_account}"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Approve (with the node's request) or deny, with a reason and a message for people."""

    approve: bool
    reason: str
    message: str
    request: attestation.NodeRequest | None = None


def _deny(reason: str, message: str) -> Verdict:
    return Verdict(approve=False, reason=reason, message=message)


def judge(csr: Mapping[str, Any], *, agent: str) -> Verdict:
    """Whether the operator signs ``csr`` (see the module docstring), but for the GPUNode's
    existence, which ``NodeSigner`` asks the API about."""
    spec = csr.get("spec") or {}
    try:
        pem = base64.b64decode(str(spec.get("request") or ""), validate=True)
        request = attestation.read_request(pem)
    except (binascii.Error, ValueError) as e:
        return _deny("BadRequest", f"spec.request is not base64: {e}")
    except attestation.AttestationError as e:
        return _deny("BadRequest", f"spec.request: {e.reason}")
    usages = spec.get("usages") or []
    if not usages or not set(usages) <= USAGES:
        return _deny("BadUsages", f"spec.usages must be {sorted(USAGES)}, not {usages}")
    if request.role != attestation.ROLE_NODE:
        return _deny("WrongRole", f"the request asks for role {request.role!r}, not 'node'")
    username = spec.get("username")
    if username != agent:
        return _deny("NotNodeAgent", f"requested by {username!r}, not the node agent {agent!r}")
    bound = (spec.get("extra") or {}).get(NODE_NAME_EXTRA)
    if not bound:
        return _deny("NotNodeBound", "the requester's token is not bound to a node")
    if list(bound) != [request.node_name]:
        return _deny(
            "OtherNode",
            f"the request names node {request.node_name!r} but came from node {bound}",
        )
    return Verdict(
        approve=True,
        reason="NodeAgent",
        message=f"the node agent of {request.node_name} asked for its own node",
        request=request,
    )


def _conditions(csr: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    status = csr.get("status") or {}
    return {
        str(c.get("type")): c
        for c in status.get("conditions") or ()
        if isinstance(c, Mapping) and c.get("status") == "True"
    }


def lifetime_of(csr: Mapping[str, Any], *, longest: dt.timedelta) -> dt.timedelta:
    """What the node asked for (``spec.expirationSeconds``), at most ``longest``."""
    asked = (csr.get("spec") or {}).get("expirationSeconds")
    if isinstance(asked, int) and asked > 0:
        return min(longest, dt.timedelta(seconds=asked))
    return longest


class Revocation(Protocol):
    """Where a node's certificates are revoked (the service that keeps them)."""

    async def revoke_node_certificates(self, node_id: str) -> object: ...


def _stamp(now: dt.datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass
class NodeSigner:
    """Answers CSRs of the ``bcd.dev/node-report`` signer (``handle``) and revokes."""

    kube: KubeClient
    #: The node agent's user name (``agent_username``).
    agent: str
    authority: Callable[[], Awaitable[attestation.CertificateAuthority]]
    lifetime: dt.timedelta = LIFETIME
    revocation: Revocation | None = None
    clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)
    retry_first_s: float = 1.0

    async def handle(self, seen: Mapping[str, Any]) -> str:
        """Approve and sign, or deny, one request; what was done (for logs and tests).

        It works on the request as the API has it now, not as the event showed it: events
        queue up, and an older one must not sign a second time. Every write carries the
        version read, so of two writers (replicas, or an event handled twice) one gets 409
        and reads the request again."""
        name = str(seen["metadata"]["name"])
        # kopf calls an event handler once: a write the API failed is tried again here, or the
        # request would wait for an event that never comes.
        backoff = supervising.Backoff(first_s=self.retry_first_s, max_s=30.0)
        for _ in range(ATTEMPTS):
            try:
                current = await self.kube.get(resources.CERTIFICATE_SIGNING_REQUESTS, name)
                if current is None:
                    return "gone"
                return await self._answer(current)
            except KubeError as e:
                if e.status == 409:  # another writer was first: read it again at once
                    continue
                if e.status not in TRANSIENT and e.status < 500:
                    raise
                log.warning("CertificateSigningRequest %s: %s; trying again", name, e)
                await backoff.wait()
        return "gave up"

    async def _answer(self, csr: Mapping[str, Any]) -> str:
        spec = csr.get("spec") or {}
        if spec.get("signerName") != names.NODE_REPORT_SIGNER:
            return "not ours"
        conditions = _conditions(csr)
        if "Denied" in conditions or "Failed" in conditions:
            return "decided"
        if (csr.get("status") or {}).get("certificate"):
            return "signed"
        name = str(csr["metadata"]["name"])
        verdict = judge(csr, agent=self.agent)
        if verdict.approve and verdict.request is not None:
            node = verdict.request.node_name
            if await self.kube.get(resources.GPUNODES, node) is None:
                verdict = _deny("NoSuchNode", f"no GPUNode named {node!r}")
        if "Approved" not in conditions:
            kind = "Approved" if verdict.approve else "Denied"
            csr = await self._condition(csr, "approval", kind, verdict)
            log.info("CertificateSigningRequest %s %s: %s", name, kind, verdict.message)
            if not verdict.approve:
                return "denied"
        elif not verdict.approve:
            # Approved by someone else: the signer still signs only what passes its own rule.
            await self._condition(csr, "status", "Failed", verdict)
            log.warning("CertificateSigningRequest %s not signed: %s", name, verdict.message)
            return "failed"
        assert verdict.request is not None
        authority = await self.authority()
        issued = authority.issue(
            public_key=verdict.request.public_key,
            node_name=verdict.request.node_name,
            role=verdict.request.role,
            now=self.clock(),
            lifetime=lifetime_of(csr, longest=self.lifetime),
        )
        pem = attestation.certificate_pem(issued)
        status = {**(csr.get("status") or {}), "certificate": base64.b64encode(pem).decode()}
        await self.kube.replace(resources.CSR_STATUS, name, {**csr, "status": status})
        log.info(
            "signed node certificate %x for %s (until %s)",
            issued.serial_number,
            verdict.request.node_name,
            issued.not_valid_after_utc.isoformat(),
        )
        return "signed"

    async def _condition(
        self, csr: Mapping[str, Any], subresource: str, kind: str, verdict: Verdict
    ) -> Mapping[str, Any]:
        now = _stamp(self.clock())
        condition = {
            "type": kind,
            "status": "True",
            "reason": verdict.reason,
            "message": verdict.message,
            "lastUpdateTime": now,
            "lastTransitionTime": now,
        }
        status = dict(csr.get("status") or {})
        status["conditions"] = [*(status.get("conditions") or ()), condition]
        target = resources.CSR_APPROVAL if subresource == "approval" else resources.CSR_STATUS
        name = str(csr["metadata"]["name"])
        written = await self.kube.replace(target, name, {**csr, "status": status})
        return written if written is not None else csr

    async def node_deleted(self, node: str) -> None:
        """A GPUNode is gone: its certificates are no longer any node's."""
        await self._revoke(node, why="its GPUNode was deleted")

    async def node_annotated(self, node: str, annotations: Mapping[str, str]) -> None:
        """Revoke when ``REVOKE_ANNOTATION`` has a value not acted on yet."""
        asked = annotations.get(REVOKE_ANNOTATION)
        if not asked or asked == annotations.get(REVOKED_ANNOTATION):
            return
        if await self._revoke(node, why=f"{REVOKE_ANNOTATION}={asked}"):
            # When, too: the node's agent sees its certificate is older, and enrols again
            # with a new key.
            marks = {REVOKED_ANNOTATION: asked, names.REVOKED_CERTIFICATES_AT: _stamp(self.clock())}
            await self.kube.patch(resources.GPUNODES, node, {"metadata": {"annotations": marks}})

    async def _revoke(self, node: str, *, why: str) -> bool:
        if self.revocation is None:
            log.error("cannot revoke the certificates of node %s (%s): no revocation", node, why)
            return False
        await self.revocation.revoke_node_certificates(node)
        log.warning("revoked every certificate of node %s: %s", node, why)
        return True
