"""The kubelet's DRA plugin service for driver ``gpu.bcd.dev``: prepare and unprepare claims.

Why it exists: for a pool whose devices reach pods through ResourceClaims, the kubelet calls
``NodePrepareResources`` before a pod that uses a claim starts, and ``NodeUnprepareResources``
once no pod on the node uses it any more (docs/reference/dra-protocol.md). ``Preparer`` is the
one implementation; the ``v1`` and ``v1beta1`` services are thin adapters over it (the two
packages have the same messages), and ``DraServer`` serves both on one unix socket
(``<kubelet plugins dir>/gpu.bcd.dev/dra.sock``), which ``draregistering`` names to the kubelet.

Prepare, per claim: a claim prepared before (the checkpoint) is answered the same devices again;
otherwise the claim is read from the API (``ClaimReader``: the kubelet sends only namespace,
name and uid), ``draclaims.decide`` says whether and with which devices, and the answer is
remembered on disk before it is given. Each device is answered with bcd's CDI device
(``bcd.dev/gpu=<id>``, the spec ``devicefiles`` wrote for the allocation) and NVIDIA's for the
GPU behind it when the node's NVIDIA specs name one; the first device of each request also
with the claim's own CDI device (``bcd.dev/gpu=claim-<uid>-<request>``, whose spec
``draclaims.ClaimFiles`` writes before the answer), which sets the container's environment.
Unprepare forgets the claims (unknown ones too: it is idempotent), removes their specs and wakes
the converger, which may then finish a release.

Every claim of a request gets an entry in the answer; a claim that cannot be prepared gets a
per-claim ``error`` (the kubelet retries it), never a gRPC error, which would fail the other
claims of the call with it.

What it must never do: answer devices ``draclaims.decide`` refused, answer before the checkpoint
holds the claim, or let one bad claim fail the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc

from bettercompute.deviceplugin import draclaims
from bettercompute.deviceplugin.allocations import Allocations
from bettercompute.deviceplugin.draclaims import (
    ClaimFiles,
    PreparedClaim,
    PreparedClaims,
    Refusal,
)
from bettercompute.deviceplugin.serving import socket_replaced
from bettercompute.kube import dra, resources
from bettercompute.kube.client import KubeClient, KubeError
from bettercompute.proto.dra.v1 import api_pb2 as v1_pb2
from bettercompute.proto.dra.v1 import api_pb2_grpc as v1_grpc
from bettercompute.proto.dra.v1beta1 import api_pb2 as v1beta1_pb2
from bettercompute.proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc

log = logging.getLogger(__name__)

KUBELET_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
SOCKET_NAME = "dra.sock"
#: The services the socket serves, as the registration names them (newest first).
SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")


def socket_path(plugins_dir: Path) -> Path:
    """Where the DRA service listens: a folder of the driver's own under the plugins dir."""
    return plugins_dir / dra.DRIVER / SOCKET_NAME


class ClaimUnreadable(Exception):
    """The API did not answer about a claim; the message says which and why."""


class ClaimReader(Protocol):
    """Reads one ResourceClaim (``resource.k8s.io/v1``) as a plain dict; None when it does not
    exist; ``ClaimUnreadable`` when the API cannot tell."""

    async def read(self, *, namespace: str, name: str) -> Mapping[str, Any] | None: ...


