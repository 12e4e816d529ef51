"""``pools.timeline`` and ``reservations.history`` over the real API: the compact answer, its
validation, and the attack the timeline must resist: another tenant's booking leaves the server
as a ``busy`` bar and nothing more (checked in the raw bytes of the answer)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter

from bettercompute.core import answers, timelines
from bettercompute.store.database import Database
from tests.api.conftest import POOL, Api, Serve, create_body
from tests.support.world import World

HOSTILE_KEY = "<script>alert('acme')</script>"
DAY = 86_400_000


@pytest.fixture
async def shared(db: Database, serve: Serve) -> Api:
    """acme's pool, offered to globex (both book in it) and to the root tenant."""
    await (
        World(db)
        .tenant("acme")
        .tenant("globex")
        .tenant("root", root=True)
        .pool(POOL, owner="acme", policy={"maxPending": "24h"})
        .offer(POOL, "globex")
        .offer(POOL, "root")
        .nodes(POOL, 2)
        .quota("acme", "gpu:H100", 16)
        .quota("globex", "gpu:H100", 8)
        .build()
    )
    return await serve()


async def book(api: Api) -> dict[str, dict[str, Any]]:
    made = {
        "acme": await api.ok("reservations/create", create_body(idempotencyKey=HOSTILE_KEY)),
        "acme-later": await api.ok(
            "reservations/create",
            create_body(
                idempotencyKey="acme-spot-next-week",
                devices=[{"class": "gpu", "count": 2}],
                start=(await api.ok("pools/timeline", {"poolId": POOL}))["now"] + 7 * DAY,
                spot=True,
                projectId="llm-secret-project",
            ),
        ),
        "globex": await api.ok(
            "reservations/create",
            create_body(
                tenantId="globex",
                idempotencyKey="globex-job",
                devices=[{"class": "gpu", "count": 2}],
            ),
            who="gina",
        ),
    }
    return made


async def test_the_answer_is_the_pool_its_devices_and_its_bookings(shared: Api):
    made = await book(shared)
    data = await shared.ok("pools/timeline", {"poolId": POOL})
    assert data["pool"] == {
        "id": POOL,
        "name": POOL,
        "sharing": "exclusive",
        "model": "H100",
        "horizon": data["now"] + timelines.MIN_HORIZON_MS,
    }
    assert data["from"] == data["now"] - DAY
    assert data["to"] == data["pool"]["horizon"]
    assert data["states"] == list(timelines.STATES)
    assert [n["name"] for n in data["nodes"]] == [f"{POOL}-node-00", f"{POOL}-node-01"]
    node = data["nodes"][0]
    assert [d["label"] for d in node["devices"]] == [f"GPU {i}" for i in range(8)]
    assert {d["kind"] for d in node["devices"]} == {"gpu"}
    assert node["healthy"] is True
    assert node["maintenance"] is False
    # One row per reservation and node; alice's two by name, gina's as busy.
    assert len(data["bookings"]) == 3
    by_ref = {row[5]: row for row in data["bookings"]}
    mine = {r["id"]: r for r in data["reservations"]}
    assert set(mine) == {made["acme"]["id"], made["acme-later"]["id"]}
    first = mine[made["acme"]["id"]]
    assert first["name"] == HOSTILE_KEY
    assert first["state"] == "placed"
    assert first["gpus"] == 4
    assert first["spot"] is False
    assert first["start"] == made["acme"]["during"]["start"]
    assert first["labels"] == {"binding": "hold"}
    later = mine[made["acme-later"]["id"]]
    assert later["spot"] is True
    assert later["labels"] == {"binding": "hold", "project": "llm-secret-project"}
    row = by_ref[data["reservations"].index(first)]
    assert row[2:5] == [first["start"], first["end"], timelines.STATES.index("placed")]
    assert len(row[1]) == 4
    spot_row = by_ref[data["reservations"].index(later)]
    assert spot_row[4] == timelines.STATES.index("spot")
    busy = by_ref[None]
    assert busy[4] == 0
    assert busy[2:4] == [made["globex"]["during"]["start"], made["globex"]["during"]["end"]]
    assert len(busy[1]) == 2
    assert data["pending"] == []
    # The answer is what its type (and so the OpenAPI document) names, closed.
    TypeAdapter(answers.Timeline).validate_python(data, strict=True, by_alias=True)


