"""A Reservation object's life as service calls: create, extend, renew, release.

Each method takes the object as kopf hands it over, calls the service once as the stamped
requester of the namespace's tenant, and writes the answer into ``status`` (the projection,
or a ``Refused`` condition with the core's code and message, plus a Warning Event). It
answers how long to wait before kopf should try again, or ``None`` when done: the retry itself
is the handler's business (``kopf.TemporaryError`` belongs at the handler edge).

One stored reservation, one object: two objects with the same idempotency key and request
name the same reservation, and the first to claim it (a row in the store, atomic across
replicas) owns it. The other is refused with ``CONFLICT`` naming the owner and never acts on
the reservation: not by ``spec.release``, an extend, a renew, nor its deletion.

The reservation an object's ``status.id`` names is believed only when the store's claim of it
names this very object (namespace, name and uid): a tenant allowed to write its Reservation's
status could write another reservation's id there, and an operator that believed it would show
that reservation on the tenant's object (or release it when the object is deleted). Claims are
written only from the service's answers (a create's, a confirmation's), never from a status.
An object whose id does not check out is handled as one never admitted: its own spec is
admitted again (the same key reaches its own reservation, with no second decision once past
the draft), which also writes its true id over the one written there.

What it must never do: decide. Whether a request is valid, allowed, within quota or placeable
is the core's answer; this module only carries it both ways.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from bettercompute.core import ports, states
from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.kube import names, resources
from bettercompute.kube.client import KubeClient
from bettercompute.operator import definitions, statuses
from bettercompute.operator.delegating import Delegations
from bettercompute.operator.projecting import Projector
from bettercompute.service.owners import ReservationOwners
from bettercompute.service.reservations import ReservationService

log = logging.getLogger(__name__)

#: Refusals worth trying again by themselves, and after how many seconds. Everything else
#: waits for the object to change (a CONFLICT or an INVALID_INPUT does not heal by waiting).
RETRY_AFTER_S: Mapping[ErrorCode, float] = {
    ErrorCode.QUOTA_EXCEEDED: 30.0,
    ErrorCode.SPEND_LIMIT_REACHED: 60.0,
    ErrorCode.CONFIRMATION_REQUIRED: 30.0,
}

TERMINAL = frozenset(s.value for s in states.TERMINAL)


class ReservationDoor:
    """The Reservation resource as a door onto the reservation service."""

    def __init__(
        self,
        *,
        service: ReservationService,
        projector: Projector,
        kube: KubeClient,
        delegations: Delegations | None = None,
    ):
        self.service = service
        self.projector = projector
        self.kube = kube
        self.delegations = delegations or Delegations(kube)
        self.owners = ReservationOwners(service.db)
        #: Create handler runs that called the service (a replica that stood by made none).
        self.admissions = 0

    # --- create --------------------------------------------------------------------------------

    async def admit(
        self, body: Mapping[str, Any], *, tenant_labels: Mapping[str, str] | None
    ) -> float | None:
        """Create (or, for an object already admitted, re-read) the reservation."""
        body = await self._trusted(body)
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        rid = status.get("id")
        if rid:  # admitted before (a resume): show what is stored now
            view = await self.service.snapshot(str(rid))
            if view is not None:
                await self._show(body, view)
                return None
        try:
            tenant = definitions.tenant_of(meta.get("namespace", ""), tenant_labels)
            caller = await self._caller(meta, tenant)
            request = definitions.create_request(
                body.get("spec") or {}, tenant_id=tenant, uid=str(meta.get("uid"))
            )
            self.admissions += 1
            view = await self.service.create(caller, request)
        except ComputeError as e:
            if e.code is ErrorCode.CONFIRMATION_REQUIRED and e.details.get("reservationId"):
                return await self._awaiting(body, e, person=caller.on_behalf_of)
            return await self._refuse(body, e, operation="create")
        # The create answered the stored reservation this key names, which may be another
        # object's: claim it before showing it.
        if (taken := await self._taken(body, str(view["id"]))) is not None:
            return await self._refuse(body, taken, operation="create", disown=True)
        await self._show(body, view, keep_refusal=False)
        return None

    # --- changes: release, extend, renew -------------------------------------------------------

    async def changed(
        self, body: Mapping[str, Any], *, tenant_labels: Mapping[str, str] | None
    ) -> float | None:
        """Act on what changed in ``spec`` and the renew annotation since it was last acted on."""
        body = await self._trusted(body)
        meta, spec, status = (
            body.get("metadata") or {},
            body.get("spec") or {},
            body.get("status") or {},
        )
        rid = status.get("id")
        if not rid:
            # Never admitted (refused): a changed object is a new chance to admit it.
            return await self.admit(body, tenant_labels=tenant_labels)
        try:
            tenant = definitions.tenant_of(meta.get("namespace", ""), tenant_labels)
            caller = await self._caller(meta, tenant)
        except ComputeError as e:
            return await self._refuse(body, e, operation="update")
        target = {"tenantId": tenant, "reservationId": rid}
        if status.get("state") == states.State.AWAITING_CONFIRMATION.value:
            answered = await self._answer(body, tenant)
            if answered:  # decided: the agent's request is admitted again, at once
                return await self._readmit(body, caller, tenant)
        if spec.get("release") is True and status.get("state") not in TERMINAL:
            return await self._call(body, "release", caller, target)
        extension = status.get("extension") or {}
        if spec.get("extendKey") and spec.get("extendKey") != extension.get("key"):
            retry = await self._extend(body, caller, target, spec)
            if retry is not None:
                return retry
        renew = (meta.get("annotations") or {}).get(names.RENEW)
        if renew and renew != status.get("renewed"):
            return await self._call(body, "renew", caller, target, extra={"renewed": renew})
        return None

    async def _extend(
        self,
        body: Mapping[str, Any],
        caller: ports.Caller,
        target: Mapping[str, Any],
        spec: Mapping[str, Any],
    ) -> float | None:
        request: dict[str, Any] = {**target, "idempotencyKey": spec["extendKey"]}
        if spec.get("extendBy") is not None:
            request["by"] = spec["extendBy"]
        extension: dict[str, Any] = {"key": spec["extendKey"]}
        try:
            if spec.get("until") is not None:
                request["until"] = definitions.moment_ms(spec["until"], field="until")
            answer = await self.service.extend(caller, request)
        except ComputeError as e:
            extension.update(extended=False, error=e.code.value)
            return await self._refuse(body, e, operation="extend", extra={"extension": extension})
        extension["extended"] = bool(answer["extended"])
        if answer.get("availableUntil") is not None:
            extension["availableUntil"] = statuses.rfc3339(answer["availableUntil"])
        await self._show(body, answer["reservation"], extra={"extension": extension})
        return None

    async def _call(
        self,
        body: Mapping[str, Any],
        operation: str,
        caller: ports.Caller,
        target: Mapping[str, Any],
        *,
        extra: Mapping[str, Any] | None = None,
    ) -> float | None:
        call = {"release": self.service.release, "renew": self.service.renew}[operation]
        try:
            view = await call(caller, dict(target))
        except ComputeError as e:
            return await self._refuse(body, e, operation=operation, extra=extra)
        await self._show(body, view, extra=extra, keep_refusal=False)
        return None

    # --- delegated confirmation ----------------------------------------------------------------

    async def _awaiting(
        self, body: Mapping[str, Any], error: ComputeError, *, person: str | None
    ) -> float | None:
        """The agent's request waits for its person: show the reservation awaiting
        confirmation, and say in an Event who answers and how."""
        rid = str(error.details["reservationId"])
        if (taken := await self._taken(body, rid)) is not None:
            return await self._refuse(body, taken, operation="create", disown=True)
        view = await self.service.snapshot(rid)
        if view is None:  # gone between the answer and the read: try again shortly
            return RETRY_AFTER_S[ErrorCode.CONFIRMATION_REQUIRED]
        confirmation = {
            "id": str(error.details.get("confirmationId") or ""),
            "person": person or "",
        }
        expires = error.details.get("expiresAt")
        if expires is not None and (shown := statuses.rfc3339(int(expires))) is not None:
            confirmation["expiresAt"] = shown
        await self._show(body, view, extra={"confirmation": confirmation}, keep_refusal=False)
        meta = body.get("metadata") or {}
        await self.kube.post_event(
            involved=body,
            type_="Normal",
            reason="ConfirmationRequired",
            message=(
                f"{person or 'the person this agent acts for'} must confirm this request before "
                f"{confirmation.get('expiresAt', 'its deadline')}: kubectl annotate reservation "
                f"{meta.get('name')} -n {meta.get('namespace')} {names.CONFIRMATION}=approve"
                " (or =deny)"
            ),
            namespace=meta.get("namespace", "default"),
        )
        return None

    async def _answer(self, body: Mapping[str, Any], tenant: str) -> bool:
        """Pass a new ``bcd.dev/confirmation`` answer to the service as the user the webhook
        stamped; ``True`` once it is decided. Whether that user may answer is the service's
        call: anyone but the person is refused (a Warning Event and the Refused condition)."""
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        annotations = meta.get("annotations") or {}
        answer, by = annotations.get(names.CONFIRMATION), annotations.get(names.CONFIRMED_BY)
        confirmation = dict(status.get("confirmation") or {})
        if answer not in ("approve", "deny") or not by or not confirmation.get("id"):
            return False
        seen = f"{answer} by {by}"
        if confirmation.get("answer") == seen:
            return False  # acted on already: a refusal is not repeated at every change
        confirmation["answer"] = seen
        person = ports.Caller(identity_id=str(by), tenant_id=tenant, kind="user")
        call = (
            self.service.confirmations_approve
            if answer == "approve"
            else self.service.confirmations_deny
        )
        try:
            await call(person, {"tenantId": tenant, "confirmationId": confirmation["id"]})
        except ComputeError as e:
            await self._refuse(body, e, operation="confirm", extra={"confirmation": confirmation})
            return False
        await self.kube.patch(
            resources.RESERVATIONS,
            meta["name"],
            {"status": {"confirmation": confirmation}},
            namespace=meta["namespace"],
            status=True,
        )
        return True

    async def _readmit(
        self, body: Mapping[str, Any], caller: ports.Caller, tenant: str
    ) -> float | None:
        """The agent's same request again, with the same key: placed after an approval,
        denied after a denial."""
        meta = body.get("metadata") or {}
        try:
            request = definitions.create_request(
                body.get("spec") or {}, tenant_id=tenant, uid=str(meta.get("uid"))
            )
            self.admissions += 1
            view = await self.service.create(caller, request)
        except ComputeError as e:
            rid = str((body.get("status") or {}).get("id") or "")
            view_after = await self.service.snapshot(rid) if rid else None
            if view_after is not None:
                await self._show(body, view_after)
            return await self._refuse(body, e, operation="create")
        await self._show(body, view, keep_refusal=False)
        return None

    # --- delete --------------------------------------------------------------------------------

    async def deleted(
        self, body: Mapping[str, Any], *, tenant_labels: Mapping[str, str] | None
    ) -> None:
        """``kubectl delete``: release the reservation before the finalizer lets the object go.

        A release the core refuses (the stamped requester lost its rights) is reported as a
        Warning Event and the object still goes: holding it forever would help nobody; the
        reservation then ends at its own end.

        An object that does not own the reservation its status names goes without a word: the
        reservation is its owner's to release.
        """
        body = await self._trusted(body)
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        rid = status.get("id")
        if not rid or status.get("state") in TERMINAL:
            return
        try:
            tenant = definitions.tenant_of(meta.get("namespace", ""), tenant_labels)
            caller = await self._caller(meta, tenant)
            await self.service.release(caller, {"tenantId": tenant, "reservationId": rid})
        except ComputeError as e:
            await self._event(body, "ReleaseRefused", f"{e.code.value}: {e.message}")

    async def _caller(self, meta: Mapping[str, Any], tenant: str) -> ports.Caller:
        """The stamped requester; an agent acting for its person when its service account
        says so (a ``KubeError`` propagates: kopf tries the handler again)."""
        caller = definitions.caller(meta.get("annotations") or {}, tenant_id=tenant)
        return await self.delegations.caller(caller)

    # --- ownership -----------------------------------------------------------------------------

    async def _trusted(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """``body`` as the operator may believe it: its ``status.id`` kept only when the store's
        claim of that reservation names this object; otherwise the object reads as never
        admitted (the rest of its status, the tenant's to write too, decides nothing)."""
        status = body.get("status") or {}
        rid = status.get("id")
        if not rid:
            return body
        meta = body.get("metadata") or {}
        if await self.owners.owns(
            str(rid),
            object_uid=str(meta.get("uid")),
            namespace=str(meta.get("namespace")),
            name=str(meta.get("name")),
        ):
            return body
        log.info(
            "Reservation %s/%s names %s in its status, which is not its own: admitted anew",
            meta.get("namespace"),
            meta.get("name"),
            rid,
        )
        return {**body, "status": {k: v for k, v in status.items() if k != "id"}}

    async def _taken(self, body: Mapping[str, Any], rid: str) -> ComputeError | None:
        """Claim ``rid`` for this object; the refusal to show when another object owns it."""
        meta = body.get("metadata") or {}
        uid = str(meta.get("uid"))
        owner = await self.owners.claim(
            rid, object_uid=uid, namespace=meta["namespace"], name=meta["name"]
        )
        if owner.object_uid == uid:
            return None
        other = f"{owner.namespace}/{owner.name}"
        return ComputeError(
            ErrorCode.CONFLICT,
            f"the idempotency key and request are already used by Reservation {other}, which"
            f" owns reservation {rid}; give this object its own spec.idempotencyKey",
            {"field": "spec.idempotencyKey", "reservationId": rid, "owner": other},
        )

    # --- writing status ------------------------------------------------------------------------

    async def _show(
        self,
        body: Mapping[str, Any],
        view: Mapping[str, Any],
        *,
        extra: Mapping[str, Any] | None = None,
        keep_refusal: bool = True,
    ) -> None:
        meta = body.get("metadata") or {}
        await self.projector.write(
            namespace=meta["namespace"],
            name=meta["name"],
            view=view,
            previous=body.get("status") or {},
            generation=meta.get("generation"),
            extra=extra,
            keep_refusal=keep_refusal,
            uid=str(meta["uid"]) if meta.get("uid") else None,
        )

    async def _refuse(
        self,
        body: Mapping[str, Any],
        error: ComputeError,
        *,
        operation: str,
        extra: Mapping[str, Any] | None = None,
        disown: bool = False,
    ) -> float | None:
        """Show ``error`` as the Refused condition and a Warning Event.

        ``disown``: the object is refused a reservation it does not own, so its status shows
        none (an object from before ownership was recorded may still show the owner's) and the
        refusal is not kept for the owner's projections.
        """
        meta = body.get("metadata") or {}
        previous = {} if disown else body.get("status") or {}
        if disown:  # the owner's projections must not land on this object
            self.projector.objects.forget(body)
        observed = {
            **(statuses.disowned() if disown else {}),
            "observedGeneration": meta.get("generation"),
            **(extra or {}),
        }
        await self.projector.refuse(
            namespace=meta["namespace"],
            name=meta["name"],
            error=error,
            operation=operation,
            previous=previous,
            extra=observed,
        )
        await self._event(body, "Refused", f"{operation}: {error.code.value}: {error.message}")
        return RETRY_AFTER_S.get(error.code)

    async def _event(self, body: Mapping[str, Any], reason: str, message: str) -> None:
        meta = body.get("metadata") or {}
        await self.kube.post_event(
            involved=body,
            type_="Warning",
            reason=reason,
            message=message,
            namespace=meta.get("namespace", "default"),
        )
