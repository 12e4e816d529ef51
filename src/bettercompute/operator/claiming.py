"""A Reservation's ResourceClaimTemplate: how pods get a ``dra`` pool's reserved devices.

Why a template and not a claim: Jobs, Deployments and JobSets make pods from templates, and a
pod names a ``resourceClaimTemplateName`` there; the controller-manager makes each pod its own
claim. The template's one request (``gpus``) asks the DeviceClass ``gpu.bcd.dev`` for
``allocationMode: All`` of the devices that carry this reservation's id and namespace (the
attributes the node agent publishes for a bound device, ``kube.dra``): one pod per node gets
every device the reservation holds there. The template's spec is immutable in the API and
never needs to change: an extend or a re-place changes which devices carry the attributes,
not the selectors.

The projector calls ``ClaimTemplates.follow`` with every projection of a Reservation; the
template exists while the reservation is placed, binding or active, and goes when it is
releasing or ended (claims already made keep their devices until the kubelet unprepares
them: the node holds the devices booked until then). ``follow`` answers the status fields
it owns (``claimTemplate``; ``resourceName`` is emptied: a dra pool advertises none).

What it must never do: write a template it did not make (one of the same name without this
Reservation's owner reference is left alone and not named in the status), or decide anything
about the reservation: it follows the stored state. No template is attempted where the
cluster does not serve ``resource.k8s.io/v1``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from bettercompute.kube import dra, names, resources
from bettercompute.kube.client import KubeClient, KubeError
from bettercompute.operator import statuses

log = logging.getLogger(__name__)

API = "resource.k8s.io/v1"
#: The template's one request; a pod's container lists it in ``resources.claims``.
REQUEST = dra.CLAIM_REQUEST
#: The label naming the Reservation a template belongs to.
LABEL = names.RESERVATION_LABEL
#: States in which a reservation's template exists.
HOLDING = frozenset({"placed", "binding", "active"})
#: How long an answer "not served" is believed before discovery is asked again (seconds).
RECHECK_S = 60.0

#: The GPUPool condition for a ``dra`` pool on a cluster without ``resource.k8s.io/v1``.
CONDITION = "DraAvailable"
MISSING = "ResourceApiMissing"


def template(*, namespace: str, name: str, uid: str, reservation_id: str) -> dict[str, Any]:
    """The ResourceClaimTemplate of Reservation ``namespace/name`` (uid ``uid``)."""
    selectors = [
        {"cel": {"expression": dra.namespace_selector(namespace)}},
        {"cel": {"expression": dra.reservation_selector(reservation_id)}},
    ]
    return {
        "apiVersion": API,
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {dra.MANAGED_BY_LABEL: dra.MANAGED_BY, LABEL: name},
            "ownerReferences": [
                {
                    "apiVersion": names.API_VERSION,
                    "kind": "Reservation",
                    "name": name,
                    "uid": uid,
                    "controller": True,
                    "blockOwnerDeletion": False,
                }
            ],
        },
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": REQUEST,
                            "exactly": {
                                "deviceClassName": dra.DEVICE_CLASS,
                                "allocationMode": "All",
                                "selectors": selectors,
                            },
                        }
                    ]
                }
            }
        },
    }


def ours(found: Mapping[str, Any], *, uid: str) -> bool:
    """Whether ``found`` is the template this operator made for the Reservation ``uid``."""
    meta = found.get("metadata") or {}
    labels = meta.get("labels") or {}
    owned = any(ref.get("uid") == uid for ref in meta.get("ownerReferences") or ())
    return owned and labels.get(dra.MANAGED_BY_LABEL) == dra.MANAGED_BY


class ClaimTemplates:
    """Keeps each Reservation's template as its state says (``follow``)."""

    def __init__(
        self,
        *,
        kube: KubeClient,
        pool_api: Callable[[str], Awaitable[str | None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.pool_api = pool_api
        self.clock = clock
        self._served: bool | None = None
        self._asked_at = 0.0

    async def served(self) -> bool:
        """Whether the cluster serves ``resource.k8s.io/v1`` (a "no" is asked again after
        ``RECHECK_S``: a cluster upgraded under a running operator)."""
        if self._served or (self._served is False and self.clock() - self._asked_at < RECHECK_S):
            return bool(self._served)
        self._served = await self.kube.serves(API)
        self._asked_at = self.clock()
        return self._served

    async def follow(
        self, *, namespace: str, name: str, uid: str | None, view: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Create or delete the template of Reservation ``namespace/name`` as ``view`` (the
        stored reservation) says; the status fields to write (``{}`` for a reservation that is
        not a ``kubernetes`` binding on a ``dra`` pool)."""
        if (view.get("request") or {}).get("binding") != "kubernetes":
            return {}
        if await self.pool_api(str(view.get("poolId"))) != dra.API_DRA:
            return {}
        if not await self.served():
            return {"claimTemplate": None, "resourceName": None}
        found = await self.kube.get(resources.RESOURCE_CLAIM_TEMPLATES, name, namespace=namespace)
        if view.get("state") not in HOLDING or not uid:
            if found is not None and uid and ours(found, uid=uid):
                await self.kube.delete(
                    resources.RESOURCE_CLAIM_TEMPLATES, name, namespace=namespace
                )
            return {"claimTemplate": None, "resourceName": None}
        if found is None:
            body = template(namespace=namespace, name=name, uid=uid, reservation_id=str(view["id"]))
            try:
                found = await self.kube.create(
                    resources.RESOURCE_CLAIM_TEMPLATES, body, namespace=namespace
                )
            except KubeError as e:
                if e.status != 409:
                    raise
                found = await self.kube.get(
                    resources.RESOURCE_CLAIM_TEMPLATES, name, namespace=namespace
                )
        if found is None or not ours(found, uid=uid):
            # Someone else's template of that name: never named as this reservation's.
            log.warning(
                "ResourceClaimTemplate %s/%s exists and is not Reservation %s's: not used",
                namespace,
                name,
                name,
            )
            return {"claimTemplate": None, "resourceName": None}
        return {"claimTemplate": name, "resourceName": None}


def pool_condition(*, served: bool, now: str, previous: Any, generation: int) -> dict[str, Any]:
    """The ``DraAvailable`` condition of a ``dra`` GPUPool."""
    status = "True" if served else "False"
    return {
        "type": CONDITION,
        "status": status,
        "reason": "ResourceApiServed" if served else MISSING,
        "message": (
            f"{API} is served: Reservations get a ResourceClaimTemplate"
            if served
            else f"the cluster does not serve {API} (Kubernetes 1.34 or later): policy."
            "kubernetes.api dra cannot hand devices to pods here, and no claim template is made"
        ),
        "lastTransitionTime": statuses.transition_time(previous, CONDITION, status, now=now),
        "observedGeneration": generation,
    }
