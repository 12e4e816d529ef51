"""Nodes without kubelets: ``bettercompute.dev.controlplane.nodes.KubeletNode`` (the one copy,
which ``better-compute dev --kube`` registers its simulated nodes with), plus what the tests'
nodes hear from the gRPC kubelet stand-in (``tests/support/kubelet.py``): the devices each
plugin listed on its real ListAndWatch stream.

What it must never do: write as the admin what a kubelet writes, or publish a resource no
plugin listed.
"""

from __future__ import annotations

from typing import Any

from bettercompute.dev.controlplane.nodes import HEALTHY, KUBELET_VERSION, KubeletNode
from tests.support.kubelet import Kubelet

__all__ = ["HEALTHY", "KUBELET_VERSION", "FakeNode"]


class FakeNode(KubeletNode):
    async def advertise_from(self, kubelet: Kubelet) -> dict[str, Any]:
        """What every registered plugin of the gRPC kubelet stand-in listed last."""
        for resource, plugin in kubelet.plugins.items():
            self.devices[resource] = dict(plugin.latest())
        return await self.publish()
