"""Real gRPC over unix sockets: Register and a server-streaming ListAndWatch, end to end.

Each test starts a ``grpc.aio`` server on a socket in a temporary folder (as kubelet and a plugin
do in ``/var/lib/kubelet/device-plugins/``) and calls it through a real channel.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from bettercompute.proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc


class RecordingRegistration(api_pb2_grpc.RegistrationServicer):
    """Kubelet's side of Register, reduced to remembering what it was sent."""

    def __init__(self) -> None:
        self.requests: list[api_pb2.RegisterRequest] = []

    async def Register(  # the RPC name is fixed by the protocol
        self, request: api_pb2.RegisterRequest, context: Any
    ) -> api_pb2.Empty:
        self.requests.append(request)
        return api_pb2.Empty()


class TwoListsPlugin(api_pb2_grpc.DevicePluginServicer):
    """A plugin's ListAndWatch that sends two complete device lists, then ends the stream."""

    def __init__(self, lists: list[api_pb2.ListAndWatchResponse]) -> None:
        self.lists = lists

    async def ListAndWatch(  # the RPC name is fixed by the protocol
        self, request: api_pb2.Empty, context: Any
    ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        for devices in self.lists:
            yield devices


@pytest.fixture
async def server() -> AsyncIterator[grpc.aio.Server]:
    started = grpc.aio.server()
    yield started
    await started.stop(grace=None)


async def _serve(server: grpc.aio.Server, socket: Path) -> str:
    target = f"unix:{socket}"
    server.add_insecure_port(target)
    await server.start()
    return target


def _register_request() -> api_pb2.RegisterRequest:
    return api_pb2.RegisterRequest(
        version="v1beta1",
        endpoint="bcd-gpu.sock",
        resource_name="bcd.dev/gpu",
        options=api_pb2.DevicePluginOptions(get_preferred_allocation_available=True),
    )


async def test_register_round_trip_over_a_unix_socket(
    tmp_path: Path, server: grpc.aio.Server
) -> None:
    kubelet = RecordingRegistration()
    api_pb2_grpc.add_RegistrationServicer_to_server(kubelet, server)
    target = await _serve(server, tmp_path / "kubelet.sock")

    async with grpc.aio.insecure_channel(target) as channel:
        answer = await api_pb2_grpc.RegistrationStub(channel).Register(
            _register_request(), timeout=10
        )

    assert answer == api_pb2.Empty()
    assert kubelet.requests == [_register_request()]
    assert kubelet.requests[0].options.get_preferred_allocation_available is True


async def test_register_answers_on_the_exact_kubelet_path(
    tmp_path: Path, server: grpc.aio.Server
) -> None:
    # A raw call on the literal path, not the generated stub, proves the path on the wire.
    kubelet = RecordingRegistration()
    api_pb2_grpc.add_RegistrationServicer_to_server(kubelet, server)
    target = await _serve(server, tmp_path / "kubelet.sock")

    async with grpc.aio.insecure_channel(target) as channel:
        register = channel.unary_unary("/v1beta1.Registration/Register")
        answer = await register(_register_request().SerializeToString(), timeout=10)

    assert answer == b""  # v1beta1.Empty encodes to zero bytes
    assert [request.resource_name for request in kubelet.requests] == ["bcd.dev/gpu"]


async def test_list_and_watch_streams_every_message(
    tmp_path: Path, server: grpc.aio.Server
) -> None:
    healthy = api_pb2.ListAndWatchResponse(
        devices=[
            api_pb2.Device(ID="GPU-0", health="Healthy"),
            api_pb2.Device(
                ID="GPU-1",
                health="Healthy",
                topology=api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=1)]),
            ),
        ]
    )
    one_sick = api_pb2.ListAndWatchResponse(
        devices=[
            api_pb2.Device(ID="GPU-0", health="Healthy"),
            api_pb2.Device(ID="GPU-1", health="Unhealthy"),
        ]
    )
    api_pb2_grpc.add_DevicePluginServicer_to_server(TwoListsPlugin([healthy, one_sick]), server)
    target = await _serve(server, tmp_path / "bcd-gpu.sock")

    async with grpc.aio.insecure_channel(target) as channel:
        stream = api_pb2_grpc.DevicePluginStub(channel).ListAndWatch(api_pb2.Empty(), timeout=10)
        received = [message async for message in stream]

    assert received == [healthy, one_sick]
    assert [device.health for device in received[1].devices] == ["Healthy", "Unhealthy"]
    assert received[0].devices[1].topology.nodes[0].ID == 1


async def test_an_unimplemented_rpc_is_a_grpc_error_not_a_hang(
    tmp_path: Path, server: grpc.aio.Server
) -> None:
    api_pb2_grpc.add_DevicePluginServicer_to_server(TwoListsPlugin([]), server)
    target = await _serve(server, tmp_path / "bcd-gpu.sock")

    async with grpc.aio.insecure_channel(target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await api_pb2_grpc.DevicePluginStub(channel).Allocate(
                api_pb2.AllocateRequest(), timeout=10
            )

    assert failure.value.code() is grpc.StatusCode.UNIMPLEMENTED
