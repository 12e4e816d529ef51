"""A fluent builder for the world a test reserves in: tenants, pools, nodes, quotas.

``await World(db).tenant("acme").pool("pool_a", owner="acme").nodes("pool_a", 2).quota(
"acme", "gpu:H100", 16).build()`` writes it through the same store calls the product uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bettercompute.store import inventory
from bettercompute.store.database import Database


@dataclass
class _Pool:
    pool_id: str
    owner: str
    region: str
    model: str | None
    sharing: str
    replicas: int
    policy: dict[str, Any]


@dataclass
class World:
    db: Database
    _tenants: list[tuple[str, bool]] = field(default_factory=list)
    _pools: list[_Pool] = field(default_factory=list)
    _offers: list[tuple[str, str, str | None]] = field(default_factory=list)
    _quotas: list[tuple[str, str, int]] = field(default_factory=list)
    _nodes: list[inventory.NodeSpec] = field(default_factory=list)

    def tenant(self, tenant_id: str, *, root: bool = False) -> World:
        self._tenants.append((tenant_id, root))
        return self

    def pool(
        self,
        pool_id: str,
        *,
        owner: str,
        region: str = "eu-west-1",
        model: str | None = "H100",
        sharing: str = "exclusive",
        replicas: int = 1,
        policy: Mapping[str, Any] | None = None,
    ) -> World:
        self._pools.append(
            _Pool(pool_id, owner, region, model, sharing, replicas, dict(policy or {}))
        )
        return self

    def offer(
        self, pool_id: str, tenant_id: str, *, on_budget_exceeded: str | None = None
    ) -> World:
        self._offers.append((pool_id, tenant_id, on_budget_exceeded))
        return self

    def quota(self, tenant_id: str, resource: str, limit: int) -> World:
        self._quotas.append((tenant_id, resource, limit))
        return self

    def nodes(
        self,
        pool_id: str,
        count: int,
        *,
        gpus: int = 8,
        domains: int = 2,
        prefix: str = "",
        labels: Mapping[str, tuple[str, str]] | None = None,
        mig: Mapping[str, int] | None = None,
        slots: int = 0,
        host: Mapping[str, Any] | None = None,
    ) -> World:
        """``count`` nodes of ``gpus`` GPUs in ``domains`` NVLink domains. With ``mig``
        (profile → instances per GPU) the atoms are MIG instances; with ``slots`` they are
        that many time-slice slots per GPU. ``host`` is each node's host inventory (``vcpu``,
        ``memoryGiB``, huge pages, ``numaNodes``): its bookable rows."""
        start = len([n for n in self._nodes if n.pool_id == pool_id])
        for i in range(start, start + count):
            name = f"{prefix or pool_id}-node-{i:02d}"
            atoms: list[inventory.AtomSpec] = []
            per_domain = max(1, gpus // max(1, domains))
            for g in range(gpus):
                gpu = f"GPU-{name}-{g}"
                domain = f"{name}-nvl{g // per_domain}" if domains else None
                numa = g * 2 // gpus
                if mig:
                    for profile, n in mig.items():
                        for k in range(n):
                            atoms.append(
                                inventory.AtomSpec(
                                    device_id=f"MIG-{gpu}-{profile}-{k}",
                                    kind="mig",
                                    parent_gpu=gpu,
                                    profile=profile,
                                    numa_node=numa,
                                    nvlink_domain=domain,
                                )
                            )
                elif slots:
                    for k in range(slots):
                        atoms.append(
                            inventory.AtomSpec(
                                device_id=f"{gpu}::{k}",
                                kind="slot",
                                parent_gpu=gpu,
                                numa_node=numa,
                                nvlink_domain=domain,
                            )
                        )
                else:
                    atoms.append(
                        inventory.AtomSpec(device_id=gpu, numa_node=numa, nvlink_domain=domain)
                    )
            self._nodes.append(
                inventory.NodeSpec(
                    id=f"node_{name}",
                    name=name,
                    pool_id=pool_id,
                    atoms=atoms,
                    labels=dict(labels or {}),
                    resources=dict(host or {}),
                )
            )
        return self

    async def build(self) -> World:
        for tenant_id, root in self._tenants:
            await inventory.upsert_tenant(self.db, tenant_id=tenant_id, root=root)
        for p in self._pools:
            await inventory.upsert_pool(
                self.db,
                pool_id=p.pool_id,
                owner_tenant_id=p.owner,
                region=p.region,
                gpu_model=p.model,
                sharing_mode=p.sharing,
                replicas=p.replicas,
                policy=p.policy,
            )
        for pool_id, tenant_id, on_budget in self._offers:
            await inventory.set_offer(
                self.db, pool_id=pool_id, tenant_id=tenant_id, on_budget_exceeded=on_budget
            )
        for tenant_id, resource, limit in self._quotas:
            await inventory.set_quota(self.db, tenant_id=tenant_id, resource=resource, limit=limit)
        for node in self._nodes:
            await inventory.upsert_node(self.db, node)
        return self
