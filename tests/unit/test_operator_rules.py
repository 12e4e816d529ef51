"""The operator's pure rules: specs to requests, pools and nodes to store values, statuses,
webhook verdicts. Table-driven; no cluster, no database."""

from __future__ import annotations

import json
import re

import pytest

from bettercompute.core import pools
from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.kube import allocations, names
from bettercompute.kube.parsing import ShapeError
from bettercompute.operator import definitions, statuses, webhooks

GPU_A, GPU_B = "GPU-aaaa", "GPU-bbbb"


def _gpunode_status(*, ready: bool = True, mig: bool = False) -> dict:
    gpus = []
    for i, uuid in enumerate((GPU_A, GPU_B)):
        gpu = {
            "uuid": uuid,
            "index": i,
            "model": "H100",
            "memoryMiB": 81559,
            "numaNode": i,
            "nvlinkDomain": "n1-nvl0",
            "healthy": i == 0,
        }
        if mig:
            gpu["mig"] = [
                {"uuid": f"MIG-{i}-{k}", "profile": "1g.10gb", "healthy": True} for k in range(2)
            ]
        gpus.append(gpu)
    return {
        "inventory": {"gpus": gpus, "host": {"vcpu": 64, "memoryGiB": 512}},
        "capabilities": ["binding.kubernetes", "devices.limits", "cdi.nvidia", "unknown.cap"],
        "conditions": [
            {
                "type": "Ready",
                "status": "True" if ready else "False",
                "reason": "AgentReady" if ready else "AgentNotReady",
                "message": "",
                "lastTransitionTime": "2026-12-06T00:00:00Z",
            }
        ],
    }


def _pool(mode: str = "exclusive", replicas: int = 1):
    return definitions.pool_definition(
        "h100",
        {
            "region": "eu-west-1",
            "model": "H100",
            "sharing": {"mode": mode, "replicas": replicas},
            "owner": {"tenant": "acme"},
            "offers": [{"tenant": "globex", "onBudgetExceeded": "stop-new"}],
            "nodeSelector": {"matchLabels": {"bcd.dev/pool": "h100"}},
        },
    )


def test_create_request_takes_the_namespace_tenant_and_defaults_the_key_to_the_uid():
    spec = {
        "poolId": "h100",
        "devices": [{"class": "gpu", "count": 1}],
        "duration": "1h",
        "until": 5,
        "extendKey": "k",
        "release": False,
    }
    request = definitions.create_request(spec, tenant_id="acme", uid="uid-1")
    assert request == {
        "poolId": "h100",
        "devices": [{"class": "gpu", "count": 1}],
        "duration": "1h",
        "tenantId": "acme",
        "idempotencyKey": "uid-1",
    }
    keyed = definitions.create_request({**spec, "idempotencyKey": "mine"}, tenant_id="a", uid="u")
    assert keyed["idempotencyKey"] == "mine"


def test_caller_is_the_stamped_user_and_an_unstamped_object_is_refused_naming_the_annotation():
    caller = definitions.caller(
        {names.REQUESTED_BY: "alice", names.REQUESTED_BY_GROUPS: '["ml","x"]'},
        tenant_id="acme",
    )
    assert (caller.identity_id, caller.tenant_id, caller.groups) == ("alice", "acme", ("ml", "x"))
    with pytest.raises(ComputeError) as refused:
        definitions.caller({}, tenant_id="acme")
    assert refused.value.code == ErrorCode.INVALID_INPUT
    assert names.REQUESTED_BY in refused.value.message


def test_a_namespace_without_a_tenant_label_is_refused_naming_it():
    assert definitions.tenant_of("ml", {names.TENANT_LABEL: "acme"}) == "acme"
    with pytest.raises(ComputeError, match=r"bcd\.dev/tenant"):
        definitions.tenant_of("ml", {})


