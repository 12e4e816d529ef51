"""Which refusals a person may lift: Cedar's ``@confirm`` on a ``forbid``, and the principal's
``actingFor`` attribute that such a policy tests (``iam.policies``, delegated confirmation)."""

from __future__ import annotations

import pytest

from bettercompute.core.errors import ComputeError
from bettercompute.core.ports import Caller, Decision
from bettercompute.iam.policies import DEFAULT_POLICIES, CedarPolicyEngine
from tests.unit.test_policies import gpu_attributes, request

HELD = """
@id("agents-confirm-big-requests") @confirm
forbid (principal, action == Compute::Action::"compute:reservations:create", resource)
when { principal has actingFor && resource.gpuCount > 4 };
"""
PLAIN = """
@id("never-more-than-8")
forbid (principal, action, resource is Compute::Reservation) when { resource.gpuCount > 8 };
"""
#: ``@confirm`` on a permit holds nothing: it must not make a refusal confirmable.
ODD_PERMIT = """
@id("odd") @confirm("yes")
permit (principal, action, resource) when { principal.tenant == "nobody" };
"""

AGENT = Caller(identity_id="agent", tenant_id="t1", kind="agent", on_behalf_of="alice")
ALICE = Caller(identity_id="alice", tenant_id="t1")


async def decide(text: str, caller: Caller, count: int) -> Decision:
    engine = CedarPolicyEngine.from_texts([DEFAULT_POLICIES, text], validate=True)
    return await engine.decide(
        request(gpu_attributes(count=count, hours_ms=3_600_000), principal=caller, owner="x")
    )


@pytest.mark.parametrize(
    ("policies", "who", "count", "allowed", "held"),
    [
        pytest.param(HELD, AGENT, 4, True, False, id="agent-small-allowed"),
        pytest.param(HELD, AGENT, 6, False, True, id="agent-big-held"),
        pytest.param(HELD, ALICE, 6, True, False, id="person-big-allowed"),
        pytest.param(HELD + PLAIN, AGENT, 6, False, True, id="only-the-held-forbid-applies"),
        pytest.param(HELD + PLAIN, AGENT, 9, False, False, id="a-plain-forbid-joins"),
        pytest.param(HELD + PLAIN, ALICE, 9, False, False, id="plain-forbid-for-a-person"),
        pytest.param(HELD + ODD_PERMIT, AGENT, 6, False, True, id="annotated-permit-is-no-hold"),
    ],
)
async def test_a_refusal_is_held_only_when_every_determining_forbid_is_marked(
    policies: str, who: Caller, count: int, allowed: bool, held: bool
) -> None:
    decision = await decide(policies, who, count)
    assert decision.allowed is allowed
    assert decision.held_for_confirmation is held


async def test_no_permit_is_never_held() -> None:
    """A refusal because nothing permits (another tenant's reservation) stays a refusal even
    when a marked forbid matches too: a person's yes must not stand in for a missing permit."""
    engine = CedarPolicyEngine.from_texts([DEFAULT_POLICIES, HELD], validate=True)
    small = await engine.decide(
        request(gpu_attributes(count=2), principal=AGENT, tenant="t2", owner="x")
    )
    assert not small.allowed
    assert small.reasons == ()
    assert not small.held_for_confirmation
    big = await engine.decide(
        request(gpu_attributes(count=6), principal=AGENT, tenant="t2", owner="x")
    )
    assert not big.allowed
    assert big.reasons == ("agents-confirm-big-requests",)
    assert not big.held_for_confirmation


async def test_acting_for_is_the_person_and_absent_otherwise() -> None:
    text = """
    @id("only-for-alice")
    permit (principal, action, resource) when { principal has actingFor &&
                                                principal.actingFor == "alice" };
    """
    engine = CedarPolicyEngine.from_text(text, validate=True)
    assert (await engine.decide(request(principal=AGENT))).allowed
    assert not (await engine.decide(request(principal=ALICE))).allowed
    bob_agent = Caller(identity_id="agent", tenant_id="t1", kind="agent", on_behalf_of="bob")
    assert not (await engine.decide(request(principal=bob_agent))).allowed


def test_a_misspelt_acting_for_is_a_load_error() -> None:

    with pytest.raises(ComputeError, match="actingfor"):
        CedarPolicyEngine.from_text(
            '@id("x") forbid (principal, action, resource) when { principal.actingfor == "a" };',
            validate=True,
        )
