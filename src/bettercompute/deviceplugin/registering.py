"""Registering our three device-plugin servers with the kubelet, and again after it restarts.

Why it exists: the kubelet only dials a plugin that called ``v1beta1.Registration/Register`` on
its ``kubelet.sock``, and forgets every plugin when it restarts. On startup the kubelet deletes
each socket in the device-plugin directory and then creates ``kubelet.sock`` again
(the kubelet's device plugin registration protocol). ``Registrar.run`` therefore polls
every 100 ms (plain ``stat`` calls, no inotify, so it works on any filesystem and in any
container): a plugin socket that is gone or replaced is served again, and a ``kubelet.sock`` with
a new identity (inode, change time) is registered with again, each resource once, well within a
second of the restart.

The register call carries ``version: v1beta1``, the socket's file name as ``endpoint``, and the
same options GetDevicePluginOptions answers (the kubelet uses the latter; they must agree).

What it must never do: register before its server is serving (the kubelet dials back while
Register is still open), or give up: a kubelet that is down or refuses is retried on the next
poll, and the failure is logged once per distinct message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from bettercompute.deviceplugin import serving
from bettercompute.deviceplugin.allocations import Resource
from bettercompute.deviceplugin.serving import PluginServer
from bettercompute.proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)

VERSION = "v1beta1"
KUBELET_SOCKET_NAME = "kubelet.sock"
POLL_SECONDS = 0.1
#: The kubelet dials us back while Register is open, for up to 10 s; wait a little longer.
REGISTER_TIMEOUT_SECONDS = 12.0

# A file's identity: a re-created kubelet.sock has a new inode or at least a new ctime.
Identity = tuple[int, int, int]


def identity(path: Path) -> Identity | None:
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return (found.st_dev, found.st_ino, found.st_ctime_ns)


def register_request(resource_name: str, socket_name: str) -> api_pb2.RegisterRequest:
    return api_pb2.RegisterRequest(
        version=VERSION,
        endpoint=socket_name,
        resource_name=resource_name,
        options=serving.options(),
    )


class RegisterError(Exception):
    """The kubelet did not accept a registration; the message says which resource and why."""


async def register(*, kubelet_socket: Path, server: PluginServer) -> None:
    """One Register call for ``server``'s resource."""
    request = register_request(server.resource.name, server.resource.socket_name)
    try:
        async with grpc.aio.insecure_channel(f"unix:{kubelet_socket}") as channel:
            stub = api_pb2_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
            await stub.Register(request, timeout=REGISTER_TIMEOUT_SECONDS)
    except grpc.aio.AioRpcError as e:
        raise RegisterError(
            f"{server.resource.name}: the kubelet at {kubelet_socket} refused Register: "
            f"{e.code().name} {e.details()}"
        ) from e


class Registrar:
    """Keeps every server serving and registered with the current kubelet."""

    def __init__(
        self,
        *,
        servers: Sequence[PluginServer],
        plugin_dir: Path,
        poll_seconds: float = POLL_SECONDS,
        own_resources: Callable[[], Sequence[Resource]] | None = None,
        make_server: Callable[[Resource], PluginServer] | None = None,
    ) -> None:
        self.servers = list(servers)
        #: The reservations' own resources to serve now, and how to make a server for one: each
        #: gets its endpoint while it is wanted and loses it (socket removed) once it is not.
        self.own_resources = own_resources
        self.make_server = make_server
        self._own: dict[str, PluginServer] = {}
        self.kubelet_socket = plugin_dir / KUBELET_SOCKET_NAME
        self.poll_seconds = poll_seconds
        # Resource name -> the kubelet.sock identity it registered with.
        self._registered: dict[str, Identity] = {}
        self._last_problem: dict[str, str] = {}
        #: Completed registrations (for tests and logs): (resource, kubelet identity).
        self.registrations: list[tuple[str, Identity]] = []

    async def run(self) -> None:
        """Poll until cancelled; stops the servers when it ends."""
        try:
            while True:
                await self.step()
                await asyncio.sleep(self.poll_seconds)
        finally:
            for server in self.servers:
                await server.stop()

    async def step(self) -> None:
        """One poll: serve what is not served, register what is not registered."""
        await self._follow_own_resources()
        for server in self.servers:
            if server.socket_gone():
                if server.resource.name in self._registered:
                    log.info("%s: our socket is gone, serving again", server.resource.name)
                await server.start()
                self._registered.pop(server.resource.name, None)
        kubelet = identity(self.kubelet_socket)
        if kubelet is None:
            return
        pending = [s for s in self.servers if self._registered.get(s.resource.name) != kubelet]
        results = await asyncio.gather(
            *(register(kubelet_socket=self.kubelet_socket, server=s) for s in pending),
            return_exceptions=True,
        )
        for server, result in zip(pending, results, strict=True):
            name = server.resource.name
            if isinstance(result, RegisterError):
                if self._last_problem.get(name) != str(result):
                    log.warning("%s (retrying every %ss)", result, self.poll_seconds)
                self._last_problem[name] = str(result)
            elif isinstance(result, BaseException):
                raise result
            else:
                self._registered[name] = kubelet
                self._last_problem.pop(name, None)
                self.registrations.append((name, kubelet))
                log.info("%s: registered with the kubelet at %s", name, self.kubelet_socket)

    async def _follow_own_resources(self) -> None:
        """Add a server for each reservation's resource newly wanted; stop the ones no longer
        wanted and remove their sockets, so the kubelet drops the resource."""
        if self.own_resources is None or self.make_server is None:
            return
        wanted = {resource.name: resource for resource in self.own_resources()}
        for name, resource in wanted.items():
            if name not in self._own:
                server = self.make_server(resource)
                self._own[name] = server
                self.servers.append(server)
        for name in [n for n in self._own if n not in wanted]:
            server = self._own.pop(name)
            self.servers.remove(server)
            await server.stop()
            with contextlib.suppress(FileNotFoundError):
                server.socket_path.unlink()
            self._registered.pop(name, None)
            self._last_problem.pop(name, None)
            log.info("%s: released and no pod holds its devices: endpoint removed", name)
