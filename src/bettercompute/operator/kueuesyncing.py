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
   the next pass reads again;
5. in the same write, our condition ``bcd.dev/ReservationEnding`` in ``status.conditions``
   (Kueue's kept) when a Ready Workload's reservation ends within its pool's spot notice or is
   being preempted (``kueuechecks.notice``), and one Warning Event on the Workload when that
   condition turns true, posted only after the write succeeded: the condition, kept on the
   Workload, is what makes it one Event across passes and restarts.

``run`` makes a pass when woken (a Workload or AdmissionCheck event, a reservation change)
and every ``resync_s`` in any case; everything is read again each pass, so an operator that
restarts loses nothing. What it must never do: decide (``kueuechecks`` does), write any
Workload field but ``status.admissionChecks`` and our own condition, or touch an entry of
another controller's check or a condition of Kueue's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from lightkube import ALL_NS
from lightkube.generic_resource import create_global_resource, create_namespaced_resource
from lightkube.resources.batch_v1 import Job

from bettercompute.core import moments, pools, states
from bettercompute.kube import resources
from bettercompute.kube.client import KubeClient, KubeError
from bettercompute.operator import kueuechecks, podaccess, podowners
from bettercompute.service import reservations
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


def _wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


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
        now_ms: Callable[[], int] = _wall_clock_ms,
    ) -> None:
        self.kube = kube
        self.service = service
        self.owners = podowners.PodOwners(service)
        #: Wall-clock time for the notice's lead time, as the node agent's preemption notice.
        self.now_ms = now_ms
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
        notices = [
            kueuechecks.notice(
                workload=workload,
                decision=decision,
                candidates=candidates,
                now_ms=self.now_ms(),
                shown=moments.rfc3339,
            )
            for decision in decisions.values()
        ]
        owed = next((n for n in notices if n is not None), None)
        conditions = kueuechecks.ending_conditions(workload, owed, now=self.clock())
        if merged is None and conditions is None:
            return 0
        status: dict[str, Any] = {}
        if merged is not None:
            status["admissionChecks"] = merged
        if conditions is not None:
            status["conditions"] = conditions
        await self.kube.patch(
            WORKLOADS,
            str(meta["name"]),
            {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "status": status},
            namespace=str(meta["namespace"]),
            status=True,
        )
        if owed is not None and conditions is not None and not _ending(workload):
            await self._tell(workload, owed)
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

    async def _tell(self, workload: Mapping[str, Any], owed: kueuechecks.Notice) -> None:
        """The Warning Event of a notice; best effort (the condition is the state)."""
        meta = workload["metadata"]
        try:
            await self.kube.post_event(
                involved={**workload, "apiVersion": kueuechecks.API_VERSION, "kind": "Workload"},
                type_="Warning",
                reason=kueuechecks.ENDING_EVENT_REASON,
                message=owed.message,
                namespace=str(meta["namespace"]),
            )
        except KubeError as e:
            log.warning(
                "could not post the notice of Workload %s/%s: %s",
                meta["namespace"],
                meta["name"],
                e,
            )
        log.warning("Workload %s/%s: %s", meta["namespace"], meta["name"], owed.message)

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
            notice_s=await self._notice_s(view["poolId"], view["tenantId"]),
            preempted=states.has_condition(
                view.get("conditions") or (), states.Condition.PREEMPTED
            ),
        )

    async def _notice_s(self, pool_id: str, tenant_id: str) -> int:
        """The pool's spot notice (``policy.spot.noticeSeconds``, its default when unset)."""
        pool = await reservations.admission_pool(self.service.db, pool_id, tenant_id)
        return pool.spot_notice_s if pool is not None else pools.DEFAULT_SPOT_NOTICE_S


def _ending(workload: Mapping[str, Any]) -> bool:
    """Our condition is already true: its Event was posted when it turned so."""
    return any(
        isinstance(c, Mapping)
        and c.get("type") == kueuechecks.ENDING_CONDITION
        and c.get("status") == "True"
        for c in (workload.get("status") or {}).get("conditions") or ()
    )


def _entries(workload: Mapping[str, Any], ours: set[str]) -> list[Mapping[str, Any]]:
    entries = (workload.get("status") or {}).get("admissionChecks") or ()
    return [e for e in entries if isinstance(e, Mapping) and str(e.get("name")) in ours]


def _gang(request: Mapping[str, Any]) -> int:
    size = (request.get("gang") or {}).get("size")
    return size if isinstance(size, int) and size > 0 else 1
