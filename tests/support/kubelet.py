"""Stand-ins for the kubelet's two gRPC faces: device-plugin registration and PodResources.

Why: the device plugin is tested against real gRPC over unix sockets, the way the kubelet
drives it (shared/reference/kubelet-device-plugin-protocol.md §3), not against mocks.

``Kubelet`` serves ``v1beta1.Registration`` on ``<plugin dir>/kubelet.sock``. On each Register it
checks the version and the resource name as the kubelet does, dials the plugin's socket, calls
GetDevicePluginOptions while Register is still open, then opens one ListAndWatch stream and
records every message with its receive time. ``plugins[resource]`` can then call
GetPreferredAllocation, Allocate and PreStartContainer like the kubelet. ``restart()`` behaves
like a kubelet restart: stop, delete ``kubelet.sock`` and every other socket in the directory
(plain files stay), then serve a new ``kubelet.sock``.

``PodResources`` serves ``v1.PodResourcesLister/List`` with whatever the test set
(``holding(...)``), one ``ContainerDevices`` entry per device as the kubelet does, and can be
stopped to play an unreachable kubelet.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bettercompute.proto.deviceplugin.v1beta1 import api_pb2 as dp
from bettercompute.proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from bettercompute.proto.podresources.v1 import api_pb2 as pr
from bettercompute.proto.podresources.v1 import api_pb2_grpc as pr_grpc

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def is_extended_resource_name(name: str) -> bool:
    """The kubelet's ``IsExtendedResourceName`` (fact sheet §5)."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    prefix, _, part = f"requests.{name}".rpartition("/")
    return (
        len(prefix) <= 253
        and bool(_DNS_SUBDOMAIN.fullmatch(prefix))
        and len(part) <= 63
        and bool(_NAME.fullmatch(part))
    )


@dataclass
class Plugin:
    """The kubelet's connection to one registered plugin, and what it heard on it."""

    resource: str
    endpoint: str
    options: dp.DevicePluginOptions
    channel: grpc.aio.Channel
    stub: Any
    #: (monotonic receive time, message) for every ListAndWatch message.
    messages: list[tuple[float, dp.ListAndWatchResponse]] = field(default_factory=list)
    stream_ended: bool = False
    _arrived: asyncio.Condition = field(default_factory=asyncio.Condition)
    _reader: asyncio.Task[None] | None = None

    def latest(self) -> dict[str, str]:
        """Device id -> health, from the last message (empty before the first)."""
        if not self.messages:
            return {}
        return {device.ID: device.health for device in self.messages[-1][1].devices}

    async def wait_for(
        self, predicate: Callable[[dict[str, str]], bool], *, within: float = 2.0
    ) -> dict[str, str]:
        """The latest device list once ``predicate`` holds for it."""
        async with asyncio.timeout(within), self._arrived:
            await self._arrived.wait_for(lambda: bool(self.messages) and predicate(self.latest()))
            return self.latest()

    async def wait_devices(self, expected: Mapping[str, str], *, within: float = 2.0) -> None:
        """Until the latest list is exactly ``expected`` (id -> health)."""
        try:
            await self.wait_for(lambda latest: latest == dict(expected), within=within)
        except TimeoutError:
            raise AssertionError(
                f"{self.resource}: expected {dict(expected)}, last list {self.latest()}"
            ) from None

    async def _read(self) -> None:
        try:
            async for message in self.stub.ListAndWatch(dp.Empty()):
                async with self._arrived:
                    self.messages.append((time.monotonic(), message))
                    self._arrived.notify_all()
        except grpc.aio.AioRpcError:
            pass  # the plugin went away: the real kubelet marks its devices unhealthy
        finally:
            self.stream_ended = True

    async def allocate(self, device_ids: Sequence[str]) -> dp.ContainerAllocateResponse:
        answer = await self.stub.Allocate(
            dp.AllocateRequest(
                container_requests=[dp.ContainerAllocateRequest(devices_ids=device_ids)]
            ),
            timeout=5,
        )
        assert len(answer.container_responses) == 1, "the kubelet needs one answer per container"
        response: dp.ContainerAllocateResponse = answer.container_responses[0]
        return response

    async def preferred(
        self, *, available: Sequence[str], must_include: Sequence[str] = (), size: int
    ) -> list[str]:
        answer = await self.stub.GetPreferredAllocation(
            dp.PreferredAllocationRequest(
                container_requests=[
                    dp.ContainerPreferredAllocationRequest(
                        available_deviceIDs=available,
                        must_include_deviceIDs=must_include,
                        allocation_size=size,
                    )
                ]
            ),
            timeout=5,
        )
        return list(answer.container_responses[0].deviceIDs)

    async def pre_start(self, device_ids: Sequence[str]) -> None:
        await self.stub.PreStartContainer(
            dp.PreStartContainerRequest(devices_ids=device_ids), timeout=30
        )

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self.channel.close()


