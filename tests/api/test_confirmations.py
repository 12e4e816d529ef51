"""Delegated confirmation through the real app on a real socket: an agent acting for alice asks
for more than a ``@confirm`` policy lets it book alone, alice approves or denies over HTTP, and
the agent's retry with the same key is decided again.

Every path of the guide's loop (open, retry before approval, approve, placed; deny; deadline
passed on a late retry and on approval), and the attacks on it: the agent approving its own
request, another member approving, another tenant approving or listing (no existence leak), a
forged id, a different request under the same key. Answers are checked against their types.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter

from bettercompute.core import answers, ports
from bettercompute.iam import identities, policies
from bettercompute.store import inventory
from bettercompute.store.database import Database
from tests.api.conftest import TOKENS, Api, Serve, build_world, create_body
from tests.support.policies import CountingPolicy

#: Agents acting for a person book at most 4 GPUs without the person's yes.
HELD = """
@id("agents-confirm-big-requests") @confirm
forbid (principal, action == Compute::Action::"compute:reservations:create", resource)
when { principal.kind == "agent" && resource.gpuCount > 4 };
"""
AGENTS = {
    # acting for alice: its confirmations are alice's to decide
    "agent": ports.Caller(
        identity_id="agent", tenant_id="acme", kind="agent", on_behalf_of="alice"
    ),
    # an agent acting for nobody: refused outright, nobody to ask
    "lone-agent": ports.Caller(identity_id="lone-agent", tenant_id="acme", kind="agent"),
}
BIG = {"devices": [{"class": "gpu", "count": 6}], "duration": "2h"}


@pytest.fixture
async def api(db: Database, serve: Serve) -> Api:
    await build_world(db)
    tokens = {**TOKENS, **{f"token-of-{name}": who for name, who in AGENTS.items()}}
    return await serve(
        policy=CountingPolicy(policies.DEFAULT_POLICIES + HELD),
        authenticator=identities.StaticTokenAuthenticator(tokens),
    )


def big(key: str = "agent-train-1", **overrides: Any) -> dict[str, Any]:
    return create_body(**{**BIG, "idempotencyKey": key, **overrides})


async def ask(api: Api, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The agent's create, which must be held: the error's details."""
    err = await api.error(
        "reservations/create",
        body or big(),
        status=403,
        code="CONFIRMATION_REQUIRED",
        who="agent",
    )
    return dict(err["details"])


def decide_body(cid: str, tenant: str = "acme") -> dict[str, Any]:
    return {"tenantId": tenant, "confirmationId": cid}


async def events(api: Api, rid: str) -> list[str]:
    async with api.db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT type FROM outbox WHERE subject = %s ORDER BY id", (f"reservation/{rid}",)
            )
        ).fetchall()
    return [row["type"] for row in rows]


async def audit(api: Api, rid: str) -> list[tuple[str, str, dict[str, Any]]]:
    async with api.db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT action, outcome, context FROM audit_log WHERE resource_id = %s ORDER BY id",
                (rid,),
            )
        ).fetchall()
    return [(row["action"], row["outcome"], row["context"]) for row in rows]


