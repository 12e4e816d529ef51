"""``EventSubscription`` objects turned into webhook subscriptions, and their deliveries into
their status.

Why a door of its own: a subscription made from Kubernetes is the same subscription
``events.subscriptions.create`` makes (``ReservationService``: same checks, same secret
shown once), but its secret must reach the tenant without anyone reading an API answer. So the
operator writes it into a Secret beside the object (``spec.secretName``, default
``<name>-signing``, key ``secret``), owned by the object through ``ownerReferences`` so the
garbage collector removes it with the object.

- Tenant: the namespace's ``bcd.dev/tenant`` label, as for a Reservation
  (``definitions.tenant_of``); nothing in the object can name another tenant, so an object in
  tenant B's namespace only ever receives tenant B's events.
- Idempotent: the subscription's id is kept in ``status.subscriptionId``; an object that
  already has an active one is updated in place (``url``, ``eventTypes``: the id, secret and
  delivery log stay). One without is subscribed anew, after disabling any subscription this
  object made that its status never recorded (a restart between the two writes), so an object
  never has two.
- The Secret: created; written over only at the ``resourceVersion`` the operator recorded, so
  a Secret someone else made (or changed) is never overwritten: the object shows
  ``Ready=False``, reason ``SecretExists``, and the subscription it made is disabled. The
  operator may write Secrets only in namespaces opened to it (the chart's
  ``eventSubscriptions.namespaces``); elsewhere the API server refuses and the object shows
  ``Ready=False``, reason ``SecretForbidden``, its subscription disabled the same way.
- Invalid input the CRD let through, or a tenant not known yet: ``Ready=False`` with the error's
  code as reason, never an exception out of the handler. A URL whose host is an internal
  address (or ``localhost``) that the operator's ``--event-webhook-allow`` does not take is
  such input (``INVALID_INPUT`` on ``spec.url``): no delivery could ever reach it.

What it must never do: log or put the secret anywhere but the Secret, write a Secret outside
the object's namespace, or act for a tenant other than its namespace's.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bettercompute.core import ports, requests
from bettercompute.core.egress import EgressPolicy
from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.kube import names, resources
from bettercompute.kube.client import KubeClient, KubeError
from bettercompute.operator import definitions, statuses
from bettercompute.service import webhooks
from bettercompute.service.reservations import ReservationService

KIND = "EventSubscription"
#: The key of the signing secret in the Secret.
SECRET_KEY = "secret"
SUBSCRIBED = "Subscribed"
SECRET_EXISTS = "SecretExists"
#: The operator is not allowed to write Secrets in the object's namespace.
SECRET_FORBIDDEN = "SecretForbidden"
DISABLED = "SubscriptionDisabled"
#: How soon a refusal that may clear by itself (a tenant or a Secret) is tried again.
RETRY_S = 30.0


def creator(namespace: str, name: str) -> str:
    """The ``createdBy`` of the subscriptions an object makes: finds them after a restart."""
    return f"kubernetes:eventsubscription:{namespace}/{name}"


def secret_name(body: Mapping[str, Any]) -> str:
    meta = body.get("metadata") or {}
    return str((body.get("spec") or {}).get("secretName") or f"{meta.get('name')}-signing")


def parse(spec: Mapping[str, Any], *, tenant_id: str) -> tuple[str, list[str]]:
    """``(url, eventTypes)`` checked as ``events.subscriptions.create`` checks them;
    INVALID_INPUT naming the field."""
    try:
        value = requests.parse(
            requests.SubscriptionCreateInput,
            {
                "tenantId": tenant_id,
                "url": spec.get("url"),
                "eventTypes": list(spec.get("eventTypes") or ()),
            },
        )
    except ComputeError as e:
        field = e.details.get("field")
        if isinstance(field, str) and field != "tenantId":
            raise ComputeError(e.code, e.message, {**e.details, "field": f"spec.{field}"}) from None
        raise
    return value.url, list(value.eventTypes)


def types_shown(types: Sequence[str]) -> str:
    """``status.types`` for ``kubectl get esub``."""
    return ",".join(t.removeprefix("reservation.") for t in sorted(types)) or "all"


def secret_manifest(
    body: Mapping[str, Any], *, name: str, secret: str, version: str | None = None
) -> dict[str, Any]:
    """The Secret holding the signing secret, owned by the object (deleted with it)."""
    meta = body.get("metadata") or {}
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": meta.get("namespace"),
        "labels": {"app.kubernetes.io/managed-by": "better-compute"},
        "ownerReferences": [
            {
                "apiVersion": f"{names.GROUP}/{names.VERSION}",
                "kind": KIND,
                "name": meta.get("name"),
                "uid": meta.get("uid"),
                "controller": True,
            }
        ],
    }
    if version is not None:
        metadata["resourceVersion"] = version
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "Opaque",
        "data": {SECRET_KEY: base64.b64encode(secret.encode()).decode()},
    }


def ready_condition(
    *, ready: bool, reason: str, message: str, generation: int, previous: Any, now: str
) -> dict[str, Any]:
    value = "True" if ready else "False"
    return {
        "type": statuses.READY,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": statuses.transition_time(previous, statuses.READY, value, now=now),
        "observedGeneration": generation,
    }


def deliveries_shown(summary: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "delivered": summary["delivered"],
        "pending": summary["pending"],
        "failing": summary["failing"],
        "dead": summary["dead"],
        "lastDeliveredAt": statuses.rfc3339(summary["lastDeliveredAt"]),
        "lastError": summary["lastError"],
    }


class SubscriptionDoor:
    """What the EventSubscription handlers call: apply, delete, show."""

    def __init__(
        self,
        *,
        service: ReservationService,
        kube: KubeClient,
        clock: Callable[[], str],
        allowlist: EgressPolicy | None = None,
    ) -> None:
        self.service = service
        self.kube = kube
        self.clock = clock
        #: The operator's ``--event-webhook-allow``: a URL no delivery could reach is refused.
        self.allowlist = allowlist

    async def apply(
        self, body: Mapping[str, Any], *, tenant_labels: Mapping[str, str] | None
    ) -> float | None:
        """Subscribe (or update the subscription) as the object says; returns a delay when
        the handler should try again (a refusal that may clear by itself)."""
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        try:
            tenant = definitions.tenant_of(namespace, tenant_labels)
            url, types = parse(body.get("spec") or {}, tenant_id=tenant)
            webhooks.check_url(url, self.allowlist, field="spec.url")
        except ComputeError as e:
            await self._refused(body, e.code.value, e.message)
            return RETRY_S if e.details.get("field") == "metadata.namespace" else None
        caller = ports.Caller(
            identity_id=creator(namespace, name), tenant_id=tenant, kind="service"
        )
        db = self.service.db
        sid = status.get("subscriptionId")
        if (
            sid
            and status.get("tenantId") == tenant
            and await webhooks.is_active(db, tenant_id=tenant, subscription_id=str(sid))
        ):
            await webhooks.update_subscription(
                db, tenant_id=tenant, subscription_id=str(sid), url=url, event_types=types
            )
            await self._subscribed(body, tenant=tenant, sid=str(sid), types=types)
            return None
        before = status.get("tenantId")
        if before and before != tenant:  # the namespace changed tenants: the old one stops
            await self.delete(body)
        # None recorded (or it was disabled): any this object made is an orphan of a restart.
        await self._disable(caller, tenant, await self._made(tenant, namespace, name))
        try:
            made = await self.service.subscriptions_create(
                caller, {"tenantId": tenant, "url": url, "eventTypes": types}
            )
        except ComputeError as e:
            await self._refused(body, e.code.value, e.message)
            return RETRY_S
        where = secret_name(body)
        try:
            version = await self._write_secret(
                body, name=where, secret=made["secret"], known=status.get("secretVersion")
            )
        except KubeError as e:
            if e.status != 403:
                raise
            # The chart grants Secrets only in the namespaces opened to the operator: a
            # subscription whose secret cannot reach its tenant must not deliver.
            await self._disable(caller, tenant, [made["id"]])
            await self._refused(
                body,
                SECRET_FORBIDDEN,
                f"the operator may not write Secrets in namespace {namespace}: add it to the "
                "chart's eventSubscriptions.namespaces",
            )
            return RETRY_S
        if version is None:
            await self._disable(caller, tenant, [made["id"]])
            await self._refused(
                body,
                SECRET_EXISTS,
                f"Secret {namespace}/{where} exists and was not written by this "
                "EventSubscription: delete it, or name another in spec.secretName",
            )
            return RETRY_S
        await self._subscribed(
            body, tenant=tenant, sid=made["id"], types=types, secret=where, version=version
        )
        return None

    async def delete(self, body: Mapping[str, Any]) -> None:
        """Disable the object's subscriptions (its Secret goes with the object: owned)."""
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        tenant = status.get("tenantId")
        if not tenant:
            return  # never subscribed
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        caller = ports.Caller(
            identity_id=creator(namespace, name), tenant_id=str(tenant), kind="service"
        )
        await self._disable(caller, str(tenant), await self._made(str(tenant), namespace, name))

    async def show(self, body: Mapping[str, Any]) -> None:
        """Refresh ``status.deliveries`` (and ``Ready``, if the subscription was disabled
        outside Kubernetes); written only when something changed."""
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        sid, tenant = status.get("subscriptionId"), status.get("tenantId")
        if not sid or not tenant:
            return
        db = self.service.db
        summary = await webhooks.delivery_summary(db, subscription_id=str(sid))
        shown: dict[str, Any] = {"deliveries": deliveries_shown(summary)}
        active = await webhooks.is_active(db, tenant_id=str(tenant), subscription_id=str(sid))
        if not active:
            shown["conditions"] = [
                ready_condition(
                    ready=False,
                    reason=DISABLED,
                    message=f"subscription {sid} was deleted outside Kubernetes; change this "
                    "object (or restart the operator) to subscribe again",
                    generation=int(meta.get("generation") or 0),
                    previous=status.get("conditions"),
                    now=self.clock(),
                )
            ]
        if any(status.get(k) != v for k, v in shown.items()):
            await self._patch(body, shown)

    # --- the parts ----------------------------------------------------------------------------

    async def _made(self, tenant: str, namespace: str, name: str) -> list[str]:
        return await webhooks.made_by(
            self.service.db, tenant_id=tenant, created_by=creator(namespace, name)
        )

    async def _disable(self, caller: ports.Caller, tenant: str, sids: Sequence[str]) -> None:
        for sid in sids:
            try:
                await self.service.subscriptions_delete(
                    caller, {"tenantId": tenant, "subscriptionId": sid}
                )
            except ComputeError as e:
                if e.code is not ErrorCode.NOT_FOUND:  # already disabled: what we wanted
                    raise

    async def _write_secret(
        self, body: Mapping[str, Any], *, name: str, secret: str, known: Any
    ) -> str | None:
        """Create the Secret, or write over it at the version we recorded; its new
        ``resourceVersion`` (``""`` when the server gives none), or ``None`` when a Secret
        of that name is not ours to write."""
        namespace = str((body.get("metadata") or {}).get("namespace"))
        try:
            manifest = secret_manifest(body, name=name, secret=secret)
            made = await self.kube.create(resources.SECRETS, manifest, namespace=namespace)
        except KubeError as e:
            if e.status != 409:
                raise
        else:
            return str((made.get("metadata") or {}).get("resourceVersion") or "")
        if not known:
            return None
        manifest = secret_manifest(body, name=name, secret=secret, version=str(known))
        try:
            replaced = await self.kube.replace(
                resources.SECRETS, name, manifest, namespace=namespace
            )
        except KubeError as e:
            if e.status != 409:
                raise
            return None  # changed since we wrote it: not ours any more
        if replaced is None:  # deleted meanwhile: the next try creates it
            return None
        return str((replaced.get("metadata") or {}).get("resourceVersion") or "")

    async def _subscribed(
        self,
        body: Mapping[str, Any],
        *,
        tenant: str,
        sid: str,
        types: Sequence[str],
        secret: str | None = None,
        version: str | None = None,
    ) -> None:
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        generation = int(meta.get("generation") or 0)
        shown: dict[str, Any] = {
            "observedGeneration": generation,
            "subscriptionId": sid,
            "tenantId": tenant,
            "types": types_shown(types),
            "conditions": [
                ready_condition(
                    ready=True,
                    reason=SUBSCRIBED,
                    message=f"tenant {tenant}'s events are delivered by subscription {sid}",
                    generation=generation,
                    previous=status.get("conditions"),
                    now=self.clock(),
                )
            ],
        }
        if secret is not None:
            shown["secretName"] = secret
            shown["secretVersion"] = version
        summary = await webhooks.delivery_summary(self.service.db, subscription_id=sid)
        shown["deliveries"] = deliveries_shown(summary)
        if any(status.get(k) != v for k, v in shown.items()):
            await self._patch(body, shown)

    async def _refused(self, body: Mapping[str, Any], reason: str, message: str) -> None:
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        generation = int(meta.get("generation") or 0)
        shown = {
            "observedGeneration": generation,
            "conditions": [
                ready_condition(
                    ready=False,
                    reason=reason,
                    message=message,
                    generation=generation,
                    previous=status.get("conditions"),
                    now=self.clock(),
                )
            ],
        }
        if any(status.get(k) != v for k, v in shown.items()):
            await self._patch(body, shown)

    async def _patch(self, body: Mapping[str, Any], status: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        await self.kube.patch(
            resources.EVENT_SUBSCRIPTIONS,
            str(meta.get("name")),
            {"status": dict(status)},
            namespace=str(meta.get("namespace")),
            status=True,
        )