async def test_another_tenant_never_receives_ids_names_keys_or_labels(shared: Api):
    made = await book(shared)
    answer = await shared.call("pools/timeline", {"poolId": POOL}, who="gina")
    assert answer.status_code == 200, answer.text
    raw = answer.content
    acme = [made["acme"], made["acme-later"]]
    for secret in (
        *(r["id"] for r in acme),
        *(r["idempotencyKey"] for r in acme),
        "acme-spot-next-week",
        "alert(",
        "llm-secret-project",
        "alice",
        '"acme"',  # the tenant (the pool's own id contains the word)
    ):
        assert secret.encode() not in raw, secret
    data = answer.json()["data"]
    # acme's bookings are there, as busy bars: node, devices and time only.
    busy = [row for row in data["bookings"] if row[5] is None]
    assert len(busy) == 2
    assert {row[4] for row in busy} == {0}
    assert [r["id"] for r in data["reservations"]] == [made["globex"]["id"]]
    assert data["reservations"][0]["name"] == "globex-job"


async def test_members_of_the_root_tenant_see_every_booking_by_name(shared: Api):
    made = await book(shared)
    # The platform team's own view of a pool offered to it (the policy decides whether it may
    # read another tenant's: Cedar's defaults do not let it).
    data = await shared.ok("pools/timeline", {"poolId": POOL}, who="root-ops")
    assert {r["id"] for r in data["reservations"]} == {r["id"] for r in made.values()}
    assert all(row[5] is not None for row in data["bookings"])


async def test_a_released_reservations_past_booking_stays_as_ended(shared: Api):
    made = await shared.ok("reservations/create", create_body(start=None))
    await shared.ok("reservations/release", {"tenantId": "acme", "reservationId": made["id"]})
    data = await shared.ok("pools/timeline", {"poolId": POOL})
    (mine,) = data["reservations"]
    assert mine["state"] == "released"
    (row,) = data["bookings"]
    assert row[4] == timelines.STATES.index("ended")
    assert row[5] == 0


async def test_pending_reservations_of_the_caller_are_listed_beside_the_grid(shared: Api):
    whole = [{"class": "gpu", "count": 8}]
    await shared.ok("reservations/create", create_body(idempotencyKey="a", devices=whole))
    await shared.ok(
        "reservations/create",
        create_body(tenantId="globex", idempotencyKey="g", devices=whole),
        who="gina",
    )
    # The pool is full now: with maxPending, the next create waits in the queue.
    queued = await shared.ok("reservations/create", create_body(idempotencyKey="queued"))
    assert queued["state"] == "pending"
    data = await shared.ok("pools/timeline", {"poolId": POOL})
    assert data["pending"] == [
        {
            "id": queued["id"],
            "name": "queued",
            "state": "pending",
            "gpus": 4,
            "requestedStart": queued.get("requestedStart"),
        }
    ]
    gina = await shared.call("pools/timeline", {"poolId": POOL}, who="gina")
    assert gina.json()["data"]["pending"] == []
    assert queued["id"].encode() not in gina.content


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "poolId"),
        ({"poolId": POOL, "from": "yesterday"}, "from"),
        ({"poolId": POOL, "from": "2026-12-06"}, "from"),
        ({"poolId": POOL, "from": "2026-12-06T09:00:00"}, "from"),
        ({"poolId": POOL, "to": -1}, "to"),
        ({"poolId": POOL, "to": 1.5}, "to"),
        ({"poolId": POOL, "from": True}, "from"),
        ({"poolId": POOL, "from": 2_000_000_000_000, "to": 2_000_000_000_000}, "to"),
        ({"poolId": POOL, "from": 2_000_000_000_000, "to": 1_000_000_000_000}, "to"),
        ({"poolId": POOL, "from": 0, "to": 63 * DAY}, "to"),
        ({"poolId": POOL, "from": "2026-01-01T00:00:00Z", "to": "2026-03-05T00:00:00Z"}, "to"),
        ({"poolId": "../etc", "from": 0}, "poolId"),
        ({"poolId": POOL, "window": 1}, "window"),
    ],
)
async def test_bad_input_is_refused_naming_the_field(shared: Api, body: dict[str, Any], field: str):
    error = await shared.error("pools/timeline", body, status=400, code="INVALID_INPUT")
    assert error["details"]["field"] == field, error
    assert field in error["message"]