def test_pool_definition_gathers_offers_and_no_quotas():
    pool = _pool()
    assert pool.pool.owner == "acme"
    assert {o.tenant: o.onBudgetExceeded for o in pool.offers} == {"globex": "stop-new"}
    assert pool.quotas == ()  # a GPUQuota's business now
    with pytest.raises(ComputeError, match=r"^spec\.owner\.tenant: required$"):
        definitions.pool_definition("p", {"region": "r", "owner": {}})
    with pytest.raises(ComputeError, match=r"^spec\.owner: required$"):
        definitions.pool_definition("p", {"region": "r"})


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
        (
            {"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]},
            {"a": "2"},
            True,
        ),
        (
            {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]},
            {"a": "1"},
            False,
        ),
        ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {}, False),
        ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {}, True),
        ({}, {"a": "1"}, False),  # an empty selector takes nothing
        (None, {"a": "1"}, False),
    ],
)
def test_label_selectors(selector, labels, expected):
    assert definitions.selects(selector, labels) is expected


def test_an_exclusive_pool_books_whole_gpus_with_health_numa_and_nvlink():
    node = definitions.node_spec(
        "n1", labels={"bcd.dev/pool": "h100"}, status=_gpunode_status(), pool=_pool()
    )
    assert [(a.device_id, a.kind, a.numa_node, a.nvlink_domain, a.healthy) for a in node.atoms] == [
        (GPU_A, "gpu", 0, "n1-nvl0", True),
        (GPU_B, "gpu", 1, "n1-nvl0", False),
    ]
    assert node.pool_id == "h100"
    assert node.ready
    assert node.labels[pools.CAP_BINDING_KUBERNETES] == ("true", "system")
    assert node.labels[pools.CAP_DEVICES_LIMITS] == ("true", "system")
    assert node.labels[pools.CAP_CDI_NVIDIA] == ("true", "system")
    assert not [k for k in node.labels if "unknown" in k]  # only the capabilities we know
    assert node.labels["bcd.dev/pool"] == ("h100", "operator")
    assert node.resources == {"vcpu": 64, "memoryGiB": 512}


def test_a_mig_pool_books_instances_and_a_sliced_pool_books_replicas_slots():
    mig = definitions.node_spec(
        "n1", labels={}, status=_gpunode_status(mig=True), pool=_pool("mig")
    )
    assert [a.device_id for a in mig.atoms] == ["MIG-0-0", "MIG-0-1", "MIG-1-0", "MIG-1-1"]
    assert {a.parent_gpu for a in mig.atoms[2:]} == {GPU_B}
    assert not mig.atoms[2].healthy  # its GPU is unhealthy
    slots = definitions.node_spec(
        "n1", labels={}, status=_gpunode_status(), pool=_pool("timeslice", 3)
    )
    assert [a.device_id for a in slots.atoms][:3] == [f"{GPU_A}::0", f"{GPU_A}::1", f"{GPU_A}::2"]
    assert len(slots.atoms) == 6
    assert {a.kind for a in slots.atoms} == {"slot"}


def test_a_node_no_pool_takes_books_nothing_and_a_not_ready_node_takes_no_work():
    node = definitions.node_spec("n1", labels={}, status=_gpunode_status(ready=False), pool=None)
    assert node.atoms == []
    assert node.pool_id is None
    assert not node.ready


@pytest.mark.parametrize(
    ("condition", "expected"),
    [
        (None, None),
        ({"status": "False", "reason": "OnlyBcd", "message": "only bcd"}, None),
        (
            {"status": "True", "reason": "ForeignPath", "message": "sockets nvidia.sock"},
            "sockets nvidia.sock",
        ),
    ],
)
def test_a_gpunode_foreign_gpu_exposure_condition_reaches_the_node(condition, expected):
    status = _gpunode_status()
    if condition is not None:
        status["conditions"].append(
            {
                "type": "ForeignGpuExposure",
                "lastTransitionTime": "2026-12-06T00:00:00Z",
                **condition,
            }
        )
    node = definitions.node_spec("n1", labels={}, status=status, pool=_pool())
    assert node.foreign_exposure == expected
    assert node.ready  # foreign exposure takes no work away and releases nothing


def test_allocation_manifest_is_named_for_kubernetes_and_labelled_for_its_node():
    item = {
        "allocationId": "alloc_01ABC",
        "reservationId": "rsv_x",
        "tenantId": "acme",
        "state": "releasing",
        "binding": "kubernetes",
        "class": "gpu",
        "deviceIds": [GPU_A],
        "parentGpus": [GPU_A],
        "until": 123,
    }
    spec = allocations.allocation_spec(item, node="n1")
    assert spec["nodeName"] == "n1"
    manifest = allocations.allocation_manifest(spec, namespace="bc")
    assert manifest["metadata"]["name"] == "alloc-01abc"
    assert manifest["metadata"]["labels"] == {
        names.NODE_LABEL: "n1",
        names.RESERVATION_LABEL: "rsv_x",
    }
    assert manifest["spec"]["release"] is True
    assert manifest["spec"]["class"] == "gpu"
    # No podAccess said: the pool's default, ``reservation``: the devices get their own name.
    assert manifest["spec"]["resourceName"] == "bcd.dev/rsv-x"


