"""Publishing this node's GPUs on its ``GPUNode``: the object the operator turns into devices.

Why it exists: the operator books only what a GPUNode's ``status`` says the node has
(docs/kubernetes.md), so the node must create its GPUNode (cluster-scoped, named like the node)
and keep its status true: the inventory with each GPU's health, NVLink domain, NUMA node and MIG
instances, the agent's capabilities, a heartbeat, the ``Ready`` condition and the
``HostLimitsEnforced`` condition: ``True`` when the node enforces host limits in cgroup v2 slices
(and so advertises ``devices.limits``), else ``False`` with the reason in its message, and the
``ForeignGpuExposure`` condition: ``True`` while something besides bcd can hand the node's GPUs
to pods (``foreign``, checked on each write), its message saying what; the ``GpusHealthy``
condition, naming each unhealthy GPU and why (a failed NVML read, a critical XID: ``health``);
and the ``NvidiaCdi`` condition, saying whether NVIDIA's CDI specs name every GPU (then the
agent also advertises the ``cdi.nvidia`` capability and Allocate asks for NVIDIA's devices
beside bcd's) or the node is env-only (``nvidiacdi``).

- ``gpunode_status`` builds the status from an ``inventory.Inventory`` (a pure function).
- ``NodePublisher.connect`` creates the object if it is missing (labels from ``--node-labels``,
  else copied from the Kubernetes Node, when the agent may read it) and merges explicitly given
  labels into an existing one; it retries with backoff, saying so, while the API cannot be
  reached.
- ``NodePublisher.run`` writes the status at once, again whenever the inventory changes (a GPU
  turning unhealthy, or healthy again, shows without a restart) and at least every
  ``heartbeat_s``. The inventory comes from ``Allocations``, which the converger keeps current
  from its own inventory watch, so NVML is polled once, not twice.
- ``NodePublisher.stopped`` marks the node not Ready (reason ``AgentStopped``) when the agent
  stops cleanly, so no new work is placed where nothing would bind it.

The status is written whole with a merge patch: fields the node cannot know are written as
``null``, which removes a value an earlier run wrote.

What it must never do: write ``spec`` or labels it was not given, or stop the agent because the
API is down (it logs once per distinct problem and tries again).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from bettercompute.deviceplugin.allocations import Allocations
from bettercompute.deviceplugin.foreign import ForeignExposure
from bettercompute.deviceplugin.inventory import Inventory, NvidiaCdi
from bettercompute.deviceplugin.nvidiacdi import describe
from bettercompute.deviceplugin.watching import Backoff
from bettercompute.kube import names, nodes, resources
from bettercompute.kube.client import KubeClient, KubeError
from bettercompute.kube.names import API_VERSION

log = logging.getLogger(__name__)

#: What this agent does (docs/kubernetes.md): the operator turns each into a system label.
#: Advertised only by an agent that enforces host limits (``agent`` drops it otherwise).
LIMITS_CAPABILITY = "devices.limits"
CAPABILITIES = ("binding.kubernetes", LIMITS_CAPABILITY)
#: Added by the inventory, not the configuration: NVIDIA's CDI specs name every GPU.
NVIDIA_CDI_CAPABILITY = "cdi.nvidia"
HEARTBEAT_SECONDS = 30.0
LIMITS_CONDITION = "HostLimitsEnforced"
HEALTH_CONDITION = "GpusHealthy"
NVIDIA_CDI_CONDITION = "NvidiaCdi"
STOP_TIMEOUT_SECONDS = 2.0


def rfc3339(epoch_s: float) -> str:
    moment = datetime.datetime.fromtimestamp(int(epoch_s), tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def gpunode_status(
    *,
    inventory: Inventory,
    capabilities: tuple[str, ...],
    heartbeat: str,
    ready: bool = True,
    reason: str = "AgentRunning",
    message: str = "",
    ready_since: str,
    limits_problem: str | None = None,
    foreign_exposure: str | None = None,
) -> dict[str, Any]:
    """The GPUNode ``status`` for ``inventory``, in the shared ``kube.nodes`` shape;
    ``foreign_exposure`` says what besides bcd hands the node's GPUs out (``None``: nothing)."""
    domain_of = {
        uuid: domain for domain, uuids in inventory.nvlink_domains.items() for uuid in uuids
    }
    numa = sorted({gpu.numa_node for gpu in inventory.gpus if gpu.numa_node is not None})
    has_host = inventory.vcpu is not None or inventory.memory_gib is not None
    status = nodes.GpuNodeStatus(
        inventory=nodes.NodeInventory(
            gpus=[
                nodes.GpuEntry(
                    uuid=gpu.uuid,
                    index=gpu.index,
                    model=gpu.model,
                    memoryMiB=gpu.memory_mib,
                    numaNode=gpu.numa_node,
                    nvlinkDomain=domain_of.get(gpu.uuid),
                    healthy=gpu.healthy,
                    # A MIG instance is as healthy as its GPU: NVML reports health per GPU.
                    mig=[
                        nodes.MigEntry(uuid=m.uuid, profile=m.profile, healthy=gpu.healthy)
                        for m in gpu.mig
                    ],
                )
                for gpu in inventory.gpus
            ],
            numaNodes=[nodes.NumaNode(id=n) for n in numa] or None,
            host=nodes.Host(
                vcpu=inventory.vcpu,
                memoryGiB=inventory.memory_gib,
                hugepages1Gi=inventory.hugepages_1gi,
                isolatedCpus=inventory.isolated_cpus,
            )
            if has_host
            else None,
        ),
        gpus=len(inventory.gpus),
        capabilities=[
            *capabilities,
            *([NVIDIA_CDI_CAPABILITY] if inventory.nvidia_cdi.complete else []),
        ],
        heartbeatTime=heartbeat,
        conditions=[
            nodes.Condition(
                type="Ready",
                status="True" if ready else "False",
                reason=reason,
                message=message,
                lastTransitionTime=ready_since,
            ),
            nodes.Condition(
                type=LIMITS_CONDITION,
                status="True" if limits_problem is None else "False",
                reason="CgroupV2" if limits_problem is None else "NotEnforced",
                message=limits_problem or "each hold with limits runs in its own cgroup v2 slice",
                lastTransitionTime=ready_since,
            ),
            nodes.Condition(
                type=names.FOREIGN_GPU_EXPOSURE,
                status="True" if foreign_exposure else "False",
                reason="ForeignPath" if foreign_exposure else "OnlyBcd",
                message=foreign_exposure or "only bcd hands this node's GPUs to pods",
                lastTransitionTime=ready_since,
            ),
            _health_condition(inventory, since=ready_since),
            _nvidia_cdi_condition(inventory.nvidia_cdi, since=ready_since),
        ],
    )
    return status.document()


