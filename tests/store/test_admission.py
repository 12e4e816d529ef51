"""The admission sequence against a real PostgreSQL: pre-check, drafts and the replay rules,
pool rules, policy decisions, quota all-or-nothing, budget, placement outcomes, get and list."""

from __future__ import annotations

from typing import Any

import pytest

from bettercompute.core.errors import ComputeError
from bettercompute.iam import policies
from bettercompute.service.reservations import ReservationService
from bettercompute.store import inventory
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.support.policies import CountingPolicy
from tests.support.world import World


def create_input(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "tenantId": "acme",
        "poolId": "pool_a",
        "devices": [{"class": "gpu", "count": 4, "topology": "nvlink-all"}],
        "duration": "8h",
        "idempotencyKey": "train-1",
    }
    body.update(overrides)
    return body


async def acme(db: Database, *, gpus: int = 16, nodes: int = 2, **pool: Any) -> World:
    return await (
        World(db)
        .tenant("acme")
        .tenant("globex")
        .tenant("root", root=True)
        .pool("pool_a", owner="acme", **pool)
        .nodes("pool_a", nodes)
        .quota("acme", "gpu:H100", gpus)
        .build()
    )


async def expect(code: str, awaitable: Any) -> ComputeError:
    with pytest.raises(ComputeError) as info:
        await awaitable
    assert info.value.code == code, info.value
    return info.value


# --- pre-check and validation ---------------------------------------------------------------


async def test_other_tenant_is_denied_before_any_read(db: Database, service: ReservationService):
    # No world at all: the answer must not depend on whether anything exists.
    err = await expect("ACCESS_DENIED", service.create(caller(tenant="globex"), create_input()))
    assert "acme" in err.message
    await acme(db)
    again = await expect("ACCESS_DENIED", service.create(caller(tenant="globex"), create_input()))
    assert again.to_dict() == err.to_dict()


ROOT_OPERATORS = (
    policies.DEFAULT_POLICIES
    + """
@id("root-operators")
permit (principal, action, resource) when { principal.tenant == "root" };
"""
)


async def test_root_tenant_passes_the_precheck(db: Database, make_service: Any):
    await acme(db)
    service = make_service(CountingPolicy(ROOT_OPERATORS))
    view = await service.create(caller("ops", tenant="root"), create_input())
    assert view["state"] == "placed"
    assert view["tenantId"] == "acme"
    assert view["ownerIdentityId"] == "ops"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (create_input(colour="blue"), "colour"),
        (create_input(devices=[{"class": "gpu", "count": 1, "extra": 1}]), "devices[0].extra"),
        (create_input(duration="8 hours"), "duration"),
        (create_input(duration=0), "duration"),
        (create_input(devices=[{"class": "mig", "count": 1}]), "devices[0]"),
        (create_input(binding="nodes"), "binding"),
        (create_input(idempotencyKey=""), "idempotencyKey"),
        (create_input(binding="node"), "body"),
    ],
)
async def test_invalid_input_names_the_field(
    db: Database, service: ReservationService, body: dict[str, Any], field: str
):
    err = await expect("INVALID_INPUT", service.create(caller(), body))
    assert err.details["field"] == field


async def test_instance_binding_is_unsupported(db: Database, service: ReservationService):
    await acme(db)
    await expect("UNSUPPORTED", service.create(caller(), create_input(binding="instance")))


async def test_unknown_or_unoffered_or_archived_pool_is_not_found(
    db: Database, service: ReservationService
):
    await acme(db)
    await World(db).pool("pool_g", owner="globex").nodes("pool_g", 1).build()
    await expect("NOT_FOUND", service.create(caller(), create_input(poolId="nope")))
    await expect("NOT_FOUND", service.create(caller(), create_input(poolId="pool_g")))
    await inventory.set_offer(db, pool_id="pool_g", tenant_id="acme")
    await inventory.set_quota(db, tenant_id="acme", resource="gpu:H100", limit=64)
    assert (await service.create(caller(), create_input(poolId="pool_g", idempotencyKey="g")))[
        "state"
    ] == "placed"
    await inventory.upsert_pool(
        db,
        pool_id="pool_g",
        owner_tenant_id="globex",
        region="eu-west-1",
        gpu_model="H100",
        archived=True,
    )
    await expect(
        "NOT_FOUND", service.create(caller(), create_input(poolId="pool_g", idempotencyKey="g2"))
    )