class Kubelet(dp_grpc.RegistrationServicer):
    """The kubelet's device manager, reduced to what a plugin can observe."""

    def __init__(self, plugin_dir: Path) -> None:
        self.plugin_dir = plugin_dir
        self.socket = plugin_dir / "kubelet.sock"
        self.plugins: dict[str, Plugin] = {}
        #: (monotonic time, request) of every accepted Register.
        self.registrations: list[tuple[float, dp.RegisterRequest]] = []
        self._server: grpc.aio.Server | None = None
        self._registered = asyncio.Condition()

    async def start(self) -> None:
        server = grpc.aio.server()
        dp_grpc.add_RegistrationServicer_to_server(self, server)
        server.add_insecure_port(f"unix:{self.socket}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        """Stop, then delete every socket in the directory, as a starting kubelet does."""
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None
        for plugin in self.plugins.values():
            await plugin.close()
        self.plugins.clear()
        for path in self.plugin_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(path.lstat().st_mode):
                    path.unlink()

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def Register(self, request: dp.RegisterRequest, context: Any) -> dp.Empty:
        if request.version != "v1beta1":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"version {request.version!r}")
        if not is_extended_resource_name(request.resource_name):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"resource name {request.resource_name!r}"
            )
        channel = grpc.aio.insecure_channel(f"unix:{self.plugin_dir / request.endpoint}")
        stub = dp_grpc.DevicePluginStub(channel)
        try:
            options = await stub.GetDevicePluginOptions(dp.Empty(), timeout=10)
        except grpc.aio.AioRpcError as e:
            await channel.close()
            await context.abort(grpc.StatusCode.UNKNOWN, f"cannot dial the plugin: {e.details()}")
        plugin = Plugin(
            resource=request.resource_name,
            endpoint=request.endpoint,
            options=options,
            channel=channel,
            stub=stub,
        )
        old = self.plugins.pop(request.resource_name, None)
        if old is not None:
            await old.close()  # a new endpoint for a resource replaces the old one
        plugin._reader = asyncio.create_task(plugin._read())
        self.plugins[request.resource_name] = plugin
        async with self._registered:
            self.registrations.append((time.monotonic(), request))
            self._registered.notify_all()
        return dp.Empty()

    async def wait_registered(
        self, resources: Sequence[str], *, after: float = 0.0, within: float = 2.0
    ) -> float:
        """The monotonic time by which every one of ``resources`` registered after ``after``."""

        def done() -> bool:
            names = {r.resource_name for t, r in self.registrations if t > after}
            return set(resources) <= names

        async with asyncio.timeout(within), self._registered:
            await self._registered.wait_for(done)
        return max(t for t, r in self.registrations if t > after and r.resource_name in resources)


class PodResources(pr_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources ``List``, answering what the test says pods hold."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.calls = 0
        # "namespace/name" -> resource name -> device ids
        self._pods: dict[str, dict[str, list[str]]] = {}
        self._server: grpc.aio.Server | None = None

    def holding(self, pods: Mapping[str, Mapping[str, Sequence[str]]]) -> None:
        """Set the answer: ``{"ml/trainer-0": {"bcd.dev/gpu": ["GPU-…"]}}``."""
        self._pods = {pod: {r: list(ids) for r, ids in held.items()} for pod, held in pods.items()}

    async def List(self, request: pr.ListPodResourcesRequest, context: Any) -> Any:
        self.calls += 1
        answer = pr.ListPodResourcesResponse()
        for pod, held in self._pods.items():
            namespace, name = pod.split("/")
            # The kubelet answers one entry per device, each with a single id.
            devices = [
                pr.ContainerDevices(resource_name=resource, device_ids=[device_id])
                for resource, ids in held.items()
                for device_id in ids
            ]
            answer.pod_resources.append(
                pr.PodResources(
                    name=name,
                    namespace=namespace,
                    containers=[
                        pr.ContainerResources(name="main", devices=devices),
                        pr.ContainerResources(name="sidecar"),
                    ],
                )
            )
        return answer

    async def start(self) -> None:
        server = grpc.aio.server()
        pr_grpc.add_PodResourcesListerServicer_to_server(self, server)
        server.add_insecure_port(f"unix:{self.socket}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None
        self.socket.unlink(missing_ok=True)
