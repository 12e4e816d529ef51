"""Runs our Kueue AdmissionCheck controller: reads Workloads, writes their checks' states.

Why it exists: ``kueuechecks`` decides what each Workload's ``bcd.dev/reservation`` check
should say; this module feeds it and writes its answers. One pass (``sync``):

1. lists the AdmissionChecks; ours are those of ``controllerName: bcd.dev/reservation``, and
   each is marked ``Active=True`` (Kueue admits nothing through an inactive check);
2. lists the Workloads and keeps those with an entry for one of our checks in
   ``status.admissionChecks`` (Kueue adds the entries of the Workload's ClusterQueue; we never
   add one, Kueue would remove it), leaving finished ones alone;
3. for each, the Reservation names it gives (reading its owner Job only when the Workload
   itself names none), the Reservations of that name (one cluster-wide list per pass), each
   as the store knows it (``podowners``: its state, devices, window, never its ``status``),
   and the nodes its devices are on;
4. writes ``status.admissionChecks`` back with our entries changed and everyone else's kept,
   under the Workload's ``resourceVersion``: a conflicting write (Kueue's own) is a 409, and
   the next pass reads again.

``run`` makes a pass when woken (a Workload or AdmissionCheck event, a reservation change)
and every ``resync_s`` in any case; everything is read again each pass, so an operator that
restarts loses nothing. What it must never do: decide (``kueuechecks`` does), write any
Workload field but ``status.admissionChecks``, or touch an entry of another controller's check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from lightkube import ALL_NS
from lightkube.generic_resource import create_global_resource, create_namespaced_resource
from lightkube.resources.batch_v1 import Job

from bettercompute.core import moments
from bettercompute.kube import resources
from bettercompute.kube.client import KubeClient, KubeError
from bettercompute.operator import kueuechecks, podaccess, podowners
from bettercompute.service.nodes import NodeService
from bettercompute.service.reservations import ReservationService

log = logging.getLogger(__name__)

WORKLOADS = create_namespaced_resource(
    kueuechecks.GROUP, kueuechecks.VERSION, "Workload", "workloads"
)
ADMISSION_CHECKS = create_global_resource(
    kueuechecks.GROUP, kueuechecks.VERSION, "AdmissionCheck", "admissionchecks"
)
#: kopf's names for the same resources (the handlers that wake the loop).
KOPF_WORKLOADS = (kueuechecks.GROUP, kueuechecks.VERSION, "workloads")
KOPF_ADMISSION_CHECKS = (kueuechecks.GROUP, kueuechecks.VERSION, "admissionchecks")


async def kueue_served(kube: KubeClient) -> bool:
    """Whether the API server serves Kueue's ``v1beta1`` Workloads and AdmissionChecks."""
    group_version = f"{kueuechecks.GROUP}/{kueuechecks.VERSION}"
    if not await kube.serves(group_version):
        return False
    try:
        await kube.list(ADMISSION_CHECKS)
        return True
    except KubeError as e:
        if e.status == 404:
            return False
        raise


