"""Writing a loaded dev configuration and its simulated nodes: the dev stack's world.

Why a module of its own: ``running`` wires processes together; this is the one place that turns
the YAML's world into writes, made through ``service.clusters`` as the operator makes a
cluster's. Every write is an upsert, so applying the same file at every start changes nothing,
and a restart on the same state dir keeps every reservation.

What it must never do: delete. A tenant, pool, offer or quota removed from the file stays in the
database (``--fresh`` starts over); only simulated nodes the stack no longer runs are marked
not ready and not connected, so nothing new is placed where no agent would bind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bettercompute.core import ports
from bettercompute.core.inventories import AtomSpec, NodeSpec
from bettercompute.dev.config import ConfigError, LoadedConfig
from bettercompute.service.clusters import ClusterService
from bettercompute.sim.inventories import SimNode


@dataclass(frozen=True)
class Applied:
    nodes: int
    #: Nodes of an earlier run that this one does not simulate.
    retired_nodes: tuple[str, ...]


async def apply(
    clusters: ClusterService, loaded: LoadedConfig, *, nodes: Sequence[SimNode]
) -> Applied:
    """Tenants, pools, offers, quotas, budgets, then the nodes; idempotent."""
    config = loaded.config
    root = next((t.id for t in config.tenants if t.root), None)
    existing_root = await clusters.root_tenant()
    if root is not None and existing_root is not None and existing_root != root:
        raise ConfigError(
            file=loaded.source,
            path="tenants",
            reason=f"the root tenant is {root!r} here but {existing_root!r} in the state dir's "
            "database; keep it, or start over with --fresh",
        )
    for tenant in config.tenants:
        await clusters.put_tenant(tenant.id, name=tenant.name, root=tenant.root)
    for pool in config.pools:
        await clusters.put_pool(pool)
    for offer in config.offers:
        await clusters.put_offer(offer)
    for quota in config.quotas:
        await clusters.put_quota(quota)
    for budget in config.budgets:
        await clusters.put_budget(
            budget.tenant, gpu_hours=budget.gpuHours, window_seconds=budget.windowSeconds
        )
    for node in nodes:
        await clusters.apply_node(node_spec(node))
    running = {n.id for n in nodes}
    retired = tuple(n for n in await clusters.node_ids() if n not in running)
    for node_id in retired:
        await clusters.node_gone(node_id)
    return Applied(nodes=len(nodes), retired_nodes=retired)


def node_spec(node: SimNode) -> NodeSpec:
    """A simulated node as the store's inventory takes it; its labels are the daemon's own."""
    return NodeSpec(
        id=node.id,
        name=node.name,
        pool_id=node.pool_id,
        atoms=[
            AtomSpec(
                device_id=a.device_id,
                kind=a.kind,
                parent_gpu=a.parent_gpu,
                profile=a.profile,
                numa_node=a.numa_node,
                nvlink_domain=a.nvlink_domain,
            )
            for a in node.atoms
        ],
        labels={key: (value, "system") for key, value in node.labels.items()},
        ready=True,
        connected=True,
        resources=dict(node.host),
    )


def callers(loaded: LoadedConfig) -> dict[str, ports.Caller]:
    """Token → caller, for ``iam.identities.StaticTokenAuthenticator``."""
    return {
        identity.token: ports.Caller(
            identity_id=identity.id,
            tenant_id=identity.tenant,
            kind=identity.kind,
            groups=tuple(identity.groups),
            # An agent acting for a person: its held requests wait for that person's yes.
            on_behalf_of=identity.actingFor,
        )
        for identity in loaded.config.identities
    }
