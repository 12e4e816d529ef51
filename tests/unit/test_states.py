"""The operation table and the pool rules, as tables."""

from __future__ import annotations

from typing import Any

import pytest

from bettercompute.core import attributes, pools, states
from bettercompute.core.errors import ComputeError
from bettercompute.core.states import State

QUEUED = [{"type": "Queued", "reason": "PoolPlacer"}]
UNSCHEDULABLE = [{"type": "Unschedulable", "reason": "NoFit"}]


@pytest.mark.parametrize(
    ("state", "conditions", "op", "error"),
    [
        (State.DRAFT, [], "running", None),
        (State.PENDING, QUEUED, "running", None),
        (State.PENDING, UNSCHEDULABLE, "pending", None),
        (State.AWAITING_CONFIRMATION, [], "pending", None),
        (State.PLACED, [], "succeeded", None),
        (State.BINDING, [], "succeeded", None),
        (State.ACTIVE, [], "succeeded", None),
        (State.RELEASING, [], "succeeded", None),
        (State.RELEASED, [], "succeeded", None),
        (State.FAILED, [], "failed", "CAPACITY_UNAVAILABLE"),
        (State.DENIED, [], "failed", "ACCESS_DENIED"),
        (State.CANCELLED, [], "failed", "INVALID_STATE"),
        (State.EXPIRED, [], "failed", "INVALID_STATE"),
    ],
)
def test_operation_follows_the_guide_table(
    state: State, conditions: list[dict[str, Any]], op: str, error: str | None
):
    got = states.operation(reservation_id="rsv_x", state=state, conditions=conditions)
    assert got["id"] == "rsv_x"
    assert got["state"] == op
    assert (got.get("error") or {}).get("code") == error


def test_terminal_states_are_exactly_the_guides():
    assert {s.value for s in states.TERMINAL} == {
        "denied",
        "released",
        "failed",
        "cancelled",
        "expired",
    }


def pool(**kw: Any) -> pools.PoolInfo:
    base: dict[str, Any] = dict(
        id="p",
        owner_tenant_id="acme",
        region="eu-west-1",
        gpu_model="H100",
        sharing_mode="exclusive",
        replicas=1,
        archived=False,
        policy={},
        offered=False,
    )
    base.update(kw)
    base["policy"] = pools.PoolPolicy.model_validate(base["policy"])
    return pools.PoolInfo(**base)


def request(**kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "poolId": "p",
        "devices": [{"class": "gpu", "count": 1}],
        "duration": "3600000ms",
        "binding": "hold",
    }
    body.update(kw)
    return body


@pytest.mark.parametrize(
    ("pool_kw", "req_kw", "tenant", "code", "words"),
    [
        ({}, {}, "acme", None, None),
        ({}, {}, "globex", "NOT_FOUND", "pool"),
        ({"offered": True}, {}, "globex", None, None),
        ({"archived": True}, {}, "acme", "NOT_FOUND", "pool"),
        ({"sharing_mode": "mig"}, {}, "acme", "INVALID_INPUT", "'mig'"),
        ({"sharing_mode": "mps"}, {"devices": [{"class": "slot", "count": 2}]}, "acme", None, None),
        ({}, {"binding": "node"}, "acme", "INVALID_INPUT", "tenantRoot"),
        ({"policy": {"tenantRoot": True}}, {"binding": "node"}, "acme", None, None),
        ({}, {"binding": "kubernetes"}, "acme", "INVALID_INPUT", "policy.kubernetes"),
        ({"policy": {"kubernetes": True}}, {"binding": "kubernetes"}, "acme", None, None),
        (
            {"policy": {"kubernetes": True}, "offered": True},
            {"binding": "kubernetes"},
            "globex",
            "INVALID_INPUT",
            "owner",
        ),
    ],
)
def test_pool_rules(
    pool_kw: dict[str, Any],
    req_kw: dict[str, Any],
    tenant: str,
    code: str | None,
    words: str | None,
):
    if code is None:
        pools.check_request(request=request(**req_kw), pool=pool(**pool_kw), tenant_id=tenant)
        return
    with pytest.raises(ComputeError) as info:
        pools.check_request(request=request(**req_kw), pool=pool(**pool_kw), tenant_id=tenant)
    assert info.value.code == code
    assert words is not None
    assert words in info.value.message


def test_max_pending_and_budget_flags():
    assert pool().max_pending_ms == 24 * 3_600_000
    assert pool(policy={"maxPending": "1h"}).max_pending_ms == 3_600_000
    assert pool(policy={"maxPending": 60_000}).max_pending_ms == 60_000
    assert not pool().wants_budget_check
    assert pool(policy={"admission": {"budgetCheck": "meter"}}).wants_budget_check
    assert pool(on_budget_exceeded="stop-new").wants_budget_check
    assert not pool(on_budget_exceeded="allow").wants_budget_check


def test_attribute_table():
    req = request(
        devices=[{"class": "gpu", "count": 4}],
        gang={"size": 2},
        leaseSeconds=600,
        projectId="llm",
        spot=True,
        resources={"vcpu": 8, "memoryGiB": 64, "hugepages1Gi": 0},
    )
    attrs = attributes.reservation_attributes(
        request=req, gpu_model=None, region="us-east-1", duration_ms=5_400_000
    )
    assert attrs == {
        "gpuModel": "other",
        "gpuCount": 8,
        "gpuSlices": 0,
        "gangSize": 2,
        "durationHours": 1.5,
        "region": "us-east-1",
        "binding": "hold",
        "spot": True,
        "renewable": True,
        "projectId": "llm",
        "vcpu": 16,
        "memoryGiB": 128,
    }
    mig = request(devices=[{"class": "mig", "count": 3, "profile": "1g.10gb"}])
    assert (
        attributes.reservation_attributes(
            request=mig, gpu_model="A100", region="r", duration_ms=3_600_000
        )["gpuSlices"]
        == 3
    )
    assert attributes.quota_demand(mig, gpu_model="A100") == {"gpuSlices:A100": 3}
    assert attributes.quota_demand(req, gpu_model="H100") == {"gpu:H100": 8}


def test_required_labels_of_a_demand():
    kube = pools.demand(request=request(binding="kubernetes"))
    assert dict(kube.required_labels) == {pools.CAP_BINDING_KUBERNETES: "*"}
    limits = pools.demand(request=request(resources={"vcpu": 2, "memoryGiB": 0, "hugepages1Gi": 0}))
    assert dict(limits.required_labels) == {pools.CAP_DEVICES_LIMITS: "*"}
    assert pools.demand(request=request(binding="node")).whole_node
