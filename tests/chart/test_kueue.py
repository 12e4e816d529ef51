"""The chart's ``kueue.admissionCheck``: off by default; on, exactly the rights the Kueue
AdmissionCheck controller uses (``operator/kueuesyncing.py``) and the switch that starts it.

Why a file of its own: ``test_rbac.py``'s table is the default and ``full()`` install; this
value adds rules only where Kueue is installed, and the rules it adds are compared here with
what the controller and kopf's watches of the real handler registry need.
"""

from __future__ import annotations

from typing import Any

import pytest

from bettercompute.operator import handlers
from tests.chart import rendering
from tests.chart.test_rbac import OPERATOR, _granted

ON = {"kueue": {"admissionCheck": {"enabled": True}}}

#: (group, resource, verb) the controller's calls and kopf's hints need, and nothing else.
KUEUE_RULES = {
    ("kueue.x-k8s.io", "workloads", "list"),
    ("kueue.x-k8s.io", "workloads", "watch"),
    ("kueue.x-k8s.io", "admissionchecks", "list"),
    ("kueue.x-k8s.io", "admissionchecks", "watch"),
    # Only status.admissionChecks of a Workload, only the Active condition of a check.
    ("kueue.x-k8s.io", "workloads/status", "patch"),
    ("kueue.x-k8s.io", "admissionchecks/status", "patch"),
    # A Workload's owner Job, for its bcd.dev/reservation label or annotation.
    ("batch", "jobs", "get"),
}


def _operator_env(rendered: rendering.Rendered) -> dict[str, Any]:
    operator = rendered.one("StatefulSet", OPERATOR)
    (container,) = [c for c in rendering.containers(operator) if c["name"] == "operator"]
    return rendering.env_of(container)


def test_off_by_default_nothing_of_kueue(defaults: rendering.Rendered, everything) -> None:
    for rendered in (defaults, everything):
        granted = _granted(rendered)
        assert not [g for g in granted if g[2] in ("kueue.x-k8s.io", "batch")]
        assert "BCD_KUEUE_ADMISSION_CHECK" not in _operator_env(rendered)


def test_on_adds_exactly_the_controllers_rules(render: Any, defaults) -> None:
    rendered = render(ON)
    added = _granted(rendered) - _granted(defaults)
    assert {(kind, name) for kind, name, *_ in added} == {("ClusterRole", OPERATOR)}
    assert {(group, resource, verb) for _, _, group, resource, names, verb in added} == (
        KUEUE_RULES
    )
    assert all(names is None for *_, names, _ in added)
    assert _operator_env(rendered)["BCD_KUEUE_ADMISSION_CHECK"] == "true"


def test_kopfs_kueue_watches_are_granted(render: Any) -> None:
    granted = {(g, r, v) for _, _, g, r, _, v in _granted(render(ON))}
    registry = handlers.make_registry(kueue_checks=True)
    kueue = [
        h for h in registry._watching.get_all_handlers() if h.selector.group == "kueue.x-k8s.io"
    ]
    assert {h.selector.any_name for h in kueue} == {"workloads", "admissionchecks"}
    for handler in kueue:
        for verb in ("list", "watch"):
            assert (handler.selector.group, handler.selector.any_name, verb) in granted
    # Without the switch the registry watches nothing of Kueue (a cluster without its CRDs).
    plain = handlers.make_registry()
    assert not [
        h for h in plain._watching.get_all_handlers() if h.selector.group == "kueue.x-k8s.io"
    ]


def test_a_wrong_value_is_refused(render: Any) -> None:
    with pytest.raises(Exception, match=r"enabled|kueue|additional"):
        render({"kueue": {"admissionCheck": {"enabled": "yes"}}})


# --- examples/kueue-*.yaml ------------------------------------------------------------------


def _kueue_examples() -> list[tuple[str, dict[str, Any]]]:
    return [(n, o) for n, o in rendering.load_examples() if n.startswith("kueue-")]


def test_the_kueue_job_runs_in_its_reservation_through_our_check() -> None:
    """The queue lists our check and counts bcd.dev/gpu; the Job names its Reservation (same
    namespace) on its pod template, and fits it: what the controller needs to say Ready."""
    from bettercompute.operator import kueuechecks, podaccess

    objects = {(o["kind"], o["metadata"]["name"]): o for _, o in _kueue_examples()}
    check = objects[("AdmissionCheck", "bcd-reservation")]
    assert check["spec"]["controllerName"] == kueuechecks.CONTROLLER_NAME
    queue = objects[("ClusterQueue", "gpu-reservations")]
    assert queue["spec"]["admissionChecks"] == ["bcd-reservation"]
    (group,) = queue["spec"]["resourceGroups"]
    assert "bcd.dev/gpu" in group["coveredResources"]
    local = objects[("LocalQueue", "team")]
    job = objects[("Job", "train-kueue")]
    reservation = objects[("Reservation", "train-kueue")]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == local["metadata"]["name"]
    assert job["metadata"]["namespace"] == local["metadata"]["namespace"]
    assert reservation["spec"]["binding"] == "kubernetes"
    # The Workload Kueue makes of it, and the Reservation once active.
    workload = {
        "metadata": {"namespace": job["metadata"]["namespace"]},
        "spec": {"podSets": [{"name": "main", "count": 1, "template": job["spec"]["template"]}]},
    }
    named = kueuechecks.names_given(workload, job)
    assert named == {reservation["metadata"]["name"]}
    booked = podaccess.booked({**reservation, "status": {"state": "active"}})
    stored = kueuechecks.Stored(
        namespace=booked.namespace,
        name=booked.name,
        booked=booked,
        gang=1,
        start_ms=0,
        end_ms=8 * 3600 * 1000,
        nodes=("gpu-node-1",),
    )
    decision = kueuechecks.decide(
        workload=workload, named=named, candidates=[stored], previous="Pending", shown=str
    )
    assert decision.state == kueuechecks.READY, decision.message