def _health_condition(inventory: Inventory, *, since: str) -> nodes.Condition:
    sick = [gpu for gpu in inventory.gpus if not gpu.healthy]
    return nodes.Condition(
        type=HEALTH_CONDITION,
        status="False" if sick else "True",
        reason="Unhealthy" if sick else "AllHealthy",
        message="; ".join(
            f"GPU {gpu.index} ({gpu.uuid}): {gpu.problem or 'unhealthy'}" for gpu in sick
        )
        or "every GPU answers NVML and has reported no critical XID",
        lastTransitionTime=since,
    )


def _nvidia_cdi_condition(cdi: NvidiaCdi, *, since: str) -> nodes.Condition:
    if cdi.complete:
        reason = "NvidiaSpecs"
    elif cdi.found:
        reason = "Incomplete"
    else:
        reason = "EnvOnly"
    return nodes.Condition(
        type=NVIDIA_CDI_CONDITION,
        status="True" if cdi.complete else "False",
        reason=reason,
        message=describe(cdi),
        lastTransitionTime=since,
    )


def parse_labels(text: str) -> dict[str, str]:
    """``a=1,b=2`` → ``{"a": "1", "b": "2"}``; a ``ValueError`` names the bad entry."""
    labels: dict[str, str] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        key, separator, value = entry.partition("=")
        if not separator or not key.strip():
            raise ValueError(f"node label {entry!r} is not key=value")
        labels[key.strip()] = value.strip()
    return labels


