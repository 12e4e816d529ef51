"""The kubelet-facing gRPC servers: one ``v1beta1.DevicePlugin`` per resource, on a unix socket.

Why it exists: the kubelet learns which ``bcd.dev/gpu``, ``bcd.dev/gpu.mig`` and
``bcd.dev/gpu.slot`` devices this node has, and asks for them at pod admission, only through
this protocol (the kubelet's device plugin API, v1beta1). ``registering`` tells the
kubelet where the sockets are; ``converging`` changes ``allocations.Allocations``, which these
servers read.

Each RPC is a few lines around a pure function of ``Allocations`` (``device_list``,
``allocate_container``, ``preferred_devices``, ``check_pre_start``), so the rules are testable
without a socket:

- **Options.** ``get_preferred_allocation_available`` is true. ``pre_start_required`` is true as
  well: the kubelet then asks before *every* start of a container, restarts included, and we
  refuse the start of a container whose devices are no longer bound (the reservation was released
  while the pod lived on). Without it a crash-looping pod would keep restarting onto GPUs that
  are being handed back. The check is a dictionary lookup, far inside the kubelet's 30 s budget.
- **ListAndWatch** sends the complete list at once, then again within milliseconds of every
  change that alters it (it waits on ``Allocations.wait_changed``).
- **Allocate** answers ``cdi_devices`` (``bcd.dev/gpu=<id>``, then NVIDIA's device for each of
  the container's GPUs or MIG instances where the node's NVIDIA CDI specs name one:
  ``nvidia.com/gpu=GPU-…``, see ``nvidiacdi``), the envs ``BCD_ALLOCATION_ID``,
  ``BCD_RESERVATION_ID`` and ``NVIDIA_VISIBLE_DEVICES`` (exactly the container's GPUs or MIG
  instances; a slot's physical GPU: kept with CDI too, since it overrides the ``all`` a CUDA
  image sets for the NVIDIA runtime), and the same ids as container annotations. An id this node
  does not hold bound for the resource is ``INVALID_ARGUMENT``; one whose allocation is being
  released is ``FAILED_PRECONDITION``; both name the ids.
- **GetPreferredAllocation** keeps a request inside one allocation and one NVLink domain where
  it can, and always honours ``must_include``.

What it must never do: change ``Allocations`` (only the converger does), touch files, or talk to
Kubernetes. A refused call is a gRPC status with a message, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc

from bettercompute.deviceplugin import devicefiles
from bettercompute.deviceplugin.allocations import (
    AdvertisedDevice,
    Allocations,
    Phase,
    Resource,
    is_dra,
)
from bettercompute.deviceplugin.metrics import DevicePluginMetrics
from bettercompute.proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)

DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class Refused(Exception):
    """A request the node will not serve; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def options() -> api_pb2.DevicePluginOptions:
    return api_pb2.DevicePluginOptions(
        pre_start_required=True, get_preferred_allocation_available=True
    )


def device_list(devices: Iterable[AdvertisedDevice]) -> api_pb2.ListAndWatchResponse:
    """The kubelet's view of a resource: every device, its health, its NUMA node."""
    return api_pb2.ListAndWatchResponse(
        devices=[
            api_pb2.Device(
                ID=device.device_id,
                health=HEALTHY if device.healthy else UNHEALTHY,
                topology=None
                if device.numa_node is None
                else api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=device.numa_node)]),
            )
            for device in devices
        ]
    )


def _bound_owners(
    allocations: Allocations, resource: Resource, device_ids: Sequence[str], *, verb: str
) -> list[devicefiles.Allocation]:
    """The allocation of each id, or ``Refused`` naming every id that is not bound here."""
    if not device_ids:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{resource.name}: no device ids given")
    unknown, releasing, owners = [], [], []
    for device_id in device_ids:
        held = allocations.owner_of(device_id)
        if (
            held is None
            or held.allocation.binding != "kubernetes"
            or is_dra(held.allocation)  # reaches pods through claims, never Allocate
            # Under this resource only: a reservation's devices only through its own
            # endpoint, and never through a shared name or another reservation's.
            or held.allocation.resource_name != resource.name
            or held.phase is Phase.BINDING  # its files may not be written yet
        ):
            unknown.append(device_id)
        elif held.phase is Phase.RELEASING:
            releasing.append(device_id)
        else:
            owners.append(held.allocation)
    if unknown:
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"cannot {verb} {resource.name} devices this node does not hold bound: "
            + ", ".join(unknown),
        )
    if releasing:
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"cannot {verb} {resource.name} devices whose allocation is being released: "
            + ", ".join(releasing),
        )
    return owners