@pytest.mark.parametrize(
    ("binding", "pod_access", "expected"),
    [
        ("kubernetes", "reservation", "bcd.dev/rsv-abc234"),
        ("kubernetes", "shared", None),
        ("hold", "reservation", None),
    ],
)
def test_only_a_reservation_mode_kubernetes_allocation_gets_its_own_resource_name(
    binding: str, pod_access: str, expected: str | None
):
    item = {
        "allocationId": "alloc_01ABC",
        "reservationId": "rsv_ABC234",
        "tenantId": "acme",
        "state": "desired",
        "binding": binding,
        "podAccess": pod_access,
        "class": "gpu",
        "deviceIds": [GPU_A],
        "parentGpus": [GPU_A],
        "until": 123,
    }
    assert allocations.allocation_spec(item, node="n1").get("resourceName") == expected


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (
            {"phase": "Bound", "cdiDevices": ["bcd.dev/gpu=G"], "envFile": "/e"},
            ("bound", {"cdiDevices": ["bcd.dev/gpu=G"], "envFile": "/e"}),
        ),
        (
            {
                "phase": "Bound",
                "cdiDevices": ["bcd.dev/gpu=G"],
                "envFile": "/e",
                "cgroupParent": "bcd-alloc-alloc_1.slice",
            },
            (
                "bound",
                {
                    "cdiDevices": ["bcd.dev/gpu=G"],
                    "envFile": "/e",
                    "cgroupParent": "bcd-alloc-alloc_1.slice",
                },
            ),
        ),
        ({"phase": "Failed"}, ("failed", {"reason": "the node did not say why"})),
        (
            {"phase": "Releasing", "pods": ["ml/p"], "since": 5},
            ("releasing", {"pods": ["ml/p"], "since": 5}),
        ),
        ({"phase": "Released"}, ("released", {})),
        ({}, None),
        ({"nodeName": "n1", "reportedAt": "2026-12-03T00:00:00Z"}, None),
    ],
)
def test_node_reports(status, expected):
    assert allocations.report(status) == expected


@pytest.mark.parametrize(
    ("status", "field"),
    [
        ({"phase": "Whatever"}, "status.phase"),
        ({"phase": "Bound", "cdiDevices": "bcd.dev/gpu=G"}, "status.cdiDevices"),
        ({"phase": "Releasing", "since": "yesterday"}, "status.since"),
        ({"phase": "Bound", "signature": "forged"}, "status.signature"),
        ({"phase": "Bound", "cgroupParent": ["x.slice"]}, "status.cgroupParent"),
        ([], "status"),
    ],
)
def test_a_status_of_another_shape_is_refused_naming_the_field(status, field):
    with pytest.raises(ShapeError) as refused:
        allocations.report(status)
    assert str(refused.value).startswith(f"{field}:"), str(refused.value)


def test_an_allocation_spec_the_crd_would_refuse_is_never_written():
    row = {
        "allocationId": "alloc_1",
        "reservationId": "rsv_x",
        "tenantId": "acme",
        "state": "desired",
        "binding": None,
        "class": "gpu",
        "deviceIds": [],
        "parentGpus": [],
        "until": 1,
    }
    with pytest.raises(ValueError, match="deviceIds"):
        allocations.allocation_spec(row, node="n1")
    assert allocations.allocation_spec({**row, "deviceIds": [GPU_A]}, node="n1")["binding"] == (
        "hold"
    )


@pytest.mark.parametrize(
    ("status", "field"),
    [
        ({"inventory": {"gpus": [{"uuid": "G", "index": 0, "model": "H100"}]}}, "memoryMiB"),
        ({"inventory": {"gpus": [{"index": 0, "model": "H100", "memoryMiB": 1}]}}, "uuid"),
        ({"conditions": [{"type": "Ready", "status": "Yes"}]}, "status.conditions[0].status"),
        ({"inventory": {"gpus": "eight"}}, "status.inventory.gpus"),
    ],
)
def test_a_gpunode_status_of_another_shape_is_refused_naming_the_field(status, field):
    with pytest.raises(ShapeError, match=re.escape(field)):
        definitions.node_spec("n1", labels={}, status=status, pool=None)


