"""Which pods still hold our devices: a client of the kubelet's PodResources ``List``.

Why it exists: a released allocation's devices may be freed only once no pod uses them, and only
the kubelet knows which pod got which device. ``converging`` asks here once per pass
(``holdings``) and reads from that answer which pods hold each bound or ``Releasing``
allocation's devices.

The kubelet answers one ``ContainerDevices`` entry per (device, NUMA node), each with one id, and
covers regular and restartable init containers (the fact sheet, §4), so entries are grouped by
resource name here and a pod counts once however many of its containers hold devices.

What it must never do: read "the kubelet did not answer" as "no pod holds the devices". Every
failure (no socket, a refused or timed-out call, rate limiting) is ``KubeletUnreachable``, and the
caller keeps the devices held.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Protocol

import grpc

from bettercompute.proto.podresources.v1 import api_pb2, api_pb2_grpc

POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
TIMEOUT_SECONDS = 2.0


class KubeletUnreachable(Exception):
    """The kubelet's PodResources service did not answer; the message says where and why."""


class Holdings:
    """What pods held as of one ``List``: asked about any number of allocations' devices, so a
    pass over many allocations asks the kubelet once."""

    def __init__(self, response: api_pb2.ListPodResourcesResponse | None = None) -> None:
        self.response = response

    def holders(self, *, devices: Mapping[str, Collection[str]]) -> list[str]:
        return [] if self.response is None else holders_in(self.response, devices=devices)


class PodHolders(Protocol):
    """Who holds devices: ``PodResourcesClient`` on a node, anything alike in a test."""

    async def holdings(self) -> Holdings: ...


def holders_in(
    response: api_pb2.ListPodResourcesResponse, *, devices: Mapping[str, Collection[str]]
) -> list[str]:
    """``namespace/name`` of each pod that holds any of ``devices`` (resource name -> device
    ids), sorted. Devices of other resources with equal ids do not count."""
    found: set[str] = set()
    for pod in response.pod_resources:
        for container in pod.containers:
            for entry in container.devices:
                wanted = devices.get(entry.resource_name)
                if wanted and any(device_id in wanted for device_id in entry.device_ids):
                    found.add(f"{pod.namespace}/{pod.name}")
    return sorted(found)


class PodResourcesClient:
    """Asks the kubelet over ``socket_path``; a channel per call, because the kubelet re-creates
    the socket when it restarts and a call must then reach the new one."""

    def __init__(
        self, *, socket_path: Path = POD_RESOURCES_SOCKET, timeout_s: float = TIMEOUT_SECONDS
    ) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    async def list_pods(self) -> api_pb2.ListPodResourcesResponse:
        if not self.socket_path.exists():
            raise KubeletUnreachable(f"PodResources: no socket at {self.socket_path}")
        try:
            async with grpc.aio.insecure_channel(f"unix:{self.socket_path}") as channel:
                stub = api_pb2_grpc.PodResourcesListerStub(channel)  # type: ignore[no-untyped-call]
                answer: api_pb2.ListPodResourcesResponse = await stub.List(
                    api_pb2.ListPodResourcesRequest(), timeout=self.timeout_s
                )
        except grpc.aio.AioRpcError as e:
            raise KubeletUnreachable(
                f"PodResources List at {self.socket_path} failed: {e.code().name} {e.details()}"
            ) from e
        return answer

    async def holdings(self) -> Holdings:
        return Holdings(await self.list_pods())

    async def holders(self, *, devices: Mapping[str, Collection[str]]) -> list[str]:
        """One question, one ``List``."""
        return (await self.holdings()).holders(devices=devices)
