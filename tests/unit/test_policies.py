"""The Cedar policy engine: the entity model policies see, decisions, reasons and errors.

The headline is the guide's example, "at most 8 H100s for at most 72 hours in these regions",
written as ONE Cedar policy over attributes built by ``core.attributes``, as the service will.
"""

from __future__ import annotations

import time
from typing import Any

import cedarpy
import pytest

from bettercompute.core.attributes import reservation_attributes
from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.core.ports import (
    ACTIONS,
    CREATE,
    EXTEND,
    READ,
    Caller,
    CallerKind,
    DecisionRequest,
    PoolRelation,
)
from bettercompute.iam.policies import (
    DEFAULT_POLICIES,
    RESERVATION_RESOURCE,
    TENANT_RESOURCE,
    AllowAllPolicyEngine,
    CedarPolicyEngine,
    DenyAllPolicyEngine,
)

HOUR_MS = 3_600_000

AT_MOST_8_H100_FOR_72H = """
@id("at-most-8-h100-for-72h")
permit (principal, action == Compute::Action::"compute:reservations:create", resource)
when {
  resource.gpuModel == "H100" &&
  resource.gpuCount <= 8 &&
  resource.durationHours.lessThanOrEqual(decimal("72.0")) &&
  ["eu-west-1", "us-east-1"].contains(resource.region) &&
  principal.tenant == resource.tenant
};
"""


def caller(
    tenant: str = "t1",
    identity: str = "alice",
    *,
    groups: tuple[str, ...] = (),
    kind: CallerKind = "user",
) -> Caller:
    return Caller(identity_id=identity, tenant_id=tenant, kind=kind, groups=groups)


def request(
    attributes: dict[str, Any] | None = None,
    *,
    principal: Caller | None = None,
    action: str = CREATE,
    tenant: str = "t1",
    resource_type: str = RESERVATION_RESOURCE,
    owner: str | None = None,
    pool: PoolRelation | None = None,
) -> DecisionRequest:
    return DecisionRequest(
        principal=principal or caller(),
        action=action,
        resource_type=resource_type,
        resource_id="rsv_1",
        tenant_id=tenant,
        owner_identity_id=owner,
        attributes=attributes or {},
        pool=pool,
    )


def gpu_attributes(
    *,
    count: int = 8,
    hours_ms: int = 72 * HOUR_MS,
    model: str = "H100",
    region: str = "eu-west-1",
    gang: int = 1,
) -> dict[str, Any]:
    body: dict[str, Any] = {"devices": [{"class": "gpu", "count": count}]}
    if gang > 1:
        body["gang"] = {"size": gang}
    return reservation_attributes(
        request=body, gpu_model=model, region=region, duration_ms=hours_ms
    )


# --- the headline: one policy, table-driven --------------------------------------------------


@pytest.mark.parametrize(
    ("attributes", "tenant", "allowed"),
    [
        pytest.param(gpu_attributes(), "t1", True, id="8xH100-72h-eu-west-1"),
        pytest.param(gpu_attributes(region="us-east-1"), "t1", True, id="other-listed-region"),
        pytest.param(gpu_attributes(count=1, hours_ms=HOUR_MS), "t1", True, id="1xH100-1h"),
        pytest.param(gpu_attributes(count=2, gang=4), "t1", True, id="gang-of-4x2-is-8"),
        pytest.param(gpu_attributes(count=9), "t1", False, id="9-gpus"),
        pytest.param(gpu_attributes(count=2, gang=5), "t1", False, id="gang-of-5x2-is-10"),
        pytest.param(gpu_attributes(hours_ms=72 * HOUR_MS + 3_600), "t1", False, id="72.001-hours"),
        pytest.param(gpu_attributes(region="ap-south-1"), "t1", False, id="unlisted-region"),
        pytest.param(gpu_attributes(model="A100"), "t1", False, id="other-model"),
        pytest.param(gpu_attributes(), "t2", False, id="other-tenant"),
    ],
)
async def test_one_policy_bounds_model_count_duration_region_and_tenant(
    attributes: dict[str, Any], tenant: str, allowed: bool
) -> None:
    engine = CedarPolicyEngine.from_text(AT_MOST_8_H100_FOR_72H)

    decision = await engine.decide(request(attributes, tenant=tenant))

    assert decision.allowed is allowed
    assert decision.errors == ()
    assert decision.reasons == (("at-most-8-h100-for-72h",) if allowed else ())


