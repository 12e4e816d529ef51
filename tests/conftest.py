"""Test-session plumbing: the real PostgreSQL plugin and the services under test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from bettercompute.core import ports
from bettercompute.iam import policies
from bettercompute.service.reservations import ReservationService
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database

pytest_plugins = [
    "tests.support.database",
    "tests.support.kubeserver",
    "tests.controlplane.plugin",
    "tests.support.leftovers",
]

ROOT = "root"


@pytest.fixture
def make_service(db: Database) -> Callable[..., ReservationService]:
    def make(policy: Any = None) -> ReservationService:
        engine = policy or policies.CedarPolicyEngine.from_text(policies.DEFAULT_POLICIES)
        return ReservationService(
            db=db, policy=engine, budget=DatabaseBudget(db), root_tenant_id=ROOT
        )

    return make


@pytest.fixture
def service(make_service: Callable[..., ReservationService]) -> ReservationService:
    return make_service()


def caller(identity: str = "alice", tenant: str = "acme") -> ports.Caller:
    return ports.Caller(identity_id=identity, tenant_id=tenant)