async def test_the_whole_loop_asks_waits_and_places_after_the_persons_yes(api: Api):
    details = await ask(api)
    cid, rid, expires = details["confirmationId"], details["reservationId"], details["expiresAt"]
    assert cid.startswith("cnf_")
    assert rid.startswith("rsv_")
    async with api.db.connection() as conn:
        row = await (await conn.execute("SELECT epoch_ms(compute_now()) AS now")).fetchone()
    assert row is not None
    assert 0 < expires - row["now"] <= 30 * 60_000

    # Visible while it waits, with its condition, and nothing charged.
    shown = await api.ok(
        "reservations/get", {"tenantId": "acme", "reservationId": rid}, who="agent"
    )
    TypeAdapter(answers.Reservation).validate_python(shown, strict=True)
    assert shown["state"] == "awaiting-confirmation"
    assert shown["operation"] == {"id": rid, "state": "pending"}
    [condition] = shown["conditions"]
    assert (condition["type"], condition["reason"], condition["message"]) == (
        "ConfirmationRequired",
        cid,
        str(expires),
    )
    listed = await api.ok("reservations/list", {"tenantId": "acme"}, who="agent")
    assert [r["id"] for r in listed["items"]] == [rid]
    quota = await api.ok("quotas/get", {"tenantId": "acme"})
    assert quota["quotas"] == [{"resource": "gpu:H100", "limit": 16, "used": 0}]
    assert await events(api, rid) == ["reservation.awaiting-confirmation"]

    # A retry before the person answers: asked again, the same confirmation, no second one.
    assert await ask(api) == details
    assert await api.rows("confirmations") == 1

    # The person sees it; so does the agent that asked; nobody else.
    inbox = await api.ok("confirmations/list", {"tenantId": "acme"})
    TypeAdapter(answers.ConfirmationList).validate_python(inbox, strict=True)
    [item] = inbox["items"]
    assert (item["id"], item["state"], item["personId"], item["agentId"]) == (
        cid,
        "pending",
        "alice",
        "agent",
    )
    assert (item["reservationId"], item["expiresAt"], item["decidedBy"]) == (rid, expires, None)
    assert item["request"]["devices"] == [{"class": "gpu", "count": 6}]
    assert (await api.ok("confirmations/list", {"tenantId": "acme"}, who="agent")) == inbox
    assert (await api.ok("confirmations/list", {"tenantId": "acme"}, who="bob"))["items"] == []
    pending = {"tenantId": "acme", "state": "pending"}
    assert len((await api.ok("confirmations/list", pending))["items"]) == 1
    approved_only = {"tenantId": "acme", "state": "approved"}
    assert (await api.ok("confirmations/list", approved_only))["items"] == []

    # Alice approves (twice: the same answer), and the agent's retry is placed.
    approved = await api.ok("confirmations/approve", decide_body(cid))
    TypeAdapter(answers.Confirmation).validate_python(approved, strict=True)
    assert (approved["state"], approved["decidedBy"]) == ("approved", "alice")
    assert await api.ok("confirmations/approve", decide_body(cid)) == approved
    placed = await api.ok("reservations/create", big(), who="agent")
    assert (placed["id"], placed["state"], placed["conditions"]) == (rid, "placed", [])
    assert placed["ownerIdentityId"] == "agent"
    quota = await api.ok("quotas/get", {"tenantId": "acme"})
    assert quota["quotas"] == [{"resource": "gpu:H100", "limit": 16, "used": 6}]
    assert await events(api, rid) == ["reservation.awaiting-confirmation", "reservation.placed"]
    # The admission's audit row says whose yes let it through.
    rows = await audit(api, rid)
    admitted = [
        ctx for action, outcome, ctx in rows if (action, outcome) == (ports.CREATE, "placed")
    ]
    assert [(c["decision"], c["confirmationId"], c["approvedBy"]) for c in admitted] == [
        ("allow", cid, "alice")
    ]
    # Once placed, the same key answers the stored reservation (no third decision).
    decisions = api.policy.creates
    again = await api.ok("reservations/create", big(), who="agent")
    assert again["id"] == rid
    assert api.policy.creates == decisions
    # A no after the yes is refused.
    await api.error("confirmations/deny", decide_body(cid), status=409, code="INVALID_STATE")


async def test_each_step_is_audited(api: Api):
    details = await ask(api)
    cid, rid = details["confirmationId"], details["reservationId"]
    await ask(api)
    await api.ok("confirmations/approve", decide_body(cid))
    await api.ok("reservations/create", big(), who="agent")
    steps = [(a, o) for a, o, _ in await audit(api, rid) if a != "transition"]
    assert steps == [
        (ports.CREATE, "CONFIRMATION_REQUIRED"),
        (ports.CREATE, "CONFIRMATION_REQUIRED"),
        ("compute:confirmations:approve", "approved"),
        (ports.CREATE, "placed"),
    ]
    opened = (await audit(api, rid))[1][2]
    assert (opened["confirmationId"], opened["person"], opened["decision"]) == (
        cid,
        "alice",
        "deny",
    )


async def test_a_denial_denies_the_reservation_and_the_key_stays_refused(api: Api):
    details = await ask(api)
    cid, rid = details["confirmationId"], details["reservationId"]
    denied = await api.ok("confirmations/deny", decide_body(cid))
    assert (denied["state"], denied["decidedBy"]) == ("denied", "alice")
    assert await api.ok("confirmations/deny", decide_body(cid)) == denied
    shown = await api.ok(
        "reservations/get", {"tenantId": "acme", "reservationId": rid}, who="agent"
    )
    assert shown["state"] == "denied"
    assert shown["operation"]["error"]["code"] == "ACCESS_DENIED"
    await api.error("reservations/create", big(), status=403, code="ACCESS_DENIED", who="agent")
    await api.error("confirmations/approve", decide_body(cid), status=409, code="INVALID_STATE")
    quota = await api.ok("quotas/get", {"tenantId": "acme"})
    assert quota["quotas"][0]["used"] == 0


async def test_only_agents_acting_for_someone_are_asked(api: Api):
    # Small enough: the agent books alone.
    small = await api.ok(
        "reservations/create", big("small", devices=[{"class": "gpu", "count": 4}]), who="agent"
    )
    assert small["state"] == "placed"
    # A person asking for the same is not held (the policy is for agents).
    assert (await api.ok("reservations/create", big("mine")))["state"] == "placed"
    # An agent acting for nobody has nobody to ask: a plain refusal, the draft denied.
    err = await api.error(
        "reservations/create", big("lone"), status=403, code="ACCESS_DENIED", who="lone-agent"
    )
    assert err["details"]["reasons"] == ["agents-confirm-big-requests"]
    assert await api.rows("confirmations") == 0


