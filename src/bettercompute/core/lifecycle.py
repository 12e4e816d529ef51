"""What is due for a reservation now: the reconciler's rules as one pure decision.

Why here: the lifecycle's rules (when a binding starts, how often it may fail, what a lost node
or an unhealthy device means, when a pending reservation gives up) are the part of the
reconciler worth reading and testing as a table. ``store/reconciling.py`` locks the reservation,
reads a ``Reservation`` snapshot and its ``Allocation`` rows, calls ``decide`` and applies the
returned ``Step`` with guarded statements, the habit the placer follows (read, decide purely,
write). A re-placement is the one step whose outcome the store learns only by placing; what a
no-fit then means is decided here too, by ``after_no_fit``.

Never: I/O, reading a clock (``now`` is an argument: business time is ``compute_now()`` in the
database), or importing anything outside ``core``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bettercompute.core import pools, states
from bettercompute.core.durations import human, to_ms
from bettercompute.core.states import Condition, Reason, State

#: A binding the node has not reported within this long is tried elsewhere, …
BIND_TIMEOUT = dt.timedelta(minutes=5)
#: … except a node lease (binding ``node``): its machine is deployed, which takes longer.
NODE_BIND_TIMEOUT = dt.timedelta(hours=2)
#: The attempt that fails the reservation instead of placing it again.
MAX_BIND_ATTEMPTS = 3
#: How often an active reservation's nodes and devices are looked at again.
ACTIVE_RECHECK = dt.timedelta(minutes=15)
#: How often a pending reservation is placed again (sooner when capacity is freed).
PENDING_RETRY = dt.timedelta(seconds=30)


# --- what the store reads -----------------------------------------------------------------------


@dataclass(frozen=True)
class Reservation:
    """The locked reservation row, and the facts its state needs, read in the same transaction.

    The store reads only what the state asks for: ``pool`` for a pending reservation,
    ``booking_sound`` for a placed one, ``unhealthy_devices``, ``unreachable_nodes`` and
    ``foreign_exposed_nodes`` for an active one; the others keep their defaults.
    """

    state: State
    tenant_id: str
    #: How the devices are handed over: ``container``, ``kubernetes`` or ``node``.
    binding_mode: str
    conditions: Sequence[Mapping[str, Any]] = ()
    #: The binding as shown (``nodeId``, ``nodeIds``, …), or ``None``.
    binding: Mapping[str, Any] | None = None
    start: dt.datetime | None = None
    end: dt.datetime | None = None
    requested_start: dt.datetime | None = None
    duration: dt.timedelta = dt.timedelta(0)
    lease_seconds: int | None = None
    lease_expires_at: dt.datetime | None = None
    pending_since: dt.datetime | None = None
    bind_deadline: dt.datetime | None = None
    bind_failures: int = 0
    pool: pools.PoolInfo | None = None
    #: Every booked device healthy and not retired, on a ready node still in the pool.
    booking_sound: bool = True
    unhealthy_devices: Sequence[str] = ()
    unreachable_nodes: Sequence[str] = ()
    #: Booked nodes whose agent reports ``ForeignGpuExposure`` (an active reservation's).
    foreign_exposed_nodes: Sequence[str] = ()


@dataclass(frozen=True)
class Allocation:
    """One node's share of the reservation, with the node's last report."""

    id: str
    node_id: str
    state: str
    report: Mapping[str, Any] | None = None


# --- the steps ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class NothingDue:
    """Nothing to do now: the wake-up that matters is already queued (or none is needed)."""


@dataclass(frozen=True)
class WaitUntil:
    """Nothing changes now; look again at ``at``."""

    at: dt.datetime
    why: str


@dataclass(frozen=True)
class Release:
    """End the reservation now (the end was reached, or the lease lapsed)."""

    reason: str


@dataclass(frozen=True)
class CarryHeld:
    """Released: keep booked the devices a node has not yet confirmed free, a while longer."""


@dataclass(frozen=True)
class Fail:
    """Fail for good: unbook, refund, ``failed`` with ``condition`` as its only condition.

    ``bind_failures``: the attempt count to record first (a binding that ran out of attempts).
    """

    reason: str
    message: str
    condition: Mapping[str, Any]
    bind_failures: int | None = None


@dataclass(frozen=True)
class NoFitRule:
    """What a re-placement that does not fit means (see ``after_no_fit``)."""

    reason: str
    #: Put before the placer's message in the ``Unschedulable`` condition.
    prefix: str = ""
    #: Whether this is the reservation's first time pending (its ``pending`` event).
    first: bool = True
    #: A pending retry: an unchanged no-fit keeps the reservation as it is, version and all.
    still_pending_if_unchanged: bool = False


@dataclass(frozen=True)
class Place:
    """Book [start, end) and mark the reservation placed; on no fit, see ``no_fit``.

    ``unbook``: drop the current bookings first (a repair, a binding tried elsewhere).
    ``bind_failures``: record the attempt and clear the bind deadline before placing.
    ``then_condition``: added to the conditions after the placed or pending mark (the
    ``BindTimeout`` that says why the binding moved).
    """

    start: dt.datetime
    end: dt.datetime
    no_fit: NoFitRule
    lease: dt.datetime | None = None
    event: str = "reservation.placed"
    unbook: bool = False
    bind_failures: int | None = None
    then_condition: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Requeue:
    """A pool-lease pool's pending reservation is due a retry: hand it to the pool's batch.

    The batch tries it in the same fair order as new requests (``core.batching``) and, when it
    still does not fit, applies ``still_unschedulable`` as ``after_no_fit`` does. Nothing about
    the reservation changes here: no condition, no version.
    """


@dataclass(frozen=True)
class MarkPending:
    """``pending`` with ``Unschedulable``; retried in 30 s."""

    reason: str
    message: str
    first: bool


@dataclass(frozen=True)
class StartBinding:
    """The window began: hand the allocations to their nodes, ``binding`` until ``deadline``.

    Then decide again: reports that arrived while the reservation was placed count at once.
    """

    deadline: dt.datetime


@dataclass(frozen=True)
class Activate:
    """Every node bound: ``active`` with ``binding`` and ``conditions``; recheck later."""

    binding: Mapping[str, Any]
    conditions: Sequence[Mapping[str, Any]]
    recheck_at: dt.datetime


@dataclass(frozen=True)
class SetConditions:
    """Active, and its conditions changed: store these (and ``binding``); recheck later."""

    conditions: Sequence[Mapping[str, Any]]
    binding: Mapping[str, Any] | None
    recheck_at: dt.datetime


Step = (
    NothingDue
    | WaitUntil
    | Release
    | CarryHeld
    | Fail
    | Place
    | Requeue
    | MarkPending
    | StartBinding
    | Activate
    | SetConditions
)


# --- the rules ----------------------------------------------------------------------------------


def decide(
    reservation: Reservation, allocations: Sequence[Allocation], *, now: dt.datetime
) -> Step:
    """The next step for ``reservation`` at ``now``, by state.

    The lease and the end come first, whatever the state. While active it only sets and clears
    conditions: it never releases (the end and the lease do).
    """
    r = reservation
    if r.state in states.TERMINAL or r.state in (State.DRAFT, State.AWAITING_CONFIRMATION):
        # A released reservation is only woken while a node holds its devices.
        return CarryHeld() if r.state == State.RELEASED else NothingDue()
    if r.lease_expires_at is not None and now >= r.lease_expires_at:
        return Release("lease-lapsed")
    if r.end is not None and now >= r.end:
        # A spot reservation given notice ends at its deadline, released as preempted.
        preempted = any(c.get("type") == Condition.PREEMPTED for c in r.conditions)
        return Release("preempted" if preempted else "expired")
    if r.state == State.PENDING:
        return _pending(r, now)
    if r.state == State.PLACED:
        return _placed(r, now)
    if r.state == State.BINDING:
        return _binding(r, allocations, now)
    if r.state == State.ACTIVE:
        return _active(r, allocations, now)
    return NothingDue()


def after_no_fit(reservation: Reservation, step: Place, message: str, *, now: dt.datetime) -> Step:
    """What a ``Place`` that did not fit (the placer said ``message``) leads to."""
    rule = step.no_fit
    # Still no fit for the same reason: nothing changed, so keep the version still (no churn
    # for watchers) and try again in 30 s.
    if rule.still_pending_if_unchanged and still_unschedulable(reservation.conditions, message):
        return WaitUntil(now + PENDING_RETRY, "retry")
    return MarkPending(rule.reason, rule.prefix + message, rule.first)


def still_unschedulable(conditions: Sequence[Mapping[str, Any]], message: str) -> bool:
    """Whether a pending retry that did not fit (the placer said ``message``) leaves the
    reservation as it is: its ``Unschedulable`` already says so, or says that its booking went
    bad (which stays the reason). The reconciler's retries and the batch's share this rule."""
    current = next((c for c in conditions if c.get("type") == Condition.UNSCHEDULABLE), None)
    return current is not None and (
        current.get("reason") == Reason.BOOKING_REPAIR_FAILED or current.get("message") == message
    )


def _pending(r: Reservation, now: dt.datetime) -> Step:
    pool = r.pool
    if pool is None or not pool.visible_to(r.tenant_id):
        return _fail(
            Reason.POOL_GONE,
            "the pool is archived or no longer offered to the tenant",
            Condition.UNSCHEDULABLE,
            now,
        )
    if r.pending_since is not None and now - r.pending_since > dt.timedelta(
        milliseconds=pool.max_pending_ms
    ):
        return _fail(
            Reason.MAX_PENDING_EXCEEDED,
            f"pending longer than the pool's maxPending ({human(pool.max_pending_ms)})",
            Condition.UNSCHEDULABLE,
            now,
        )
    if pool.pool_lease and states.has_condition(r.conditions, Condition.QUEUED):
        # Queued for the pool-lease placer: its batch places it, never the reconciler (a pool
        # switched back to inline has its queued reservations placed here instead).
        return NothingDue()
    if pool.pool_lease:
        # Any other retry of a pool-lease pool goes through its batch too, so what waits is
        # tried in the same fair order as new requests: one tenant's older flood does not take
        # freed capacity ahead of another tenant's request.
        return Requeue()
    # The requested start is kept while it is ahead; once it has passed, the window begins at
    # placement with the full duration.
    start = max(now, r.requested_start) if r.requested_start is not None else now
    lease = now + dt.timedelta(seconds=r.lease_seconds) if r.lease_seconds else None
    return Place(
        start=start,
        end=start + r.duration,
        lease=lease,
        no_fit=NoFitRule(Reason.NO_FIT, first=False, still_pending_if_unchanged=True),
    )


def _placed(r: Reservation, now: dt.datetime) -> Step:
    # A placed reservation has its window.
    assert r.start is not None
    assert r.end is not None
    if not r.booking_sound:
        # Repair before the start: book the same window elsewhere, or wait pending.
        return Place(
            start=max(r.start, now),
            end=r.end,
            unbook=True,
            event="reservation.repaired",
            no_fit=NoFitRule(
                Reason.BOOKING_REPAIR_FAILED, prefix="the booking went bad before the start: "
            ),
        )
    if now < r.start:
        return NothingDue()
    timeout = NODE_BIND_TIMEOUT if r.binding_mode == "node" else BIND_TIMEOUT
    return StartBinding(now + timeout)


def _binding(r: Reservation, allocations: Sequence[Allocation], now: dt.datetime) -> Step:
    failed = [a for a in allocations if a.state == "failed"]
    if allocations and not failed and all(a.state == "bound" for a in allocations):
        return Activate(
            binding=binding_view(allocations),
            conditions=states.without(r.conditions, Condition.BIND_TIMEOUT),
            recheck_at=now + ACTIVE_RECHECK,
        )
    if not failed and r.bind_deadline is not None and now < r.bind_deadline:
        return NothingDue()
    attempt = r.bind_failures + 1
    reason = Reason.NODE_REJECTED_BINDING if failed else Reason.NODE_DID_NOT_BIND
    if failed:
        detail = "; ".join(
            f"{a.node_id}: {(a.report or {}).get('reason', 'failed')}" for a in failed
        )
        what = f"node refused the binding ({detail})"
    else:
        silent = sorted({a.node_id for a in allocations if a.state != "bound"})
        what = f"no bound report within the deadline from {', '.join(silent)}"
    message = f"attempt {attempt} of {MAX_BIND_ATTEMPTS}: {what}"
    # A node lease (binding 'node') gets no second placement: its machines were deployed for it.
    if attempt >= MAX_BIND_ATTEMPTS or r.binding_mode == "node":
        return _fail(reason, message, Condition.BIND_TIMEOUT, now, bind_failures=attempt)
    assert r.end is not None  # a binding reservation has its window
    # Release the bookings and place again, for what remains of the window.
    return Place(
        start=now,
        end=r.end,
        unbook=True,
        bind_failures=attempt,
        then_condition=states.condition(Condition.BIND_TIMEOUT, reason, message, at_ms=to_ms(now)),
        no_fit=NoFitRule(Reason.NO_FIT),
    )


def _active(r: Reservation, allocations: Sequence[Allocation], now: dt.datetime) -> Step:
    """Set and clear ``Degraded`` and ``NodeUnreachable`` from reports, devices and nodes."""
    lost = sorted(a.node_id for a in allocations if a.state == "lost")
    at = to_ms(now)
    kept = {c["type"]: c for c in r.conditions}
    wanted: list[Mapping[str, Any]] = []
    # One Degraded at a time, the gravest: a lost binding, then devices others can hand out
    # (another device plugin, then pods of another namespace), then an unhealthy device.
    intruders = sorted(
        f"{a.node_id}: {pod}"
        for a in allocations
        if a.state == "bound"
        for pod in (a.report or {}).get("intruders") or ()
    )
    if lost:
        wanted.append(
            _keep(
                kept,
                states.condition(
                    Condition.DEGRADED,
                    Reason.BINDING_LOST,
                    f"nodes reported lost devices: {', '.join(lost)}",
                    at_ms=at,
                ),
            )
        )
    elif r.foreign_exposed_nodes:
        wanted.append(
            _keep(
                kept,
                states.condition(
                    Condition.DEGRADED,
                    Reason.FOREIGN_GPU_EXPOSURE,
                    "something besides bcd can hand the GPUs of these nodes to pods: "
                    + ", ".join(r.foreign_exposed_nodes),
                    at_ms=at,
                ),
            )
        )
    elif intruders:
        wanted.append(
            _keep(
                kept,
                states.condition(
                    Condition.DEGRADED,
                    Reason.POD_OUTSIDE_NAMESPACE,
                    "pods outside the Reservation's namespace hold its devices: "
                    + ", ".join(intruders),
                    at_ms=at,
                ),
            )
        )
    elif r.unhealthy_devices:
        wanted.append(
            _keep(
                kept,
                states.condition(
                    Condition.DEGRADED,
                    Reason.ATOM_UNHEALTHY,
                    f"unhealthy booked devices: {', '.join(r.unhealthy_devices)}",
                    at_ms=at,
                ),
            )
        )
    if r.unhealthy_devices and r.binding_mode == "node":
        # A node lease is not billed for its unhealthy GPUs (store/usage.py's rule): say so.
        wanted.append(
            _keep(
                kept,
                states.condition(
                    Condition.UNHEALTHY_ATOMS,
                    Reason.NOT_BILLED,
                    f"not billed while unhealthy: {', '.join(r.unhealthy_devices)}",
                    at_ms=at,
                ),
            )
        )
    if r.unreachable_nodes:
        wanted.append(
            _keep(
                kept,
                states.condition(
                    Condition.NODE_UNREACHABLE,
                    Reason.UNREACHABLE,
                    f"nodes not connected: {', '.join(r.unreachable_nodes)}",
                    at_ms=at,
                ),
            )
        )
    computed = (Condition.DEGRADED, Condition.NODE_UNREACHABLE, Condition.UNHEALTHY_ATOMS)
    others = [c for c in r.conditions if c["type"] not in computed]
    conditions = others + wanted
    recheck_at = now + ACTIVE_RECHECK
    binding = binding_view(allocations) if allocations and not lost else r.binding
    # A re-report (the pods holding the devices changed) moves the binding alone.
    if conditions == list(r.conditions) and binding == r.binding:
        return WaitUntil(recheck_at, "recheck")
    return SetConditions(conditions=conditions, binding=binding, recheck_at=recheck_at)


def _keep(existing: Mapping[str, Mapping[str, Any]], new: dict[str, Any]) -> Mapping[str, Any]:
    # A condition that still holds keeps its original ``since``.
    old = existing.get(new["type"])
    if old and old.get("reason") == new["reason"] and old.get("message") == new["message"]:
        return dict(old)
    return new


def _fail(
    reason: str,
    message: str,
    kind: Condition,
    now: dt.datetime,
    *,
    bind_failures: int | None = None,
) -> Fail:
    return Fail(
        reason=reason,
        message=message,
        condition=states.condition(kind, reason, message, at_ms=to_ms(now)),
        bind_failures=bind_failures,
    )


def binding_view(allocations: Sequence[Allocation]) -> dict[str, Any]:
    """The ``binding`` shown once nodes have bound: nodes, allocations, CDI devices, env files,
    for a hold with limits the cgroup slice (``cgroupParent``), and for a ``kubernetes`` binding
    the pods (``namespace/name``) its nodes last saw holding its devices (``pods``)."""
    reports = [a.report or {} for a in allocations]
    view: dict[str, Any] = {
        "nodeId": allocations[0].node_id,
        "nodeIds": [a.node_id for a in allocations],
        "allocationIds": [a.id for a in allocations],
        "cdiDevices": [d for r in reports for d in r.get("cdiDevices", [])],
        # Whether every node's bound report was signed by that node's certified key and
        # checked before it counted (attested bindings).
        "attested": all(r.get("attested") is True for r in reports),
    }
    env_files = [r["envFile"] for r in reports if r.get("envFile")]
    if env_files:
        view["envFile"] = env_files[0]
        if len(env_files) > 1:
            view["envFiles"] = env_files
    # The store keeps a node's slice only when it is that allocation's own (store.reports).
    slices = [r["cgroupParent"] for r in reports if r.get("cgroupParent")]
    if slices:
        view["cgroupParent"] = slices[0]
        if len(slices) > 1:
            view["cgroupParents"] = slices
    pods = sorted({p for r in reports for p in r.get("pods") or ()})
    if pods:
        view["pods"] = pods
    return view