def allocate_container(
    allocations: Allocations, resource: Resource, device_ids: Sequence[str]
) -> api_pb2.ContainerAllocateResponse:
    """What the runtime must give one container that was assigned ``device_ids``."""
    owners = _bound_owners(allocations, resource, device_ids, verb="allocate")
    parents = []
    for device_id, owner in zip(device_ids, owners, strict=True):
        parents.append(owner.parent_gpus[owner.device_ids.index(device_id)])
    allocation_ids = ",".join(dict.fromkeys(owner.allocation_id for owner in owners))
    reservation_ids = ",".join(dict.fromkeys(owner.reservation_id for owner in owners))
    visible = devicefiles.visible_devices(
        device_class=resource.device_class, device_ids=device_ids, parent_gpus=parents
    )
    inventory = allocations.inventory
    nvidia = [] if inventory is None else inventory.nvidia_cdi.devices_for(visible)
    return api_pb2.ContainerAllocateResponse(
        envs={
            "BCD_ALLOCATION_ID": allocation_ids,
            "BCD_RESERVATION_ID": reservation_ids,
            "NVIDIA_VISIBLE_DEVICES": ",".join(visible),
        },
        annotations={
            devicefiles.ANNOTATION_ALLOCATION: allocation_ids,
            devicefiles.ANNOTATION_RESERVATION: reservation_ids,
        },
        cdi_devices=[
            api_pb2.CDIDevice(name=name)
            for name in [*(devicefiles.cdi_name(d) for d in device_ids), *nvidia]
        ],
    )


def check_pre_start(
    allocations: Allocations, resource: Resource, device_ids: Sequence[str]
) -> None:
    """Refuse to start a container onto devices that are no longer bound here."""
    _bound_owners(allocations, resource, device_ids, verb="start a container on")


def preferred_devices(
    *,
    devices: Sequence[AdvertisedDevice],
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
) -> list[str]:
    """Which ``size`` devices of ``available`` one container should get.

    ``must_include`` always comes first. The rest come from one (allocation, NVLink domain)
    group when one is big enough: the smallest such group (in the smallest allocation), so
    bigger groups stay whole for bigger requests; a group that holds ``must_include`` devices
    is preferred, then its allocation. When no group is big enough, the request stays inside
    one allocation if that one is, taking its biggest domains first. Inside a group, devices go
    in GPU order, so slots pack onto as few GPUs as possible.
    """
    chosen = list(dict.fromkeys(must_include))
    need = size - len(chosen)
    if need <= 0:
        return chosen
    by_id = {device.device_id: device for device in devices}
    candidates = [by_id[d] for d in dict.fromkeys(available) if d in by_id and d not in chosen]
    groups: dict[tuple[str, str], list[AdvertisedDevice]] = {}
    for device in candidates:
        groups.setdefault((device.allocation_id, device.nvlink_domain or ""), []).append(device)
    allocation_size: dict[str, int] = {}
    for (allocation_id, _), members in groups.items():
        allocation_size[allocation_id] = allocation_size.get(allocation_id, 0) + len(members)
    anchors = [by_id[d] for d in chosen if d in by_id]
    anchor_groups = {(d.allocation_id, d.nvlink_domain or "") for d in anchors}
    anchor_allocations = {d.allocation_id for d in anchors}

    def rank(key: tuple[str, str]) -> tuple[Any, ...]:
        allocation_id, domain = key
        members = len(groups[key])
        if not anchors or key in anchor_groups:
            anchor = 0
        else:
            anchor = 1 if allocation_id in anchor_allocations else 2
        if members >= need:
            # Best fit, then the smallest allocation: big groups stay whole for big requests.
            fit: tuple[int, ...] = (0, members, allocation_size[allocation_id])
        elif allocation_size[allocation_id] >= need:
            fit = (1, -members)
        else:
            fit = (2, -allocation_size[allocation_id], -members)
        return (anchor, fit, allocation_id, domain)

    ordered = sorted(groups, key=rank)
    if ordered:
        first_allocation = ordered[0][0]
        # After the best group, the rest of its allocation before any other allocation.
        rest = sorted(ordered[1:], key=lambda key: (key[0] != first_allocation, rank(key)))
        ordered = [ordered[0], *rest]
    picks: list[str] = []
    for key in ordered:
        members = sorted(
            groups[key],
            key=lambda d: (d.gpu_index if d.gpu_index is not None else 1 << 30, d.device_id),
        )
        picks.extend(d.device_id for d in members)
        if len(picks) >= need:
            break
    # Ids the node does not know come last: the kubelet fills any shortfall itself anyway.
    picks.extend(d for d in dict.fromkeys(available) if d not in by_id and d not in chosen)
    return chosen + picks[:need]


