"""The lifecycle's rules as tables: ``core.lifecycle.decide`` and ``after_no_fit``, no database.

Each row is a reservation snapshot, its allocations and ``now``, and the one step the rules
must return. What the store does with a step (the SQL, the locks, the races) is tested in
``tests/store/test_lifecycle.py``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import pytest

from bettercompute.core import lifecycle, pools
from bettercompute.core.durations import to_ms
from bettercompute.core.lifecycle import (
    Activate,
    Allocation,
    CarryHeld,
    Fail,
    MarkPending,
    NoFitRule,
    NothingDue,
    Place,
    Release,
    Requeue,
    Reservation,
    SetConditions,
    StartBinding,
    WaitUntil,
)
from bettercompute.core.states import State

NOW = dt.datetime(2026, 5, 1, 12, 0, tzinfo=dt.UTC)
NOW_MS = to_ms(NOW)
MS = dt.timedelta(milliseconds=1)
HOUR = dt.timedelta(hours=1)
MINUTE = dt.timedelta(minutes=1)


# --- builders ---------------------------------------------------------------------------------


def pool(**kw: Any) -> pools.PoolInfo:
    fields: dict[str, Any] = {
        "id": "pool_a",
        "owner_tenant_id": "acme",
        "region": "eu-west-1",
        "gpu_model": "H100",
        "sharing_mode": "exclusive",
        "replicas": 1,
        "archived": False,
        **kw,
    }
    fields["policy"] = pools.PoolPolicy(**fields.get("policy", {}))
    return pools.PoolInfo(**fields)


def pending(**kw: Any) -> Reservation:
    fields: dict[str, Any] = {
        "state": State.PENDING,
        "tenant_id": "acme",
        "binding_mode": "container",
        "duration": 2 * HOUR,
        "pending_since": NOW - MINUTE,
        "pool": pool(),
        **kw,
    }
    return Reservation(**fields)


def placed(**kw: Any) -> Reservation:
    fields: dict[str, Any] = {
        "state": State.PLACED,
        "tenant_id": "acme",
        "binding_mode": "container",
        "start": NOW + HOUR,
        "end": NOW + 2 * HOUR,
        "duration": HOUR,
        "binding": {"nodeId": "n1", "nodeIds": ["n1"]},
        **kw,
    }
    return Reservation(**fields)


def binding(**kw: Any) -> Reservation:
    fields: dict[str, Any] = {
        "state": State.BINDING,
        "start": NOW - MINUTE,
        "end": NOW + HOUR,
        "bind_deadline": NOW + 4 * MINUTE,
        **kw,
    }
    return placed(**fields)


def active(**kw: Any) -> Reservation:
    # Bound on n1, as activation stored it: a recheck that changes nothing writes nothing.
    fields: dict[str, Any] = {
        "state": State.ACTIVE,
        "bind_deadline": None,
        "binding": lifecycle.binding_view([bound("n1")]),
        **kw,
    }
    return binding(**fields)


def alloc(node: str, state: str, **report: Any) -> Allocation:
    return Allocation(id=f"alloc_{node}", node_id=node, state=state, report=report or None)


def bound(node: str) -> Allocation:
    return alloc(
        node,
        "bound",
        cdiDevices=[f"bcd.dev/gpu={node}-0"],
        envFile=f"/run/bcd/allocations/alloc_{node}.env",
    )


def cond(kind: str, reason: str, message: str, since: int = NOW_MS) -> dict[str, Any]:
    return {"type": kind, "reason": reason, "message": message, "since": since}


def view(*allocs: Allocation) -> dict[str, Any]:
    return lifecycle.binding_view(allocs)


RETRY_PENDING = NoFitRule("NoFit", first=False, still_pending_if_unchanged=True)
RECHECK = WaitUntil(NOW + 15 * MINUTE, "recheck")


# --- decide: a table of (reservation, allocations, now) → step ----------------------------------

Row = tuple[Reservation, list[Allocation], dt.datetime, lifecycle.Step]

DECIDE: dict[str, Row] = {
    # Terminal and not-yet-admitted states: nothing, except the devices a release still holds.
    "released: carry the held devices": (
        placed(state=State.RELEASED),
        [],
        NOW,
        CarryHeld(),
    ),
    **{
        f"{s.value}: nothing": (placed(state=s), [], NOW, NothingDue())
        for s in (
            State.FAILED,
            State.CANCELLED,
            State.DENIED,
            State.EXPIRED,
            State.DRAFT,
            State.AWAITING_CONFIRMATION,
        )
    },
    # The lease and the end come first, in every live state.
    "active, lease lapsed at its instant": (
        active(lease_seconds=600, lease_expires_at=NOW),
        [bound("n1")],
        NOW,
        Release("lease-lapsed"),
    ),
    "active, lease and end both passed: the lease is the reason": (
        active(lease_seconds=600, lease_expires_at=NOW - MINUTE, end=NOW - MS),
        [bound("n1")],
        NOW,
        Release("lease-lapsed"),
    ),
    "active, end reached at its instant: expired": (
        active(end=NOW),
        [bound("n1")],
        NOW,
        Release("expired"),
    ),
    "active, one ms before the end: still running": (
        active(end=NOW + MS),
        [bound("n1")],
        NOW,
        RECHECK,
    ),
    "active, lease renewed past now: still running": (
        active(lease_seconds=600, lease_expires_at=NOW + MS),
        [bound("n1")],
        NOW,
        RECHECK,
    ),
    "pending with a lapsed lease: released": (
        pending(lease_seconds=600, lease_expires_at=NOW - MS),
        [],
        NOW,
        Release("lease-lapsed"),
    ),
    "binding, end reached: expired": (
        binding(end=NOW - MS),
        [alloc("n1", "desired")],
        NOW,
        Release("expired"),
    ),
    # Pending: give up when the pool is gone or after maxPending; otherwise place again.
    "pending, pool deleted": (
        pending(pool=None),
        [],
        NOW,
        Fail(
            "PoolGone",
            "the pool is archived or no longer offered to the tenant",
            cond(
                "Unschedulable",
                "PoolGone",
                "the pool is archived or no longer offered to the tenant",
            ),
        ),
    ),
    "pending, pool archived": (
        pending(pool=pool(archived=True)),
        [],
        NOW,
        Fail(
            "PoolGone",
            "the pool is archived or no longer offered to the tenant",
            cond(
                "Unschedulable",
                "PoolGone",
                "the pool is archived or no longer offered to the tenant",
            ),
        ),
    ),
    "pending, offer withdrawn": (
        pending(pool=pool(owner_tenant_id="lender", offered=False)),
        [],
        NOW,
        Fail(
            "PoolGone",
            "the pool is archived or no longer offered to the tenant",
            cond(
                "Unschedulable",
                "PoolGone",
                "the pool is archived or no longer offered to the tenant",
            ),
        ),
    ),
    "pending, offered pool: placed again": (
        pending(pool=pool(owner_tenant_id="lender", offered=True)),
        [],
        NOW,
        Place(start=NOW, end=NOW + 2 * HOUR, no_fit=RETRY_PENDING),
    ),
    "pending longer than maxPending: failed": (
        pending(pool=pool(policy={"maxPending": "1h"}), pending_since=NOW - HOUR - MS),
        [],
        NOW,
        Fail(
            "MaxPendingExceeded",
            "pending longer than the pool's maxPending (1h)",
            cond(
                "Unschedulable",
                "MaxPendingExceeded",
                "pending longer than the pool's maxPending (1h)",
            ),
        ),
    ),
    "pending exactly maxPending: placed again": (
        pending(pool=pool(policy={"maxPending": "1h"}), pending_since=NOW - HOUR),
        [],
        NOW,
        Place(start=NOW, end=NOW + 2 * HOUR, no_fit=RETRY_PENDING),
    ),
    "pending 23 h with the default maxPending (24 h): placed again": (
        pending(pending_since=NOW - 23 * HOUR),
        [],
        NOW,
        Place(start=NOW, end=NOW + 2 * HOUR, no_fit=RETRY_PENDING),
    ),
    "pending, requested start ahead: the requested window": (
        pending(requested_start=NOW + HOUR),
        [],
        NOW,
        Place(start=NOW + HOUR, end=NOW + 3 * HOUR, no_fit=RETRY_PENDING),
    ),
    "pending, requested start passed: full duration from now": (
        pending(requested_start=NOW - 30 * MINUTE),
        [],
        NOW,
        Place(start=NOW, end=NOW + 2 * HOUR, no_fit=RETRY_PENDING),
    ),
    "pending with a lease: the lease runs from this placement": (
        pending(lease_seconds=600),
        [],
        NOW,
        Place(
            start=NOW,
            end=NOW + 2 * HOUR,
            lease=NOW + dt.timedelta(seconds=600),
            no_fit=RETRY_PENDING,
        ),
    ),
    # A pool-lease pool: a retry goes through the pool's batch (its fair order), never inline.
    "pending on a pool-lease pool: requeued for its batch": (
        pending(
            pool=pool(policy={"placer": "pool-lease"}),
            conditions=[cond("Unschedulable", "NoFit", "0 of 1 nodes fit")],
        ),
        [],
        NOW,
        Requeue(),
    ),
    "preempted spot work on a pool-lease pool: requeued for its batch": (
        pending(
            pool=pool(policy={"placer": "pool-lease"}),
            conditions=[cond("Unschedulable", "SpotPreempted", "preempted")],
        ),
        [],
        NOW,
        Requeue(),
    ),
    "pending on a pool-lease pool, archived: failed, not requeued": (
        pending(pool=pool(policy={"placer": "pool-lease"}, archived=True)),
        [],
        NOW,
        Fail(
            "PoolGone",
            "the pool is archived or no longer offered to the tenant",
            cond(
                "Unschedulable",
                "PoolGone",
                "the pool is archived or no longer offered to the tenant",
            ),
        ),
    ),
    "pending on a pool-lease pool longer than maxPending: failed, not requeued": (
        pending(
            pool=pool(policy={"placer": "pool-lease", "maxPending": "1h"}),
            pending_since=NOW - HOUR - MS,
        ),
        [],
        NOW,
        Fail(
            "MaxPendingExceeded",
            "pending longer than the pool's maxPending (1h)",
            cond(
                "Unschedulable",
                "MaxPendingExceeded",
                "pending longer than the pool's maxPending (1h)",
            ),
        ),
    ),
    # Placed: repair a bad booking, wait for the start, then hand over to the nodes.
    "placed before the start: nothing": (placed(), [], NOW, NothingDue()),
    "placed, 15 minutes before the start: nothing": (
        placed(start=NOW + 15 * MINUTE),
        [],
        NOW,
        NothingDue(),
    ),
    "placed at the start: binding for 5 minutes": (
        placed(start=NOW),
        [],
        NOW,
        StartBinding(NOW + 5 * MINUTE),
    ),
    "node lease at the start: binding for 2 hours": (
        placed(start=NOW, binding_mode="node"),
        [],
        NOW,
        StartBinding(NOW + 2 * HOUR),
    ),
    "placed, booking went bad before the start: repaired on the same window": (
        placed(booking_sound=False),
        [],
        NOW,
        Place(
            start=NOW + HOUR,
            end=NOW + 2 * HOUR,
            unbook=True,
            event="reservation.repaired",
            no_fit=NoFitRule("BookingRepairFailed", "the booking went bad before the start: "),
        ),
    ),
    "placed, booking went bad after the start: repaired from now": (
        placed(booking_sound=False, start=NOW - MINUTE),
        [],
        NOW,
        Place(
            start=NOW,
            end=NOW + 2 * HOUR,
            unbook=True,
            event="reservation.repaired",
            no_fit=NoFitRule("BookingRepairFailed", "the booking went bad before the start: "),
        ),
    ),
    # Binding: activate when every node bound; otherwise wait for the deadline or a refusal.
    "binding, every node bound: active, BindTimeout cleared, others kept": (
        binding(
            conditions=[
                cond("BindTimeout", "NodeDidNotBind", "attempt 1 of 3: …"),
                cond("DevicesHeld", "PodsHoldDevices", "held"),
            ]
        ),
        [bound("n1"), bound("n2")],
        NOW,
        Activate(
            binding=view(bound("n1"), bound("n2")),
            conditions=[cond("DevicesHeld", "PodsHoldDevices", "held")],
            recheck_at=NOW + 15 * MINUTE,
        ),
    ),
    "binding, bound after the deadline (early report judged now): active": (
        binding(bind_deadline=NOW - MINUTE),
        [bound("n1")],
        NOW,
        Activate(binding=view(bound("n1")), conditions=[], recheck_at=NOW + 15 * MINUTE),
    ),
    "binding, one node still desired, deadline ahead: nothing": (
        binding(bind_deadline=NOW + MS),
        [bound("n1"), alloc("n2", "desired")],
        NOW,
        NothingDue(),
    ),
    "binding, no allocations yet, deadline ahead: nothing": (
        binding(),
        [],
        NOW,
        NothingDue(),
    ),
    "binding, deadline reached, attempt 1: placed again, BindTimeout names the silent nodes": (
        binding(bind_deadline=NOW),
        [alloc("n2", "desired"), bound("n1"), alloc("n3", "desired")],
        NOW,
        Place(
            start=NOW,
            end=NOW + HOUR,
            unbook=True,
            bind_failures=1,
            then_condition=cond(
                "BindTimeout",
                "NodeDidNotBind",
                "attempt 1 of 3: no bound report within the deadline from n2, n3",
            ),
            no_fit=NoFitRule("NoFit"),
        ),
    ),
    "binding, a node refused before the deadline: placed again at once": (
        binding(bind_failures=1),
        [bound("n1"), alloc("n2", "failed", reason="resources-exhausted")],
        NOW,
        Place(
            start=NOW,
            end=NOW + HOUR,
            unbook=True,
            bind_failures=2,
            then_condition=cond(
                "BindTimeout",
                "NodeRejectedBinding",
                "attempt 2 of 3: node refused the binding (n2: resources-exhausted)",
            ),
            no_fit=NoFitRule("NoFit"),
        ),
    ),
    "binding, refusals without a reason say 'failed'": (
        binding(),
        [alloc("n1", "failed"), alloc("n2", "failed", reason="cdi")],
        NOW,
        Place(
            start=NOW,
            end=NOW + HOUR,
            unbook=True,
            bind_failures=1,
            then_condition=cond(
                "BindTimeout",
                "NodeRejectedBinding",
                "attempt 1 of 3: node refused the binding (n1: failed; n2: cdi)",
            ),
            no_fit=NoFitRule("NoFit"),
        ),
    ),
    "binding, third attempt times out: failed": (
        binding(bind_deadline=NOW - MS, bind_failures=2),
        [alloc("n1", "desired")],
        NOW,
        Fail(
            "NodeDidNotBind",
            "attempt 3 of 3: no bound report within the deadline from n1",
            cond(
                "BindTimeout",
                "NodeDidNotBind",
                "attempt 3 of 3: no bound report within the deadline from n1",
            ),
            bind_failures=3,
        ),
    ),
    "node lease times out: failed on the first attempt (no second placement)": (
        binding(binding_mode="node", bind_deadline=NOW),
        [alloc("n1", "desired")],
        NOW,
        Fail(
            "NodeDidNotBind",
            "attempt 1 of 3: no bound report within the deadline from n1",
            cond(
                "BindTimeout",
                "NodeDidNotBind",
                "attempt 1 of 3: no bound report within the deadline from n1",
            ),
            bind_failures=1,
        ),
    ),
    "node lease, 6 minutes into its 2 hours: nothing": (
        binding(binding_mode="node", start=NOW - 6 * MINUTE, bind_deadline=NOW + 114 * MINUTE),
        [alloc("n1", "desired")],
        NOW,
        NothingDue(),
    ),
    # Active: only conditions change; the end and the lease release, never the rules below.
    "active, all well: recheck in 15 minutes": (active(), [bound("n1")], NOW, RECHECK),
    "active, a binding lost: Degraded/BindingLost, the binding shown stays": (
        active(binding={"nodeId": "n1", "cdiDevices": ["x"]}),
        [alloc("n1", "lost"), bound("n2")],
        NOW,
        SetConditions(
            conditions=[cond("Degraded", "BindingLost", "nodes reported lost devices: n1")],
            binding={"nodeId": "n1", "cdiDevices": ["x"]},
            recheck_at=NOW + 15 * MINUTE,
        ),
    ),
    "active, unhealthy devices: Degraded/AtomUnhealthy naming them": (
        active(unhealthy_devices=["GPU-0", "GPU-3"]),
        [bound("n1")],
        NOW,
        SetConditions(
            conditions=[
                cond("Degraded", "AtomUnhealthy", "unhealthy booked devices: GPU-0, GPU-3")
            ],
            binding=view(bound("n1")),
            recheck_at=NOW + 15 * MINUTE,
        ),
    ),
    "active node lease, unhealthy devices: also UnhealthyAtoms/NotBilled naming them": (
        active(unhealthy_devices=["GPU-0", "GPU-3"], binding_mode="node"),
        [bound("n1")],
        NOW,
        SetConditions(
            conditions=[
                cond("Degraded", "AtomUnhealthy", "unhealthy booked devices: GPU-0, GPU-3"),
                cond("UnhealthyAtoms", "NotBilled", "not billed while unhealthy: GPU-0, GPU-3"),
            ],
            binding=view(bound("n1")),
            recheck_at=NOW + 15 * MINUTE,
        ),
    ),
    "active node lease, healed: UnhealthyAtoms/NotBilled cleared": (
        active(
            binding_mode="node",
            conditions=[
                cond("UnhealthyAtoms", "NotBilled", "not billed while unhealthy: GPU-0", NOW_MS)
            ],
        ),
        [bound("n1")],
        NOW,
        SetConditions(conditions=[], binding=view(bound("n1")), recheck_at=NOW + 15 * MINUTE),
    ),
    "active, lost beats unhealthy; unreachable is its own condition": (
        active(unhealthy_devices=["GPU-0"], unreachable_nodes=["n1"]),
        [alloc("n1", "lost")],
        NOW,
        SetConditions(
            conditions=[
                cond("Degraded", "BindingLost", "nodes reported lost devices: n1"),
                cond("NodeUnreachable", "Unreachable", "nodes not connected: n1"),
            ],
            binding=active().binding,
            recheck_at=NOW + 15 * MINUTE,
        ),
    ),
    "active, foreign exposure beats unhealthy: Degraded/ForeignGpuExposure naming the nodes": (
        active(unhealthy_devices=["GPU-0"], foreign_exposed_nodes=["n1", "n2"]),
        [bound("n1")],
        NOW,
        SetConditions(
            conditions=[
                cond(
                    "Degraded",
                    "ForeignGpuExposure",
                    "something besides bcd can hand the GPUs of these nodes to pods: n1, n2",
                )
            ],
            binding=view(bound("n1")),
            recheck_at=NOW + 15 * MINUTE,
        ),
    ),
    "active, pods of another namespace: Degraded/PodOutsideNamespace naming node and pod": (
        active(unhealthy_devices=["GPU-0"]),
        [
            alloc("n1", "bound", cdiDevices=[], pods=["ml/a", "x/b"], intruders=["x/b"]),
            alloc("n2", "bound", cdiDevices=[], pods=["y/c"], intruders=["y/c"]),
        ],
        NOW,
        SetConditions(
            conditions=[
                cond(
                    "Degraded",
                    "PodOutsideNamespace",
                    "pods outside the Reservation's namespace hold its devices: n1: x/b, n2: y/c",
                )
            ],
            binding=view(
                alloc("n1", "bound", cdiDevices=[], pods=["ml/a", "x/b"]),
                alloc("n2", "bound", cdiDevices=[], pods=["y/c"]),
            ),
            recheck_at=NOW + 15 * MINUTE,
        ),
    ),
    "active, the node re-reports who holds the devices: the binding moves alone": (
        active(),
        [
            alloc(
                "n1",
                "bound",
                cdiDevices=["bcd.dev/gpu=n1-0"],
                envFile="/run/bcd/allocations/alloc_n1.env",
                pods=["ml/a"],
            )
        ],
        NOW,
        SetConditions(
            conditions=[],
            binding={**lifecycle.binding_view([bound("n1")]), "pods": ["ml/a"]},
            recheck_at=NOW + 15 * MINUTE,
        ),
    ),
    "active, foreign exposure beats pods of another namespace": (
        active(foreign_exposed_nodes=["n1"]),
        [alloc("n1", "bound", cdiDevices=[], pods=["x/b"], intruders=["x/b"])],
        NOW,
        SetConditions(
            conditions=[
                cond(
                    "Degraded",
                    "ForeignGpuExposure",
                    "something besides bcd can hand the GPUs of these nodes to pods: n1",
                )
            ],
            binding=view(alloc("n1", "bound", cdiDevices=[], pods=["x/b"])),
            recheck_at=NOW + 15 * MINUTE,
        ),
    ),
    "active, lost beats foreign exposure": (
        active(foreign_exposed_nodes=["n1"]),
        [alloc("n1", "lost")],
        NOW,
        SetConditions(
            conditions=[cond("Degraded", "BindingLost", "nodes reported lost devices: n1")],
            binding=active().binding,
            recheck_at=NOW + 15 * MINUTE,
        ),
    ),
    "active, a condition that still holds keeps its since and writes nothing": (
        active(
            conditions=[
                cond("Degraded", "AtomUnhealthy", "unhealthy booked devices: GPU-0", NOW_MS - 5)
            ],
            unhealthy_devices=["GPU-0"],
        ),
        [bound("n1")],
        NOW,
        RECHECK,
    ),
    "active, the same condition with a new message starts again": (
        active(
            conditions=[
                cond("Degraded", "AtomUnhealthy", "unhealthy booked devices: GPU-0", NOW_MS - 5)
            ],
            unhealthy_devices=["GPU-0", "GPU-1"],
        ),
        [bound("n1")],
        NOW,
        SetConditions(
            conditions=[
                cond("Degraded", "AtomUnhealthy", "unhealthy booked devices: GPU-0, GPU-1")
            ],
            binding=view(bound("n1")),
            recheck_at=NOW + 15 * MINUTE,
        ),
    ),
    "active, everything healed: conditions cleared, other conditions kept first": (
        active(
            conditions=[
                cond("Degraded", "BindingLost", "nodes reported lost devices: n1"),
                cond("DevicesHeld", "PodsHoldDevices", "held"),
                cond("NodeUnreachable", "Unreachable", "nodes not connected: n1"),
            ]
        ),
        [bound("n1")],
        NOW,
        SetConditions(
            conditions=[cond("DevicesHeld", "PodsHoldDevices", "held")],
            binding=view(bound("n1")),
            recheck_at=NOW + 15 * MINUTE,
        ),
    ),
    "active, conditions gained while healthy nodes came back: order others, then ours": (
        active(
            conditions=[cond("NodeUnreachable", "Unreachable", "nodes not connected: n2")],
            unreachable_nodes=["n2"],
            unhealthy_devices=["GPU-1"],
        ),
        [bound("n1"), bound("n2")],
        NOW,
        SetConditions(
            conditions=[
                cond("Degraded", "AtomUnhealthy", "unhealthy booked devices: GPU-1"),
                cond("NodeUnreachable", "Unreachable", "nodes not connected: n2"),
            ],
            binding=view(bound("n1"), bound("n2")),
            recheck_at=NOW + 15 * MINUTE,
        ),
    ),
}


@pytest.mark.parametrize("case", list(DECIDE))
def test_decide(case: str) -> None:
    reservation, allocations, now, expected = DECIDE[case]
    assert lifecycle.decide(reservation, allocations, now=now) == expected


@pytest.mark.parametrize("rechecks", [1, 3, 96])
def test_an_active_reservation_is_never_released_by_its_conditions(rechecks: int) -> None:
    # Lost, unhealthy and unreachable together, recheck after recheck: conditions only.
    reservation = active(end=NOW + 48 * HOUR, unhealthy_devices=["GPU-0"], unreachable_nodes=["n1"])
    allocations = [alloc("n1", "lost")]
    for i in range(rechecks):
        now = NOW + i * (15 * MINUTE + dt.timedelta(seconds=1))
        step = lifecycle.decide(reservation, allocations, now=now)
        assert isinstance(step, SetConditions | WaitUntil), step
        if isinstance(step, SetConditions):
            reservation = dataclasses.replace(reservation, conditions=step.conditions)
            assert step.recheck_at == now + 15 * MINUTE
        else:
            assert step == WaitUntil(now + 15 * MINUTE, "recheck")
    assert [c["reason"] for c in reservation.conditions] == ["BindingLost", "Unreachable"]
    # The since of a condition that kept holding is the first one's.
    assert {c["since"] for c in reservation.conditions} == {NOW_MS}


def test_a_report_that_came_while_placed_is_judged_as_the_binding_starts() -> None:
    # The store applies StartBinding and decides again on the binding reservation.
    start = placed(start=NOW)
    early = [bound("n1")]
    step = lifecycle.decide(start, early, now=NOW)
    assert step == StartBinding(NOW + 5 * MINUTE)
    assert isinstance(step, StartBinding)
    now_binding = dataclasses.replace(start, state=State.BINDING, bind_deadline=step.deadline)
    assert lifecycle.decide(now_binding, early, now=NOW) == Activate(
        binding=view(bound("n1")), conditions=[], recheck_at=NOW + 15 * MINUTE
    )


# --- after_no_fit: what a re-placement that found no room means ----------------------------------

NO_ROOM = "0 of 1 nodes fit: 4 free GPUs, 8 asked"
RETRY = Place(start=NOW, end=NOW + HOUR, no_fit=RETRY_PENDING)
REPAIR = Place(
    start=NOW,
    end=NOW + HOUR,
    unbook=True,
    event="reservation.repaired",
    no_fit=NoFitRule("BookingRepairFailed", "the booking went bad before the start: "),
)
REBIND = Place(start=NOW, end=NOW + HOUR, unbook=True, bind_failures=1, no_fit=NoFitRule("NoFit"))

AFTER_NO_FIT: dict[str, tuple[Reservation, Place, lifecycle.Step]] = {
    "pending retry, same message: unchanged, retried in 30 s": (
        pending(conditions=[cond("Unschedulable", "NoFit", NO_ROOM)]),
        RETRY,
        WaitUntil(NOW + dt.timedelta(seconds=30), "retry"),
    ),
    "pending retry after a failed repair: the bad booking stays the reason": (
        pending(conditions=[cond("Unschedulable", "BookingRepairFailed", "went bad: other")]),
        RETRY,
        WaitUntil(NOW + dt.timedelta(seconds=30), "retry"),
    ),
    "pending retry, a new message: pending again (no second event)": (
        pending(conditions=[cond("Unschedulable", "NoFit", "0 of 2 nodes fit")]),
        RETRY,
        MarkPending("NoFit", NO_ROOM, first=False),
    ),
    "pending retry without an Unschedulable condition: pending again": (
        pending(conditions=[cond("Queued", "PoolPlacer", "queued")]),
        RETRY,
        MarkPending("NoFit", NO_ROOM, first=False),
    ),
    "repair without room: pending, BookingRepairFailed, first time": (
        placed(booking_sound=False),
        REPAIR,
        MarkPending(
            "BookingRepairFailed", f"the booking went bad before the start: {NO_ROOM}", True
        ),
    ),
    "binding tried elsewhere without room: pending, NoFit, first time": (
        binding(conditions=[cond("Unschedulable", "NoFit", NO_ROOM)]),
        REBIND,
        MarkPending("NoFit", NO_ROOM, first=True),
    ),
}


@pytest.mark.parametrize("case", list(AFTER_NO_FIT))
def test_after_no_fit(case: str) -> None:
    reservation, step, expected = AFTER_NO_FIT[case]
    assert lifecycle.after_no_fit(reservation, step, NO_ROOM, now=NOW) == expected


# --- the binding a client sees ----------------------------------------------------------------

BINDING_VIEWS: dict[str, tuple[list[Allocation], dict[str, Any]]] = {
    "one node": (
        [bound("n1")],
        {
            "nodeId": "n1",
            "nodeIds": ["n1"],
            "allocationIds": ["alloc_n1"],
            "cdiDevices": ["bcd.dev/gpu=n1-0"],
            "attested": False,
            "envFile": "/run/bcd/allocations/alloc_n1.env",
        },
    ),
    "two nodes: the first env file, and all of them": (
        [bound("n1"), bound("n2")],
        {
            "nodeId": "n1",
            "nodeIds": ["n1", "n2"],
            "allocationIds": ["alloc_n1", "alloc_n2"],
            "cdiDevices": ["bcd.dev/gpu=n1-0", "bcd.dev/gpu=n2-0"],
            "attested": False,
            "envFile": "/run/bcd/allocations/alloc_n1.env",
            "envFiles": [
                "/run/bcd/allocations/alloc_n1.env",
                "/run/bcd/allocations/alloc_n2.env",
            ],
        },
    ),
    "a gang of holds with limits: the first slice, and all of them": (
        [
            alloc("n1", "bound", cdiDevices=[], cgroupParent="bcd-alloc-alloc_n1.slice"),
            alloc("n2", "bound", cdiDevices=[], cgroupParent="bcd-alloc-alloc_n2.slice"),
        ],
        {
            "nodeId": "n1",
            "nodeIds": ["n1", "n2"],
            "allocationIds": ["alloc_n1", "alloc_n2"],
            "cdiDevices": [],
            "attested": False,
            "cgroupParent": "bcd-alloc-alloc_n1.slice",
            "cgroupParents": ["bcd-alloc-alloc_n1.slice", "bcd-alloc-alloc_n2.slice"],
        },
    ),
    "no report details: no devices, no env file": (
        [alloc("n1", "bound")],
        {
            "nodeId": "n1",
            "nodeIds": ["n1"],
            "allocationIds": ["alloc_n1"],
            "cdiDevices": [],
            "attested": False,
        },
    ),
    "attested only when every node's report was": (
        [
            Allocation(id="alloc_n1", node_id="n1", state="bound", report={"attested": True}),
            Allocation(id="alloc_n2", node_id="n2", state="bound", report={"attested": True}),
        ],
        {
            "nodeId": "n1",
            "nodeIds": ["n1", "n2"],
            "allocationIds": ["alloc_n1", "alloc_n2"],
            "cdiDevices": [],
            "attested": True,
        },
    ),
}


@pytest.mark.parametrize("case", list(BINDING_VIEWS))
def test_binding_view(case: str) -> None:
    allocations, expected = BINDING_VIEWS[case]
    assert lifecycle.binding_view(allocations) == expected
