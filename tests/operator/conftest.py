"""The real operator (kopf handlers, projector, allocation sync, reconciler, HTTP API) against
the Kubernetes API stand-in over HTTP and the test session's PostgreSQL.

``world`` applies a tenant namespace, a GPUPool and its GPUNodes and waits until the store
has them, so a scenario starts from "a cluster with GPUs" in one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from bettercompute.operator import nodeca
from bettercompute.operator.config import OperatorConfig
from bettercompute.operator.running import Operator, started
from bettercompute.store.database import Database
from tests.support import kubeworld, nodecerts
from tests.support.kubeobjects import GPUNODES, GPUPOOLS, GPUQUOTAS, SECRETS
from tests.support.kubeserver import TOKEN, KubeApi
from tests.support.policies import CountingPolicy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def operator_config(kube: KubeApi, db: Database, **overrides: Any) -> OperatorConfig:
    settings: dict[str, Any] = {
        "database_url": db.dsn,
        "namespace": kubeworld.OPERATOR_NAMESPACE,
        "http_host": "127.0.0.1",
        "http_port": 0,
        "metrics_host": "127.0.0.1",
        "metrics_port": 0,
        "webhook_host": "127.0.0.1",
        "webhook_port": free_port(),
        "standalone": True,
        "api_server": kube.url,
        "api_token": TOKEN,
        "allocation_resync_s": 3600.0,
        "pool_status_s": 0.5,
    }
    settings.update(overrides)
    return OperatorConfig(**settings)


async def trust_test_authority(kube: KubeApi, config: OperatorConfig) -> None:
    """The node-report authority's Secret holds the test authority, so nodes certified by
    ``tests.support.nodecerts`` are trusted, as a platform would provide its own CA."""
    manifest = nodeca.secret_manifest(
        nodecerts.AUTHORITY, name=config.node_ca_secret, namespace=config.namespace
    )
    if kube.stored(SECRETS, config.namespace, config.node_ca_secret) is None:
        await kube.create(manifest)


@pytest.fixture
def policy() -> CountingPolicy:
    return CountingPolicy()


@pytest.fixture
def start_operator(
    kube_api: KubeApi, db: Database, policy: CountingPolicy
) -> Callable[..., contextlib.AbstractAsyncContextManager[Operator]]:
    @contextlib.asynccontextmanager
    async def start(**overrides: Any) -> AsyncIterator[Operator]:
        config = operator_config(kube_api, db, **overrides)
        await trust_test_authority(kube_api, config)
        async with started(config, db=db, policy=policy) as op:
            await op.ready.wait()
            yield op

    return start


@pytest.fixture
async def operator(start_operator: Callable[..., Any]) -> AsyncIterator[Operator]:
    async with start_operator() as op:
        yield op


@dataclass
class World:
    kube: KubeApi
    db: Database
    nodes: list[str]


async def apply_world(
    kube: KubeApi,
    db: Database,
    *,
    pool: str = "h100",
    nodes: int = 1,
    gpus: int = 8,
    tenant_namespaces: dict[str, str] | None = None,
    quota: int = 64,
    **pool_options: Any,
) -> World:
    """Namespaces of tenants, a GPUPool with its GPUNodes, and a GPUQuota of ``quota`` GPUs of
    the pool's model for every tenant named."""
    tenants = tenant_namespaces or {"ml": "acme"}
    for ns, tenant in tenants.items():
        await kube.create(kubeworld.namespace(ns, tenant=tenant))
    await kube.create(kubeworld.namespace(kubeworld.OPERATOR_NAMESPACE, tenant=None))
    model = pool_options.get("model", "H100")
    named = sorted({t for t in tenants.values() if t} | {pool_options.get("owner", "acme")})
    for tenant in named:
        await kube.create(kubeworld.gpuquota(tenant, {f"gpu:{model}": quota}))
    await kube.create(kubeworld.gpupool(pool, **pool_options))
    names = [f"{pool}-node-{i}" for i in range(nodes)]
    for name in names:
        await kube.create(kubeworld.gpunode(name, pool=pool))
        await kube.patch(
            GPUNODES,
            None,
            name,
            {"status": kubeworld.gpunode_status(name, gpus=gpus)},
            status=True,
        )
    await kube.wait_for(
        GPUPOOLS,
        None,
        pool,
        # Both writers done: the pool handler (observedGeneration, Ready) and the node handlers
        # (nodes); they run concurrently, in either order.
        lambda o: (
            bool(o)
            and (o.get("status") or {}).get("nodes") == nodes
            and (o.get("status") or {}).get("observedGeneration") is not None
        ),
    )
    await _wait_atoms(db, count=nodes * gpus)
    for tenant in named:
        await kube.wait_for(GPUQUOTAS, None, tenant, lambda o: bool(o) and _ready(o) == "True")
    return World(kube=kube, db=db, nodes=names)


def _ready(obj: dict[str, Any]) -> str | None:
    for condition in (obj.get("status") or {}).get("conditions") or ():
        if condition.get("type") == "Ready":
            return str(condition.get("status"))
    return None


async def _wait_atoms(db: Database, *, count: int, within_s: float = 5.0) -> None:
    """The store has the nodes' atoms (written by the GPUNode handler)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        async with db.connection() as conn:
            row = await (
                await conn.execute(
                    "SELECT count(*) AS n FROM atoms a JOIN nodes n ON n.id = a.node_id"
                    " WHERE n.pool_id IS NOT NULL AND NOT a.retired"
                )
            ).fetchone()
        if row is not None and row["n"] >= count:
            return
        if loop.time() > deadline:
            pytest.fail(f"the store has {row['n'] if row else 0} atoms, expected {count}")
        await asyncio.sleep(0.02)


@pytest.fixture
async def world(kube_api: KubeApi, db: Database, operator: Operator) -> World:
    return await apply_world(kube_api, db)