class DevicePluginService(api_pb2_grpc.DevicePluginServicer):
    """The RPCs of one resource; each a thin wrapper of a function above."""

    def __init__(
        self,
        *,
        resource: Resource,
        allocations: Allocations,
        metrics: DevicePluginMetrics,
        allocated: Callable[[], None] | None = None,
    ) -> None:
        self.resource = resource
        self.allocations = allocations
        self.metrics = metrics
        #: Called after each Allocate answered: the converger looks at who holds what.
        self.allocated = allocated

    async def GetDevicePluginOptions(  # the RPC names are fixed by the protocol
        self, request: api_pb2.Empty, context: grpc.aio.ServicerContext[Any, Any]
    ) -> api_pb2.DevicePluginOptions:
        return options()

    async def ListAndWatch(
        self, request: api_pb2.Empty, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        last: api_pb2.ListAndWatchResponse | None = None
        while True:
            version = self.allocations.version
            current = device_list(self.allocations.advertised(self.resource))
            if current != last:
                yield current
                last = current
            await self.allocations.wait_changed(after=version)

    async def GetPreferredAllocation(
        self,
        request: api_pb2.PreferredAllocationRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> api_pb2.PreferredAllocationResponse:
        devices = self.allocations.advertised(self.resource)
        return api_pb2.PreferredAllocationResponse(
            container_responses=[
                api_pb2.ContainerPreferredAllocationResponse(
                    deviceIDs=preferred_devices(
                        devices=devices,
                        available=list(container.available_deviceIDs),
                        must_include=list(container.must_include_deviceIDs),
                        size=container.allocation_size,
                    )
                )
                for container in request.container_requests
            ]
        )

    async def Allocate(
        self, request: api_pb2.AllocateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> api_pb2.AllocateResponse:
        started = time.perf_counter()
        try:
            answers = [
                allocate_container(self.allocations, self.resource, list(c.devices_ids))
                for c in request.container_requests
            ]
        except Refused as e:
            log.warning("%s: Allocate refused: %s", self.resource.name, e)
            await context.abort(e.code, str(e))
            raise  # abort raises; this only tells the type checker
        finally:
            self.metrics.observe_allocate(
                resource=self.resource.name, seconds=time.perf_counter() - started
            )
        if self.allocated is not None:
            self.allocated()
        return api_pb2.AllocateResponse(container_responses=answers)

    async def PreStartContainer(
        self,
        request: api_pb2.PreStartContainerRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> api_pb2.PreStartContainerResponse:
        try:
            check_pre_start(self.allocations, self.resource, list(request.devices_ids))
        except Refused as e:
            log.warning("%s: PreStartContainer refused: %s", self.resource.name, e)
            await context.abort(e.code, str(e))
            raise
        return api_pb2.PreStartContainerResponse()


@dataclasses.dataclass
class PluginServer:
    """One resource's server on ``<plugin_dir>/<socket name>``; restartable, since the kubelet
    deletes every socket in its directory when it restarts."""

    resource: Resource
    allocations: Allocations
    plugin_dir: Path
    metrics: DevicePluginMetrics
    allocated: Callable[[], None] | None = None
    _server: grpc.aio.Server | None = None
    _starting: asyncio.Future[None] | None = None
    _inode: int | None = None

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / self.resource.socket_name

    async def start(self) -> None:
        await self.stop()
        path = self.socket_path
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()  # a socket left by a crashed run; never any other file
        server = grpc.aio.server()
        api_pb2_grpc.add_DevicePluginServicer_to_server(  # type: ignore[no-untyped-call]
            DevicePluginService(
                resource=self.resource,
                allocations=self.allocations,
                metrics=self.metrics,
                allocated=self.allocated,
            ),
            server,
        )
        server.add_insecure_port(f"unix:{path}")
        # grpc cannot stop a server halfway through starting ("invalid state"): a start runs to
        # its end even when the caller is cancelled, and ``stop`` waits for it.
        starting = asyncio.ensure_future(server.start())
        self._server, self._starting = server, starting
        await asyncio.shield(starting)
        self._inode = os.stat(path).st_ino
        log.info("%s: serving on %s", self.resource.name, path)

    async def stop(self) -> None:
        server, starting = self._server, self._starting
        self._server = self._starting = self._inode = None
        if starting is not None:
            await asyncio.wait({starting})
        if server is not None:
            # Open ListAndWatch streams never end on their own: cancel them at once.
            await server.stop(grace=None)

    def socket_gone(self) -> bool:
        """Whether our socket file was removed or replaced since we started serving."""
        return self._server is None or socket_replaced(self.socket_path, self._inode)


def socket_replaced(path: str | os.PathLike[str], inode: int | None) -> bool:
    """Whether the socket we made at ``path`` (its ``inode``) was removed or replaced: the
    kubelet deletes plugin sockets when it restarts, and a new server must then be made."""
    try:
        return os.stat(path).st_ino != inode
    except FileNotFoundError:
        return True
