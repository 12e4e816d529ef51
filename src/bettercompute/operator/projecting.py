"""Keeping every Reservation's ``status`` equal to the stored reservation, within a second.

Three inputs wake a projection: the database's change notifications
(``compute_reservation``, one per changed reservation or allocation), the outbox (lifecycle
events, delivered at least once; each also becomes a Kubernetes Event on the object), and the
operator's own handlers after they called the service. Notifications are hints: the projector
re-reads the reservation and writes the whole projected status, so a repeated or late hint
changes nothing, and one lost while the operator was down is covered by the resume handlers
re-projecting every object at start.

Dirty ids are coalesced: a burst of changes to one reservation is one read and one patch.

Each projection also keeps a ``dra`` pool's Reservation's ResourceClaimTemplate in step with
the stored state (``claiming.ClaimTemplates.follow``): made once placed, gone once releasing;
a template write that fails leaves the status written and is tried again after
``TEMPLATE_RETRY_S`` (no hint may come: a placed reservation can sit unchanged for hours).

Which object a reservation is projected onto comes from the store, not from the object: a
``status.id`` is only a hint, since a tenant allowed to write its Reservation's status could
name another's reservation there and then read that reservation's status on its own object.
An object is remembered under an id only when the store's claim of that reservation
(``kube_owners``, written by the operator from the service's answers) names this very object:
its namespace, name and uid. An id seen before on the same object is not asked again.

What it must never do: decide anything. It reads the service's answer and writes ``status``;
a failed write is retried by the next hint, never by a loop of its own. The one exception is
a projection the database was away for: no hint may come for it (notifications sent during an
outage are lost), so it is marked again after a short, jittered wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging
import random
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from bettercompute.core.errors import ComputeError, StoreError
from bettercompute.kube import resources
from bettercompute.kube.client import KubeClient, KubeError
from bettercompute.operator import claiming, statuses
from bettercompute.service.nodes import NodeService
from bettercompute.service.owners import ReservationOwners
from bettercompute.service.reservations import ReservationService

log = logging.getLogger(__name__)

#: Outbox event types that are news to a person: Warning Events; the rest are Normal.
WARNINGS = frozenset(
    {
        "reservation.failed",
        "reservation.expired",
        "reservation.binding-rejected",
        "reservation.preempted",
        "reservation.preempting",
    }
)


#: How long a projection the database was away for waits before it is tried again (seconds).
STORE_RETRY_S = 2.0

#: How long a claim template the API server refused or did not answer waits to be tried again
#: (seconds): long enough that a lasting refusal (the chart without dra.enabled: no RBAC for
#: templates) costs one call a reservation every half minute, not a loop.
TEMPLATE_RETRY_S = 30.0

#: Reservations whose events may wait for their object to be seen (one of another operator's
#: objects, or one deleted before it was seen, never will be).
MAX_UNANNOUNCED = 10_000


@dataclasses.dataclass
class Placement:
    """Where a reservation's object lives, and what it last said (from the watch)."""

    namespace: str
    name: str
    status: Mapping[str, Any]
    generation: int | None
    body: Mapping[str, Any]
    uid: str = ""

    def same_object(self, body: Mapping[str, Any]) -> bool:
        meta = body.get("metadata") or {}
        return (self.namespace, self.name, self.uid) == (
            meta.get("namespace"),
            meta.get("name"),
            str(meta.get("uid")),
        )