async def test_times_may_be_rfc_3339_and_the_window_is_what_was_asked(shared: Api):
    data = await shared.ok(
        "pools/timeline",
        {"poolId": POOL, "from": "2026-01-01T00:00:00Z", "to": "2026-01-03T12:00:00+02:00"},
    )
    assert data["from"] == 1_767_225_600_000
    assert data["to"] == 1_767_225_600_000 + 2 * DAY + 10 * 3_600_000
    sixty_two = await shared.ok("pools/timeline", {"poolId": POOL, "from": 0, "to": 62 * DAY})
    assert sixty_two["to"] - sixty_two["from"] == timelines.MAX_SPAN_MS


async def test_a_pool_the_tenant_cannot_see_is_not_found(db: Database, serve: Serve):
    await (
        World(db)
        .tenant("acme")
        .tenant("globex")
        .tenant("root", root=True)
        .pool(POOL, owner="acme")
        .pool("pool_globex", owner="globex")
        .nodes(POOL, 1)
        .nodes("pool_globex", 1)
        .build()
    )
    api = await serve()
    for pool in ("pool_globex", "pool_nowhere"):
        response = await api.call("pools/timeline", {"poolId": pool})
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "NOT_FOUND"
    # Another tenant's timeline is refused before anything is read.
    await api.error(
        "pools/timeline",
        {"tenantId": "globex", "poolId": "pool_globex"},
        status=403,
        code="ACCESS_DENIED",
    )


def test_device_labels_name_gpus_mig_instances_and_slots():
    atoms = [
        {"parent_gpu": "A", "kind": "mig", "profile": "1g.10gb"},
        {"parent_gpu": "A", "kind": "mig", "profile": "1g.10gb"},
        {"parent_gpu": "A", "kind": "mig", "profile": "3g.40gb"},
        {"parent_gpu": "B", "kind": "mig", "profile": "1g.10gb"},
        {"parent_gpu": "C", "kind": "slot", "profile": None},
        {"parent_gpu": "C", "kind": "slot", "profile": None},
        {"parent_gpu": "D", "kind": "gpu", "profile": None},
    ]
    assert timelines.device_labels(atoms) == [
        "GPU 0 · 1g.10gb #0",
        "GPU 0 · 1g.10gb #1",
        "GPU 0 · 3g.40gb #0",
        "GPU 1 · 1g.10gb #0",
        "GPU 2 · slot 0",
        "GPU 2 · slot 1",
        "GPU 3",
    ]


# --- reservations.history ---------------------------------------------------------------------


async def test_history_has_the_transitions_who_made_them_and_the_events(shared: Api):
    made = await shared.ok("reservations/create", create_body())
    await shared.ok("reservations/release", {"tenantId": "acme", "reservationId": made["id"]})
    data = await shared.ok("reservations/history", {"id": made["id"]})
    steps = [(i["from"], i["to"]) for i in data["items"]]
    assert steps[0] == ("draft", "placed")
    assert steps[-1][1] in ("released", "cancelled")
    assert data["items"][0]["actor"] == "alice"
    assert data["items"][-1]["actor"] == "alice"
    assert all(i["at"].endswith("Z") for i in data["items"])
    types = [e["type"] for e in data["events"]]
    assert types[0] == "reservation.placed"
    assert types[-1] in ("reservation.released", "reservation.cancelled")
    TypeAdapter(answers.History).validate_python(data, strict=True, by_alias=True)
    # A unique start of the id, as get takes it.
    short = await shared.ok("reservations/history", {"id": made["id"][:10]})
    assert short == data


async def test_history_is_not_found_for_another_tenant(shared: Api):
    made = await shared.ok("reservations/create", create_body())
    for body, who in (({"id": made["id"]}, "gina"), ({"id": "rsv_nothing"}, "alice")):
        response = await shared.call("reservations/history", body, who=who)
        assert response.status_code == 404, response.text
        assert made["id"].encode() not in response.content
    await shared.error(
        "reservations/history",
        {"tenantId": "acme", "id": made["id"]},
        status=403,
        code="ACCESS_DENIED",
        who="gina",
    )