VIEW = {
    "id": "rsv_x",
    "tenantId": "acme",
    "poolId": "h100",
    "state": "placed",
    "request": {"devices": [{"class": "gpu", "count": 2}], "gang": {"size": 2}},
    "during": {"start": 1_790_000_000_000, "end": 1_790_028_800_000},
    "conditions": [
        {
            "type": "DevicesHeld",
            "reason": "PodsHoldDevices",
            "message": "m",
            "since": 1_790_000_000_000,
            "nodes": ["n1"],
            "pods": ["ml/p"],
        }
    ],
    "binding": None,
    "operation": {"id": "rsv_x", "state": "succeeded"},
    "version": 3,
}


def test_reservation_status_projects_the_guide_object_for_kubectl():
    status = statuses.reservation_status(
        VIEW, nodes=["n1", "n2"], generation=4, previous=None, now="2026-12-02T00:00:00Z"
    )
    assert status["state"] == "placed"
    assert status["gpus"] == 4
    assert status["nodes"] == "n1,n2"
    assert status["startTime"] == "2026-09-21T14:13:20Z"
    assert status["observedGeneration"] == 4
    assert status["binding"] is None
    held = status["conditions"][0]
    assert held["status"] == "True"
    assert held["type"] == "DevicesHeld"
    assert held["lastTransitionTime"] == "2026-09-21T14:13:20Z"  # since, not now
    assert held["observedGeneration"] == 4
    # metav1.Condition has no room for the rest: it moves beside the conditions.
    assert "pods" not in held
    assert status["conditionDetails"]["DevicesHeld"]["pods"] == ["ml/p"]
    for condition in status["conditions"]:
        assert set(condition) == {
            "type",
            "status",
            "reason",
            "message",
            "lastTransitionTime",
            "observedGeneration",
        }


def test_a_condition_that_clears_turns_false_and_stays_so():
    before = statuses.reservation_status(VIEW, nodes=["n1"], generation=4, previous=None, now="T1")
    cleared_view = {**VIEW, "conditions": []}
    after = statuses.reservation_status(
        cleared_view, nodes=["n1"], generation=None, previous=before, now="T2"
    )
    held = next(c for c in after["conditions"] if c["type"] == "DevicesHeld")
    assert held["status"] == "False"
    assert held["reason"] == "Cleared"
    assert held["lastTransitionTime"] == "T2"
    assert held["observedGeneration"] == 4
    assert after["conditionDetails"] is None
    later = statuses.reservation_status(
        cleared_view, nodes=["n1"], generation=5, previous=after, now="T3"
    )
    again = next(c for c in later["conditions"] if c["type"] == "DevicesHeld")
    assert (again["status"], again["lastTransitionTime"]) == ("False", "T2")
    assert again["observedGeneration"] == 5
    assert len([c for c in later["conditions"] if c["type"] == "DevicesHeld"]) == 1


def test_conditions_keep_their_transition_time_while_they_stand_still():
    first = statuses.conditions(
        [{"type": "Degraded", "reason": "AtomUnhealthy"}], previous=None, now="T1"
    )
    again = statuses.conditions(
        [{"type": "Degraded", "reason": "AtomUnhealthy"}], previous=first, now="T2"
    )
    changed = statuses.conditions(
        [{"type": "Degraded", "reason": "BindingLost"}], previous=first, now="T3"
    )
    assert [c["lastTransitionTime"] for c in (*first, *again, *changed)] == ["T1", "T1", "T3"]


