"""pytest fixtures for the real control plane (a plugin listed in ``tests/conftest.py``).

- ``control_plane`` (session): etcd, kube-apiserver, controller-manager and scheduler on
  loopback (``tests/controlplane/cluster.py``), built first when the binary is missing or
  stale. Without Go the tests that use it skip, saying so; CI has Go, so none skip there.
- ``chart`` (session): the chart's CRDs, RBAC and webhook configurations applied.
- ``cluster`` (per test): both, and afterwards every object of our kinds, every namespace and
  node a test made, removed, so tests share one control plane but not its state.
- ``real_operator`` (per test): the real operator in this event loop, logged in with a
  TokenRequest token of the chart's operator service account: what that account may not do,
  the operator cannot do either.

What it must never do: start anything beyond loopback, or leave a process after the session.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from bettercompute.operator.config import OperatorConfig
from bettercompute.operator.running import Operator, started
from bettercompute.store.database import Database
from tests.controlplane import build, install
from tests.controlplane.cluster import ControlPlane, ControlPlaneError, free_port
from tests.support.policies import CountingPolicy


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    try:
        binary = build.build()
    except build.BuildError as e:
        pytest.skip(f"the real control plane cannot be built here: {e}")
    try:
        # The audit log shows who was allowed what (test_real_rbac.py).
        with ControlPlane.running(binary=binary, audit=True) as plane:
            yield plane
    except ControlPlaneError as e:
        pytest.fail(f"the real control plane did not start: {e}")


@pytest.fixture(scope="session")
def chart(control_plane: ControlPlane) -> install.Installed:
    return install.install(control_plane, webhook_port=free_port())


@dataclass
class Cluster:
    plane: ControlPlane
    chart: install.Installed


@pytest.fixture
def cluster(control_plane: ControlPlane, chart: install.Installed) -> Iterator[Cluster]:
    yield Cluster(plane=control_plane, chart=chart)
    install.empty(control_plane, chart)


def operator_config(cluster: Cluster, db: Database, **overrides: Any) -> OperatorConfig:
    """The operator as the chart runs it, under the chart's operator service account."""
    plane, chart = cluster.plane, cluster.chart
    token = plane.service_account_token(install.NAMESPACE, chart.operator_account)
    setting = chart.operator_setting
    settings: dict[str, Any] = {
        "database_url": db.dsn,
        "namespace": install.NAMESPACE,
        "http_host": "127.0.0.1",
        "http_port": 0,
        "metrics_host": "127.0.0.1",
        "metrics_port": 0,
        "webhook_host": "127.0.0.1",
        "webhook_port": chart.webhook_port,
        # The operator makes and renews its webhook certificate (the chart's default); the
        # API server reaches it at 127.0.0.1, so that is among the certificate's names.
        # The names of the chart's objects, exactly as its StatefulSet gives them.
        "webhook_secret": setting("BCD_WEBHOOK_SECRET"),
        "webhook_service": setting("BCD_WEBHOOK_SERVICE"),
        "webhook_extra_names": ("127.0.0.1",),
        "webhook_configurations": tuple(setting("BCD_WEBHOOK_CONFIGURATIONS").split(",")),
        "node_agent_service_account": setting("BCD_NODE_AGENT_SERVICE_ACCOUNT"),
        "node_ca_secret": setting("BCD_NODE_CA_SECRET"),
        "node_ca_create": setting("BCD_NODE_CA_CREATE") == "true",
        "node_certificates": setting("BCD_NODE_CERTIFICATES") == "true",
        "standalone": True,
        "api_server": plane.url,
        "api_token": token,
        "api_ca": plane.ca,
        "allocation_resync_s": 3600.0,
        "pool_status_s": 0.5,
    }
    settings.update(overrides)
    return OperatorConfig(**settings)


@pytest.fixture
def start_real_operator(
    cluster: Cluster, db: Database
) -> Callable[..., contextlib.AbstractAsyncContextManager[Operator]]:
    @contextlib.asynccontextmanager
    async def start(**overrides: Any) -> AsyncIterator[Operator]:
        config = operator_config(cluster, db, **overrides)
        async with started(config, db=db, policy=CountingPolicy()) as op:
            await op.ready.wait()
            yield op

    return start


@pytest.fixture
async def real_operator(
    start_real_operator: Callable[..., contextlib.AbstractAsyncContextManager[Operator]],
) -> AsyncIterator[Operator]:
    async with start_real_operator() as op:
        yield op
