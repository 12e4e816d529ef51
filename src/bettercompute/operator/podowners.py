"""What the pod webhooks believe about Reservations: only what the operator itself recorded.

Why it exists: a pod may take a reservation's devices only if the reservation is its own
namespace's (``podaccess``). A Reservation's ``status`` (its id, state and ``resourceName``) is
a projection the operator writes, but anyone allowed to write the status subresource, a tenant
whose role grants it, can write it too. Trusting it let a tenant name another namespace's
resource as its own Reservation's and, after an operator restart rebuilt the watch's index
from those statuses, get a pod admitted onto the victim's devices. So:

- the labelled Reservation's state, binding, devices and resource name come from the store
  (``ReservationService.snapshot``), and only when the store's claim of that reservation
  (``kube_owners``, written by the operator when it admitted the object) names this very object
  (namespace, name and uid). ``status.id`` is only the hint of which reservation to look up;
  an object whose hint does not check out reads as not admitted (no state, no resource);
- which namespace owns a ``bcd.dev/rsv-…`` resource comes from the same claims.

What it must never do: read anything a tenant can write to decide who owns devices, or decide
anything itself (``podaccess`` does, pure).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from bettercompute.core import answers
from bettercompute.operator import podaccess
from bettercompute.service.owners import ReservationOwners
from bettercompute.service.reservations import ReservationService


class PodOwners:
    """Reservations as the store knows them, for the pod webhooks."""

    def __init__(self, service: ReservationService) -> None:
        self.service = service
        self.owners = ReservationOwners(service.db)

    async def reservation(self, body: Mapping[str, Any]) -> podaccess.Booked:
        """The Reservation object ``body`` (read from the API server) with what the store
        holds for it: its own request, state and resource name once the operator admitted it
        for this object, else as not admitted (no state, no resource name)."""
        meta = body.get("metadata") or {}
        view = await self.view(body)
        if view is None:
            return podaccess.booked({"metadata": meta, "spec": body.get("spec") or {}})
        return podaccess.booked(
            {
                "metadata": meta,
                "spec": view["request"],
                "status": {"state": view["state"], "resourceName": view.get("resourceName")},
            }
        )

    async def view(self, body: Mapping[str, Any]) -> answers.Reservation | None:
        """The store's reservation of the Reservation object ``body``, only when the store's
        claim names this very object (namespace, name and uid); else ``None``."""
        meta = body.get("metadata") or {}
        hint = (body.get("status") or {}).get("id")
        if not isinstance(hint, str) or not hint:
            return None
        mine = await self.owners.owns(
            hint,
            object_uid=str(meta.get("uid")),
            namespace=str(meta.get("namespace")),
            name=str(meta.get("name")),
        )
        return await self.service.snapshot(hint) if mine else None

    async def owners_of(
        self, resources: Iterable[str], *, known: podaccess.Booked | None
    ) -> dict[str, podaccess.Owned]:
        """Who owns each ``bcd.dev/rsv-…`` resource (those no object owns left out): ``known``
        (a Reservation ``reservation`` returned) for its own resource, else the store's claim."""
        found: dict[str, podaccess.Owned] = {}
        for resource in sorted(set(resources)):
            if known is not None and known.resource_name == resource:
                found[resource] = known
                continue
            owner = await self.owners.owner_of_resource(resource)
            if owner is not None:
                found[resource] = podaccess.Owner(namespace=owner.namespace, name=owner.name)
        return found