async def test_device_class_must_fit_the_sharing_mode(db: Database, service: ReservationService):
    await acme(db)
    err = await expect(
        "INVALID_INPUT",
        service.create(caller(), create_input(devices=[{"class": "slot", "count": 2}])),
    )
    assert err.details["field"] == "devices[0].class"


async def test_binding_rules_of_the_pool(db: Database, service: ReservationService):
    await acme(db)
    await (
        World(db)
        .pool("pool_k", owner="acme", policy={"kubernetes": True})
        .pool("pool_g", owner="globex", policy={"kubernetes": True})
        .offer("pool_g", "acme")
        .build()
    )
    err = await expect(
        "INVALID_INPUT", service.create(caller(), create_input(binding="kubernetes"))
    )
    assert "policy.kubernetes" in err.message
    err = await expect(
        "INVALID_INPUT",
        service.create(
            caller(), create_input(poolId="pool_g", binding="kubernetes", idempotencyKey="k2")
        ),
    )
    assert "owner" in err.message
    err = await expect(
        "INVALID_INPUT",
        service.create(
            caller(),
            create_input(binding="node", node={"profileId": "ubuntu"}, idempotencyKey="n1"),
        ),
    )
    assert "tenantRoot" in err.message
    # Nothing half-written: no draft, no idempotency row for refused inputs.
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT (SELECT count(*) FROM reservations) AS r,"
                " (SELECT count(*) FROM idempotency) AS i"
            )
        ).fetchone()
    assert row == {"r": 0, "i": 0}


# --- idempotency ----------------------------------------------------------------------------


async def test_same_request_returns_the_stored_reservation_without_a_decision(
    db: Database, make_service: Any
):
    await acme(db)
    policy = CountingPolicy()
    service = make_service(policy)
    first = await service.create(caller(), create_input(duration="2h"))
    same = await service.create(caller(), create_input(duration=7_200_000, binding="hold"))
    assert same["id"] == first["id"]
    assert same["version"] == first["version"]
    assert policy.creates == 1
    assert first["id"].startswith("rsv_")
    assert first["id"] == first["id"].lower()


async def test_different_request_with_the_same_key_conflicts(
    db: Database, service: ReservationService
):
    await acme(db)
    first = await service.create(caller(), create_input())
    err = await expect("CONFLICT", service.create(caller(), create_input(duration="9h")))
    assert err.details["reservationId"] == first["id"]


async def test_same_key_from_another_identity_is_another_row(
    db: Database, service: ReservationService
):
    await acme(db)
    a = await service.create(caller("alice"), create_input())
    b = await service.create(caller("bob"), create_input(duration="1h"))
    assert a["id"] != b["id"]
    assert b["ownerIdentityId"] == "bob"


async def test_refused_key_stays_access_denied(db: Database, make_service: Any):
    await acme(db)
    policy = CountingPolicy(
        policies.DEFAULT_POLICIES.replace(
            "when { principal.tenant == resource.tenant }",
            "when { principal.tenant == resource.tenant && resource.gpuCount <= 2 }",
        )
    )
    service = make_service(policy)
    await expect("ACCESS_DENIED", service.create(caller(), create_input()))
    await expect("ACCESS_DENIED", service.create(caller(), create_input()))
    # Even a different request on the refused key stays refused.
    await expect("ACCESS_DENIED", service.create(caller(), create_input(duration="1h")))
    assert policy.creates == 1
    async with db.connection() as conn:
        rows = await (await conn.execute("SELECT state FROM reservations")).fetchall()
        audit = await (
            await conn.execute(
                "SELECT outcome FROM audit_log WHERE action = 'compute:reservations:create'"
            )
        ).fetchall()
    assert rows == [{"state": "denied"}]
    assert audit == [{"outcome": "denied"}]


