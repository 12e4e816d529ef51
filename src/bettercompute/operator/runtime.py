"""Everything the kopf handlers reach, in one value kept in kopf's ``memo``.

Why one value: handlers are module-level functions that kopf calls; they get their services
from the memo instead of module globals, so two operators can run in one process (the peering
test does) and each test starts from nothing.

Data only: built and started by ``running``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import kopf

from bettercompute.core.inventories import NodeSpec
from bettercompute.kube.client import KubeClient
from bettercompute.operator.allocating import AllocationSync
from bettercompute.operator.claiming import ClaimTemplates
from bettercompute.operator.config import OperatorConfig
from bettercompute.operator.kueuesyncing import KueueChecks
from bettercompute.operator.nodecerts import NodeSigner
from bettercompute.operator.projecting import Objects, Projector
from bettercompute.operator.reserving import ReservationDoor
from bettercompute.service.clusters import ClusterService
from bettercompute.service.nodes import NodeService
from bettercompute.service.reservations import ReservationService

#: Reservation events handled at once (the operator's pool has 20 connections by default; the
#: reconciler, the projector and the HTTP API need some too).
ADMITTING_AT_ONCE = 12


@dataclass
class Runtime:
    config: OperatorConfig
    #: kopf's credentials, read again each time kopf logs in (``running.connection_info``).
    login: Callable[[], kopf.ConnectionInfo]
    service: ReservationService
    clusters: ClusterService
    nodes: NodeService
    kube: KubeClient
    objects: Objects
    projector: Projector
    #: A dra pool's Reservations' claim templates, and whether the cluster serves DRA.
    claims: ClaimTemplates
    allocations: AllocationSync
    door: ReservationDoor
    #: Answers node certificate requests and revokes node certificates.
    signer: NodeSigner
    #: The Kueue AdmissionCheck controller, when on and Kueue is served (else ``None``).
    kueue: KueueChecks | None = None
    #: The last NodeSpec written per node: a GPUNode heartbeat that changes nothing the placer
    #: reads must not bump the pool's inventory version (and empty the placement cache).
    applied_nodes: dict[str, NodeSpec] = field(default_factory=dict)
    #: Pools written since start, so a node is never written before its pool.
    applied_pools: set[str] = field(default_factory=set)
    _node_locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    #: How many Reservation events reach the store at once. A burst of applies (a thousand
    #: objects) otherwise asks the connection pool for more than it has, and the waits past
    #: an interactive request's bound are cut: here they queue in the process instead.
    admitting: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(ADMITTING_AT_ONCE)
    )
    #: Set once kopf was told to stop. A kopf cut short in its shutdown (a loaded machine
    #: passes the grace) leaves per-object timers running; each ends itself at its next call
    #: (``handlers._runtime``) instead of writing quotas and statuses through a closed client
    #: into a database that now serves someone else.
    stopped: bool = False

    def node_lock(self, name: str) -> asyncio.Lock:
        """Serialises the writes of one GPUNode (see ``handlers._apply_node``)."""
        return self._node_locks.setdefault(name, asyncio.Lock())