async def test_duration_hours_is_a_three_decimal_cedar_decimal() -> None:
    assert gpu_attributes(hours_ms=72 * HOUR_MS + 3_600)["durationHours"] == 72.001
    engine = CedarPolicyEngine.from_text(
        'permit (principal, action, resource) when { resource.durationHours == decimal("72.001") };'
    )

    assert (await engine.decide(request({"durationHours": 72.001}))).allowed
    # A whole number of hours is a decimal too, so one comparison fits every request.
    assert (await engine.decide(request({"durationHours": 72}))).errors == ()


async def test_bounded_extend_denies_once_the_total_passes_the_bound() -> None:
    engine = CedarPolicyEngine.from_text(
        """
        @id("bounded-extend")
        permit (principal, action == Compute::Action::"compute:reservations:extend", resource)
        when { resource.durationHours.lessThanOrEqual(decimal("24.0")) };
        """
    )

    def extended_to(hours: float) -> DecisionRequest:
        return request({"durationHours": hours}, action=EXTEND)

    assert (await engine.decide(extended_to(20.0))).allowed
    assert (await engine.decide(extended_to(24.0))).allowed
    denied = await engine.decide(extended_to(24.5))
    assert not denied.allowed
    assert denied.errors == ()


# --- the entity model: what policies can see -------------------------------------------------


@pytest.mark.parametrize(
    ("condition", "seen", "not_seen"),
    [
        ("resource.gpuSlices == 4", {"gpuSlices": 4}, {"gpuSlices": 0}),
        ("resource.gangSize == 4", {"gangSize": 4}, {"gangSize": 1}),
        ('resource.binding == "kubernetes"', {"binding": "kubernetes"}, {"binding": "hold"}),
        ("resource.spot", {"spot": True}, {"spot": False}),
        ("resource.renewable", {"renewable": True}, {"renewable": False}),
        (
            'resource has projectId && resource.projectId == "proj-1"',
            {"projectId": "proj-1"},
            {"projectId": None},
        ),
        ('resource.labels.contains("gpu-team")', {"labels": ["gpu-team"]}, {"labels": ["x"]}),
        ('principal.kind == "agent" && resource.gpuCount == 1', {"gpuCount": 1}, {"gpuCount": 2}),
    ],
)
async def test_request_attributes_are_visible_to_policies(
    condition: str, seen: dict[str, Any], not_seen: dict[str, Any]
) -> None:
    engine = CedarPolicyEngine.from_text(
        f"permit (principal, action, resource) when {{ {condition} }};"
    )
    agent = caller(kind="agent")

    allowed = await engine.decide(request(seen, principal=agent))
    denied = await engine.decide(request(not_seen, principal=agent))

    assert allowed.allowed, allowed.errors
    assert not denied.allowed
    assert denied.errors == ()


async def test_tenant_and_owner_come_from_the_request_not_from_attributes() -> None:
    engine = CedarPolicyEngine.from_text(
        "permit (principal, action, resource)"
        " when { principal.tenant == resource.tenant && resource.owner == principal.tenant };"
    )

    # An attribute named like a reserved one cannot claim the caller's tenant or be the owner.
    spoofed = request({"tenant": "t1", "owner": "t1"}, tenant="t2")
    decision = await engine.decide(spoofed)

    assert not decision.allowed
    owned = await engine.decide(request({"owner": "nobody"}, owner="t1"))
    assert owned.allowed


