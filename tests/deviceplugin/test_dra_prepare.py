"""The DRA plugin prepares exactly the claims allocated devices of their own namespace's
reservation, over real gRPC (v1 and v1beta1), and refuses every other claim by itself."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator

import pytest

from bettercompute.deviceplugin import draserving, nvidiacdi
from bettercompute.kube import dra
from bettercompute.kube.client import KubeClient, kube_config
from tests.deviceplugin.conftest import GPU, NODE, Node, allocation_spec
from tests.deviceplugin.dranodes import DraNode, dra_node, dra_spec, wait_report
from tests.support.drakubelet import Claim, PreparedDevice
from tests.support.kubeserver import KubeApi


@pytest.fixture
async def dranode(kubelet_node: Node, kube_api: KubeApi) -> AsyncIterator[DraNode]:
    async with dra_node(kubelet_node, kube_api) as found:
        yield found


def device(device_id: str, *cdi: str, claim: Claim | None = None) -> PreparedDevice:
    """A device as the answer names it; the first of its request (``claim`` given) also
    carries the claim's own CDI device, which sets the container's environment."""
    own = () if claim is None else (f"bcd.dev/gpu=claim-{claim.uid}-gpus",)
    return PreparedDevice(
        request_names=("gpus",),
        pool_name=NODE,
        device_name=dra.device_name(device_id),
        cdi_device_ids=(f"bcd.dev/gpu={device_id}", *cdi, *own),
    )


async def test_registration_offers_both_services_and_the_kubelet_picks_v1(dranode: DraNode) -> None:
    async with dranode.agent():
        plugin = dranode.kubelet.plugins["gpu.bcd.dev"]
        assert plugin.version == "v1"
        assert plugin.endpoint == str(dranode.node.root / "kplugins" / "gpu.bcd.dev" / "dra.sock")
        assert dranode.kubelet.registrations[-1][1:] == (True, "")
        registrar = dranode.node.plugin.dra_registrar if dranode.node.plugin else None
        assert registrar is not None
        assert registrar.statuses == [(True, "")]


async def test_prepare_answers_the_claims_devices_as_cdi_ids(dranode: DraNode) -> None:
    async with dranode.agent() as node:
        node.put(dra_spec("alloc_a", ["GPU-0", "GPU-1"]))
        bound = await node.reporter.wait_phase("alloc_a", "Bound")
        assert bound["pods"] == []
        claim = await dranode.claim("ml", "train-gpus", ["GPU-0", "GPU-1"])

        answers = await dranode.kubelet.prepare([claim])

        assert answers[claim.uid].error == ""
        assert answers[claim.uid].devices == (device("GPU-0", claim=claim), device("GPU-1"))
        spec = json.loads((node.root / "cdi" / f"bcdclaim-{claim.uid}.json").read_text())
        assert spec["kind"] == "bcd.dev/gpu"
        assert spec["devices"] == [
            {
                "name": f"claim-{claim.uid}-gpus",
                "containerEdits": {
                    "env": [
                        "NVIDIA_VISIBLE_DEVICES=GPU-0,GPU-1",
                        "BCD_ALLOCATION_ID=alloc_a",
                        "BCD_RESERVATION_ID=rsv_alloc_a",
                        "BCD_CLAIM=ml/train-gpus",
                    ]
                },
            }
        ]
        # Never through the device plugin: the shared resource lists nothing.
        await node.stream(GPU).wait_devices({})
        # The prepared claim now holds the allocation's devices, and the report says so.
        await wait_report(node, "alloc_a", lambda s: s["pods"] == ["ml/train-gpus"])


async def test_a_v1beta1_kubelet_prepares_the_same(kubelet_node: Node, kube_api: KubeApi) -> None:
    async with (
        dra_node(kubelet_node, kube_api, speaks=("v1beta1",)) as found,
        found.agent() as node,
    ):
        assert found.kubelet.plugins["gpu.bcd.dev"].version == "v1beta1"
        node.put(dra_spec("alloc_a", ["MIG-4a"], device_class="mig"))
        await node.reporter.wait_phase("alloc_a", "Bound")
        claim = await found.claim("ml", "one-mig", ["MIG-4a"])

        answers = await found.kubelet.prepare([claim])

        assert answers[claim.uid].error == ""
        assert answers[claim.uid].devices == (device("MIG-4a", claim=claim),)
        assert await found.kubelet.unprepare([claim]) == {claim.uid: ""}
        assert node.plugin is not None
        assert node.plugin.claims is not None
        assert node.plugin.claims.all() == []


async def test_nvidia_cdi_device_is_answered_beside_ours(dranode: DraNode) -> None:
    specs = dranode.node.root / "nvidia-cdi"
    specs.mkdir()
    (specs / "nvidia.json").write_text(
        json.dumps(
            {
                "cdiVersion": "0.5.0",
                "kind": "nvidia.com/gpu",
                "devices": [
                    {"name": "GPU-0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}
                ],
            }
        )
    )
    source = nvidiacdi.WithNvidiaCdi(dranode.node.file_source(), dirs=[specs])
    async with dranode.agent(inventory_source=source) as node:
        node.put(dra_spec("alloc_a", ["GPU-0"]))
        await node.reporter.wait_phase("alloc_a", "Bound")
        claim = await dranode.claim("ml", "c", ["GPU-0"])

        answers = await dranode.kubelet.prepare([claim])

        assert answers[claim.uid].devices == (device("GPU-0", "nvidia.com/gpu=GPU-0", claim=claim),)


async def test_every_claim_of_a_request_gets_its_own_answer(dranode: DraNode) -> None:
    async with dranode.agent() as node:
        node.put(dra_spec("alloc_a", ["GPU-0"]))
        await node.reporter.wait_phase("alloc_a", "Bound")
        good = await dranode.claim("ml", "good", ["GPU-0"])
        bad = await dranode.claim("ml", "bad", ["GPU-2"])  # GPU-2 is booked by nobody
        missing = Claim(namespace="ml", name="missing", uid="0000-missing")

        answers = await dranode.kubelet.prepare([good, bad, missing])

        assert set(answers) == {good.uid, bad.uid, missing.uid}
        assert answers[good.uid].devices == (device("GPU-0", claim=good),)
        assert "not bound on node" in answers[bad.uid].error
        assert answers[bad.uid].devices == ()
        assert "does not exist" in answers[missing.uid].error


async def test_refusals(dranode: DraNode) -> None:
    """Each claim that must not be prepared gets a per-claim error naming why, and is not
    remembered (so it holds nothing)."""
    async with dranode.agent() as node:
        node.put(dra_spec("alloc_a", ["GPU-0"]))
        node.put(dra_spec("alloc_b", ["GPU-1"]))
        node.put(allocation_spec("alloc_dp", ["GPU-2"]))  # a device-plugin binding
        for allocation_id in ("alloc_a", "alloc_b", "alloc_dp"):
            await node.reporter.wait_phase(allocation_id, "Bound")
        cases = {
            "not bound here": (await dranode.claim("ml", "c1", ["GPU-3"]), "not bound on node"),
            "a device-plugin allocation's device": (
                await dranode.claim("ml", "c2", ["GPU-2"]),
                "not bound on node",
            ),
            "spanning two reservations": (
                await dranode.claim("ml", "c3", ["GPU-0", "GPU-1"]),
                "span allocations alloc_a, alloc_b",
            ),
            "another node's pool": (
                await dranode.claim("ml", "c4", ["GPU-0"], pool="gpu-node-2"),
                "in pool gpu-node-2",
            ),
            "not allocated": (await dranode.claim("ml", "c5", allocated=False), "is not allocated"),
            "another driver only": (
                await dranode.claim("ml", "c6", ["GPU-0"], driver="gpu.nvidia.com"),
                "no device of driver gpu.bcd.dev",
            ),
        }
        uid_swapped = await dranode.claim("ml", "c7", ["GPU-0"])
        cases["uid mismatch"] = (
            Claim(namespace="ml", name="c7", uid="not-" + uid_swapped.uid),
            "a different claim",
        )

        answers = await dranode.kubelet.prepare([claim for claim, _ in cases.values()])

        for why, (claim, said) in cases.items():
            assert said in answers[claim.uid].error, (why, answers[claim.uid].error)
            assert answers[claim.uid].devices == (), why
        assert node.plugin is not None
        assert node.plugin.claims is not None
        assert node.plugin.claims.all() == []
        assert not dranode.checkpoint.exists()
        assert not list((node.root / "cdi").glob("bcdclaim-*"))


async def test_a_claim_of_another_namespace_allocated_a_reservations_devices_is_refused(
    dranode: DraNode,
) -> None:
    """The attack: the scheduler (through a bad policy or a race) allocated reservation
    ``alloc_a`` of namespace ``ml`` to a claim in namespace ``intruder``. The node refuses it,
    whatever the scheduler decided; the rightful claim is still prepared."""
    async with dranode.agent() as node:
        node.put(dra_spec("alloc_a", ["GPU-0", "GPU-1"], namespace="ml"))
        await node.reporter.wait_phase("alloc_a", "Bound")
        stolen = await dranode.claim("intruder", "steal", ["GPU-0"])
        rightful = await dranode.claim("ml", "mine", ["GPU-1"])

        answers = await dranode.kubelet.prepare([stolen, rightful])

        assert answers[stolen.uid].devices == ()
        assert "of namespace ml, not intruder" in answers[stolen.uid].error
        assert answers[rightful.uid].devices == (device("GPU-1", claim=rightful),)
        assert node.plugin is not None
        assert node.plugin.claims is not None
        assert [c.holder for c in node.plugin.claims.all()] == ["ml/mine"]


async def test_prepare_twice_answers_the_same_and_unprepare_is_idempotent(dranode: DraNode) -> None:
    async with dranode.agent() as node:
        node.put(dra_spec("alloc_a", ["GPU-0"]))
        await node.reporter.wait_phase("alloc_a", "Bound")
        claim = await dranode.claim("ml", "c", ["GPU-0"])
        first = await dranode.kubelet.prepare([claim])

        again = await dranode.kubelet.prepare([claim])

        assert again == first
        unknown = Claim(namespace="ml", name="never", uid="never-prepared")
        assert await dranode.kubelet.unprepare([claim, unknown]) == {claim.uid: "", unknown.uid: ""}
        assert await dranode.kubelet.unprepare([claim]) == {claim.uid: ""}
        assert node.plugin is not None
        assert node.plugin.claims is not None
        assert node.plugin.claims.all() == []


async def test_a_subrequest_result_is_answered_under_its_main_request(dranode: DraNode) -> None:
    """A container names the claim's request ("gpus"); a firstAvailable result names
    "gpus/h100". The kubelet hands a container the devices whose request names contain the
    container's, so the answer must say "gpus"."""
    async with dranode.agent() as node:
        node.put(dra_spec("alloc_a", ["GPU-0"]))
        await node.reporter.wait_phase("alloc_a", "Bound")
        claim = await dranode.claim("ml", "c", ["GPU-0"], request="gpus/h100")

        answers = await dranode.kubelet.prepare([claim])

        assert answers[claim.uid].devices == (device("GPU-0", claim=claim),)


