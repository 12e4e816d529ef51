"""Whose pods hold a reservation's devices: the node agent asks the kubelet's PodResources on
every pass and just after each Allocate, reports the holders in its signed ``Bound`` report,
and in pod access ``reservation`` names every holder outside the Reservation's namespace
(``intruders``) and warns it once. Through the kubelet and PodResources stand-ins' real gRPC
over unix sockets.

The attack: a pod of another namespace that got hold of the devices anyway (a pod created
while the webhooks were off, or through a hole in them) is caught by the node and named in a
report the control plane can verify.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from bettercompute.deviceplugin import converging, signing
from tests.deviceplugin.conftest import GPU, Node, allocation_spec

MINE = "bcd.dev/rsv-aaaaaaaaaaaaaaaaaaaaaaaa"


async def _until(check: Callable[[], Any], *, within_s: float = 3.0) -> Any:
    deadline = time.monotonic() + within_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError("not reached in time")
        await asyncio.sleep(0.02)


def _bound_with(node: Node, allocation_id: str, **fields: Any) -> Callable[[], Any]:
    def check() -> Any:
        last = node.reporter.last(allocation_id)
        if last and last["phase"] == "Bound" and all(last[k] == v for k, v in fields.items()):
            return last
        return None

    return check


async def test_a_pod_of_another_namespace_holding_the_devices_is_named_and_warned_once(
    running_node: Node,
) -> None:
    node = running_node
    node.put(
        allocation_spec("alloc_a", ["GPU-0", "GPU-1"], resourceName=MINE, reservationNamespace="ml")
    )
    await node.reporter.wait_phase("alloc_a", "Bound")
    node.pod_resources.holding({"ml/trainer-0": {MINE: ["GPU-0"]}})
    await _until(_bound_with(node, "alloc_a", pods=["ml/trainer-0"], intruders=[]))
    assert node.warnings.raised == []

    # A thief of another namespace: named in the report, signed, and warned on its pod.
    node.pod_resources.holding(
        {"ml/trainer-0": {MINE: ["GPU-0"]}, "other/thief": {MINE: ["GPU-1"]}}
    )
    status = await _until(
        _bound_with(
            node, "alloc_a", pods=["ml/trainer-0", "other/thief"], intruders=["other/thief"]
        )
    )
    signed = signing.verify(signature=status["signature"], public_key=node.key.public_key)
    assert (signed["pods"], signed["intruders"]) == (
        ["ml/trainer-0", "other/thief"],
        ["other/thief"],
    )
    ((pod, reason, message),) = node.warnings.raised
    assert (pod, reason) == ("other/thief", converging.INTRUDER_REASON)
    assert "rsv_alloc_a" in message
    assert "namespace ml" in message
    assert "GPU-0, GPU-1" in message
    # Many passes later: still one warning, one report of it.
    calls = node.pod_resources.calls
    await _until(lambda: node.pod_resources.calls > calls + 5)
    assert len(node.warnings.raised) == 1
    reports = [s for s in node.reporter.statuses["alloc_a"] if s["intruders"] == ["other/thief"]]
    assert len(reports) == 1

    # It lets go: the report clears; the devices are never taken from a running pod.
    node.pod_resources.holding({"ml/trainer-0": {MINE: ["GPU-0"]}})
    await _until(_bound_with(node, "alloc_a", pods=["ml/trainer-0"], intruders=[]))
    assert node.plugin is not None
    assert node.plugin.allocations.get("alloc_a") is not None


async def test_in_shared_pod_access_the_holders_are_reported_without_intruders(
    running_node: Node,
) -> None:
    node = running_node
    # Pod access 'shared': no resource of its own, so any pod may; the report says which.
    node.put(allocation_spec("alloc_s", ["GPU-2"], reservationNamespace="ml"))
    await node.reporter.wait_phase("alloc_s", "Bound")
    node.pod_resources.holding({"other/anyone": {GPU: ["GPU-2"]}})
    await _until(_bound_with(node, "alloc_s", pods=["other/anyone"], intruders=[]))
    assert node.warnings.raised == []


async def test_a_reservation_made_through_the_api_has_no_namespace_to_hold_to(
    running_node: Node,
) -> None:
    node = running_node
    node.put(allocation_spec("alloc_api", ["GPU-3"], resourceName=MINE))
    await node.reporter.wait_phase("alloc_api", "Bound")
    node.pod_resources.holding({"team/job": {MINE: ["GPU-3"]}})
    await _until(_bound_with(node, "alloc_api", pods=["team/job"], intruders=[]))
    assert node.warnings.raised == []


async def test_an_allocate_makes_the_agent_look_at_once_not_at_its_next_pass(
    kubelet_node: Node,
) -> None:
    node = kubelet_node
    node.plugin = node.make_plugin(pass_seconds=30.0)  # passes far apart: only Allocate wakes
    async with node.plugin.running():
        node.put(
            allocation_spec("alloc_w", ["GPU-0"], resourceName=MINE, reservationNamespace="ml")
        )
        await node.reporter.wait_phase("alloc_w", "Bound")
        await node.kubelet.wait_registered([MINE], within=3.0)
        # The kubelet records the assignment, then calls Allocate (the stand-in answers List
        # from what the test says).
        node.pod_resources.holding({"other/thief": {MINE: ["GPU-0"]}})
        await node.stream(MINE).allocate(["GPU-0"])
        await _until(_bound_with(node, "alloc_w", intruders=["other/thief"]), within_s=3.0)
        assert [w[0] for w in node.warnings.raised] == ["other/thief"]


async def test_a_kubelet_that_does_not_answer_keeps_the_last_known_holders(
    running_node: Node,
) -> None:
    node = running_node
    node.put(allocation_spec("alloc_k", ["GPU-1"], resourceName=MINE, reservationNamespace="ml"))
    node.pod_resources.holding({"other/thief": {MINE: ["GPU-1"]}})
    await _until(_bound_with(node, "alloc_k", intruders=["other/thief"]))
    await node.pod_resources.stop()
    calls = len(node.reporter.statuses["alloc_k"])
    await asyncio.sleep(0.5)  # ten passes without a kubelet
    assert len(node.reporter.statuses["alloc_k"]) == calls  # nothing forgotten, nothing new
    assert len(node.warnings.raised) == 1


async def test_pods_of_a_preempted_spot_reservation_are_warned_once_with_when(
    running_node: Node,
) -> None:
    node = running_node
    spec = allocation_spec("alloc_p", ["GPU-2"], resourceName=MINE, reservationNamespace="ml")
    node.put(spec)
    node.pod_resources.holding({"ml/train-0": {MINE: ["GPU-2"]}})
    await _until(_bound_with(node, "alloc_p", pods=["ml/train-0"]))
    assert node.warnings.raised == []
    node.put({**spec, "preemptAt": 1_790_000_120_000})  # the operator's notice
    await _until(lambda: node.warnings.raised)
    calls = node.pod_resources.calls
    await _until(lambda: node.pod_resources.calls > calls + 5)
    ((pod, reason, message),) = node.warnings.raised
    assert (pod, reason) == ("ml/train-0", converging.PREEMPTED_REASON)
    assert "rsv_alloc_p is preempted" in message
    assert signing.rfc3339(1_790_000_120_000) in message