class KueueChecks:
    """Our AdmissionChecks' controller (see the module docstring)."""

    def __init__(
        self,
        *,
        kube: KubeClient,
        service: ReservationService,
        nodes: NodeService,
        clock: Callable[[], str],
        resync_s: float = 10.0,
    ) -> None:
        self.kube = kube
        self.owners = podowners.PodOwners(service)
        self.nodes = nodes
        self.clock = clock
        self.resync_s = resync_s
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Make a pass soon (something changed)."""
        self._wake.set()

    async def run(self) -> None:
        """Passes until cancelled: when woken, and every ``resync_s``."""
        while True:
            self._wake.clear()
            try:
                await self.sync()
            except KubeError as e:
                log.warning("Kueue admission checks: %s; trying again", e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.resync_s)

    async def sync(self) -> int:
        """One pass; how many Workloads were written."""
        ours: set[str] = set()
        for check in await self.kube.list(ADMISSION_CHECKS):
            if (check.get("spec") or {}).get("controllerName") != kueuechecks.CONTROLLER_NAME:
                continue
            name = str(check["metadata"]["name"])
            ours.add(name)
            conditions = kueuechecks.active_condition(check, now=self.clock())
            if conditions is not None:
                await self.kube.patch(
                    ADMISSION_CHECKS, name, {"status": {"conditions": conditions}}, status=True
                )
        if not ours:
            return 0
        # Every namespace (the client's own default is the operator's namespace).
        mine = [w for w in await self.kube.list(WORKLOADS, namespace=ALL_NS) if _entries(w, ours)]
        mine = [w for w in mine if not kueuechecks.is_finished(w)]
        if not mine:
            return 0
        by_name: dict[str, list[dict[str, Any]]] = {}
        for body in await self.kube.list(resources.RESERVATIONS, namespace=ALL_NS):
            by_name.setdefault(str(body["metadata"]["name"]), []).append(body)
        written = 0
        for workload in mine:
            try:
                written += await self._sync_workload(workload, ours, by_name)
            except KubeError as e:
                if e.status != 409:  # 409: Kueue wrote meanwhile; the next pass reads again
                    raise
        return written

    async def _sync_workload(
        self,
        workload: Mapping[str, Any],
        ours: set[str],
        by_name: Mapping[str, list[dict[str, Any]]],
    ) -> int:
        meta = workload["metadata"]
        named = kueuechecks.names_given(workload, None)
        if not named:
            named = kueuechecks.names_given(workload, await self._owner_job(workload))
        candidates: list[kueuechecks.Stored] = []
        if len(named) == 1:
            for body in by_name.get(next(iter(named)), ()):
                candidates.append(await self._stored(body))
        entries = list((workload.get("status") or {}).get("admissionChecks") or ())
        decisions = {
            str(entry["name"]): kueuechecks.decide(
                workload=workload,
                named=named,
                candidates=candidates,
                previous=entry.get("state"),
                shown=moments.rfc3339,
            )
            for entry in _entries(workload, ours)
        }
        merged = kueuechecks.merged_checks(entries, decisions, now=self.clock())
        if merged is None:
            return 0
        await self.kube.patch(
            WORKLOADS,
            str(meta["name"]),
            {
                "metadata": {"resourceVersion": meta.get("resourceVersion")},
                "status": {"admissionChecks": merged},
            },
            namespace=str(meta["namespace"]),
            status=True,
        )
        for name, decision in sorted(decisions.items()):
            log.info(
                "Workload %s/%s: check %s is %s: %s",
                meta["namespace"],
                meta["name"],
                name,
                decision.state,
                decision.message,
            )
        return 1

    async def _owner_job(self, workload: Mapping[str, Any]) -> dict[str, Any] | None:
        """The Workload's controlling Job in its own namespace, if its uid matches."""
        reference = kueuechecks.owner_job_reference(workload)
        if reference is None:
            return None
        name, uid = reference
        job = await self.kube.get(Job, name, namespace=str(workload["metadata"]["namespace"]))
        if job is None or str((job.get("metadata") or {}).get("uid")) != uid:
            return None
        return job

    async def _stored(self, body: Mapping[str, Any]) -> kueuechecks.Stored:
        """A Reservation object as the store knows it (not admitted: no state, no window)."""
        meta = body.get("metadata") or {}
        view = await self.owners.view(body)
        if view is None:
            booked = podaccess.booked({"metadata": meta, "spec": body.get("spec") or {}})
            return kueuechecks.Stored(
                namespace=booked.namespace,
                name=booked.name,
                booked=booked,
                gang=_gang(body.get("spec") or {}),
                start_ms=None,
                end_ms=None,
                nodes=(),
            )
        booked = podaccess.booked(
            {
                "metadata": meta,
                "spec": view["request"],
                "status": {"state": view["state"], "resourceName": view.get("resourceName")},
            }
        )
        during = view.get("during") or None
        return kueuechecks.Stored(
            namespace=booked.namespace,
            name=booked.name,
            booked=booked,
            gang=_gang(view["request"]),
            start_ms=during["start"] if during else None,
            end_ms=during["end"] if during else None,
            nodes=tuple(await self.nodes.nodes_of(view["id"])),
            release_reason=view.get("releaseReason"),
        )


def _entries(workload: Mapping[str, Any], ours: set[str]) -> list[Mapping[str, Any]]:
    entries = (workload.get("status") or {}).get("admissionChecks") or ()
    return [e for e in entries if isinstance(e, Mapping) and str(e.get("name")) in ours]


def _gang(request: Mapping[str, Any]) -> int:
    size = (request.get("gang") or {}).get("size")
    return size if isinstance(size, int) and size > 0 else 1