async def test_quota_exceeded_keeps_the_draft_and_is_decided_again(db: Database, make_service: Any):
    await acme(db, gpus=2)
    policy = CountingPolicy()
    service = make_service(policy)
    err = await expect("QUOTA_EXCEEDED", service.create(caller(), create_input()))
    assert err.details["quota"] == [{"resource": "gpu:H100", "requested": 4, "limit": 2, "used": 0}]
    # Drafts are internal.
    rid = err_id = None
    async with db.connection() as conn:
        row = await (await conn.execute("SELECT id, state FROM reservations")).fetchone()
    assert row is not None
    assert row["state"] == "draft"
    rid = row["id"]
    await expect("NOT_FOUND", service.get(caller(), {"tenantId": "acme", "reservationId": rid}))
    assert (await service.list(caller(), {"tenantId": "acme"}))["items"] == []
    assert (await inventory.quota(db, tenant_id="acme", resource="gpu:H100")) == (2, 0)
    await inventory.set_quota(db, tenant_id="acme", resource="gpu:H100", limit=8)
    view = await service.create(caller(), create_input())
    assert view["id"] == rid
    assert view["state"] == "placed"
    assert policy.creates == 2
    assert err_id is None


async def test_missing_quota_row_grants_nothing(db: Database, service: ReservationService):
    await World(db).tenant("acme").pool("pool_a", owner="acme").nodes("pool_a", 1).build()
    await expect("QUOTA_EXCEEDED", service.create(caller(), create_input()))


async def test_spend_limit_keeps_the_draft(db: Database, service: ReservationService):
    await acme(db, policy={"admission": {"budgetCheck": "meter"}})
    await inventory.set_budget(db, tenant_id="acme", gpu_hours=40, window_seconds=86_400)
    first = await service.create(caller(), create_input(idempotencyKey="a"))  # 32 GPU-hours
    assert first["state"] == "placed"
    err = await expect(
        "SPEND_LIMIT_REACHED", service.create(caller(), create_input(idempotencyKey="b"))
    )
    assert "resetsAt" in err.details
    await inventory.set_budget(db, tenant_id="acme", gpu_hours=100, window_seconds=86_400)
    assert (await service.create(caller(), create_input(idempotencyKey="b")))["state"] == "placed"


# --- placement outcomes ----------------------------------------------------------------------


async def test_no_fit_is_pending_unschedulable_and_keeps_its_charge(
    db: Database, service: ReservationService
):
    await acme(db, gpus=64)
    view = await service.create(
        caller(), create_input(devices=[{"class": "gpu", "count": 8, "topology": "nvlink-all"}])
    )
    assert view["state"] == "pending"
    assert view["operation"]["state"] == "pending"
    [cond] = view["conditions"]
    assert (cond["type"], cond["reason"]) == ("Unschedulable", "NoFit")
    assert "0 of 2 nodes fit" in cond["message"]
    assert (await inventory.quota(db, tenant_id="acme", resource="gpu:H100")) == (64, 8)


async def test_future_start_books_the_window_now(db: Database, service: ReservationService):
    await acme(db)
    async with db.connection() as conn:
        now = (await (await conn.execute("SELECT epoch_ms(compute_now()) AS n")).fetchone())["n"]
    start = now + 3 * 86_400_000
    view = await service.create(caller(), create_input(start=start, duration="1h"))
    assert view["state"] == "placed"
    assert view["during"] == {"start": start, "end": start + 3_600_000}


async def test_gang_members_land_on_distinct_nodes(db: Database, service: ReservationService):
    await acme(db, nodes=3, gpus=24)
    view = await service.create(
        caller(), create_input(gang={"size": 3}, devices=[{"class": "gpu", "count": 8}])
    )
    assert view["state"] == "placed"
    assert len(set(view["binding"]["nodeIds"])) == 3
    assert (await inventory.quota(db, tenant_id="acme", resource="gpu:H100")) == (24, 24)