class Objects:
    """Reservation id → its object, kept from the watch by the event handler (``Projector.
    remember``, which checks an id against the store before it is kept here)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Placement] = {}

    def remember(self, body: Mapping[str, Any], rid: str) -> None:
        """Keep ``body`` as the object of ``rid``: only an id the store says is its own."""
        meta = body.get("metadata") or {}
        self._by_id[rid] = Placement(
            namespace=meta.get("namespace", ""),
            name=meta.get("name", ""),
            status=body.get("status") or {},
            generation=meta.get("generation"),
            body=body,
            uid=str(meta.get("uid")),
        )

    def forget(self, body: Mapping[str, Any]) -> None:
        rid = (body.get("status") or {}).get("id")
        place = self._by_id.get(rid) if rid else None
        if place is not None and place.same_object(body):
            del self._by_id[str(rid)]

    def where(self, rid: str) -> Placement | None:
        return self._by_id.get(rid)

    def __len__(self) -> int:
        return len(self._by_id)


def now_rfc3339() -> str:
    """Wall-clock time for ``lastTransitionTime`` only: Kubernetes shows it, nothing decides
    on it (business time is the database's)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Projector:
    """Writes projected statuses; ``run`` drives it from notifications and the outbox."""

    def __init__(
        self,
        *,
        service: ReservationService,
        nodes: NodeService,
        kube: KubeClient,
        objects: Objects,
        claims: claiming.ClaimTemplates | None = None,
        clock: Callable[[], str] = now_rfc3339,
        concurrency: int = 16,
    ):
        self.service = service
        #: A dra pool's Reservations: their ResourceClaimTemplates follow each projection.
        self.claims = claims
        self.owners = ReservationOwners(service.db)
        self.nodes = nodes
        self.kube = kube
        self.objects = objects
        self.clock = clock
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._limit = asyncio.Semaphore(concurrency)
        # The Refused condition each reservation shows until an operation on it succeeds. Kept
        # here, not read back from the watch: a projection racing a refusal would erase it.
        self._refusals: dict[str, Mapping[str, Any]] = {}
        # Outbox events about reservations whose object is not known yet: the create handler
        # commits (and the event is delivered) before its status names the reservation.
        self._unannounced: dict[str, list[Mapping[str, Any]]] = {}
        self.projected = 0

    async def remember(self, body: Mapping[str, Any]) -> None:
        """The watch saw a Reservation: keep where it lives, and announce what waited for it.

        Only under a ``status.id`` the store says is this object's own: any other (a tenant's
        write naming another reservation, or one this object was refused) is ignored."""
        rid = await self._own_id(body)
        if rid is None:
            return
        self.objects.remember(body, rid)
        for event in self._unannounced.pop(rid, ()):
            await self.announce(event)

    async def _own_id(self, body: Mapping[str, Any]) -> str | None:
        rid = (body.get("status") or {}).get("id")
        if not isinstance(rid, str) or not rid:
            return None
        known = self.objects.where(rid)
        if known is not None and known.same_object(body):
            return rid  # checked when it was first kept
        meta = body.get("metadata") or {}
        try:
            owned = await self.owners.owns(
                rid,
                object_uid=str(meta.get("uid")),
                namespace=str(meta.get("namespace")),
                name=str(meta.get("name")),
            )
        except StoreError as e:
            # Its next watch event (every status the projector writes is one) asks again.
            log.warning("could not check the reservation of %s: %s", meta.get("name"), e)
            return None
        if not owned:
            log.info(
                "Reservation %s/%s names %s in its status, which is not its own: not projected",
                meta.get("namespace"),
                meta.get("name"),
                rid,
            )
            return None
        return rid

    def mark(self, rid: str) -> None:
        """Project ``rid`` soon (non-blocking; safe from any callback on the loop)."""
        self._dirty.add(rid)
        self._wake.set()

    async def write(
        self,
        *,
        namespace: str,
        name: str,
        view: Mapping[str, Any],
        previous: Mapping[str, Any] | None,
        generation: int | None = None,
        extra: Mapping[str, Any] | None = None,
        keep_refusal: bool = True,
        uid: str | None = None,
    ) -> None:
        """Write the projection of ``view`` on one object now (the handlers' path); ``uid``
        is the object's, the owner of its claim template (a dra pool's)."""
        rid = str(view["id"])
        if keep_refusal:
            refused = self._refusals.get(rid) or statuses.refused_in(previous)
        else:
            self._refusals.pop(rid, None)
            refused = None
        nodes = await self.nodes.nodes_of(rid)
        status = statuses.reservation_status(
            view,
            nodes=nodes,
            generation=generation,
            previous=previous,
            now=self.clock(),
            refused=refused,
        )
        status.update(await self._claim_template(namespace, name, uid, view))
        status.update(extra or {})
        await self.kube.patch(
            resources.RESERVATIONS,
            name,
            {"status": status},
            namespace=namespace,
            status=True,
        )
        self.projected += 1

    async def _claim_template(
        self, namespace: str, name: str, uid: str | None, view: Mapping[str, Any]
    ) -> dict[str, Any]:
        if self.claims is None:
            return {}
        if uid is None:
            place = self.objects.where(str(view["id"]))
            uid = place.uid if place is not None and place.name == name else None
        try:
            return await self.claims.follow(namespace=namespace, name=name, uid=uid, view=view)
        except KubeError as e:
            # The status is still written; the template is tried again by a later projection.
            log.warning("could not keep the claim template of %s/%s: %s", namespace, name, e)
            asyncio.get_running_loop().call_later(TEMPLATE_RETRY_S, self.mark, str(view["id"]))
            return {}

    async def refuse(
        self,
        *,
        namespace: str,
        name: str,
        error: ComputeError,
        operation: str,
        previous: Mapping[str, Any] | None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Show a refusal as the ``Refused`` condition (reason: the core's error code)."""
        refused = statuses.refusal(error, operation=operation, now=self.clock())
        rid = (previous or {}).get("id")
        if rid:
            self._refusals[str(rid)] = refused
        generation = (extra or {}).get("observedGeneration")
        body: dict[str, Any] = {
            "conditions": statuses.with_refusal(
                previous, refused, now=self.clock(), generation=generation
            )
        }
        body.update(extra or {})
        await self.kube.patch(
            resources.RESERVATIONS, name, {"status": body}, namespace=namespace, status=True
        )

    async def project(self, rid: str) -> bool:
        """Re-read ``rid`` and write its projection; ``False`` when it has no object here."""
        place = self.objects.where(rid)
        if place is None:
            return False
        view = await self.service.snapshot(rid)
        if view is None:
            return False
        await self.write(
            namespace=place.namespace,
            name=place.name,
            view=view,
            previous=place.status,
            generation=None,
            uid=place.uid,
        )
        return True

    async def announce(self, event: Mapping[str, Any]) -> None:
        """An outbox event: a Kubernetes Event on the object, and a projection."""
        subject = str(event.get("subject") or "")
        if not subject.startswith("reservation/"):
            return
        rid = subject.removeprefix("reservation/")
        self.mark(rid)
        place = self.objects.where(rid)
        if place is None:
            if len(self._unannounced) >= MAX_UNANNOUNCED:  # oldest first out: bounded memory
                del self._unannounced[next(iter(self._unannounced))]
            self._unannounced.setdefault(rid, []).append(event)
            return
        kind = str(event.get("type") or "")
        data = event.get("data") or {}
        try:
            await self.kube.post_event(
                involved=place.body,
                type_="Warning" if kind in WARNINGS else "Normal",
                reason=_reason(kind),
                message=_message(kind, data),
                namespace=place.namespace,
            )
        except KubeError as e:
            # An Event is news, not state: one the API server refused is logged, never retried
            # (retrying would hold up every later event behind it).
            log.warning("could not post the %s event of %s: %s", kind, rid, e)

    async def run(
        self, *, listen: Callable[[Callable[[str], None]], Coroutine[Any, Any, None]]
    ) -> None:
        """Project dirty reservations until cancelled; ``listen`` feeds change notifications."""
        listener = asyncio.create_task(listen(self.mark), name="reservation-changes")
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                batch, self._dirty = self._dirty, set()
                await asyncio.gather(*(self._project_one(rid) for rid in batch))
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    async def _project_one(self, rid: str) -> None:
        async with self._limit:
            try:
                await self.project(rid)
            except (KubeError, ComputeError) as e:
                log.warning("could not project %s: %s", rid, e)
            except StoreError as e:
                log.warning("could not project %s, retrying: %s", rid, e)
                delay = random.uniform(STORE_RETRY_S / 2, STORE_RETRY_S)
                asyncio.get_running_loop().call_later(delay, self.mark, rid)
            except Exception:  # a bug in one projection must not end the projector
                log.exception("could not project %s", rid)


def _reason(kind: str) -> str:
    """``reservation.binding-rejected`` → ``BindingRejected``."""
    tail = kind.removeprefix("reservation.")
    return "".join(part.capitalize() for part in tail.replace("_", "-").split("-")) or "Changed"


def _message(kind: str, data: Mapping[str, Any]) -> str:
    state = data.get("state")
    parts = [f"reservation is {state}" if state else kind]
    if data.get("nodeIds"):
        parts.append("on " + ", ".join(map(str, data["nodeIds"])))
    if data.get("reason"):
        parts.append(f"({data['reason']})")
    return " ".join(parts)
