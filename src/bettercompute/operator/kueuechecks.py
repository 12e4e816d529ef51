"""The Kueue AdmissionCheck ``bcd.dev/reservation``: what each Workload's check should say.

Why it exists: Kueue (``kueue.x-k8s.io/v1beta1``) lets an external controller gate a Workload's
admission through an AdmissionCheck and hand its pods labels and a node selector
(``podSetUpdates``); see ``docs/reference/kueue-admission-checks.md`` for the facts, checked in
Kueue's source. A Workload names a Reservation (``bcd.dev/reservation``: a label or annotation
of the Workload or of its owner Job, or a label of its pod template), and its check is:

- ``Pending`` while the Reservation is not yet ``active`` (the message says when it starts);
- ``Ready`` once it is active and every pod set fits what it holds, with updates that add the
  label our pod webhooks read (so the pods are rewritten to the reservation's devices) and, for
  a one-node reservation, that node's ``kubernetes.io/hostname``;
- ``Retry`` when a Reservation it was ``Ready`` for is being placed again;
- ``Rejected`` with the reason: no or two reservations named, a missing one, one of another
  namespace, one that can never fit, or one that ended.

A Workload whose check is ``Ready`` is told when its reservation is about to end: the window
ends within the pool's spot notice (``policy.spot.noticeSeconds``, 120 s by default, the lead
time spot preemption gives running work) or the reservation is being preempted. ``notice``
says so, and ``ending_conditions`` gives the Workload's ``status.conditions`` with our own
condition ``bcd.dev/ReservationEnding`` set (Kueue's conditions kept as they are);
``kueuesyncing`` writes them and posts one Warning Event, reason ``ReservationEnding``, when the
condition turns true. Never a notice for a check that is not ``Ready``: its pods hold nothing.

The namespace rule is the security boundary: a Workload may only use a Reservation of its own
namespace, or a tenant could queue jobs onto another tenant's devices. ``decide`` is given
every Reservation of that name in the cluster and keeps only the Workload's namespace's.

Pure: nothing here does I/O. ``kueuesyncing`` reads the objects and the store, calls
``decide`` and ``merged_checks``, and writes. What it must never do: believe a Reservation's
``status`` (a tenant may be able to write it): the state, devices and window come from the
store (``Stored``), read by ``kueuesyncing`` through ``podowners``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from bettercompute.core import pools, states
from bettercompute.kube import names
from bettercompute.operator import podaccess

#: The ``spec.controllerName`` of our AdmissionChecks.
CONTROLLER_NAME = "bcd.dev/reservation"
GROUP = "kueue.x-k8s.io"
VERSION = "v1beta1"
API_VERSION = f"{GROUP}/{VERSION}"
#: The label or annotation naming the Reservation (the one the pod webhooks read).
RESERVATION_KEY = names.POD_RESERVATION_LABEL
HOSTNAME_LABEL = "kubernetes.io/hostname"

PENDING, READY, RETRY, REJECTED = "Pending", "Ready", "Retry", "Rejected"
#: Our condition on a Workload whose reservation is about to end, and its Event's reason.
ENDING_CONDITION = "bcd.dev/ReservationEnding"
ENDING_EVENT_REASON = "ReservationEnding"
#: The longest message Kueue's schema accepts.
MESSAGE_MAX = 32768


@dataclasses.dataclass(frozen=True)
class Stored:
    """One Reservation object as the store knows it (never from its ``status``)."""

    namespace: str
    name: str
    booked: podaccess.Booked
    #: Nodes a gang spans (1 without a gang).
    gang: int
    #: The booked window's start and end, epoch ms; ``None`` until placed.
    start_ms: int | None
    end_ms: int | None
    #: The nodes its allocations are on.
    nodes: tuple[str, ...]
    release_reason: str | None = None
    #: The pool's spot notice, seconds: the lead time an ending reservation is announced at.
    notice_s: int = pools.DEFAULT_SPOT_NOTICE_S
    #: Being preempted (its ``Preempted`` condition): its window was cut to the deadline.
    preempted: bool = False


@dataclasses.dataclass(frozen=True)
class Decision:
    """What one check entry should say."""

    state: str
    message: str
    pod_set_updates: tuple[Mapping[str, Any], ...] = ()


def _named_in(meta: Mapping[str, Any] | None) -> set[str]:
    found: set[str] = set()
    for key in ("labels", "annotations"):
        values = (meta or {}).get(key)
        if isinstance(values, Mapping) and values.get(RESERVATION_KEY) is not None:
            found.add(str(values[RESERVATION_KEY]))
    return found


def names_given(workload: Mapping[str, Any], owner_job: Mapping[str, Any] | None) -> set[str]:
    """Every Reservation name the Workload gives: its own labels and annotations, its pod
    sets' template labels, and its owner Job's labels and annotations."""
    found = _named_in(workload.get("metadata"))
    for pod_set in pod_sets(workload):
        template = pod_set.get("template") or {}
        labels = (template.get("metadata") or {}).get("labels")
        if isinstance(labels, Mapping) and labels.get(RESERVATION_KEY) is not None:
            found.add(str(labels[RESERVATION_KEY]))
    if owner_job is not None:
        found |= _named_in(owner_job.get("metadata"))
    return found


def owner_job_reference(workload: Mapping[str, Any]) -> tuple[str, str] | None:
    """(name, uid) of the Workload's controlling ``batch/v1`` Job, as Kueue sets it."""
    for ref in (workload.get("metadata") or {}).get("ownerReferences") or ():
        if (
            isinstance(ref, Mapping)
            and ref.get("controller") is True
            and ref.get("apiVersion") == "batch/v1"
            and ref.get("kind") == "Job"
            and podaccess.is_object_name(ref.get("name"))
        ):
            return str(ref["name"]), str(ref.get("uid") or "")
    return None


