"""A live API where agents acting for alice are held for her confirmation: the real app on a
free port of 127.0.0.1 over the test PostgreSQL, Cedar's default policies plus one ``@confirm``
forbid (an agent may book at most 4 GPUs without alice's yes), and static tokens for alice, bob,
gina (another tenant) and the agent. Shared by the CLI and MCP tests of delegated confirmation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from bettercompute.api.app import make_app
from bettercompute.core import ports
from bettercompute.iam import identities, policies
from bettercompute.service.reservations import ReservationService
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database
from tests.cli.conftest import serve
from tests.support.world import World

HELD = """
@id("agents-confirm-big-requests") @confirm
forbid (principal, action == Compute::Action::"compute:reservations:create", resource)
when { principal has actingFor && resource.gpuCount > 4 };
"""
ALICE, BOB, GINA, AGENT = "alice-token", "bob-token", "gina-token", "agent-token"
CALLERS = {
    ALICE: ports.Caller(identity_id="alice", tenant_id="acme"),
    BOB: ports.Caller(identity_id="bob", tenant_id="acme"),
    GINA: ports.Caller(identity_id="gina", tenant_id="globex"),
    AGENT: ports.Caller(identity_id="agent", tenant_id="acme", kind="agent", on_behalf_of="alice"),
}


@dataclass(frozen=True)
class Confirming:
    url: str
    service: ReservationService


@asynccontextmanager
async def confirming_server(db: Database) -> AsyncIterator[Confirming]:
    """acme owns pool_a (2 nodes of 8 H100) with a quota of 16 H100; globex exists."""
    await (
        World(db)
        .tenant("acme")
        .tenant("globex")
        .tenant("root", root=True)
        .pool("pool_a", owner="acme")
        .nodes("pool_a", 2)
        .quota("acme", "gpu:H100", 16)
        .build()
    )
    service = ReservationService(
        db=db,
        policy=policies.CedarPolicyEngine.from_texts([policies.DEFAULT_POLICIES, HELD]),
        budget=DatabaseBudget(db),
        root_tenant_id="root",
    )
    runner, url = await serve(
        make_app(service=service, authenticator=identities.StaticTokenAuthenticator(CALLERS))
    )
    try:
        yield Confirming(url=url, service=service)
    finally:
        await runner.cleanup()
        await service.close()
