"""The agent's core against its two ports in memory, the real gRPC servers, the kubelet stand-in
and the PodResources stand-in: binding, releasing while pods hold devices, an unreachable kubelet,
restarts with live allocations, refused specs, and signed reports."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time
from typing import Any

import pytest

from bettercompute.core.attestation import Revocations
from bettercompute.deviceplugin import devicefiles, signing
from bettercompute.deviceplugin.devicefiles import Allocation
from bettercompute.kube.allocations import parse_spec
from bettercompute.kube.parsing import ShapeError
from tests.deviceplugin.conftest import GPU, MIG, SLOT, Node, allocation_spec, inventory
from tests.support import cdirules, nodecerts


async def test_binding_writes_valid_files_and_reports_bound_signed(running_node: Node) -> None:
    node = running_node
    node.put(allocation_spec("alloc_a", ["GPU-0", "GPU-1"]))

    status = await node.reporter.wait_phase("alloc_a", "Bound")

    env_file = node.root / "env" / "alloc_a.env"
    assert status["nodeName"] == "gpu-node-1"
    assert status["cdiDevices"] == ["bcd.dev/gpu=GPU-0", "bcd.dev/gpu=GPU-1"]
    assert status["envFile"] == str(env_file)
    assert (status["reason"], status["pods"], status["since"]) == ("", [], None)
    assert node.files_on_disk() == ["cdi/bcd-alloc_a.json", "env/alloc_a.env"]
    spec = json.loads((node.root / "cdi" / "bcd-alloc_a.json").read_text())
    cdirules.check(spec)
    assert spec["annotations"][devicefiles.ANNOTATION_DEVICE_PLUGIN] == GPU
    assert devicefiles.read_env(env_file)["NVIDIA_VISIBLE_DEVICES"] == "GPU-0,GPU-1"

    signed = signing.verify(signature=status["signature"], public_key=node.key.public_key)
    assert signed == {
        "purpose": "attested-report",
        "nodeName": "gpu-node-1",
        "allocationId": "alloc_a",
        "reservationId": "rsv_alloc_a",
        "phase": "Bound",
        "cdiDevices": ["bcd.dev/gpu=GPU-0", "bcd.dev/gpu=GPU-1"],
        "envFile": str(env_file),
        "cgroupParent": None,  # a kubernetes binding gets no slice
        "pods": [],
        "intruders": [],
        "since": None,
        "reportedAt": status["reportedAt"],
    }


async def test_release_waits_for_the_pods_holding_the_devices(running_node: Node) -> None:
    node = running_node
    node.put(allocation_spec("alloc_a", ["GPU-0", "GPU-1"]))
    await node.stream(GPU).wait_devices({"GPU-0": "Healthy", "GPU-1": "Healthy"})
    # Another resource's device with the same id must not count.
    node.pod_resources.holding({"ml/trainer-0": {GPU: ["GPU-1"]}, "ml/other": {SLOT: ["GPU-0"]}})

    node.release("alloc_a")

    releasing = await node.reporter.wait_phase("alloc_a", "Releasing")
    assert releasing["pods"] == ["ml/trainer-0"]
    assert isinstance(releasing["since"], int)
    await node.stream(GPU).wait_devices({})  # no longer advertised, from the first moment
    assert node.files_on_disk() == ["cdi/bcd-alloc_a.json", "env/alloc_a.env"]  # still held
    report = signing.verify(signature=releasing["signature"], public_key=node.key.public_key)
    assert (report["phase"], report["pods"], report["since"]) == (
        "Releasing",
        ["ml/trainer-0"],
        releasing["since"],
    )

    node.pod_resources.holding({"ml/other": {SLOT: ["GPU-0"]}})  # the trainer pod is gone

    released = await node.reporter.wait_phase("alloc_a", "Released")
    assert node.files_on_disk() == []
    assert (released["pods"], released["since"]) == ([], None)
    assert node.reporter.phases("alloc_a") == ["Bound", "Releasing", "Released"]


async def test_an_unreachable_kubelet_keeps_the_allocation_releasing(running_node: Node) -> None:
    node = running_node
    node.put(allocation_spec("alloc_a", ["GPU-0"]))
    await node.reporter.wait_phase("alloc_a", "Bound")
    await node.pod_resources.stop()

    node.release("alloc_a")

    releasing = await node.reporter.wait_phase("alloc_a", "Releasing")
    assert "kubelet unreachable" in releasing["reason"]
    await node.stream(GPU).wait_devices({})
    # Several passes later it is still releasing, the files still there.
    calls_before = node.pod_resources.calls
    assert node.plugin is not None
    for _ in range(3):
        await node.plugin.converger.sync_once()
    assert node.reporter.phases("alloc_a")[-1] == "Releasing"
    assert node.files_on_disk() == ["cdi/bcd-alloc_a.json", "env/alloc_a.env"]
    assert node.pod_resources.calls == calls_before

    await node.pod_resources.start()  # back, and no pod holds GPU-0
    await node.reporter.wait_phase("alloc_a", "Released")
    assert node.files_on_disk() == []


async def test_a_restarted_plugin_rebuilds_from_the_desired_list_and_the_files(
    kubelet_node: Node,
) -> None:
    node = kubelet_node
    node.put(allocation_spec("alloc_live", ["GPU-0", "GPU-1"]))
    node.put(allocation_spec("alloc_slots", ["GPU-2::0"], device_class="slot"))
    node.put(allocation_spec("alloc_held", ["MIG-4a"], device_class="mig"))
    node.plugin = node.make_plugin()
    async with node.plugin.running():
        await node.kubelet.wait_registered([GPU, MIG, SLOT])
        await node.stream(MIG).wait_devices({"MIG-4a": "Healthy"})
        await node.reporter.wait_phase("alloc_slots", "Bound")
        node.pod_resources.holding({"ml/infer": {MIG: ["MIG-4a"]}})
        node.release("alloc_held")
        first = await node.reporter.wait_phase("alloc_held", "Releasing")
    # While the agent was down: one allocation vanished, and an old agent's file was left.
    node.delete("alloc_slots")
    leaked = Allocation.from_spec(parse_spec(allocation_spec("alloc_leaked", ["GPU-3"])))
    node.files.write(leaked)
    node.plugin = node.make_plugin()
    node.reporter.statuses.clear()
    restarted = time.monotonic()

    async with node.plugin.running():
        await node.kubelet.wait_registered([GPU, MIG, SLOT], after=restarted)
        # The kubelet's first message on the new stream is already the rebuilt list.
        await node.stream(GPU).wait_devices({"GPU-0": "Healthy", "GPU-1": "Healthy"})
        assert [d.ID for d in node.stream(GPU).messages[0][1].devices] == ["GPU-0", "GPU-1"]
        await node.reporter.wait_phase("alloc_live", "Bound")  # re-reported once
        again = await node.reporter.wait_phase("alloc_held", "Releasing")
        assert again["since"] == first["since"]  # the release time survived the restart
        assert again["pods"] == ["ml/infer"]
        await node.stream(MIG).wait_devices({})
        await node.stream(SLOT).wait_devices({})
        await node.reporter.wait_phase("alloc_slots", "Released")
        await node.reporter.wait_phase("alloc_leaked", "Released")
        assert node.files_on_disk() == [
            "cdi/bcd-alloc_held.json",
            "cdi/bcd-alloc_live.json",
            "env/alloc_held.env",
            "env/alloc_live.env",
        ]
        # GPU-0 was never advertised twice, in any message.
        for _, message in node.stream(GPU).messages:
            ids = [d.ID for d in message.devices]
            assert len(ids) == len(set(ids))
        assert node.reporter.phases("alloc_live") == ["Bound"]


async def test_a_bound_gpu_gone_from_the_inventory_after_a_restart_is_kept_unhealthy(
    kubelet_node: Node,
) -> None:
    node = kubelet_node
    node.put(allocation_spec("alloc_a", ["GPU-0", "GPU-1"]))
    node.plugin = node.make_plugin()
    async with node.plugin.running():
        await node.reporter.wait_phase("alloc_a", "Bound")
    whole = inventory()
    lone = dataclasses.replace(whole.gpus[1], nvlink_peers=())
    node.set_inventory(dataclasses.replace(whole, gpus=(lone, *whole.gpus[2:])))  # GPU-0 is gone
    node.reporter.statuses.clear()
    restarted = time.monotonic()

    node.plugin = node.make_plugin()
    async with node.plugin.running():
        await node.kubelet.wait_registered([GPU], after=restarted)
        await node.stream(GPU).wait_devices({"GPU-0": "Unhealthy", "GPU-1": "Healthy"})
        assert node.reporter.phases("alloc_a") == ["Bound"]
        # A new allocation of the missing GPU is refused, though.
        node.put(allocation_spec("alloc_b", ["GPU-0"]))
        failed = await node.reporter.wait_phase("alloc_b", "Failed")
        assert "GPU-0 is not in this node's inventory" in failed["reason"]


async def test_a_device_bound_to_another_allocation_is_refused(running_node: Node) -> None:
    node = running_node
    node.put(allocation_spec("alloc_a", ["GPU-0", "GPU-1"]))
    await node.reporter.wait_phase("alloc_a", "Bound")

    node.put(allocation_spec("alloc_b", ["GPU-1", "GPU-2"]))

    failed = await node.reporter.wait_phase("alloc_b", "Failed")
    assert "GPU-1" in failed["reason"]
    assert "alloc_a" in failed["reason"]
    await node.stream(GPU).wait_devices({"GPU-0": "Healthy", "GPU-1": "Healthy"})
    assert not (node.root / "cdi" / "bcd-alloc_b.json").exists()


async def test_a_device_still_held_by_a_releasing_allocation_waits_then_binds(
    running_node: Node,
) -> None:
    node = running_node
    node.put(allocation_spec("alloc_old", ["GPU-0"]))
    await node.reporter.wait_phase("alloc_old", "Bound")
    node.pod_resources.holding({"ml/trainer-0": {GPU: ["GPU-0"]}})
    node.release("alloc_old")
    await node.reporter.wait_phase("alloc_old", "Releasing")

    node.put(allocation_spec("alloc_new", ["GPU-0"]))
    assert node.plugin is not None
    outcome = await node.plugin.converger.sync_once()
    assert outcome.waiting == ["alloc_new"]
    assert node.reporter.last("alloc_new") is None
    node.pod_resources.holding({})

    await node.reporter.wait_phase("alloc_new", "Bound")
    await node.stream(GPU).wait_devices({"GPU-0": "Healthy"})
    assert node.reporter.last("alloc_old")["phase"] == "Released"  # type: ignore[index]


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (allocation_spec("../../etc/passwd", ["GPU-0"]), "spec.allocationId"),
        (allocation_spec("alloc_x", ["GPU-0/../../x"]), "spec.deviceIds"),
        (allocation_spec("alloc_x", ["GPU-7"]), "GPU-7 is not in this node's inventory"),
        (allocation_spec("alloc_x", ["MIG-9"], device_class="mig"), "MIG device MIG-9"),
        (allocation_spec("alloc_x", ["GPU-0"], device_class="tpu"), "spec.class"),
        (allocation_spec("alloc_x", ["GPU-0"], until="soon"), "spec.until"),
        (allocation_spec("alloc_x", ["GPU-0"], reservationId=None), "spec.reservationId"),
        (allocation_spec("alloc_x", ["GPU-0"], parentGpus=["GPU-1"]), "parent"),
    ],
    ids=["traversal", "device-path", "unknown-gpu", "unknown-mig", "class", "until", "rsv", "par"],
)
async def test_a_bad_spec_is_reported_failed_and_writes_nothing(
    running_node: Node, spec: dict[str, object], reason: str
) -> None:
    node = running_node
    node.put(spec)

    failed = await node.reporter.wait_phase(str(spec["allocationId"]), "Failed")

    assert reason in failed["reason"]
    assert node.files_on_disk() == []  # nothing anywhere under the node's root
    assert {p.name for p in node.root.iterdir()} <= {
        "cdi", "env", "inventory.yaml", "plugins", "pod-resources", "cgroup", "slices",
    }  # fmt: skip
    assert list(node.cgroup_root.glob("*.slice")) == []
    await node.stream(GPU).wait_devices({})
    signing.verify(signature=failed["signature"], public_key=node.key.public_key)


def _without(spec: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k != key}


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (allocation_spec("alloc_t", ["GPU-0"], until="2026-09-30T00:00:00Z"), "spec.until"),
        (allocation_spec("alloc_t", ["GPU-0"], deviceIds=["GPU-0", 7]), "spec.deviceIds[1]"),
        (_without(allocation_spec("alloc_t", ["GPU-0"]), "tenantId"), "spec.tenantId"),
        (
            allocation_spec("alloc_t", ["GPU-0"], limits={"cpuMillis": "lots"}),
            "spec.limits.cpuMillis",
        ),
    ],
    ids=["mistyped", "mistyped-item", "missing", "nested"],
)
async def test_a_spec_of_another_shape_is_failed_once_in_the_contracts_words(
    running_node: Node, caplog: pytest.LogCaptureFixture, spec: dict[str, Any], field: str
) -> None:
    # The node reads a spec with the contract's own parser: the reason it reports is the one
    # kube.allocations gives (the operator's wording of the same mistake), reported and logged
    # once however many passes see it, and never a traceback.
    node = running_node
    caplog.set_level(logging.WARNING, logger="bettercompute.deviceplugin.converging")
    with pytest.raises(ShapeError) as refused:
        parse_spec(spec)
    assert str(refused.value).startswith(f"{field}: ")
    node.put(spec)
    node.desired.specs["no-id"] = _without(allocation_spec("alloc_n", ["GPU-1"]), "allocationId")

    failed = await node.reporter.wait_phase("alloc_t", "Failed")
    for _ in range(3):
        await node.plugin.converger.sync_once()  # type: ignore[union-attr]

    assert failed["reason"] == str(refused.value)
    assert node.reporter.phases("alloc_t") == ["Failed"]
    assert set(node.reporter.statuses) == {"alloc_t"}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [w for w in warnings if "alloc_t" in w] == [f"alloc_t: cannot bind: {refused.value}"]
    assert len([w for w in warnings if "without allocationId" in w]) == 1
    assert not [r for r in caplog.records if r.exc_info]
    assert node.files_on_disk() == []


async def test_reports_carry_the_certificate_the_enrolment_hands_the_agent(
    running_node: Node,
) -> None:
    node = running_node
    assert node.plugin is not None
    node.put(allocation_spec("alloc_uncertified", ["GPU-0"]))
    before = await node.reporter.wait_phase("alloc_uncertified", "Bound")
    assert "certificate" not in {k for k, v in before["signature"].items() if v is not None}

    # Enrolled: every report from now on carries the current certificate, and the control
    # plane's verifier accepts the binding it signs.
    certificate = nodecerts.certify("gpu-node-1", node.key)
    node.plugin.converger.certificate = lambda: certificate
    node.put(allocation_spec("alloc_certified", ["GPU-1"]))
    status = await node.reporter.wait_phase("alloc_certified", "Bound")
    assert status["signature"]["certificate"] == certificate
    attested = nodecerts.TRUST.verify_binding(
        status["signature"],
        node_name="gpu-node-1",
        allocation_id="alloc_certified",
        reservation_id="rsv_alloc_certified",
        now=datetime.datetime.now(datetime.UTC),
        revoked=Revocations(),
    )
    assert attested.cdi_devices == ("bcd.dev/gpu=GPU-1",)
