"""Simulated nodes run the real node agent, in-process.

Why: ``better-compute dev --sim N`` and the tests need reservations that really go
``placed → binding → active → released`` without hardware, and they should exercise exactly
what the DaemonSet runs. So each simulated node gets the device plugin's own ``Converger`` (the
bind, release, restore and leftover rules, signed reports) over in-process ports instead of
the Kubernetes API:

- desired allocations: ``NodeService.desired``, the DeviceAllocation specs the operator writes
  as objects;
- reports: the converger's DeviceAllocation ``status`` read by the same
  ``kube.allocations.report`` the operator relays with, into ``ReservationService.report``;
- the inventory: a file written from the simulated node (``inventory.json`` under the node's
  root), read by the agent's ``FileInventory`` as on a node started with ``--inventory-file``;
- the node key: ``node-key.pem`` under the node's root, created on first start;
- the node certificate: given an authority (``dev`` makes one at start), ``SimEnrolment``
  certifies the node's key from it and renews at two thirds of the lifetime, as a real node's
  enrolment does, so the control plane checks simulated reports exactly like real ones;
- pod holders: none (no kubelet in dev), so a release completes at once;
- host limits: a folder laid out like a cgroup v2 root (``cgroup/`` under the node's root, the
  slices recorded in ``slices/``), so a simulated node enforces them as it advertises
  (``devices.limits``) and a hold's slice and its limit files can be inspected;
- wake-ups: ``Wakeups`` wakes the agents of a reservation's nodes when the store says it
  changed, as the operator's watch wakes a real node's agent.

What it must never do: decide anything itself (the converger does), write outside the node's
root, or import the store: it sees the control plane through the service.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from bettercompute.core import attestation
from bettercompute.core.errors import StoreError
from bettercompute.deviceplugin.allocations import Allocations
from bettercompute.deviceplugin.cgroups import Cgroups, lay_out_standin
from bettercompute.deviceplugin.converging import Converger
from bettercompute.deviceplugin.devicefiles import DeviceFiles
from bettercompute.deviceplugin.inventory import (
    FileInventory,
    Gpu,
    Inventory,
    MigDevice,
    inventory_document,
)
from bettercompute.deviceplugin.podresources import Holdings
from bettercompute.deviceplugin.signing import NodeKey, SigningError
from bettercompute.kube import allocations
from bettercompute.sim.inventories import SimNode

#: How often a simulated node converges when nothing wakes it. A dev tool: a reservation
#: should be active in well under a second, and a handful of nodes asking a local database
#: costs nothing.
PASS_SECONDS = 0.3
#: What a simulated GPU reports as its memory (the placer does not look at it).
SIMULATED_MEMORY_MIB = 81_559


class NodeAgentError(Exception):
    """A simulated node's agent cannot start (its key or its folder); the message says why."""


class DesiredState(Protocol):
    """``service.nodes.NodeService``: the allocations a node should hold now."""

    async def desired(self, node_id: str) -> list[dict[str, Any]]: ...


class Reports(Protocol):
    """``service.reservations.ReservationService``: a node's report on one allocation."""

    async def report(
        self, *, node_id: str, allocation_id: str, kind: str, details: Mapping[str, Any]
    ) -> bool: ...


class ServiceDesired:
    """The converger's desired-allocations port over the service."""

    def __init__(self, *, node_id: str, service: DesiredState) -> None:
        self.node_id = node_id
        self.service = service

    async def desired(self) -> Sequence[Mapping[str, Any]]:
        return await self.service.desired(self.node_id)


class ServiceReporter:
    """The converger's status port into the service, read as the operator reads a status."""

    def __init__(self, *, service: Reports) -> None:
        self.service = service

    async def report(self, *, allocation_id: str, status: Mapping[str, Any]) -> None:
        parsed = allocations.report(status)
        if parsed is None:
            return
        kind, details = parsed
        await self.service.report(
            node_id=str(status["nodeName"]),
            allocation_id=allocation_id,
            kind=kind,
            details=details,
        )


class NoPods:
    """No kubelet in dev: no pod ever holds a simulated device."""

    async def holdings(self) -> Holdings:
        return Holdings()


class NodesOf(Protocol):
    """``service.nodes.NodeService``: the nodes a reservation has allocations on."""

    async def nodes_of(self, reservation_id: str) -> list[str]: ...


