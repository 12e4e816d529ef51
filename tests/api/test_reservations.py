"""The reservation operations over HTTP: every documented answer of create (placed, pending,
the four replay rules, identity and tenant isolation), get, list, release, cancel, extend and
renew, through the real app on a real socket and the real PostgreSQL."""

from __future__ import annotations

import json

from bettercompute.iam import policies
from bettercompute.store import inventory
from tests.api.conftest import POOL, Api, Serve, build_world, create_body
from tests.support.policies import CountingPolicy

# The guide's curl example, byte for byte but for the placeholder pool id ("pool_01k…").
GUIDE_BODY = (
    '{"tenantId":"acme","poolId":"pool_01k…","devices":[{"class":"gpu","count":4,'
    '"topology":"nvlink-all"}],"duration":"8h","idempotencyKey":"train-2026-09-24"}'
)
HOUR_MS = 3_600_000
AT_MOST_72_HOURS = policies.DEFAULT_POLICIES.replace(
    "when { principal.tenant == resource.tenant }",
    "when { principal.tenant == resource.tenant"
    ' && resource.durationHours.lessThanOrEqual(decimal("72.0")) }',
    1,
)


def ref(rid: str) -> dict[str, str]:
    return {"tenantId": "acme", "reservationId": rid}


# --- create ----------------------------------------------------------------------------------


