"""A stand-in for the kubelet's DRA side: the plugin watcher and the DRA plugin client.

Why: the node agent's DRA plugin is tested against real gRPC over unix sockets, driven the way
the kubelet drives it (docs/reference/dra-protocol.md), not against mocks; and the tests with
the real control plane reuse this stand-in to prepare the claims the real scheduler allocated.

``DraKubelet`` watches a ``plugins_registry`` folder (polling: a socket file not starting with a
dot is a plugin), dials each new registration socket, calls ``GetInfo``, checks the type
(``DRAPlugin``) and picks the newest DRA service it speaks from ``supported_versions``
(``v1.DRAPlugin``, else ``v1beta1.DRAPlugin``; ``speaks=("v1beta1",)`` plays a 1.32/1.33
kubelet), answers ``NotifyRegistrationStatus`` (refusing a plugin it cannot use, as the kubelet
does), and dials the plugin's endpoint. ``prepare(claims)`` and ``unprepare(claims)`` then call
``NodePrepareResources`` / ``NodeUnprepareResources`` with claims given as
(namespace, name, uid) and return each claim's answer by uid. ``restart()`` forgets every plugin
and deletes the registration sockets, as a kubelet restart that cleans the folder does; the
plugin must serve a new one to be registered again.
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bettercompute.kube import dra
from bettercompute.proto.dra.v1 import api_pb2 as v1
from bettercompute.proto.dra.v1 import api_pb2_grpc as v1_grpc
from bettercompute.proto.dra.v1beta1 import api_pb2 as v1beta1
from bettercompute.proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from bettercompute.proto.pluginregistration.v1 import api_pb2 as reg
from bettercompute.proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc

#: Service name in supported_versions -> (messages, stubs) of that package; newest first.
_SERVICES: dict[str, tuple[Any, Any]] = {
    "v1": (v1, v1_grpc),
    "v1beta1": (v1beta1, v1beta1_grpc),
}


@dataclass(frozen=True)
class Claim:
    """A claim as the kubelet names it to a driver."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]


@dataclass(frozen=True)
class Answer:
    """One claim's entry in an answer: its devices, or the error (empty: none)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


@dataclass
class DraPlugin:
    """The kubelet's connection to one registered DRA driver."""

    name: str
    endpoint: str
    version: str  # the package the kubelet chose: v1 or v1beta1
    registration_socket: Path
    channel: grpc.aio.Channel
    messages: Any
    stub: Any