class KubeClaimReader:
    """``ClaimReader`` over the agent's Kubernetes client (``GET …/resourceclaims/{name}``)."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client

    async def read(self, *, namespace: str, name: str) -> Mapping[str, Any] | None:
        try:
            return await self.client.get(resources.RESOURCE_CLAIMS, name, namespace=namespace)
        except KubeError as e:
            raise ClaimUnreadable(f"cannot read ResourceClaim {namespace}/{name}: {e}") from e


@dataclasses.dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    name: str
    uid: str


class Preparer:
    """Prepares and unprepares claims; both API versions call it."""

    def __init__(
        self,
        *,
        node_name: str,
        allocations: Allocations,
        claims: PreparedClaims,
        reader: ClaimReader,
        files: ClaimFiles,
        changed: Callable[[], None] | None = None,
    ) -> None:
        self.node_name = node_name
        self.allocations = allocations
        self.claims = claims
        self.reader = reader
        self.files = files
        #: Called after a claim is prepared or unprepared (the converger's ``wake``).
        self.changed = changed

    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PreparedClaim | Refusal]:
        """An answer for every claim of ``refs``, by uid."""
        answers: dict[str, PreparedClaim | Refusal] = {}
        for ref in refs:
            answers[ref.uid] = await self._prepare_one(ref)
        return answers

    async def _prepare_one(self, ref: ClaimRef) -> PreparedClaim | Refusal:
        known = self.claims.get(ref.uid)
        if known is not None:
            if (known.namespace, known.name) != (ref.namespace, ref.name):
                return Refusal(
                    f"claim uid {ref.uid} was prepared as {known.namespace}/{known.name}, "
                    f"not {ref.namespace}/{ref.name}"
                )
            try:
                self.files.write(known)  # heals a spec someone removed
            except draclaims.CheckpointError as e:
                return Refusal(str(e))
            return known  # the kubelet asks again (its restart, a retry): the same answer
        try:
            claim = await self.reader.read(namespace=ref.namespace, name=ref.name)
        except ClaimUnreadable as e:
            return Refusal(str(e))
        # No await between deciding and remembering: a release cannot start in between and
        # miss this claim among its holders.
        decided = draclaims.decide(
            uid=ref.uid,
            namespace=ref.namespace,
            name=ref.name,
            claim=claim,
            node_name=self.node_name,
            allocations=self.allocations,
        )
        if isinstance(decided, Refusal):
            log.warning("refused to prepare %s/%s: %s", ref.namespace, ref.name, decided.reason)
            return decided
        try:
            self.files.write(decided)
            self.claims.add(decided)
        except draclaims.CheckpointError as e:
            self.files.remove(decided.uid)
            return Refusal(str(e))
        log.info(
            "prepared ResourceClaim %s/%s (%s): allocation %s, devices %s",
            ref.namespace,
            ref.name,
            ref.uid,
            decided.allocation_id,
            [d.device_name for d in decided.devices],
        )
        if self.changed is not None:
            self.changed()  # the allocation's report names its new holder
        return decided

    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """An error (empty: none) for every claim of ``refs``, by uid."""
        try:
            gone = self.claims.remove(ref.uid for ref in refs)
        except draclaims.CheckpointError as e:
            return {ref.uid: str(e) for ref in refs}
        for ref in refs:  # unknown ones too: a crash may have left a spec behind
            self.files.remove(ref.uid)
        for claim in gone:
            log.info("unprepared ResourceClaim %s (%s)", claim.holder, claim.uid)
        if gone and self.changed is not None:
            self.changed()
        return {ref.uid: "" for ref in refs}


# --- the two API versions: the same messages in two packages ------------------------------


def _refs(request: Any) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in request.claims]


def _prepare_response(pb: Any, answers: Mapping[str, PreparedClaim | Refusal]) -> Any:
    response = pb.NodePrepareResourcesResponse()
    for uid, answer in answers.items():
        entry = response.claims[uid]
        if isinstance(answer, Refusal):
            entry.error = answer.reason
            continue
        entry.devices.extend(
            pb.Device(
                request_names=list(d.request_names),
                pool_name=d.pool_name,
                device_name=d.device_name,
                cdi_device_ids=list(d.cdi_device_ids),
            )
            for d in answer.devices
        )
    return response


def _unprepare_response(pb: Any, errors: Mapping[str, str]) -> Any:
    response = pb.NodeUnprepareResourcesResponse()
    for uid, error in errors.items():
        response.claims[uid].error = error
    return response


class V1Service(v1_grpc.DRAPluginServicer):
    """``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` (kubelets 1.34 and later)."""

    def __init__(self, preparer: Preparer) -> None:
        self.preparer = preparer

    async def NodePrepareResources(
        self, request: v1_pb2.NodePrepareResourcesRequest, context: Any
    ) -> v1_pb2.NodePrepareResourcesResponse:
        answers = await self.preparer.prepare(_refs(request))
        response: v1_pb2.NodePrepareResourcesResponse = _prepare_response(v1_pb2, answers)
        return response

    async def NodeUnprepareResources(
        self, request: v1_pb2.NodeUnprepareResourcesRequest, context: Any
    ) -> v1_pb2.NodeUnprepareResourcesResponse:
        errors = self.preparer.unprepare(_refs(request))
        response: v1_pb2.NodeUnprepareResourcesResponse = _unprepare_response(v1_pb2, errors)
        return response


class V1beta1Service(v1beta1_grpc.DRAPluginServicer):
    """``k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin`` (kubelets 1.32 and 1.33)."""

    def __init__(self, preparer: Preparer) -> None:
        self.preparer = preparer

    async def NodePrepareResources(
        self, request: v1beta1_pb2.NodePrepareResourcesRequest, context: Any
    ) -> v1beta1_pb2.NodePrepareResourcesResponse:
        answers = await self.preparer.prepare(_refs(request))
        response: v1beta1_pb2.NodePrepareResourcesResponse = _prepare_response(v1beta1_pb2, answers)
        return response

    async def NodeUnprepareResources(
        self, request: v1beta1_pb2.NodeUnprepareResourcesRequest, context: Any
    ) -> v1beta1_pb2.NodeUnprepareResourcesResponse:
        errors = self.preparer.unprepare(_refs(request))
        response: v1beta1_pb2.NodeUnprepareResourcesResponse = _unprepare_response(
            v1beta1_pb2, errors
        )
        return response


class DraServer:
    """Both services on one unix socket; restartable, since a kubelet restart may clear the
    plugins folder."""

    def __init__(self, *, preparer: Preparer, path: Path) -> None:
        self.preparer = preparer
        self.path = path
        self._server: grpc.aio.Server | None = None
        self._inode: int | None = None

    async def start(self) -> None:
        await self.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(self.path.lstat().st_mode):
                self.path.unlink()  # a socket left by a crashed run; never any other file
        server = grpc.aio.server()
        v1_grpc.add_DRAPluginServicer_to_server(  # type: ignore[no-untyped-call]
            V1Service(self.preparer), server
        )
        v1beta1_grpc.add_DRAPluginServicer_to_server(  # type: ignore[no-untyped-call]
            V1beta1Service(self.preparer), server
        )
        server.add_insecure_port(f"unix:{self.path}")
        self._server = server
        # grpc cannot stop a server halfway through starting: let a start finish.
        await asyncio.shield(server.start())
        self._inode = os.stat(self.path).st_ino
        log.info("DRA plugin %s serving %s on %s", dra.DRIVER, ", ".join(SERVICES), self.path)

    async def stop(self) -> None:
        server, self._server, self._inode = self._server, None, None
        if server is not None:
            await server.stop(grace=None)

    def socket_gone(self) -> bool:
        """Whether our socket file was removed or replaced since we started serving."""
        return self._server is None or socket_replaced(self.path, self._inode)