async def test_reservations_are_children_of_their_pool_and_pools_of_their_owner() -> None:
    engine = CedarPolicyEngine.from_text(
        """
        @id("pool-p1") permit (principal, action, resource in Compute::Pool::"p1");
        @id("provider-pools") permit (principal, action, resource in Compute::Tenant::"provider")
        when { Compute::Pool::"p9".region == "us-east-1" };
        """
    )
    p1 = PoolRelation(pool_id="p1", owner_tenant_id="t1", region="eu-west-1", gpu_model="H100")
    p2 = PoolRelation(pool_id="p2", owner_tenant_id="t1", region="eu-west-1", gpu_model="H100")
    p9 = PoolRelation(
        pool_id="p9", owner_tenant_id="provider", region="us-east-1", gpu_model="A100"
    )

    assert (await engine.decide(request(pool=p1))).reasons == ("pool-p1",)
    assert not (await engine.decide(request(pool=p2))).allowed
    assert not (await engine.decide(request())).allowed
    # The pool entity carries its attributes and hangs under the tenant that owns it.
    assert (await engine.decide(request(pool=p9))).reasons == ("provider-pools",)


async def test_groups_are_parents_of_the_principal() -> None:
    engine = CedarPolicyEngine.from_text(
        '@id("admins") permit (principal in Compute::Group::"admins", action, resource);'
    )

    admin = await engine.decide(request(principal=caller(groups=("ops", "admins"))))
    member = await engine.decide(request(principal=caller(groups=("ops",))))

    assert admin.allowed
    assert admin.reasons == ("admins",)
    assert not member.allowed


# --- loading ---------------------------------------------------------------------------------


def test_text_that_does_not_parse_is_invalid_input_with_cedars_message() -> None:
    text = "permit (principal, action, resource) when { resource.gpuCount <= "
    with pytest.raises(ValueError, match=r"\w") as cedar_error:
        cedarpy.PolicySet.from_str(text)

    with pytest.raises(ComputeError) as raised:
        CedarPolicyEngine.from_text(text)

    assert raised.value.code is ErrorCode.INVALID_INPUT
    assert str(cedar_error.value) in raised.value.message


def test_two_policies_with_one_id_are_invalid_input() -> None:
    with pytest.raises(ComputeError) as raised:
        CedarPolicyEngine.from_texts(
            [
                '@id("same") permit (principal, action, resource);',
                '@id("same") forbid (principal, action, resource);',
            ]
        )

    assert raised.value.code is ErrorCode.INVALID_INPUT
    assert "same" in raised.value.message


async def test_several_files_make_one_policy_set() -> None:
    engine = CedarPolicyEngine.from_texts(
        [
            AT_MOST_8_H100_FOR_72H,
            '@id("no-spot") forbid (principal, action, resource) when { resource.spot };',
        ]
    )

    assert (await engine.decide(request(gpu_attributes()))).allowed
    denied = await engine.decide(request({**gpu_attributes(), "spot": True}))
    assert not denied.allowed
    assert denied.reasons == ("no-spot",)


def test_the_headline_and_default_policies_match_the_schema() -> None:
    CedarPolicyEngine.from_texts([DEFAULT_POLICIES, AT_MOST_8_H100_FOR_72H], validate=True)


def test_validation_refuses_a_misspelt_attribute_naming_the_policy() -> None:
    with pytest.raises(ComputeError) as raised:
        CedarPolicyEngine.from_text(
            '@id("typo") permit (principal, action, resource is Compute::Reservation)'
            " when { resource.gpuCont <= 8 };",
            validate=True,
        )

    assert raised.value.code is ErrorCode.INVALID_INPUT
    assert "gpuCont" in raised.value.message
    assert "`typo`" in raised.value.message


# --- decisions: reasons and errors -----------------------------------------------------------


async def test_reasons_are_the_id_annotation_else_cedars_policy_id() -> None:
    engine = CedarPolicyEngine.from_text(
        """
        @id("named") permit (principal, action, resource);
        permit (principal, action, resource);
        """
    )

    decision = await engine.decide(request())

    assert sorted(decision.reasons) == ["named", "policy1"]