def test_a_refusal_stays_through_projections_until_an_operation_succeeds():
    refused = statuses.refusal(
        ComputeError(ErrorCode.CONFLICT, "key reused"), operation="extend", now="T"
    )
    assert refused == {
        "type": "Refused",
        "status": "True",
        "reason": "CONFLICT",
        "message": "extend: key reused",
        "lastTransitionTime": "T",
    }
    shown = {
        "conditions": statuses.with_refusal(
            {"conditions": [refused]}, refused, now="T", generation=3
        )
    }
    assert [c["type"] for c in shown["conditions"]] == ["Refused", "Ready", "Placed"]
    assert shown["conditions"][0] == {**refused, "observedGeneration": 3}  # replaced, once
    # Never admitted: kubectl wait still finds Ready, False because of the refusal.
    ready = shown["conditions"][1]
    assert (ready["status"], ready["reason"]) == ("False", "Refused")
    assert statuses.refused_in(shown) == shown["conditions"][0]
    kept = statuses.reservation_status(
        VIEW, nodes=[], generation=None, previous=shown, now="T", refused=refused
    )
    assert ("Refused", "True") in [(c["type"], c["status"]) for c in kept["conditions"]]
    cleared = statuses.reservation_status(VIEW, nodes=[], generation=None, previous=shown, now="T")
    assert ("Refused", "False") in [(c["type"], c["status"]) for c in cleared["conditions"]]
    assert statuses.refused_in(cleared) is None


ALICE = {"username": "alice", "groups": ["ml", "system:authenticated"]}
SPEC = {"poolId": "h100", "devices": [{"class": "gpu", "count": 1}], "duration": "1h"}


def _obj(spec=SPEC, stamps=None):
    return {"metadata": {"annotations": dict(stamps or {})}, "spec": dict(spec)}


def test_the_stamp_is_the_requesting_user():
    assert webhooks.stamps(ALICE) == {
        names.REQUESTED_BY: "alice",
        names.REQUESTED_BY_GROUPS: json.dumps(["ml", "system:authenticated"]),
    }


@pytest.mark.parametrize(
    ("operation", "new", "old", "problem"),
    [
        ("CREATE", _obj(stamps=webhooks.stamps(ALICE)), None, None),
        ("CREATE", _obj(stamps={names.REQUESTED_BY: "mallory"}), None, "requested-by"),
        ("CREATE", _obj(), None, "requested-by"),
        (
            "CREATE",
            _obj({**SPEC, "devices": [{"class": "mig", "count": 1}]}, webhooks.stamps(ALICE)),
            None,
            "spec.devices[0]",
        ),
        ("CREATE", _obj({**SPEC, "bogus": 1}, webhooks.stamps(ALICE)), None, "spec.bogus"),
        ("CREATE", _obj({**SPEC, "until": 5}, webhooks.stamps(ALICE)), None, "spec.extendKey"),
        (
            "UPDATE",
            _obj({**SPEC, "duration": "2h"}, webhooks.stamps(ALICE)),
            _obj(stamps=webhooks.stamps(ALICE)),
            "spec.duration: is immutable",
        ),
        (
            "UPDATE",
            _obj(stamps={**webhooks.stamps(ALICE), names.REQUESTED_BY: "bob"}),
            _obj(stamps=webhooks.stamps(ALICE)),
            "is immutable",
        ),
        (
            "UPDATE",
            _obj({**SPEC, "extendBy": "1h", "extendKey": "e1"}, webhooks.stamps(ALICE)),
            _obj(stamps=webhooks.stamps(ALICE)),
            None,
        ),
        (
            "UPDATE",
            _obj({**SPEC, "extendBy": "soon", "extendKey": "e1"}, webhooks.stamps(ALICE)),
            _obj(stamps=webhooks.stamps(ALICE)),
            "spec.extendBy",
        ),
        (
            "UPDATE",
            _obj({**SPEC, "release": True}, webhooks.stamps(ALICE)),
            _obj(stamps=webhooks.stamps(ALICE)),
            None,
        ),
    ],
)
def test_webhook_verdicts(operation, new, old, problem):
    found = webhooks.refusal(operation=operation, userinfo=ALICE, new=new, old=old)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert problem in found


def test_a_node_whose_agent_stopped_heartbeating_is_not_connected():
    status = {**_gpunode_status(), "heartbeatTime": "2026-12-02T00:00:00Z"}
    beat = 1_796_169_600.0  # 2026-12-02T00:00:00Z
    fresh = definitions.node_spec("n1", labels={}, status=status, pool=_pool(), now_s=beat + 60)
    stale = definitions.node_spec("n1", labels={}, status=status, pool=_pool(), now_s=beat + 91)
    assert fresh.connected
    assert not stale.connected
    assert stale.ready  # its Ready condition still stands; it only takes no new work