async def test_the_guides_curl_example_is_placed(api: Api):
    body = GUIDE_BODY.replace("pool_01k…", POOL).encode()
    response = await api.call(
        "reservations/create", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    data = response.json()["data"]
    assert data["id"].startswith("rsv_")
    assert data["state"] == "placed"
    assert data["tenantId"] == "acme"
    assert data["poolId"] == POOL
    assert data["ownerIdentityId"] == "alice"
    assert data["idempotencyKey"] == "train-2026-09-24"
    assert data["request"] == {
        "poolId": POOL,
        "devices": [{"class": "gpu", "count": 4, "topology": "nvlink-all"}],
        "duration": "28800000ms",
        "binding": "hold",
    }
    assert data["during"]["end"] - data["during"]["start"] == 8 * HOUR_MS
    assert data["operation"] == {"id": data["id"], "state": "succeeded"}
    assert await api.rows("bookings") == 4


async def test_the_guides_placeholder_pool_id_is_a_clear_input_error(api: Api):
    response = await api.call("reservations/create", content=GUIDE_BODY.encode())
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "INVALID_INPUT"
    assert error["details"]["field"] == "poolId"
    assert error["message"].startswith("poolId: ")


async def test_a_create_that_does_not_fit_is_pending_and_unschedulable(api: Api):
    await inventory.set_quota(api.db, tenant_id="acme", resource="gpu:H100", limit=64)
    await api.ok("reservations/create", create_body(devices=[{"class": "gpu", "count": 8}]))
    await api.ok(
        "reservations/create",
        create_body(devices=[{"class": "gpu", "count": 8}], idempotencyKey="second"),
    )
    data = await api.ok("reservations/create", create_body(idempotencyKey="third"))
    assert data["state"] == "pending"
    assert data["during"] is None
    assert [(c["type"], c["reason"]) for c in data["conditions"]] == [("Unschedulable", "NoFit")]
    assert "0 of 2 nodes fit" in data["conditions"][0]["message"]
    assert data["operation"]["state"] == "pending"


async def test_same_key_same_request_returns_the_stored_reservation_without_a_decision(api: Api):
    first = await api.ok("reservations/create", create_body())
    assert api.policy.creates == 1
    # Written differently (milliseconds, explicit default binding): the same request.
    again = await api.ok("reservations/create", create_body(duration=8 * HOUR_MS, binding="hold"))
    assert again == first
    assert api.policy.creates == 1
    assert await api.rows("reservations") == 1


async def test_a_draft_left_by_quota_exceeded_is_decided_again(api: Api):
    await inventory.set_quota(api.db, tenant_id="acme", resource="gpu:H100", limit=2)
    # 403 as Kubernetes answers a request over a ResourceQuota: not a 429 a generic client would
    # retry unchanged, and so no Retry-After.
    refused = await api.call("reservations/create", create_body())
    assert refused.status_code == 403, refused.text
    assert "Retry-After" not in refused.headers
    error = refused.json()["error"]
    assert error["code"] == "QUOTA_EXCEEDED"
    assert error["details"]["quota"] == [
        {"resource": "gpu:H100", "requested": 4, "limit": 2, "used": 0}
    ]
    assert "quota exceeded" in error["message"]
    # The draft is internal: get does not find it, list skips it.
    async with api.db.connection() as conn:
        row = await (await conn.execute("SELECT id, state FROM reservations")).fetchone()
    assert row is not None
    assert row["state"] == "draft"
    draft_id = row["id"]
    await api.error("reservations/get", ref(draft_id), status=404, code="NOT_FOUND")
    listed = await api.ok("reservations/list", {"tenantId": "acme", "scope": "all"})
    assert listed == {"items": [], "nextCursor": None}

    await inventory.set_quota(api.db, tenant_id="acme", resource="gpu:H100", limit=16)
    placed = await api.ok("reservations/create", create_body())
    assert placed["id"] == draft_id
    assert placed["state"] == "placed"
    assert api.policy.creates == 2


async def test_same_key_with_another_request_is_a_conflict_naming_the_reservation(api: Api):
    first = await api.ok("reservations/create", create_body())
    error = await api.error(
        "reservations/create", create_body(duration="9h"), status=409, code="CONFLICT"
    )
    assert error["details"]["reservationId"] == first["id"]


async def test_a_refused_key_stays_access_denied(db, serve: Serve):
    await build_world(db)
    api = await serve(policy=CountingPolicy(AT_MOST_72_HOURS))
    long = create_body(duration="100h")
    first = await api.error("reservations/create", long, status=403, code="ACCESS_DENIED")
    assert first["details"]["reservationId"].startswith("rsv_")
    assert api.policy.creates == 1
    again = await api.error("reservations/create", long, status=403, code="ACCESS_DENIED")
    assert again["details"]["reservationId"] == first["details"]["reservationId"]
    assert "stays refused" in again["message"]
    assert api.policy.creates == 1  # never decided again
    # Within the cap, another key is allowed.
    placed = await api.ok("reservations/create", create_body(idempotencyKey="short"))
    assert placed["state"] == "placed"


async def test_the_same_key_from_another_identity_is_a_row_of_its_own(api: Api):
    alice = await api.ok("reservations/create", create_body(), who="alice")
    bob = await api.ok("reservations/create", create_body(), who="bob")
    assert alice["id"] != bob["id"]
    assert (alice["ownerIdentityId"], bob["ownerIdentityId"]) == ("alice", "bob")
    assert await api.rows("reservations") == 2


async def test_another_tenant_is_denied_the_same_whether_or_not_it_exists(api: Api):
    existing = (await api.ok("reservations/create", create_body()))["id"]
    missing = "rsv_" + "a" * 52
    answers = []
    for rid in (existing, missing):
        response = await api.call("reservations/get", ref(rid), who="gina")
        assert response.status_code == 403
        answers.append(response.json())
    assert answers[0] == answers[1]
    assert answers[0]["error"]["code"] == "ACCESS_DENIED"
    for operation in ("release", "cancel", "renew"):
        response = await api.call(f"reservations/{operation}", ref(existing), who="gina")
        assert (response.status_code, response.json()) == (403, answers[0])
    create = await api.error(
        "reservations/create", create_body(), status=403, code="ACCESS_DENIED", who="gina"
    )
    assert create == answers[0]["error"]
    # Nothing of acme's changed.
    assert (await api.ok("reservations/get", ref(existing)))["state"] == "placed"


async def test_a_pool_the_tenant_cannot_see_is_not_found(api: Api):
    error = await api.error(
        "reservations/create",
        create_body(poolId="pool_globex"),
        status=404,
        code="NOT_FOUND",
    )
    assert error["message"] == "pool not found"


async def test_binding_instance_is_unsupported(api: Api):
    error = await api.error(
        "reservations/create", create_body(binding="instance"), status=400, code="UNSUPPORTED"
    )
    assert error["details"]["field"] == "binding"


async def test_root_members_pass_the_pre_check_and_meet_the_policy(api: Api):
    # The default policies only let a tenant's members act on its reservations.
    await api.error(
        "reservations/create", create_body(), status=403, code="ACCESS_DENIED", who="root-ops"
    )
    assert api.policy.creates == 1  # the pre-check passed: the policy decided


# --- get and list ----------------------------------------------------------------------------


async def test_get_answers_the_reservation_and_not_found_for_unknown_ids(api: Api):
    created = await api.ok("reservations/create", create_body())
    assert await api.ok("reservations/get", ref(created["id"])) == created
    await api.error("reservations/get", ref("rsv_nothing"), status=404, code="NOT_FOUND")


async def test_list_pages_newest_first_with_a_cursor(api: Api):
    one_gpu = [{"class": "gpu", "count": 1}]
    made = [
        (await api.ok("reservations/create", create_body(devices=one_gpu, idempotencyKey=f"k{i}")))[
            "id"
        ]
        for i in range(5)
    ]
    bobs = await api.ok(
        "reservations/create", create_body(devices=one_gpu, idempotencyKey="b"), who="bob"
    )
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        body = {"tenantId": "acme", "limit": 2, **({"cursor": cursor} if cursor else {})}
        page = await api.ok("reservations/list", body)
        pages += 1
        seen += [item["id"] for item in page["items"]]
        assert len(page["items"]) <= 2
        cursor = page["nextCursor"]
        if cursor is None:
            break
        assert cursor == page["items"][-1]["id"]
    assert pages == 3
    assert seen == list(reversed(made))  # scope 'mine' (the default): alice's only
    everyone = await api.ok("reservations/list", {"tenantId": "acme", "scope": "all"})
    assert [i["id"] for i in everyone["items"]] == [bobs["id"], *reversed(made)]
    placed = await api.ok(
        "reservations/list", {"tenantId": "acme", "state": "released", "poolId": POOL}
    )
    assert placed == {"items": [], "nextCursor": None}


async def test_list_refuses_bad_filters_and_other_tenants(api: Api):
    error = await api.error(
        "reservations/list", {"tenantId": "acme", "limit": 0}, status=400, code="INVALID_INPUT"
    )
    assert error["details"]["field"] == "limit"
    error = await api.error(
        "reservations/list",
        {"tenantId": "acme", "state": "sleeping"},
        status=400,
        code="INVALID_INPUT",
    )
    assert error["details"]["field"] == "state"
    await api.error(
        "reservations/list", {"tenantId": "acme"}, status=403, code="ACCESS_DENIED", who="gina"
    )


# --- release, cancel, extend, renew ------------------------------------------------------------


async def test_release_ends_a_reservation_and_a_second_release_changes_nothing(api: Api):
    rid = (await api.ok("reservations/create", create_body()))["id"]
    released = await api.ok("reservations/release", ref(rid))
    assert released["id"] == rid
    assert released["state"] == "released"
    assert released["releaseReason"] == "release"
    async with api.db.connection() as conn:
        quota = await (
            await conn.execute("SELECT used FROM quotas WHERE tenant_id = 'acme'")
        ).fetchone()
    assert quota == {"used": 0}
    again = await api.ok("reservations/release", ref(rid))
    assert again == released


async def test_cancel_withdraws_a_future_reservation_then_is_invalid_state(api: Api):
    async with api.db.connection() as conn:
        row = await (await conn.execute("SELECT epoch_ms(compute_now()) AS now")).fetchone()
    assert row is not None
    start = int(row["now"]) + HOUR_MS
    rid = (await api.ok("reservations/create", create_body(start=start)))["id"]
    assert await api.rows("bookings") == 4
    cancelled = await api.ok("reservations/cancel", ref(rid))
    assert cancelled["state"] == "cancelled"
    assert cancelled["during"] is None
    assert await api.rows("bookings") == 0
    error = await api.error("reservations/cancel", ref(rid), status=409, code="INVALID_STATE")
    assert error["message"]


async def test_extend_by_and_until(api: Api):
    created = await api.ok("reservations/create", create_body())
    rid, end = created["id"], created["during"]["end"]
    extended = await api.ok(
        "reservations/extend", {**ref(rid), "by": "2h", "idempotencyKey": "ext-1"}
    )
    assert extended["extended"] is True
    assert extended["reservation"]["during"]["end"] == end + 2 * HOUR_MS
    reached = await api.ok(
        "reservations/extend", {**ref(rid), "until": end, "idempotencyKey": "ext-2"}
    )
    assert reached == {"reservation": extended["reservation"], "extended": False}
    conflict = await api.error(
        "reservations/extend",
        {**ref(rid), "by": "3h", "idempotencyKey": "ext-1"},
        status=409,
        code="CONFLICT",
    )
    assert conflict["message"]
    both = await api.error(
        "reservations/extend",
        {**ref(rid), "by": "1h", "until": end, "idempotencyKey": "ext-3"},
        status=400,
        code="INVALID_INPUT",
    )
    assert "exactly one" in both["message"]


async def test_renew_moves_a_lease_and_is_invalid_state_without_one(api: Api):
    leased = await api.ok(
        "reservations/create", create_body(leaseSeconds=600, idempotencyKey="lease")
    )
    renewed = await api.ok("reservations/renew", ref(leased["id"]))
    assert renewed["leaseExpiresAt"] >= leased["leaseExpiresAt"]
    assert renewed["during"] == leased["during"]
    plain = await api.ok("reservations/create", create_body(idempotencyKey="plain"))
    error = await api.error(
        "reservations/renew", ref(plain["id"]), status=409, code="INVALID_STATE"
    )
    assert "lease" in error["message"]


async def test_answers_are_json_envelopes_with_a_request_id(api: Api):
    response = await api.call("reservations/create", create_body(), headers={"X-Request-Id": "r-1"})
    assert response.headers["X-Request-Id"] == "r-1"
    assert set(response.json()) == {"data"}
    error = await api.call("reservations/get", ref("rsv_x"))
    assert set(error.json()) == {"error"}
    assert set(error.json()["error"]) == {"code", "message", "details"}
    assert json.loads(error.text) == error.json()


# --- quotas.get ------------------------------------------------------------------------------


async def test_quotas_get_shows_each_limit_and_what_live_reservations_charged(api: Api):
    body = create_body(devices=[{"class": "gpu", "count": 3}], idempotencyKey="q-1")
    created = await api.ok("reservations/create", body)
    shown = await api.ok("quotas/get", {"tenantId": "acme"})
    assert shown == {
        "tenantId": "acme",
        "quotas": [{"resource": "gpu:H100", "limit": 16, "used": 3}],
    }
    await api.ok("reservations/release", ref(created["id"]))
    again = await api.ok("quotas/get", {"tenantId": "acme"})
    assert again["quotas"] == [{"resource": "gpu:H100", "limit": 16, "used": 0}]


async def test_quotas_get_of_another_tenant_is_refused_and_bad_input_names_the_field(api: Api):
    await api.error(
        "quotas/get", {"tenantId": "acme"}, status=403, code="ACCESS_DENIED", who="gina"
    )
    err = await api.error(
        "quotas/get", {"tenantId": "acme", "resource": "gpu"}, status=400, code="INVALID_INPUT"
    )
    assert err["details"]["field"] == "resource"