async def test_an_evaluation_error_is_reported_and_never_raised() -> None:
    reads_missing = (
        '@id("reads-missing") permit (principal, action, resource) when { resource.nope == 1 };'
    )

    alone = await CedarPolicyEngine.from_text(reads_missing).decide(request())
    assert not alone.allowed
    assert len(alone.errors) == 1
    assert "`reads-missing`" in alone.errors[0]

    # Cedar skips the failing policy; the others still decide.
    with_another = await CedarPolicyEngine.from_texts(
        [reads_missing, '@id("all") permit (principal, action, resource);']
    ).decide(request())
    assert with_another.allowed
    assert with_another.reasons == ("all",)
    assert with_another.errors


@pytest.mark.parametrize(
    "attributes",
    [
        pytest.param({"nested": {"a": 1}}, id="mapping"),
        pytest.param({"big": 2**63}, id="beyond-long"),
        pytest.param({"huge": 1e300}, id="beyond-decimal"),
        pytest.param({"durationHours": float("nan")}, id="nan"),
        pytest.param({"labels": ["a", None]}, id="none-in-a-set"),
    ],
)
async def test_an_attribute_without_a_cedar_form_denies_with_an_error(
    attributes: dict[str, Any],
) -> None:
    engine = CedarPolicyEngine.from_text("permit (principal, action, resource);")

    decision = await engine.decide(request(attributes))

    assert not decision.allowed
    assert decision.errors
    assert next(iter(attributes)) in decision.errors[0]


async def test_an_unknown_resource_type_denies_with_an_error() -> None:
    engine = CedarPolicyEngine.from_text("permit (principal, action, resource);")

    decision = await engine.decide(request(resource_type="gpu-pool"))

    assert not decision.allowed
    assert "gpu-pool" in decision.errors[0]


# --- the default policies and the null engines ----------------------------------------------


@pytest.mark.parametrize("action", ACTIONS)
async def test_default_policies_let_members_act_on_their_tenants_reservations(
    action: str,
) -> None:
    engine = CedarPolicyEngine.from_text(DEFAULT_POLICIES)

    own = await engine.decide(request(gpu_attributes(), action=action, tenant="t1"))
    other = await engine.decide(request(gpu_attributes(), action=action, tenant="t2"))

    assert own.allowed
    assert own.reasons == ("tenant-members-manage-own-reservations",)
    assert not other.allowed
    assert other.errors == ()


async def test_default_policies_let_members_list_their_own_tenant_only() -> None:
    engine = CedarPolicyEngine.from_text(DEFAULT_POLICIES)

    def listing(tenant: str) -> DecisionRequest:
        return request(action=READ, resource_type=TENANT_RESOURCE, tenant=tenant)

    own = await engine.decide(listing("t1"))
    other = await engine.decide(listing("t2"))

    assert own.allowed
    assert own.reasons == ("tenant-members-list-own-tenant",)
    assert not other.allowed
    # Listing is READ on a tenant, never CREATE on one.
    create_on_tenant = request(action=CREATE, resource_type=TENANT_RESOURCE, tenant="t1")
    assert not (await engine.decide(create_on_tenant)).allowed


async def test_null_engines() -> None:
    assert await AllowAllPolicyEngine().decide(request()) == await AllowAllPolicyEngine().decide(
        request(tenant="t2")
    )
    allow = await AllowAllPolicyEngine().decide(request())
    deny = await DenyAllPolicyEngine().decide(request())

    assert allow.allowed
    assert allow.reasons == ("allow-all",)
    assert not deny.allowed


async def test_decision_time_is_printed_not_asserted() -> None:
    engine = CedarPolicyEngine.from_texts([DEFAULT_POLICIES, AT_MOST_8_H100_FOR_72H])
    pool = PoolRelation(pool_id="p1", owner_tenant_id="t1", region="eu-west-1", gpu_model="H100")
    one = request(gpu_attributes(), principal=caller(groups=("ops",)), pool=pool, owner="alice")
    for _ in range(100):
        await engine.decide(one)

    rounds = 2_000
    started = time.perf_counter()
    for _ in range(rounds):
        await engine.decide(one)
    elapsed = time.perf_counter() - started

    print(f"\nCedarPolicyEngine.decide: {elapsed / rounds * 1e6:.0f} µs per decision")