@dataclass
class DraKubelet:
    registry_dir: Path
    #: The DRA API versions this kubelet speaks, newest first.
    speaks: Sequence[str] = ("v1", "v1beta1")
    poll_seconds: float = 0.05
    plugins: dict[str, DraPlugin] = field(default_factory=dict)
    #: Every registration attempt: (socket, accepted, error).
    registrations: list[tuple[Path, bool, str]] = field(default_factory=list)
    #: Registration socket -> its identity (inode, change time) when last registered: a new
    #: file is what the kubelet's inotify watch reports as created.
    _seen: dict[Path, tuple[int, int]] = field(default_factory=dict)
    _watcher: asyncio.Task[None] | None = None
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def start(self) -> None:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._watcher = asyncio.create_task(self._watch(), name="dra-plugin-watcher")

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        for plugin in self.plugins.values():
            await plugin.channel.close()
        self.plugins.clear()
        self._seen.clear()

    async def restart(self) -> None:
        """Stop, delete every socket in the registry folder (plain files stay), start again."""
        await self.stop()
        for path in self.registry_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(path.lstat().st_mode):
                    path.unlink()
        await self.start()

    def accepted(self) -> int:
        """How many registrations this kubelet accepted so far."""
        return sum(1 for _, ok, _ in self.registrations if ok)

    async def wait_registered(self, name: str, *, after: int = 0, within: float = 5.0) -> DraPlugin:
        """The plugin ``name`` once registered, by a registration later than the ``after``-th
        accepted one (``accepted()`` before a restart: the new plugin, not the old)."""
        try:
            async with asyncio.timeout(within), self._changed:
                await self._changed.wait_for(
                    lambda: name in self.plugins and self.accepted() > after
                )
        except TimeoutError:
            raise AssertionError(
                f"DRA plugin {name} never registered; attempts: {self.registrations}"
            ) from None
        return self.plugins[name]

    async def wait_attempts(self, count: int, *, within: float = 5.0) -> None:
        async with asyncio.timeout(within), self._changed:
            await self._changed.wait_for(lambda: len(self.registrations) >= count)

    async def prepare(
        self, claims: Iterable[Claim], *, driver: str = dra.DRIVER
    ) -> dict[str, Answer]:
        """NodePrepareResources for ``claims``; each claim's answer by uid."""
        plugin = self.plugins[driver]
        request = plugin.messages.NodePrepareResourcesRequest(
            claims=[_claim(plugin, c) for c in claims]
        )
        response = await plugin.stub.NodePrepareResources(request, timeout=10)
        return {
            uid: Answer(
                devices=tuple(
                    PreparedDevice(
                        request_names=tuple(d.request_names),
                        pool_name=d.pool_name,
                        device_name=d.device_name,
                        cdi_device_ids=tuple(d.cdi_device_ids),
                    )
                    for d in entry.devices
                ),
                error=entry.error,
            )
            for uid, entry in response.claims.items()
        }

    async def unprepare(
        self, claims: Iterable[Claim], *, driver: str = dra.DRIVER
    ) -> dict[str, str]:
        """NodeUnprepareResources for ``claims``; each claim's error (empty: none) by uid."""
        plugin = self.plugins[driver]
        request = plugin.messages.NodeUnprepareResourcesRequest(
            claims=[_claim(plugin, c) for c in claims]
        )
        response = await plugin.stub.NodeUnprepareResources(request, timeout=10)
        return {uid: entry.error for uid, entry in response.claims.items()}

    # --- the plugin watcher -----------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            current: dict[Path, tuple[int, int]] = {}
            for path in sorted(self.registry_dir.iterdir()):
                with contextlib.suppress(FileNotFoundError):
                    found = path.lstat()
                    if stat.S_ISSOCK(found.st_mode) and not path.name.startswith("."):
                        current[path] = (found.st_ino, found.st_ctime_ns)
            for path, identity in current.items():
                if self._seen.get(path) != identity:
                    self._seen[path] = identity
                    await self._register(path)
            for path in [p for p in self._seen if p not in current]:
                del self._seen[path]
                await self._forget(path)
            await asyncio.sleep(self.poll_seconds)

    async def _register(self, path: Path) -> None:
        accepted, error = False, ""
        try:
            async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
                stub = reg_grpc.RegistrationStub(channel)
                info = await stub.GetInfo(reg.InfoRequest(), timeout=1)
                version, error = self._choose(info)
                if not error:
                    await self._forget_name(info.name)
                    messages, stubs = _SERVICES[version]
                    endpoint = info.endpoint or str(path)
                    dra_channel = grpc.aio.insecure_channel(f"unix:{endpoint}")
                    self.plugins[info.name] = DraPlugin(
                        name=info.name,
                        endpoint=endpoint,
                        version=version,
                        registration_socket=path,
                        channel=dra_channel,
                        messages=messages,
                        stub=stubs.DRAPluginStub(dra_channel),
                    )
                    accepted = True
                await stub.NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=accepted, error=error), timeout=5
                )
        except grpc.aio.AioRpcError as e:
            error = f"{e.code().name}: {e.details()}"
        async with self._changed:
            self.registrations.append((path, accepted, error))
            self._changed.notify_all()

    def _choose(self, info: reg.PluginInfo) -> tuple[str, str]:
        if info.type != "DRAPlugin":
            return "", f"no handler registered for plugin type: {info.type}"
        offered = list(info.supported_versions)
        for version in self.speaks:
            if f"{version}.DRAPlugin" in offered:
                return version, ""
        return "", f"none of {offered} is a DRA service this kubelet speaks ({list(self.speaks)})"

    async def _forget(self, path: Path) -> None:
        for name, plugin in list(self.plugins.items()):
            if plugin.registration_socket == path:
                await self._forget_name(name)

    async def _forget_name(self, name: str) -> None:
        plugin = self.plugins.pop(name, None)
        if plugin is not None:
            await plugin.channel.close()


def _claim(plugin: DraPlugin, claim: Claim) -> Any:
    return plugin.messages.Claim(namespace=claim.namespace, name=claim.name, uid=claim.uid)