def pod_sets(workload: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    found = (workload.get("spec") or {}).get("podSets")
    return [p for p in found if isinstance(p, Mapping)] if isinstance(found, list) else []


def is_finished(workload: Mapping[str, Any]) -> bool:
    """Kueue's ``Finished`` condition is true: nothing left to admit."""
    for condition in (workload.get("status") or {}).get("conditions") or ():
        if isinstance(condition, Mapping) and condition.get("type") == "Finished":
            return condition.get("status") == "True"
    return False


def decide(
    *,
    workload: Mapping[str, Any],
    named: set[str],
    candidates: Sequence[Stored],
    previous: str | None,
    shown: Any,
) -> Decision:
    """The check's state for ``workload``, which names ``named``; ``candidates`` are the
    Reservations of that name in any namespace (as the store knows them), ``previous`` the
    check's current state, ``shown`` turns epoch ms into the time a message shows."""
    namespace = str((workload.get("metadata") or {}).get("namespace") or "")
    if not named:
        return Decision(
            REJECTED,
            f"the Workload names no Reservation: label or annotate its Job (or the Job's pod "
            f"template) with {RESERVATION_KEY}: <name>",
        )
    if len(named) > 1:
        return Decision(REJECTED, f"the Workload names several Reservations: {sorted(named)}")
    name = next(iter(named))
    if not podaccess.is_object_name(name):
        return Decision(REJECTED, f"{RESERVATION_KEY}: {name!r} is not a Reservation's name")
    own = _own(workload, candidates)
    if not own:
        if candidates:
            return Decision(
                REJECTED,
                f"Reservation {name!r} is not in namespace {namespace!r}: a Workload may only "
                "use a Reservation of its own namespace",
            )
        return Decision(REJECTED, f"Reservation {name!r} does not exist in namespace {namespace!r}")
    return _decide_for(workload, own[0], previous=previous, shown=shown)


def _own(workload: Mapping[str, Any], candidates: Sequence[Stored]) -> list[Stored]:
    """The security boundary: only the Workload's own namespace's Reservation counts."""
    namespace = str((workload.get("metadata") or {}).get("namespace") or "")
    return [c for c in candidates if c.namespace == namespace]


@dataclasses.dataclass(frozen=True)
class Notice:
    """Why a Ready Workload's reservation is about to end: the condition's reason and the
    message of the condition and the Event."""

    reason: str
    message: str


def notice(
    *,
    workload: Mapping[str, Any],
    decision: Decision,
    candidates: Sequence[Stored],
    now_ms: int,
    shown: Any,
) -> Notice | None:
    """The notice the Workload is owed now, or ``None``: only for a ``Ready`` check, when its
    reservation is being preempted or its window ends within its pool's spot notice."""
    own = _own(workload, candidates)
    if decision.state != READY or not own:
        return None
    stored = own[0]
    if stored.booked.state != states.State.ACTIVE or stored.end_ms is None:
        return None
    ends = shown(stored.end_ms)
    if stored.preempted:
        return Notice(
            "SpotPreempted",
            f"spot Reservation {stored.name!r} is preempted: its devices go at {ends}",
        )
    if stored.end_ms - now_ms <= stored.notice_s * 1000:
        return Notice(
            "WindowEnds",
            f"Reservation {stored.name!r} ends at {ends}: its devices go then (notice "
            f"{stored.notice_s} s, the pool's spot notice); extend it to keep them",
        )
    return None


def ending_conditions(
    workload: Mapping[str, Any], found: Notice | None, *, now: str
) -> list[dict[str, Any]] | None:
    """The Workload's ``status.conditions`` with ``bcd.dev/ReservationEnding`` true while
    ``found`` is a notice, false once a notice no longer holds (the reservation was
    extended), every other condition kept in place; ``None`` when nothing changes (never a
    false condition where there was none)."""
    conditions = [
        dict(c)
        for c in (workload.get("status") or {}).get("conditions") or ()
        if isinstance(c, Mapping)
    ]
    at = next((i for i, c in enumerate(conditions) if c.get("type") == ENDING_CONDITION), None)
    previous = conditions[at] if at is not None else None
    if found is None:
        if previous is None or previous.get("status") != "True":
            return None
        status, reason, message = "False", "NotEnding", "the reservation no longer ends soon"
    else:
        status, reason, message = "True", found.reason, found.message
    wanted: dict[str, Any] = {
        "type": ENDING_CONDITION,
        "status": status,
        "reason": reason,
        "message": message[:MESSAGE_MAX],
        "lastTransitionTime": (
            previous.get("lastTransitionTime")
            if previous is not None and previous.get("status") == status
            else now
        ),
    }
    generation = (workload.get("metadata") or {}).get("generation")
    if isinstance(generation, int):
        wanted["observedGeneration"] = generation
    if wanted == previous:
        return None
    if at is None:
        return [*conditions, wanted]
    conditions[at] = wanted
    return conditions


def _decide_for(
    workload: Mapping[str, Any], stored: Stored, *, previous: str | None, shown: Any
) -> Decision:
    booked, name = stored.booked, stored.name
    if booked.binding != "kubernetes":
        return Decision(
            REJECTED,
            f"Reservation {name!r} has binding {booked.binding!r}; only a Reservation with "
            "binding 'kubernetes' hands its devices to pods",
        )
    problem = fit_problem(workload, stored)
    if problem is not None:
        return Decision(REJECTED, problem)
    state = booked.state
    if state in states.TERMINAL or state == states.State.RELEASING:
        why = f" ({stored.release_reason})" if stored.release_reason else ""
        return Decision(
            REJECTED, f"Reservation {name!r} is {state}{why}: it holds no devices any more"
        )
    if state == states.State.ACTIVE:
        return Decision(
            READY,
            f"Reservation {name!r} is active"
            + (f" until {shown(stored.end_ms)}" if stored.end_ms is not None else ""),
            tuple(_updates(workload, stored)),
        )
    if previous in (READY, RETRY):
        # It was active for this Workload and is not now: its devices are being placed again.
        return Decision(RETRY, f"Reservation {name!r} is {state}: being placed again")
    if stored.start_ms is not None:
        when = f"; its window starts at {shown(stored.start_ms)}"
    else:
        when = "; it has no window yet"
    return Decision(PENDING, f"Reservation {name!r} is {state or 'not admitted yet'}{when}")


def fit_problem(workload: Mapping[str, Any], stored: Stored) -> str | None:
    """Why the Workload's pod sets can never run in the Reservation, or ``None``: each pod must
    fit what the reservation holds on one node, and all pods together what it holds."""
    booked = stored.booked
    total: dict[str, int] = {}
    for pod_set in pod_sets(workload):
        template = pod_set.get("template") or {}
        found = podaccess.asks(template)
        where = f"pod set {pod_set.get('name')!r}"
        for ask in found:
            if ask.malformed:
                field, value = ask.malformed[0]
                return f"{where}: {field} is {value!r}, not a whole number of devices"
        count = pod_set.get("count")
        pods = count if isinstance(count, int) and count > 0 else 1
        for resource, asked in podaccess.effective(found).items():
            device_class = _class_of(resource, booked)
            if device_class is None:
                return (
                    f"{where} asks {resource}, which Reservation {stored.name!r} does not hold "
                    f"(it holds {_holds(booked)} per node)"
                )
            held = booked.per_node[device_class]
            if asked > held:
                return (
                    f"{where} asks {asked} {resource} per pod; Reservation {stored.name!r} "
                    f"holds {held} per node ({_holds(booked)}) and a pod runs on one node"
                )
            total[device_class] = total.get(device_class, 0) + asked * pods
    for device_class, asked in sorted(total.items()):
        held = booked.per_node[device_class] * max(stored.gang, 1)
        if asked > held:
            return (
                f"the pod sets ask {asked} {device_class} devices in all; Reservation "
                f"{stored.name!r} holds {held}"
            )
    return None


def _class_of(resource: str, booked: podaccess.Booked) -> str | None:
    """The device class a resource asks of this reservation (``None``: one it does not hold)."""
    if resource == booked.resource_name and len(booked.per_node) == 1:
        return next(iter(booked.per_node))
    device_class = podaccess.CLASS_OF.get(resource)
    return device_class if device_class in booked.per_node else None


def _holds(booked: podaccess.Booked) -> str:
    return ", ".join(f"{n} {c}" for c, n in sorted(booked.per_node.items())) or "nothing"


def _updates(workload: Mapping[str, Any], stored: Stored) -> Iterable[Mapping[str, Any]]:
    for pod_set in pod_sets(workload)[:8]:  # Kueue's schema: at most 8 updates
        update: dict[str, Any] = {
            "name": str(pod_set.get("name")),
            "labels": {RESERVATION_KEY: stored.name},
        }
        # One node: pin it. Several: a node selector cannot say "one of these", and the
        # reservation's own resource is advertised only on its nodes anyway.
        if len(stored.nodes) == 1:
            update["nodeSelector"] = {HOSTNAME_LABEL: stored.nodes[0]}
        yield update


def merged_checks(
    entries: Sequence[Mapping[str, Any]], ours: Mapping[str, Decision], *, now: str
) -> list[dict[str, Any]] | None:
    """``status.admissionChecks`` with our entries set to ``ours`` and every other entry kept
    as it is; ``None`` when nothing changes. As Kueue's ``SetAdmissionCheckState`` does,
    ``lastTransitionTime`` moves only when the state changes."""
    merged: list[dict[str, Any]] = []
    changed = False
    for entry in entries:
        current = dict(entry)
        decision = ours.get(str(entry.get("name")))
        if decision is not None:
            wanted = {
                **current,
                "state": decision.state,
                "message": decision.message[:MESSAGE_MAX],
                "podSetUpdates": [dict(u) for u in decision.pod_set_updates],
            }
            if not wanted["podSetUpdates"]:
                wanted.pop("podSetUpdates")
            if current.get("state") != decision.state:
                wanted["lastTransitionTime"] = now
            if wanted != current:
                changed = True
            current = wanted
        merged.append(current)
    return merged if changed else None


def active_condition(check: Mapping[str, Any], *, now: str) -> list[dict[str, Any]] | None:
    """Our AdmissionCheck's ``status.conditions`` with ``Active=True`` (what Kueue's scheduler
    needs before a ClusterQueue listing it admits anything); ``None`` when already so."""
    generation = (check.get("metadata") or {}).get("generation")
    conditions = [
        dict(c)
        for c in (check.get("status") or {}).get("conditions") or ()
        if isinstance(c, Mapping)
    ]
    previous = next((c for c in conditions if c.get("type") == "Active"), {})
    was_true = previous.get("status") == "True"
    if was_true and previous.get("observedGeneration") == generation:
        return None
    kept = [c for c in conditions if c.get("type") != "Active"]
    active = {
        "type": "Active",
        "status": "True",
        "reason": "Active",
        "message": "the Better Compute operator evaluates this check",
        # Moves only when the status does, as for any condition.
        "lastTransitionTime": previous.get("lastTransitionTime") if was_true else now,
    }
    if isinstance(generation, int):
        active["observedGeneration"] = generation
    return [*kept, active]
