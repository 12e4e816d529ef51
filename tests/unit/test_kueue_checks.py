"""The Kueue AdmissionCheck rules (``operator/kueuechecks.py``), table-driven and without I/O:
which state and message each Reservation state and request gives, where a Workload names its
Reservation, and that only our entries of ``status.admissionChecks`` change."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from bettercompute.operator import kueuechecks as kc
from bettercompute.operator import podaccess


def _stored(
    *,
    state: str | None = "active",
    namespace: str = "ml",
    gpus: int = 2,
    gang: int = 1,
    nodes: tuple[str, ...] = ("gpu-node-1",),
    binding: str = "kubernetes",
    reason: str | None = None,
) -> kc.Stored:
    booked = podaccess.Booked(
        namespace=namespace,
        name="train",
        state=state,
        binding=binding,
        resource_name="bcd.dev/rsv-abc",
        per_node={"gpu": gpus},
    )
    return kc.Stored(
        namespace=namespace,
        name="train",
        booked=booked,
        gang=gang,
        start_ms=1000,
        end_ms=2000,
        nodes=nodes,
        release_reason=reason,
    )


def _workload(*, gpus: int = 2, count: int = 1, namespace: str = "ml") -> dict[str, Any]:
    container = {"name": "c", "resources": {"limits": {"bcd.dev/gpu": str(gpus)}}}
    return {
        "metadata": {"namespace": namespace, "name": "w"},
        "spec": {
            "podSets": [
                {"name": "main", "count": count, "template": {"spec": {"containers": [container]}}}
            ]
        },
    }


def _decide(workload: dict[str, Any], *candidates: kc.Stored, previous: str = "Pending"):
    return kc.decide(
        workload=workload,
        named={"train"},
        candidates=list(candidates),
        previous=previous,
        shown=lambda ms: f"t{ms}",
    )


@pytest.mark.parametrize(
    ("state", "previous", "expected", "says"),
    [
        (None, "Pending", kc.PENDING, "is not admitted yet"),
        ("pending", "Pending", kc.PENDING, "is pending; its window starts at t1000"),
        ("placed", "Pending", kc.PENDING, "is placed"),
        ("binding", "Pending", kc.PENDING, "is binding"),
        ("active", "Pending", kc.READY, "is active until t2000"),
        ("placed", "Ready", kc.RETRY, "being placed again"),
        ("binding", "Retry", kc.RETRY, "being placed again"),
        ("releasing", "Ready", kc.REJECTED, "is releasing"),
        ("released", "Ready", kc.REJECTED, "holds no devices any more"),
        ("expired", "Pending", kc.REJECTED, "is expired"),
        ("failed", "Pending", kc.REJECTED, "is failed"),
    ],
)
def test_the_state_follows_the_reservation(state, previous, expected, says) -> None:
    decision = _decide(_workload(), _stored(state=state), previous=previous)
    assert decision.state == expected
    assert says in decision.message
    assert bool(decision.pod_set_updates) == (expected == kc.READY)


def test_ready_hands_the_label_and_the_one_node() -> None:
    decision = _decide(_workload(), _stored())
    assert decision.pod_set_updates == (
        {
            "name": "main",
            "labels": {"bcd.dev/reservation": "train"},
            "nodeSelector": {"kubernetes.io/hostname": "gpu-node-1"},
        },
    )
    # Several nodes: no node selector (it cannot say "one of these").
    spread = _decide(_workload(count=2), _stored(gang=2, nodes=("a", "b")))
    assert spread.pod_set_updates == ({"name": "main", "labels": {"bcd.dev/reservation": "train"}},)


@pytest.mark.parametrize(
    ("workload", "stored", "says"),
    [
        (_workload(gpus=3), _stored(), "asks 3 bcd.dev/gpu per pod"),
        (_workload(count=2), _stored(), "ask 4 gpu devices in all"),
        (_workload(), _stored(binding="hold"), "binding 'hold'"),
        (_workload(), _stored(state="released", reason="expired"), "(expired)"),
    ],
)
def test_rejected_with_the_reason(workload, stored, says) -> None:
    decision = _decide(workload, stored)
    assert decision.state == kc.REJECTED
    assert says in decision.message


def test_a_gang_holds_its_size_times_per_node() -> None:
    assert _decide(_workload(count=2), _stored(gang=2, nodes=("a", "b"))).state == kc.READY


def test_attack_another_namespaces_reservation_is_never_ready() -> None:
    theirs = _stored(namespace="ml")
    decision = _decide(_workload(namespace="team-b"), theirs)
    assert decision.state == kc.REJECTED
    assert "not in namespace 'team-b'" in decision.message
    # With one of its own of the same name, that one is used, never the other.
    mine = _stored(namespace="team-b", state="placed")
    assert _decide(_workload(namespace="team-b"), theirs, mine).state == kc.PENDING


@pytest.mark.parametrize(
    ("named", "says"),
    [(set(), "names no Reservation"), ({"a", "b"}, "several"), ({"A/b"}, "not a Reservation")],
)
def test_what_a_workload_must_name(named, says) -> None:
    decision = kc.decide(workload=_workload(), named=named, candidates=[], previous=None, shown=str)
    assert decision.state == kc.REJECTED
    assert says in decision.message


def test_names_come_from_the_workload_its_templates_and_its_job() -> None:
    workload = _workload()
    assert kc.names_given(workload, None) == set()
    workload["spec"]["podSets"][0]["template"]["metadata"] = {
        "labels": {"bcd.dev/reservation": "a"}
    }
    workload["metadata"]["labels"] = {"bcd.dev/reservation": "b"}
    job = {"metadata": {"annotations": {"bcd.dev/reservation": "c"}}}
    assert kc.names_given(workload, job) == {"a", "b", "c"}


def test_the_owner_job_is_the_controlling_batch_job() -> None:
    ref = {"apiVersion": "batch/v1", "kind": "Job", "name": "j", "uid": "u", "controller": True}
    workload = {"metadata": {"ownerReferences": [ref]}}
    assert kc.owner_job_reference(workload) == ("j", "u")
    for change in ({"controller": False}, {"kind": "JobSet"}, {"name": "../x"}):
        assert (
            kc.owner_job_reference({"metadata": {"ownerReferences": [{**ref, **change}]}}) is None
        )


def test_only_our_entries_change_and_time_moves_only_with_the_state() -> None:
    entries = [
        {"name": "ours", "state": "Pending", "message": "", "lastTransitionTime": "t0"},
        {"name": "theirs", "state": "Pending", "message": "x", "lastTransitionTime": "t0"},
    ]
    pending = kc.Decision(kc.PENDING, "waiting")
    merged = kc.merged_checks(entries, {"ours": pending}, now="t1")
    assert merged == [
        {"name": "ours", "state": "Pending", "message": "waiting", "lastTransitionTime": "t0"},
        entries[1],
    ]
    assert kc.merged_checks(merged or [], {"ours": pending}, now="t2") is None
    ready = kc.Decision(kc.READY, "go", ({"name": "main", "labels": {"a": "b"}},))
    again = kc.merged_checks(merged or [], {"ours": ready}, now="t3") or []
    assert again[0]["lastTransitionTime"] == "t3"
    assert again[0]["podSetUpdates"] == [{"name": "main", "labels": {"a": "b"}}]
    assert again[1] == entries[1]


def test_the_active_condition_is_written_once() -> None:
    check: dict[str, Any] = {"metadata": {"generation": 1}, "status": {}}
    conditions = kc.active_condition(check, now="t1")
    assert conditions is not None
    (active,) = conditions
    assert (active["type"], active["status"], active["observedGeneration"]) == ("Active", "True", 1)
    check["status"]["conditions"] = conditions
    assert kc.active_condition(check, now="t2") is None
    check["metadata"]["generation"] = 2
    (renewed,) = kc.active_condition(check, now="t3") or []
    assert renewed["lastTransitionTime"] == "t1"  # still True: no transition


# --- the notice of a reservation about to end ----------------------------------------------------


def _ending(*, end_ms: int = 2000, notice_s: int = 120, preempted: bool = False, **kw: Any):
    return dataclasses.replace(_stored(**kw), end_ms=end_ms, notice_s=notice_s, preempted=preempted)


def _notice(stored: kc.Stored, *, now_ms: int, workload: dict[str, Any] | None = None):
    workload = workload or _workload()
    decision = _decide(workload, stored, previous="Ready")
    return kc.notice(
        workload=workload,
        decision=decision,
        candidates=[stored],
        now_ms=now_ms,
        shown=lambda ms: f"t{ms}",
    )


@pytest.mark.parametrize(
    ("now_ms", "notice_s", "owed"),
    [
        (1_000_000 - 120_001, 120, False),  # 120.001 s before the end: not yet
        (1_000_000 - 120_000, 120, True),  # exactly the pool's spot notice
        (1_000_000 - 1, 120, True),
        (1_000_000 - 300_000, 300, True),  # the pool's own noticeSeconds
        (1_000_000 - 300_000, 120, False),
    ],
)
def test_a_ready_workload_is_told_at_the_spot_notice_lead_time(now_ms, notice_s, owed) -> None:
    found = _notice(_ending(end_ms=1_000_000, notice_s=notice_s), now_ms=now_ms)
    assert (found is not None) == owed
    if found is not None:
        assert found.reason == "WindowEnds"
        assert "Reservation 'train' ends at t1000000" in found.message


def test_a_preempted_reservation_gives_notice_at_once() -> None:
    found = _notice(_ending(end_ms=10**9, preempted=True), now_ms=0)
    assert found is not None
    assert found.reason == "SpotPreempted"
    assert "go at t1000000000" in found.message


def test_no_notice_unless_the_check_is_ready() -> None:
    # Not active (the check is Retry), too big (Rejected), another namespace's: nothing.
    assert _notice(_ending(state="binding"), now_ms=1999) is None
    assert _notice(_ending(), now_ms=1999, workload=_workload(gpus=3)) is None
    assert _notice(_ending(namespace="other"), now_ms=1999) is None


def test_the_condition_is_ours_and_keeps_kueues() -> None:
    admitted = {"type": "Admitted", "status": "True", "reason": "Admitted", "message": ""}
    workload: dict[str, Any] = {
        "metadata": {"generation": 3},
        "status": {"conditions": [admitted]},
    }
    assert kc.ending_conditions(workload, None, now="t1") is None  # never a False out of nothing
    told = kc.Notice("WindowEnds", "Reservation 'train' ends at 2026-12-06T17:00:00Z")
    conditions = kc.ending_conditions(workload, told, now="t1")
    assert conditions == [
        admitted,
        {
            "type": "bcd.dev/ReservationEnding",
            "status": "True",
            "reason": "WindowEnds",
            "message": told.message,
            "lastTransitionTime": "t1",
            "observedGeneration": 3,
        },
    ]
    workload["status"]["conditions"] = conditions
    assert kc.ending_conditions(workload, told, now="t2") is None  # written once
    preempted = kc.Notice("SpotPreempted", "spot Reservation 'train' is preempted")
    (kept, changed) = kc.ending_conditions(workload, preempted, now="t3") or []
    assert kept == admitted
    assert (changed["reason"], changed["lastTransitionTime"]) == ("SpotPreempted", "t1")
    # Extended past the notice: false, at the new time.
    (_, extended) = kc.ending_conditions(workload, None, now="t4") or []
    assert (extended["status"], extended["lastTransitionTime"]) == ("False", "t4")
