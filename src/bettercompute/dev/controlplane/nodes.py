"""Nodes without kubelets: ``Node`` objects written the way the kubelet writes them, with the
kubelet's own credentials.

Why it exists: the real scheduler places a pod only on a Node whose ``status.allocatable``
has what the pod asks, and the Node authorizer and ``NodeRestriction`` let a node write only
its own Node and the status of pods bound to it. So each node here acts as
``system:node:<name>`` (a client certificate in ``system:nodes``, as a kubelet's), registers
its Node, and publishes extended resources as the kubelet's device manager does: a resource's
capacity is the number of devices its plugin listed, its allocatable the healthy ones; a
plugin that is gone keeps its capacity with allocatable 0 (the grace period). ``dev --kube``
registers its simulated nodes this way; the tests' nodes add what a kubelet stand-in heard.

What it must never do: write as the admin what a kubelet writes, or publish a resource no
plugin (or simulated node) listed.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Mapping
from typing import Any

from bettercompute.dev.controlplane.plane import ControlPlane

KUBELET_VERSION = "v1.34.4"
HEALTHY = "Healthy"
#: What a node has when nobody says otherwise: a typical 8-GPU server's host.
HOST: Mapping[str, str] = {
    "cpu": "64",
    "memory": "512Gi",
    "pods": "110",
    "ephemeral-storage": "1Ti",
}


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubeletNode:
    def __init__(
        self,
        plane: ControlPlane,
        name: str,
        *,
        labels: Mapping[str, str] = {},
        host: Mapping[str, str] = HOST,
    ) -> None:
        self.plane = plane
        self.name = name
        self.labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **labels,
        }
        self.host = {**HOST, **host}
        cert = plane.issue_client(
            f"node-{name}", user=f"system:node:{name}", groups=("system:nodes",)
        )
        self.kubeconfig = plane.kubeconfig(f"node-{name}", cert=cert)
        self._cert = cert
        #: What the device manager counts: resource → device id → health.
        self.devices: dict[str, dict[str, str]] = {}

    def _call(self, method: str, path: str, body: Any, content_type: str) -> Any:
        return self.plane.request(method, path, body, content_type=content_type, client=self._cert)

    def _status(self) -> dict[str, Any]:
        capacity = dict(self.host)
        allocatable = dict(capacity)
        for resource, devices in self.devices.items():
            capacity[resource] = str(len(devices))
            allocatable[resource] = str(sum(1 for h in devices.values() if h == HEALTHY))
        now = _now()
        return {
            "capacity": capacity,
            "allocatable": allocatable,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
            "addresses": [{"type": "Hostname", "address": self.name}],
            "nodeInfo": {
                "machineID": self.name,
                "systemUUID": self.name,
                "bootID": self.name,
                "kernelVersion": "6.1.0",
                "osImage": "Debian GNU/Linux 12 (bookworm)",
                "containerRuntimeVersion": "containerd://2.0.0",
                "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }

    async def register(self) -> dict[str, Any]:
        """Create the Node as the kubelet does at start (as the node itself)."""
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": self.labels},
            "spec": {},
        }
        await asyncio.to_thread(self._call, "POST", "/api/v1/nodes", body, "application/json")
        return await self.publish()

    async def publish(self) -> dict[str, Any]:
        """The node status update: capacity, allocatable, conditions (a strategic merge); the
        kubelet's heartbeat too."""
        patched: dict[str, Any] = await asyncio.to_thread(
            self._call,
            "PATCH",
            f"/api/v1/nodes/{self.name}/status",
            {"status": self._status()},
            "application/strategic-merge-patch+json",
        )
        return patched

    async def advertise(self, resource: str, devices: Mapping[str, str]) -> dict[str, Any]:
        """A plugin's ListAndWatch answer for ``resource``: ``{device id: health}``."""
        self.devices[resource] = dict(devices)
        return await self.publish()

    async def run_pod(self, namespace: str, name: str) -> dict[str, Any]:
        """The kubelet's status update for a pod it started: Running, its containers ready."""
        pod = await asyncio.to_thread(self.plane.get, f"/api/v1/namespaces/{namespace}/pods/{name}")
        now = _now()
        containers = [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": "",
                "ready": True,
                "restartCount": 0,
                "started": True,
                "state": {"running": {"startedAt": now}},
            }
            for c in pod["spec"]["containers"]
        ]
        status = {
            "phase": "Running",
            "startTime": now,
            "conditions": [
                {"type": t, "status": "True", "lastTransitionTime": now}
                for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
            ],
            "containerStatuses": containers,
        }
        patched: dict[str, Any] = await asyncio.to_thread(
            self._call,
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{name}/status",
            {"status": status},
            "application/strategic-merge-patch+json",
        )
        return patched
