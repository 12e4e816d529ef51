"""The whole node agent with ``--dra``: it serves and registers the DRA plugin, reads claims from
the API through its own client, keeps its checkpoint beside the node key, and refuses to start
without the kubelet's plugin registry folder."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from bettercompute.deviceplugin.agent import AgentError, cli, started
from bettercompute.kube import dra
from tests.deviceplugin import agents
from tests.deviceplugin.agents import OPERATOR_NAMESPACE as NS
from tests.deviceplugin.conftest import GPU, MIG, SLOT, Node
from tests.deviceplugin.dranodes import dra_node, dra_spec
from tests.support.kubeobjects import DEVICEALLOCATIONS
from tests.support.kubeserver import KubeApi


async def test_the_agent_with_dra_prepares_a_claim_of_a_dra_allocation(
    kube_api: KubeApi, kubelet_node: Node
) -> None:
    async with dra_node(kubelet_node, kube_api) as found:
        config = agents.agent_config(
            kube=kube_api,
            node=kubelet_node,
            dra=True,
            kubelet_plugins_dir=kubelet_node.root / "kplugins",
            kubelet_registry_dir=kubelet_node.root / "registry",
        )
        async with started(config):
            await kubelet_node.kubelet.wait_registered([GPU, MIG, SLOT])
            plugin = await found.kubelet.wait_registered(dra.DRIVER)
            assert plugin.version == "v1"
            await kube_api.create(agents.device_allocation(dra_spec("alloc_d1", ["GPU-0"])))
            await kube_api.wait_for(DEVICEALLOCATIONS, NS, "alloc-d1", agents.phase_is("Bound"))
            claim = await found.claim("ml", "agent-claim", ["GPU-0"])

            answers = await found.kubelet.prepare([claim])

            assert [d.cdi_device_ids for d in answers[claim.uid].devices] == [
                ("bcd.dev/gpu=GPU-0", f"bcd.dev/gpu=claim-{claim.uid}-gpus")
            ]
            assert (agents.key_file(kubelet_node).parent / "dra-claims.json").is_file()
            assert (kubelet_node.root / "cdi" / f"bcdclaim-{claim.uid}.json").is_file()
            bound = await kube_api.wait_for(
                DEVICEALLOCATIONS,
                NS,
                "alloc-d1",
                lambda o: bool(o) and (o.get("status") or {}).get("pods") == ["ml/agent-claim"],
            )
            assert bound is not None


async def test_without_the_registry_folder_the_agent_says_what_to_mount(
    kube_api: KubeApi, kubelet_node: Node
) -> None:
    config = agents.agent_config(
        kube=kube_api,
        node=kubelet_node,
        dra=True,
        kubelet_registry_dir=kubelet_node.root / "no-such-registry",
    )
    with pytest.raises(AgentError, match=r"no plugin registry folder .* or --no-dra"):
        async with started(config):
            pass


def test_the_dra_flags_are_documented() -> None:
    result = CliRunner().invoke(cli, ["--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    for flag in ("--dra", "--no-dra", "--kubelet-plugins-dir", "--kubelet-registry-dir"):
        assert flag in result.output
    for variable in ("BCD_DRA", "BCD_KUBELET_PLUGINS_DIR", "BCD_KUBELET_REGISTRY_DIR"):
        assert variable in result.output
