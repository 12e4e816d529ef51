"""Noticing another path that hands this node's GPUs to pods (the ``ForeignGpuExposure`` condition).

Why: bcd's guarantee is that a reservation's devices go only to its own pods. A second device
plugin (NVIDIA's, say) or a DRA GPU driver on the same node hands the same GPUs to any pod that
asks ``nvidia.com/gpu`` or claims them, and nothing bcd does can stop that. The node agent
therefore looks for such paths on every GPUNode publish and says what it found in the GPUNode's
``ForeignGpuExposure`` condition, so an operator sees it and can turn the other path off. Three
signs count:

- another device plugin's socket in the kubelet's device-plugins directory (any ``*.sock``
  but ``kubelet.sock`` and bcd's own ``bcd-*.sock``);
- a non-zero GPU extended resource of another vendor in the Node's capacity or allocatable
  (``FOREIGN_RESOURCE_PREFIXES``);
- a DRA ResourceSlice of a GPU driver (``GPU_DRA_DRIVERS``) for this node.

The same check runs once before the agent registers anything when it is told
``--refuse-foreign`` (the chart's ``devicePlugin.refuseForeignExposure``, on by
default): then what it finds stops the start, so an install onto a node that NVIDIA's device
plugin still serves fails where ``helm install --wait`` shows it instead of degrading
reservations later. That decision is the agent's (``agent.started``), not this module's.

What it must never do: act on what it finds (nothing is released or stopped here; the
condition, or the agent's refusal to start, is the whole effect), or fail the check: a check
it cannot make (no ResourceSlice API on an older cluster, a directory it cannot read) is
skipped and the others still count.
"""

from __future__ import annotations

import logging
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lightkube.generic_resource import create_global_resource

from bettercompute.deviceplugin.registering import KUBELET_SOCKET_NAME
from bettercompute.kube.client import KubeClient, KubeError
from bettercompute.kube.resources import NODES

log = logging.getLogger(__name__)

#: Extended resources through which another vendor's plugin hands out GPUs.
FOREIGN_RESOURCE_PREFIXES = ("nvidia.com/", "amd.com/gpu", "gpu.intel.com/")
#: DRA drivers that publish GPUs as ResourceSlices.
GPU_DRA_DRIVERS = frozenset({"gpu.nvidia.com", "gpu.amd.com", "gpu.intel.com"})
#: bcd's own plugin sockets all start with this (``bcd-gpu.sock``, ``bcd-gpu-mig.sock``, …).
OWN_SOCKET_PREFIX = "bcd-"

RESOURCE_SLICES = create_global_resource("resource.k8s.io", "v1", "ResourceSlice", "resourceslices")


def foreign_sockets(plugin_dir: Path) -> list[str]:
    """Sockets of other device plugins in the kubelet's device-plugins directory."""
    found = []
    try:
        entries = sorted(plugin_dir.iterdir())
    except OSError as e:
        log.debug("cannot list %s: %s", plugin_dir, e)
        return []
    for entry in entries:
        name = entry.name
        if name == KUBELET_SOCKET_NAME or name.startswith(OWN_SOCKET_PREFIX):
            continue
        try:
            if stat.S_ISSOCK(entry.lstat().st_mode):
                found.append(name)
        except OSError:
            continue
    return found


def _count(value: object) -> int:
    # Extended resources are whole numbers ("8"); anything else reads as present but unknown.
    try:
        return int(str(value))
    except ValueError:
        return 1


def foreign_resources(node: Mapping[str, Any] | None) -> list[str]:
    """Another vendor's GPU resources with a non-zero count on the Node, as ``name=count``."""
    status = (node or {}).get("status") or {}
    counts: dict[str, int] = {}
    for field in ("capacity", "allocatable"):
        for name, value in (status.get(field) or {}).items():
            if str(name).startswith(FOREIGN_RESOURCE_PREFIXES):
                counts[str(name)] = max(counts.get(str(name), 0), _count(value))
    return [f"{name}={count}" for name, count in sorted(counts.items()) if count > 0]


def foreign_slices(slices: Iterable[Mapping[str, Any]], *, node_name: str) -> list[str]:
    """DRA ResourceSlices of a GPU driver for ``node_name``, as ``driver (slice name)``."""
    found = []
    for item in slices:
        spec = item.get("spec") or {}
        if spec.get("nodeName") == node_name and spec.get("driver") in GPU_DRA_DRIVERS:
            name = (item.get("metadata") or {}).get("name", "?")
            found.append(f"{spec['driver']} ({name})")
    return sorted(found)


def describe(*, sockets: list[str], resources: list[str], slices: list[str]) -> str | None:
    """The condition's message, or ``None`` when nothing but bcd hands out the GPUs."""
    parts = []
    if sockets:
        parts.append("device plugin sockets " + ", ".join(sockets))
    if resources:
        parts.append("Node resources " + ", ".join(resources))
    if slices:
        parts.append("DRA ResourceSlices " + ", ".join(slices))
    if not parts:
        return None
    return "another path hands this node's GPUs to pods: " + "; ".join(parts)


class ForeignExposure:
    """Looks for other paths to this node's GPUs; ``check`` answers the condition's message."""

    def __init__(self, *, client: KubeClient, node_name: str, plugin_dir: Path) -> None:
        self.client = client
        self.node_name = node_name
        self.plugin_dir = plugin_dir
        self._slices_unavailable = False

    async def check(self) -> str | None:
        node: Mapping[str, Any] | None = None
        try:
            node = await self.client.get(NODES, self.node_name)
        except KubeError as e:
            log.debug("cannot read Node %s for foreign GPU resources: %s", self.node_name, e)
        slices: list[str] = []
        if not self._slices_unavailable:
            try:
                slices = foreign_slices(
                    await self.client.list(RESOURCE_SLICES), node_name=self.node_name
                )
            except KubeError as e:
                if e.status in (403, 404):
                    # An older cluster without DRA, or no permission: this check is skipped.
                    self._slices_unavailable = True
                    log.info("not checking DRA ResourceSlices for foreign GPUs: %s", e)
                else:
                    log.debug("cannot list ResourceSlices: %s", e)
        return describe(
            sockets=foreign_sockets(self.plugin_dir),
            resources=foreign_resources(node),
            slices=slices,
        )