async def test_attacks_on_the_approval_are_refused_alike(api: Api):
    cid = (await ask(api))["confirmationId"]
    forged = "cnf_01kforgedforgedforgedforged"

    async def refused(body: dict[str, Any], who: str, op: str = "approve") -> dict[str, Any]:
        return await api.error(
            f"confirmations/{op}", body, status=403, code="ACCESS_DENIED", who=who
        )

    # The agent cannot approve what it asked; another member of acme cannot either; and the
    # answer is the one a forged id gets, so nobody learns whether a confirmation exists.
    own = await refused(decide_body(cid), "agent")
    other_member = await refused(decide_body(cid), "bob")
    forged_err = await refused(decide_body(forged), "bob")
    assert own["message"].replace(cid, "?") == forged_err["message"].replace(forged, "?")
    assert other_member["message"].replace(cid, "?") == forged_err["message"].replace(forged, "?")
    await refused(decide_body(forged), "alice", "deny")
    # Another tenant: refused before anything is read, with its own tenant or acme's.
    outsider = await refused(decide_body(cid), "gina")
    outsider_forged = await refused(decide_body(forged), "gina")
    assert outsider["message"] == outsider_forged["message"]
    in_own_tenant = await refused(decide_body(cid, "globex"), "gina")
    forged_in_own = await refused(decide_body(forged, "globex"), "gina")
    assert in_own_tenant["message"].replace(cid, "?") == forged_in_own["message"].replace(
        forged, "?"
    )
    await api.error(
        "confirmations/list", {"tenantId": "acme"}, status=403, code="ACCESS_DENIED", who="gina"
    )
    assert (await api.ok("confirmations/list", {"tenantId": "globex"}, who="gina"))["items"] == []
    # None of it decided anything.
    [item] = (await api.ok("confirmations/list", {"tenantId": "acme"}))["items"]
    assert item["state"] == "pending"
    await api.error(
        "reservations/create", big(), status=403, code="CONFIRMATION_REQUIRED", who="agent"
    )


async def test_a_different_request_under_the_same_key_is_a_conflict(api: Api):
    details = await ask(api)
    await api.ok("confirmations/approve", decide_body(details["confirmationId"]))
    err = await api.error(
        "reservations/create", big(duration="3h"), status=409, code="CONFLICT", who="agent"
    )
    assert err["details"]["reservationId"] == details["reservationId"]
    # The approved request itself still goes through.
    assert (await api.ok("reservations/create", big(), who="agent"))["state"] == "placed"


async def test_a_late_retry_finds_the_request_expired(api: Api):
    details = await ask(api)
    rid, cid = details["reservationId"], details["confirmationId"]
    await api.ok("confirmations/approve", decide_body(cid))
    await inventory.advance_clock(api.db, seconds=31 * 60)
    err = await api.error(
        "reservations/create", big(), status=409, code="INVALID_STATE", who="agent"
    )
    assert (err["details"]["reservationId"], err["details"]["confirmationId"]) == (rid, cid)
    shown = await api.ok(
        "reservations/get", {"tenantId": "acme", "reservationId": rid}, who="agent"
    )
    assert (shown["state"], shown["conditions"]) == ("expired", [])
    assert shown["operation"]["error"]["code"] == "INVALID_STATE"
    assert await events(api, rid) == ["reservation.awaiting-confirmation", "reservation.expired"]
    # Asked again: the same answer, and nothing more happens.
    await api.error("reservations/create", big(), status=409, code="INVALID_STATE", who="agent")
    assert await events(api, rid) == ["reservation.awaiting-confirmation", "reservation.expired"]
    [item] = (await api.ok("confirmations/list", {"tenantId": "acme"}))["items"]
    assert item["state"] == "expired"
    quota = await api.ok("quotas/get", {"tenantId": "acme"})
    assert quota["quotas"][0]["used"] == 0


async def test_approving_past_the_deadline_is_refused_and_expires_it(api: Api):
    details = await ask(api)
    rid, cid = details["reservationId"], details["confirmationId"]
    await inventory.advance_clock(api.db, seconds=30 * 60 + 1)
    listed = await api.ok("confirmations/list", {"tenantId": "acme", "state": "expired"})
    assert [i["id"] for i in listed["items"]] == [cid]
    err = await api.error(
        "confirmations/approve", decide_body(cid), status=409, code="INVALID_STATE"
    )
    assert err["details"]["state"] == "expired"
    shown = await api.ok(
        "reservations/get", {"tenantId": "acme", "reservationId": rid}, who="agent"
    )
    assert shown["state"] == "expired"
    assert await events(api, rid) == ["reservation.awaiting-confirmation", "reservation.expired"]


async def test_the_deadline_can_be_set_shorter_never_longer(api: Api):
    import datetime as dt

    api.service.confirmation_deadline = dt.timedelta(minutes=5)
    details = await ask(api)
    async with api.db.connection() as conn:
        row = await (await conn.execute("SELECT epoch_ms(compute_now()) AS now")).fetchone()
    assert row is not None
    assert 0 < details["expiresAt"] - row["now"] <= 5 * 60_000
    from bettercompute.service.reservations import ReservationService

    longer = ReservationService(
        db=api.db,
        policy=api.policy,
        budget=api.service.budget,
        confirmation_deadline=dt.timedelta(hours=2),
    )
    assert longer.confirmation_deadline == dt.timedelta(minutes=30)