class NodePublisher:
    """Keeps one node's GPUNode present and its status current."""

    def __init__(
        self,
        *,
        client: KubeClient,
        node_name: str,
        registry: CollectorRegistry,
        labels: Mapping[str, str] | None = None,
        capabilities: tuple[str, ...] = CAPABILITIES,
        heartbeat_s: float = HEARTBEAT_SECONDS,
        clock: Callable[[], float] = time.time,
        backoff: Backoff | None = None,
        limits_problem: str | None = None,
        foreign: ForeignExposure | None = None,
    ) -> None:
        self.client = client
        #: Looks for other paths to the node's GPUs on each publish (None: not looked for).
        self.foreign = foreign
        self._foreign_exposure: str | None = None
        #: Why the node does not enforce host limits (None: it does).
        self.limits_problem = limits_problem
        self.node_name = node_name
        self.labels = None if labels is None else dict(labels)
        self.capabilities = capabilities
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self.backoff = backoff or Backoff(initial_s=0.5, max_s=heartbeat_s)
        self._ready_since: str | None = None
        self._published: Inventory | None = None
        self._last_problem = ""
        self.published_at = Gauge(
            "bettercompute_node_gpunode_published_timestamp_seconds",
            "When this node's GPUNode status was last written (the heartbeat)",
            registry=registry,
        )
        self.failures = Counter(
            "bettercompute_node_gpunode_publish_failures",
            "GPUNode writes that failed (they are retried)",
            registry=registry,
        )

    # --- the object --------------------------------------------------------------------------

    async def connect(self) -> None:
        """Make sure the GPUNode exists, retrying (and saying so) until the API answers."""
        while True:
            try:
                await self._ensure()
            except KubeError as e:
                delay = self.backoff.next()
                # A refusal (RBAC, the own-node admission policy) is not an outage: say which,
                # so whoever reads the log looks at the token and the policy, not the network.
                refused = 400 <= e.status < 500 and e.status != 429
                log.warning(
                    "%s the Kubernetes API at %s to write GPUNode %s: %s; retrying in %.1fs",
                    "refused by" if refused else "cannot reach",
                    self.client.server,
                    self.node_name,
                    e,
                    delay,
                )
                await asyncio.sleep(delay)
                continue
            self.backoff.reset()
            return

    async def _ensure(self) -> None:
        found = await self.client.get(resources.GPUNODES, self.node_name)
        if found is None:
            labels = self.labels if self.labels is not None else await self._node_labels()
            body = {
                "apiVersion": API_VERSION,
                "kind": "GPUNode",
                "metadata": {"name": self.node_name, "labels": labels},
                "spec": {},
            }
            try:
                found = await self.client.create(resources.GPUNODES, body)
                log.info("created GPUNode %s with labels %s", self.node_name, labels)
            except KubeError as e:
                if e.status != 409:  # 409: created meanwhile (a previous run); same object
                    raise
                found = await self.client.get(resources.GPUNODES, self.node_name) or {}
        elif self.labels:
            current = (found.get("metadata") or {}).get("labels") or {}
            if any(current.get(k) != v for k, v in self.labels.items()):
                await self.client.patch(
                    resources.GPUNODES, self.node_name, {"metadata": {"labels": self.labels}}
                )
                log.info("GPUNode %s: labels %s merged in", self.node_name, self.labels)
        if self._ready_since is None:
            self._ready_since = _ready_since(found)

    async def _node_labels(self) -> dict[str, str]:
        """The Kubernetes Node's labels, or none when the agent may not read them."""
        try:
            node = await self.client.get(resources.NODES, self.node_name)
        except KubeError as e:
            if e.status in (401, 403):
                log.info(
                    "cannot read Node %s (%s); GPUNode created without labels: give "
                    "--node-labels, or let the agent get nodes",
                    self.node_name,
                    e.reason,
                )
                return {}
            raise
        if node is None:
            log.info("no Node %s; GPUNode created without labels", self.node_name)
            return {}
        labels = (node.get("metadata") or {}).get("labels") or {}
        return {str(k): str(v) for k, v in labels.items()}

    # --- the status ------------------------------------------------------------------------

    async def publish(self, inventory: Inventory) -> None:
        """Write the status for ``inventory`` now (re-creating the object if it was deleted)."""
        now = rfc3339(self.clock())
        if self._ready_since is None:
            self._ready_since = now
        if self.foreign is not None:
            exposure = await self.foreign.check()
            if exposure != self._foreign_exposure:
                if exposure:
                    log.warning("GPUNode %s: %s", self.node_name, exposure)
                else:
                    log.info("GPUNode %s: only bcd hands out its GPUs again", self.node_name)
            self._foreign_exposure = exposure
        status = gpunode_status(
            inventory=inventory,
            capabilities=self.capabilities,
            heartbeat=now,
            ready_since=self._ready_since,
            limits_problem=self.limits_problem,
            foreign_exposure=self._foreign_exposure,
        )
        if await self._write_status(status) is None:
            log.warning("GPUNode %s is gone; creating it again", self.node_name)
            await self._ensure()
            await self._write_status(status)
        if inventory != self._published:
            log.info(
                "GPUNode %s: %d GPUs published (%d healthy)",
                self.node_name,
                len(inventory.gpus),
                sum(1 for gpu in inventory.gpus if gpu.healthy),
            )
        self._published = inventory
        self.published_at.set(self.clock())

    async def run(self, *, allocations: Allocations) -> None:
        """Publish on every inventory change and every ``heartbeat_s``, until cancelled."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            version = allocations.version
            inventory = allocations.inventory
            if inventory is not None and (inventory != self._published or loop.time() >= due):
                try:
                    await self.publish(inventory)
                    due = loop.time() + self.heartbeat_s
                    self.backoff.reset()
                    self._last_problem = ""
                except KubeError as e:
                    self.failures.inc()
                    due = loop.time() + self.backoff.next()
                    self._say(f"cannot write GPUNode {self.node_name} status: {e}")
            timeout = max(0.0, due - loop.time()) if inventory is not None else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await allocations.wait_changed(after=version)

    async def stopped(self, *, timeout_s: float = STOP_TIMEOUT_SECONDS) -> None:
        """Mark the node not Ready, if the API answers within ``timeout_s``."""
        if self._published is None:
            return
        now = rfc3339(self.clock())
        status = gpunode_status(
            inventory=self._published,
            capabilities=self.capabilities,
            heartbeat=now,
            ready=False,
            reason="AgentStopped",
            message="the device plugin stopped",
            ready_since=now,
            limits_problem=self.limits_problem,
            foreign_exposure=self._foreign_exposure,
        )
        try:
            async with asyncio.timeout(timeout_s):
                await self._write_status(status)
        except (KubeError, TimeoutError) as e:
            log.warning("could not mark GPUNode %s not ready: %s", self.node_name, e)

    async def _write_status(self, status: Mapping[str, Any]) -> dict[str, Any] | None:
        """Merge ``status`` into the GPUNode's; ``None`` when the object is gone."""
        return await self.client.patch(
            resources.GPUNODES, self.node_name, {"status": dict(status)}, status=True
        )

    def _say(self, problem: str) -> None:
        if problem != self._last_problem:
            log.warning("%s (retrying)", problem)
            self._last_problem = problem


def _ready_since(found: Mapping[str, Any]) -> str | None:
    """The Ready condition's transition time when it already says True (a restart)."""
    for condition in (found.get("status") or {}).get("conditions") or ():
        if condition.get("type") == "Ready" and condition.get("status") == "True":
            since = condition.get("lastTransitionTime")
            return str(since) if since else None
    return None