class Wakeups:
    """Wakes the agents of the nodes a changed reservation has allocations on, so a start or
    a release is acted on at once, not at the next pass (the store's change notifications
    are hints: the passes still run, so a lost one costs at most a pass)."""

    def __init__(self, *, nodes: NodesOf, agents: Mapping[str, Converger]) -> None:
        self.nodes = nodes
        self.agents = agents
        self._changed: set[str] = set()
        self._wake = asyncio.Event()

    def changed(self, reservation_id: str) -> None:
        """A reservation changed (called from the change listener)."""
        self._changed.add(reservation_id)
        self._wake.set()

    async def run(self) -> None:
        """Wake agents as hints arrive, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            changed, self._changed = self._changed, set()
            for reservation_id in sorted(changed):
                try:
                    node_ids = await self.nodes.nodes_of(reservation_id)
                except StoreError:
                    node_ids = list(self.agents)  # cannot tell which: wake every one
                for node_id in node_ids:
                    agent = self.agents.get(node_id)
                    if agent is not None:
                        agent.wake()


def inventory_of(node: SimNode) -> Inventory:
    """The device plugin's inventory of a simulated node: its GPUs in index order, MIG
    instances under their GPU, NVLink peers within each simulated domain."""
    gpus = node.gpus
    domain_of = {a.parent_gpu: a.nvlink_domain for a in node.atoms}
    numa_of = {a.parent_gpu: a.numa_node for a in node.atoms}
    migs: dict[str, list[MigDevice]] = {gpu: [] for gpu in gpus}
    for atom in node.atoms:
        if atom.kind == "mig" and atom.profile is not None:
            migs[atom.parent_gpu].append(
                MigDevice(uuid=atom.device_id, profile=atom.profile, parent_uuid=atom.parent_gpu)
            )
    return Inventory(
        node_name=node.name,
        gpus=tuple(
            Gpu(
                uuid=gpu,
                index=index,
                model=node.model or "simulated",
                memory_mib=SIMULATED_MEMORY_MIB,
                numa_node=numa_of[gpu],
                nvlink_peers=tuple(
                    peer
                    for peer in gpus
                    if peer != gpu
                    and domain_of[gpu] is not None
                    and domain_of[peer] == domain_of[gpu]
                ),
                mig=tuple(migs[gpu]),
            )
            for index, gpu in enumerate(gpus)
        ),
    )


def write_inventory(node: SimNode, path: Path) -> Path:
    """Write ``node``'s inventory file at ``path`` (atomically, and only when it changed)."""
    document = json.dumps(inventory_document(inventory_of(node)), indent=2, sort_keys=True)
    if not path.exists() or path.read_text(encoding="utf-8") != document:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(document, encoding="utf-8")
        tmp.replace(path)
    return path


class SimEnrolment:
    """A simulated node's certificate: issued from ``authority`` for the node's key, renewed
    once two thirds of its lifetime have passed. Called for the current PEM on every report."""

    def __init__(
        self,
        *,
        authority: attestation.CertificateAuthority,
        node_name: str,
        key: NodeKey,
        lifetime: dt.timedelta = attestation.NODE_CERTIFICATE_LIFETIME,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self.authority = authority
        self.node_name = node_name
        self.key = key
        self.lifetime = lifetime
        self.clock = clock
        self._pem = ""
        self._renew_at: dt.datetime | None = None

    def __call__(self) -> str:
        now = self.clock()
        if self._renew_at is None or now >= self._renew_at:
            cert = self.authority.issue(
                public_key=self.key.public_key,
                node_name=self.node_name,
                role=attestation.ROLE_NODE,
                now=now,
                lifetime=self.lifetime,
            )
            self._pem = attestation.certificate_pem(cert).decode("ascii")
            self._renew_at = now + self.lifetime * 2 / 3
        return self._pem


def node_agent(
    node: SimNode,
    *,
    root: Path,
    desired: DesiredState,
    reports: Reports,
    retry_on: tuple[type[Exception], ...] = (OSError,),
    pass_seconds: float = PASS_SECONDS,
    authority: attestation.CertificateAuthority | None = None,
) -> Converger:
    """The real node agent's converger for ``node``, its files, inventory and key under
    ``root``. Writes the inventory file (it is the simulated hardware) and creates the key on
    first use; with ``authority``, certifies the key from it (``SimEnrolment``). ``run()`` it,
    or ``sync_once()`` step by step. ``NodeAgentError`` when the folder cannot be written or
    the key cannot be used."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        inventory_file = write_inventory(node, root / "inventory.json")
        key = NodeKey.load_or_create(root / "node-key.pem")
        cgroups = Cgroups(lay_out_standin(root / "cgroup"), records=root / "slices")
    except (OSError, SigningError) as e:
        raise NodeAgentError(f"simulated node {node.name}: {_said(e)}") from e
    problem = cgroups.enforcement_problem()
    if problem is not None:
        raise NodeAgentError(f"simulated node {node.name}: {problem}")
    return Converger(
        node_name=node.id,
        allocations=Allocations(),
        files=DeviceFiles(root),
        inventory_source=FileInventory(path=inventory_file, node_name=node.name),
        pods=NoPods(),
        desired=ServiceDesired(node_id=node.id, service=desired),
        reporter=ServiceReporter(service=reports),
        key=key,
        certificate=(
            None
            if authority is None
            else SimEnrolment(authority=authority, node_name=node.id, key=key)
        ),
        pass_seconds=pass_seconds,
        retry_on=retry_on,
        cgroups=cgroups,
    )


def _said(error: Exception) -> str:
    if isinstance(error, OSError) and error.strerror:
        return f"{error.filename or ''}: {error.strerror}".lstrip(": ")
    return str(error)
