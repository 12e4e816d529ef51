"""Registering our DRA plugin with the kubelet's plugin watcher, and again after it restarts.

Why it exists: the kubelet learns of a DRA driver only through its plugin watcher, which watches
the ``plugins_registry`` folder for unix sockets. A plugin serves the ``pluginregistration``
``Registration`` service there; the watcher calls ``GetInfo`` and, once it has taken the plugin
in (or failed to), ``NotifyRegistrationStatus``. For a DRA driver ``GetInfo`` answers type
``DRAPlugin``, the driver name, the path of the DRA socket (``draserving``) as its endpoint, and
the DRA services that socket serves as ``supported_versions`` (``v1.DRAPlugin``,
``v1beta1.DRAPlugin``); the kubelet picks the newest it speaks (docs/reference/dra-protocol.md).

The watcher forgets a plugin whose socket is deleted, and a kubelet restart (or someone cleaning
the folder) may delete ours. ``DraRegistrar.run`` therefore polls, like ``registering`` does for
the device plugin (plain ``stat`` calls, no inotify): a registration or DRA socket that is gone
or replaced is served again, and the new registration socket is what makes the watcher register
us afresh.

What it must never do: name an endpoint before the DRA socket serves (the kubelet may dial it
at once), or give up: a refusal is logged and the plugin stays served, so the next watcher
(a restarted kubelet) can take it in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from pathlib import Path
from typing import Any

import grpc

from bettercompute.deviceplugin import draserving
from bettercompute.deviceplugin.draserving import DraServer
from bettercompute.deviceplugin.serving import socket_replaced
from bettercompute.kube import dra
from bettercompute.proto.pluginregistration.v1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)

KUBELET_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
PLUGIN_TYPE = "DRAPlugin"
POLL_SECONDS = 0.1


def registration_socket(registry_dir: Path) -> Path:
    """Our socket in the watcher's folder; its name must not start with a dot (the watcher
    skips those)."""
    return registry_dir / f"{dra.DRIVER}-reg.sock"


def plugin_info(endpoint: Path) -> api_pb2.PluginInfo:
    return api_pb2.PluginInfo(
        type=PLUGIN_TYPE,
        name=dra.DRIVER,
        endpoint=str(endpoint),
        supported_versions=list(draserving.SERVICES),
    )


class RegistrationService(api_pb2_grpc.RegistrationServicer):
    """What the plugin watcher asks, and what it tells us."""

    def __init__(self, *, endpoint: Path, registrar: DraRegistrar | None = None) -> None:
        self.endpoint = endpoint
        self.registrar = registrar

    async def GetInfo(self, request: api_pb2.InfoRequest, context: Any) -> api_pb2.PluginInfo:
        return plugin_info(self.endpoint)

    async def NotifyRegistrationStatus(
        self, request: api_pb2.RegistrationStatus, context: Any
    ) -> api_pb2.RegistrationStatusResponse:
        if request.plugin_registered:
            log.info("DRA plugin %s registered with the kubelet", dra.DRIVER)
        else:
            log.warning(
                "the kubelet refused DRA plugin %s: %s", dra.DRIVER, request.error or "no reason"
            )
        if self.registrar is not None:
            self.registrar.statuses.append((request.plugin_registered, request.error))
        return api_pb2.RegistrationStatusResponse()


class DraRegistrar:
    """Keeps the DRA socket and the registration socket served, until cancelled."""

    def __init__(
        self, *, server: DraServer, registry_dir: Path, poll_seconds: float = POLL_SECONDS
    ) -> None:
        self.server = server
        self.path = registration_socket(registry_dir)
        self.poll_seconds = poll_seconds
        self._registration: grpc.aio.Server | None = None
        self._inode: int | None = None
        #: What the watcher told us, in order (for tests and logs): (registered, error).
        self.statuses: list[tuple[bool, str]] = []

    async def run(self) -> None:
        try:
            while True:
                await self.step()
                await asyncio.sleep(self.poll_seconds)
        finally:
            await self.stop()

    async def step(self) -> None:
        """One poll: the DRA socket first, so the endpoint the registration names serves."""
        if self.server.socket_gone():
            await self.server.start()
            await self._stop_registration()  # re-announce: the endpoint is a new socket
        if self._registration_gone():
            await self._serve_registration()

    async def stop(self) -> None:
        """Stop serving and remove our registration socket: the watcher then forgets the
        plugin at once, rather than keep dialling a socket nobody serves."""
        if not self._registration_gone():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        await self._stop_registration()
        await self.server.stop()

    async def _serve_registration(self) -> None:
        await self._stop_registration()
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()
        server = grpc.aio.server()
        api_pb2_grpc.add_RegistrationServicer_to_server(  # type: ignore[no-untyped-call]
            RegistrationService(endpoint=self.server.path, registrar=self), server
        )
        server.add_insecure_port(f"unix:{path}")
        self._registration = server
        await asyncio.shield(server.start())
        self._inode = os.stat(path).st_ino
        log.info("DRA plugin %s: registration socket %s", dra.DRIVER, path)

    async def _stop_registration(self) -> None:
        server, self._registration, self._inode = self._registration, None, None
        if server is not None:
            await server.stop(grace=None)

    def _registration_gone(self) -> bool:
        return self._registration is None or socket_replaced(self.path, self._inode)