async def test_a_kubelet_that_speaks_no_offered_version_refuses_and_the_plugin_hears_why(
    kubelet_node: Node, kube_api: KubeApi
) -> None:
    async with dra_node(kubelet_node, kube_api, speaks=("v1alpha4",)) as found:
        kubelet_node.plugin = kubelet_node.make_plugin(dra=found.setup())
        async with kubelet_node.plugin.running():
            await found.kubelet.wait_attempts(1)
            registrar = kubelet_node.plugin.dra_registrar
            assert registrar is not None
            assert found.kubelet.plugins == {}
            assert registrar.statuses[0][0] is False
            assert "v1.DRAPlugin" in registrar.statuses[0][1]


async def test_an_unreachable_api_fails_the_claim_not_the_call(
    kubelet_node: Node, kube_api: KubeApi
) -> None:
    """The claim cannot be read: its answer says so (the kubelet retries), and the claim is
    not prepared on faith."""
    async with dra_node(kubelet_node, kube_api) as found:
        config, _ = kube_config(api_server="http://127.0.0.1:1", api_token="t")
        async with KubeClient(config, timeout_s=1.0) as dead:
            setup = dataclasses.replace(found.setup(), reader=draserving.KubeClaimReader(dead))
            kubelet_node.plugin = kubelet_node.make_plugin(dra=setup)
            async with kubelet_node.plugin.running():
                await found.kubelet.wait_registered(dra.DRIVER)
                kubelet_node.put(dra_spec("alloc_a", ["GPU-0"]))
                await kubelet_node.reporter.wait_phase("alloc_a", "Bound")
                claim = Claim(namespace="ml", name="c", uid="1234")

                answers = await found.kubelet.prepare([claim])

                assert "cannot read ResourceClaim ml/c" in answers[claim.uid].error
                assert answers[claim.uid].devices == ()