async def test_mig_and_slots_book_from_matching_pools(db: Database, service: ReservationService):
    await (
        World(db)
        .tenant("acme")
        .pool("pool_m", owner="acme", sharing="mig")
        .nodes("pool_m", 1, mig={"1g.10gb": 7})
        .pool("pool_s", owner="acme", sharing="timeslice", replicas=4)
        .nodes("pool_s", 1, slots=4)
        .quota("acme", "gpuSlices:H100", 100)
        .build()
    )
    mig = await service.create(
        caller(),
        create_input(
            poolId="pool_m",
            idempotencyKey="m",
            devices=[{"class": "mig", "count": 3, "profile": "1g.10gb"}],
        ),
    )
    slot = await service.create(
        caller(),
        create_input(poolId="pool_s", idempotencyKey="s", devices=[{"class": "slot", "count": 2}]),
    )
    assert mig["state"] == slot["state"] == "placed"
    none = await service.create(
        caller(),
        create_input(
            poolId="pool_m",
            idempotencyKey="m2",
            devices=[{"class": "mig", "count": 1, "profile": "3g.40gb"}],
        ),
    )
    assert none["state"] == "pending"


# --- get and list -----------------------------------------------------------------------------


async def test_get_is_not_found_for_other_tenants_and_unknown_ids(
    db: Database, service: ReservationService
):
    await acme(db)
    await (
        World(db)
        .pool("pool_g", owner="globex")
        .nodes("pool_g", 1)
        .quota("globex", "gpu:H100", 8)
        .build()
    )
    mine = await service.create(caller(), create_input())
    theirs = await service.create(
        caller("gina", "globex"), create_input(tenantId="globex", poolId="pool_g")
    )
    assert (await service.get(caller(), {"tenantId": "acme", "reservationId": mine["id"]}))[
        "id"
    ] == mine["id"]
    a = await expect(
        "NOT_FOUND", service.get(caller(), {"tenantId": "acme", "reservationId": theirs["id"]})
    )
    b = await expect(
        "NOT_FOUND", service.get(caller(), {"tenantId": "acme", "reservationId": "rsv_nothing"})
    )
    assert a.to_dict() == b.to_dict()
    await expect(
        "ACCESS_DENIED",
        service.get(caller(), {"tenantId": "globex", "reservationId": theirs["id"]}),
    )


async def test_list_pages_newest_first_with_filters(db: Database, service: ReservationService):
    await acme(db, gpus=200, nodes=4)
    ids = []
    for i in range(7):
        view = await service.create(
            caller(), create_input(idempotencyKey=f"k{i}", devices=[{"class": "gpu", "count": 1}])
        )
        ids.append(view["id"])
    await service.create(
        caller("bob"), create_input(idempotencyKey="bob", devices=[{"class": "gpu", "count": 1}])
    )
    page1 = await service.list(caller(), {"tenantId": "acme", "limit": 3})
    page2 = await service.list(
        caller(), {"tenantId": "acme", "limit": 3, "cursor": page1["nextCursor"]}
    )
    page3 = await service.list(
        caller(), {"tenantId": "acme", "limit": 3, "cursor": page2["nextCursor"]}
    )
    got = [v["id"] for p in (page1, page2, page3) for v in p["items"]]
    assert got == list(reversed(ids))
    assert page3["nextCursor"] is None
    everyone = await service.list(caller(), {"tenantId": "acme", "scope": "all"})
    assert len(everyone["items"]) == 8
    await service.release(caller(), {"tenantId": "acme", "reservationId": ids[0]})
    released = await service.list(caller(), {"tenantId": "acme", "state": "released"})
    assert [v["id"] for v in released["items"]] == [ids[0]]
    assert (await service.list(caller(), {"tenantId": "acme", "poolId": "other"}))["items"] == []
    await expect("INVALID_INPUT", service.list(caller(), {"tenantId": "acme", "limit": 201}))
    await expect("INVALID_INPUT", service.list(caller(), {"tenantId": "acme", "state": "x"}))


