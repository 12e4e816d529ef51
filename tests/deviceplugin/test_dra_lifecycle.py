"""Prepared claims hold their devices through a release, an agent restart and a kubelet restart:
a release stays Releasing (signed) until the kubelet unprepared every claim, the checkpoint
brings prepared claims back, and the plugin registers again whenever its socket goes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from bettercompute.deviceplugin import draclaims, signing
from bettercompute.kube import dra
from tests.deviceplugin.conftest import Node
from tests.deviceplugin.dranodes import (
    RESOURCE_CLAIMS,
    DraNode,
    dra_node,
    dra_spec,
    wait_report,
)
from tests.support.kubeserver import KubeApi


@pytest.fixture
async def dranode(kubelet_node: Node, kube_api: KubeApi) -> AsyncIterator[DraNode]:
    async with dra_node(kubelet_node, kube_api) as found:
        yield found


async def test_a_release_stays_releasing_until_every_claim_is_unprepared(
    dranode: DraNode,
) -> None:
    async with dranode.agent() as node:
        node.put(dra_spec("alloc_a", ["GPU-0", "GPU-1"]))
        await node.reporter.wait_phase("alloc_a", "Bound")
        first = await dranode.claim("ml", "first", ["GPU-0"])
        second = await dranode.claim("ml", "second", ["GPU-1"])
        await dranode.kubelet.prepare([first, second])

        node.release("alloc_a")

        releasing = await node.reporter.wait_phase("alloc_a", "Releasing")
        assert releasing["pods"] == ["ml/first", "ml/second"]
        report = signing.verify(signature=releasing["signature"], public_key=node.key.public_key)
        assert (report["phase"], report["pods"]) == ("Releasing", ["ml/first", "ml/second"])
        assert node.files_on_disk() == sorted(
            [
                "cdi/bcd-alloc_a.json",
                f"cdi/bcdclaim-{first.uid}.json",
                f"cdi/bcdclaim-{second.uid}.json",
                "env/alloc_a.env",
                "state/dra-claims.json",
            ]
        )
        # A new claim on a releasing allocation's devices is refused.
        late = await dranode.claim("ml", "late", ["GPU-0"])
        answers = await dranode.kubelet.prepare([late])
        assert "which is being released" in answers[late.uid].error

        assert await dranode.kubelet.unprepare([first]) == {first.uid: ""}
        releasing = await wait_report(node, "alloc_a", lambda s: s["pods"] == ["ml/second"])
        assert releasing["phase"] == "Releasing"

        assert await dranode.kubelet.unprepare([second]) == {second.uid: ""}
        released = await node.reporter.wait_phase("alloc_a", "Released")
        report = signing.verify(signature=released["signature"], public_key=node.key.public_key)
        assert (report["phase"], report["pods"]) == ("Released", [])
        assert node.files_on_disk() == ["state/dra-claims.json"]  # listing no claim


async def test_prepared_claims_survive_an_agent_restart(dranode: DraNode) -> None:
    async with dranode.agent() as node:
        node.put(dra_spec("alloc_a", ["GPU-0"]))
        await node.reporter.wait_phase("alloc_a", "Bound")
        claim = await dranode.claim("ml", "kept", ["GPU-0"])
        first = await dranode.kubelet.prepare([claim])
        assert first[claim.uid].error == ""
    assert dranode.checkpoint.is_file()
    registered = len([r for r in dranode.kubelet.registrations if r[1]])
    # The claim is gone from the API: only the checkpoint can answer for it now.
    await dranode.kube.delete(RESOURCE_CLAIMS, "ml", "kept")
    # A crash left the specs out of step with the checkpoint: one missing, one stray.
    cdi = dranode.node.root / "cdi"
    (cdi / f"bcdclaim-{claim.uid}.json").unlink()
    (cdi / "bcdclaim-0000-stray.json").write_text("{}")

    async with dranode.agent() as node:
        await dranode.kubelet.wait_attempts(registered + 1)
        assert sorted(p.name for p in cdi.glob("bcdclaim-*")) == [f"bcdclaim-{claim.uid}.json"]
        again = await dranode.kubelet.prepare([claim])
        assert again == first
        node.release("alloc_a")
        releasing = await node.reporter.wait_phase("alloc_a", "Releasing")
        assert releasing["pods"] == ["ml/kept"]

        await dranode.kubelet.unprepare([claim])

        await node.reporter.wait_phase("alloc_a", "Released")
        assert draclaims.PreparedClaims.load(dranode.checkpoint).all() == []


async def test_a_restarted_kubelet_finds_the_plugin_again(dranode: DraNode) -> None:
    async with dranode.agent() as node:
        node.put(dra_spec("alloc_a", ["GPU-0"]))
        await node.reporter.wait_phase("alloc_a", "Bound")
        before = len(dranode.kubelet.registrations)

        await dranode.kubelet.restart()  # forgets the plugin and deletes its socket

        plugin = await dranode.kubelet.wait_registered(dra.DRIVER)
        assert len(dranode.kubelet.registrations) > before
        claim = await dranode.claim("ml", "after", ["GPU-0"])
        answers = await plugin.stub.NodePrepareResources(
            plugin.messages.NodePrepareResourcesRequest(
                claims=[
                    plugin.messages.Claim(namespace="ml", name="after", uid=claim.uid),
                ]
            ),
            timeout=5,
        )
        assert [d.device_name for d in answers.claims[claim.uid].devices] == ["gpu-0"]


async def test_a_deleted_dra_socket_is_served_and_announced_again(dranode: DraNode) -> None:
    async with dranode.agent() as node:
        node.put(dra_spec("alloc_a", ["GPU-0"]))
        await node.reporter.wait_phase("alloc_a", "Bound")
        before = len(dranode.kubelet.registrations)
        endpoint = dranode.kubelet.plugins[dra.DRIVER].endpoint

        (dranode.node.root / "kplugins" / "gpu.bcd.dev" / "dra.sock").unlink()

        await dranode.kubelet.wait_attempts(before + 1)
        plugin = await dranode.kubelet.wait_registered(dra.DRIVER)
        assert plugin.endpoint == endpoint
        claim = await dranode.claim("ml", "c", ["GPU-0"])
        answers = await dranode.kubelet.prepare([claim])
        assert answers[claim.uid].error == ""


async def test_a_damaged_checkpoint_stops_the_agent_rather_than_free_devices(
    dranode: DraNode,
) -> None:
    dranode.checkpoint.parent.mkdir(parents=True, exist_ok=True)
    dranode.checkpoint.write_text('{"format": 1, "claims": {"u": {"namespace": "ml"}}}')

    with pytest.raises(draclaims.CheckpointError, match="is damaged"):
        dranode.node.make_plugin(dra=dranode.setup())


async def test_a_leftover_dra_allocation_is_held_by_its_claims_after_a_restart(
    dranode: DraNode,
) -> None:
    """Its spec gone while the agent was down, a ``dra`` allocation is known only from its CDI
    spec on disk, which says ``kubernetesApi: dra``: its holders are still its claims (not
    PodResources, which would free it at once)."""
    async with dranode.agent() as node:
        node.put(dra_spec("alloc_a", ["GPU-0"]))
        await node.reporter.wait_phase("alloc_a", "Bound")
        claim = await dranode.claim("ml", "kept", ["GPU-0"])
        await dranode.kubelet.prepare([claim])
    del dranode.node.desired.specs["alloc_a"]

    async with dranode.agent() as node:
        releasing = await node.reporter.wait_phase("alloc_a", "Releasing")
        assert releasing["pods"] == ["ml/kept"]

        await dranode.kubelet.unprepare([claim])

        await node.reporter.wait_phase("alloc_a", "Released")
        assert node.files_on_disk() == ["state/dra-claims.json"]