async def test_events_and_audit_of_a_placement(db: Database, service: ReservationService):
    await acme(db)
    view = await service.create(caller(), create_input())
    async with db.connection() as conn:
        events = await (await conn.execute("SELECT type, subject, data FROM outbox")).fetchall()
        audit = await (
            await conn.execute(
                "SELECT actor, outcome, context FROM audit_log"
                " WHERE action = 'compute:reservations:create'"
            )
        ).fetchall()
        transitions = await (
            await conn.execute(
                "SELECT resource_id, outcome, context FROM audit_log WHERE action = 'transition'"
            )
        ).fetchall()
    [event] = events
    assert event["type"] == "reservation.placed"
    assert event["subject"] == f"reservation/{view['id']}"
    assert event["data"]["state"] == "placed"
    assert event["data"]["poolId"] == "pool_a"
    assert event["data"]["nodeIds"] == view["binding"]["nodeIds"]
    assert (event["data"]["start"], event["data"]["end"]) == (
        view["during"]["start"],
        view["during"]["end"],
    )
    [row] = audit
    assert row["actor"] == "alice"
    assert row["outcome"] == "placed"
    assert row["context"]["decision"] == "allow"
    assert row["context"]["attributes"]["gpuCount"] == 4
    assert row["context"]["attributes"]["durationHours"] == 8.0
    assert transitions == [
        {
            "resource_id": view["id"],
            "outcome": "placed",
            "context": {
                "from": "draft",
                "to": "placed",
                "version": view["version"],
                "releaseReason": None,
            },
        }
    ]


async def test_wait_returns_at_once_with_the_inline_placer(
    db: Database, service: ReservationService
):
    await acme(db)
    view = await service.create(caller(), create_input(wait={"timeoutMs": 60_000}))
    assert view["operation"]["state"] == "succeeded"


HEADLINE = """
@id("h100-at-most-8-for-72h-in-eu")
permit (
  principal,
  action == Compute::Action::"compute:reservations:create",
  resource is Compute::Reservation
)
when {
  principal.tenant == resource.tenant &&
  resource.gpuModel == "H100" && resource.gpuCount <= 8 &&
  resource.durationHours.lessThanOrEqual(decimal("72.0")) &&
  ["eu-west-1", "eu-central-1"].contains(resource.region)
};
"""


@pytest.mark.parametrize(
    ("change", "allowed"),
    [
        ({}, True),
        ({"duration": "72h"}, True),
        ({"duration": "72h4s"}, False),  # 72.001 h: policies see three decimals
        ({"devices": [{"class": "gpu", "count": 8}]}, True),
        ({"gang": {"size": 2}}, True),  # 4 × 2 = 8 GPUs
        ({"gang": {"size": 3}}, False),  # 12 GPUs
    ],
)
async def test_one_policy_bounds_model_count_duration_and_region(
    db: Database, make_service: Any, change: dict[str, Any], allowed: bool
):
    await acme(db, gpus=64, nodes=3)
    service = make_service(CountingPolicy(HEADLINE))
    body = create_input(**{"devices": [{"class": "gpu", "count": 4}], **change})
    if allowed:
        assert (await service.create(caller(), body))["state"] == "placed"
    else:
        await expect("ACCESS_DENIED", service.create(caller(), body))


async def test_the_same_policy_refuses_another_region(db: Database, make_service: Any):
    await acme(db, region="us-east-1")
    service = make_service(CountingPolicy(HEADLINE))
    await expect("ACCESS_DENIED", service.create(caller(), create_input()))


async def test_service_start_reads_the_root_tenant(db: Database):
    await acme(db)
    service = await ReservationService.start(
        db=db, policy=policies.AllowAllPolicyEngine(), budget=DatabaseBudget(db)
    )
    assert service.root_tenant_id == "root"
    view = await service.create(caller("ops", tenant="root"), create_input())
    assert view["state"] == "placed"
