"""Host CPUs, memory and 1 GiB huge pages, booked with the GPUs on their node.

Against the real PostgreSQL of the test session, through ``ReservationService`` as the API and
the operator call it: the per-GPU share (from the hosts, or ``policy.perGpu``) resolved at the
draft and stored, the share as floor, quota for anything above it (a missing row grants none),
exact refunds, the host's rows as a hard limit (never sold twice, also under 200 racing
creates), the ``devices.limits`` capability, preview, and what the node is told (its limits).
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg.errors
import pytest

from bettercompute.core.errors import ComputeError, ErrorCode, StoreError
from bettercompute.core.pools import CAP_DEVICES_LIMITS
from bettercompute.service.reservations import ReservationService
from bettercompute.store import desired, inventory
from bettercompute.store.database import Database
from tests.conftest import caller
from tests.store.test_lifecycle import activate, allocations, get, node_again, run
from tests.support.world import World

H100 = "gpu:H100"
#: A host of 8 GPUs: 64 CPUs (62 bookable: the pool keeps 2), 512 GiB, 16 1-GiB huge pages,
#: two NUMA nodes of 32 CPUs and 256 GiB (GPUs 0-3 on the first, 4-7 on the second).
HOST = {
    "vcpu": 64,
    "memoryGiB": 512,
    "hugepages1Gi": 16,
    "numaNodes": [
        {"id": 0, "cpus": "0-31", "memoryGiB": 256},
        {"id": 1, "cpus": "32-63", "memoryGiB": 256},
    ],
}
CAPABLE = {CAP_DEVICES_LIMITS: ("true", "system")}


async def world(
    db: Database,
    *,
    nodes: int = 2,
    host: dict[str, Any] | None = HOST,
    labels: dict[str, tuple[str, str]] | None = None,
    policy: dict[str, Any] | None = None,
    quotas: dict[str, int] | None = None,
) -> None:
    built = (
        World(db)
        .tenant("acme")
        .pool("pool_h", owner="acme", policy=policy)
        .nodes(
            "pool_h",
            nodes,
            gpus=8,
            domains=2,
            host=host,
            labels=CAPABLE if labels is None else labels,
        )
        .quota("acme", H100, 1000)
    )
    for resource, limit in (quotas or {}).items():
        built = built.quota("acme", resource, limit)
    await built.build()


async def create(service: ReservationService, key: str, *, gpus: int = 1, **extra: Any) -> Any:
    return await service.create(
        caller(),
        {
            "tenantId": "acme",
            "poolId": "pool_h",
            "devices": [{"class": "gpu", "count": gpus}],
            "duration": "1h",
            "idempotencyKey": key,
            **extra,
        },
    )


async def used(db: Database, resource: str) -> int | None:
    found = await inventory.quota(db, tenant_id="acme", resource=resource)
    return None if found is None else found[1]


async def host_booked(db: Database, rid: str) -> list[tuple[str, int, int, int]]:
    async with db.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT node_id, host_vcpu, host_memory_gib, host_hugepages_1gi"
                " FROM allocations WHERE reservation_id = %s ORDER BY node_id",
                (rid,),
            )
        ).fetchall()
    return [tuple(r.values()) for r in rows]  # type: ignore[misc]


async def test_without_resources_a_request_books_the_pools_per_gpu_share(
    db: Database, service: ReservationService
) -> None:
    await world(db)
    view = await create(service, "share", gpus=2)
    assert view["state"] == "placed", view["conditions"]
    # (64 - 2 reserved) // 8 = 7 CPUs and 512 // 8 = 64 GiB per GPU; two GPUs' worth.
    assert view["request"]["resources"] == {"vcpu": 14, "memoryGiB": 128, "hugepages1Gi": 0}
    assert view["hostShare"] == {"vcpu": 14, "memoryGiB": 128}
    [(_, vcpu, memory, hugepages)] = await host_booked(db, view["id"])
    assert (vcpu, memory, hugepages) == (14, 128, 0)
    # The share rides on the GPUs: no vcpu or memoryGiB quota is needed, none is charged.
    assert await used(db, H100) == 2
    assert await used(db, "vcpu") is None


async def test_policy_per_gpu_wins_where_it_names_a_resource(
    db: Database, service: ReservationService
) -> None:
    await world(db, policy={"perGpu": {"vcpu": 4, "hugepages1Gi": 1}})
    view = await create(service, "per-gpu", gpus=2)
    assert view["hostShare"] == {"vcpu": 8, "memoryGiB": 128, "hugepages1Gi": 2}


async def test_the_share_is_the_floor(db: Database, service: ReservationService) -> None:
    await world(db)
    low = await create(service, "low", resources={"vcpu": 2})
    assert low["request"]["resources"] == {"vcpu": 7, "memoryGiB": 64, "hugepages1Gi": 0}
    empty = await create(service, "empty", resources={})
    assert empty["request"]["resources"] == {"vcpu": 7, "memoryGiB": 64, "hugepages1Gi": 0}


async def test_one_gpu_with_4000_vcpu_and_no_vcpu_quota_is_quota_exceeded(
    db: Database, service: ReservationService
) -> None:
    """The contradiction the issue found: one GPU's quota could take any host's CPUs."""
    await world(db)
    with pytest.raises(ComputeError) as raised:
        await create(service, "greedy", resources={"vcpu": 4000, "memoryGiB": 60_000})
    assert raised.value.code is ErrorCode.QUOTA_EXCEEDED
    assert "vcpu" in str(raised.value.to_dict())
    assert await used(db, H100) == 0  # all or nothing
    async with db.connection() as conn:
        row = await (await conn.execute("SELECT count(*) AS n FROM allocations")).fetchone()
    assert row == {"n": 0}


async def test_above_the_share_is_charged_and_refunded_exactly(
    db: Database, service: ReservationService
) -> None:
    await world(db, quotas={"vcpu": 100, "memoryGiB": 1000})
    view = await create(service, "more", resources={"vcpu": 20, "memoryGiB": 64, "hugepages1Gi": 4})
    assert view["state"] == "placed", view["conditions"]
    assert view["hostShare"] == {"vcpu": 7, "memoryGiB": 64}
    # 20 - 7 CPUs; 64 + 4 huge pages - 64 GiB of memory.
    assert (await used(db, "vcpu"), await used(db, "memoryGiB")) == (13, 4)
    await service.release(caller(), {"tenantId": "acme", "reservationId": view["id"]})
    assert (await used(db, "vcpu"), await used(db, "memoryGiB"), await used(db, H100)) == (0, 0, 0)


async def test_a_hosts_cpus_are_never_sold_twice(db: Database, service: ReservationService) -> None:
    await world(db, quotas={"vcpu": 10_000})
    first = await create(service, "a", resources={"vcpu": 40})
    second = await create(service, "b", resources={"vcpu": 40})
    assert first["state"] == second["state"] == "placed"
    nodes = {(await host_booked(db, r["id"]))[0][0] for r in (first, second)}
    assert len(nodes) == 2  # 62 bookable CPUs per host: the second goes elsewhere
    third = await create(service, "c", resources={"vcpu": 40})
    assert third["state"] == "pending"
    [unschedulable] = third["conditions"]
    assert "2 too little free host vcpu" in unschedulable["message"]
    # Freed CPUs are bookable again.
    await service.release(caller(), {"tenantId": "acme", "reservationId": first["id"]})
    await run(db)
    assert (await get(service, third["id"]))["state"] in ("placed", "binding")


async def test_200_racing_creates_never_over_commit_a_host(
    db: Database, service: ReservationService
) -> None:
    await world(db, quotas={"vcpu": 100_000})

    async def one(i: int) -> str:
        try:
            return str((await create(service, f"race-{i}", resources={"vcpu": 10}))["state"])
        except ComputeError as e:
            return e.code.value
        except StoreError:  # what the API answers 503 UNAVAILABLE
            return "UNAVAILABLE"

    # A task group, not gather: should one create fail unexpectedly, the others are cancelled
    # with it instead of running on into the next test.
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(one(i)) for i in range(200)]
    outcomes = [t.result() for t in tasks]
    # 62 bookable CPUs per host, 10 each: 6 per host, 12 in all, though 16 GPUs are free.
    assert outcomes.count("placed") == 12, sorted(set(outcomes))
    # Each create is an interactive request, bounded as one: on a busy machine some of 200 at
    # once wait longer than that for a pooled connection and are shed (503 UNAVAILABLE, the
    # client retries); none is half-done, and the rest still fill exactly the 12 places.
    assert set(outcomes) <= {"placed", "pending", "UNAVAILABLE"}, sorted(set(outcomes))
    async with db.connection() as conn:
        per_node = await (
            await conn.execute(
                "SELECT node_id, sum(host_vcpu) AS vcpu FROM allocations GROUP BY node_id"
            )
        ).fetchall()
    assert sorted(r["vcpu"] for r in per_node) == [60, 60]


async def test_only_nodes_that_enforce_limits_take_host_bookings(
    db: Database, service: ReservationService
) -> None:
    # An operator label of the capability's name does not count: only the system's does.
    await world(db, labels={CAP_DEVICES_LIMITS: ("true", "operator")})
    view = await create(service, "uncapable")
    assert view["state"] == "pending"
    [unschedulable] = view["conditions"]
    assert f"needs label {CAP_DEVICES_LIMITS}=*" in unschedulable["message"]


async def test_a_pool_whose_hosts_have_no_rows_books_none(
    db: Database, service: ReservationService
) -> None:
    await world(db, host=None, labels={}, quotas={"vcpu": 10})
    view = await create(service, "plain")
    assert view["state"] == "placed"
    assert "resources" not in view["request"]
    assert view["hostShare"] == {}
    # Asked for explicitly (and charged: an empty share covers nothing), there is nothing to
    # book them on.
    asked = await create(service, "asked", resources={"vcpu": 1})
    assert asked["state"] == "pending"
    assert await used(db, "vcpu") == 1


async def test_preview_books_the_same_host_resources_as_create(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, quotas={"vcpu": 10_000})
    body = {"tenantId": "acme", "poolId": "pool_h", "duration": "1h"}
    fits = await service.preview(caller(), {**body, "devices": [{"class": "gpu", "count": 1}]})
    assert fits["fits"] is True
    assert fits["resources"] == {"vcpu": 7, "memoryGiB": 64}
    assert fits["hostShare"] == {"vcpu": 7, "memoryGiB": 64}
    await create(service, "big", resources={"vcpu": 60})
    full = await service.preview(
        caller(), {**body, "devices": [{"class": "gpu", "count": 1}], "resources": {"vcpu": 3}}
    )
    assert full["fits"] is False
    assert full["rejected"] == {"capacity": 1}
    # And the create the preview describes does not fit either.
    assert (await create(service, "after", resources={"vcpu": 3}))["state"] == "pending"


async def test_the_node_is_told_its_limits_and_a_cpuset_near_its_devices(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, quotas={"vcpu": 10_000, "memoryGiB": 10_000})
    view = await create(service, "limits", gpus=2, resources={"vcpu": 16, "hugepages1Gi": 2})
    await activate(service, db, view["id"])
    [alloc] = await allocations(db, view["id"])
    [wanted] = await desired.for_node(db, node_id=alloc["node_id"])
    limits = wanted["limits"]
    assert limits["cpuMillis"] == 16_000
    assert limits["memoryBytes"] == 128 * 2**30
    assert limits["hugepages1Gi"] == 2
    # Two GPUs of NUMA node 0: CPUs 0-31 less the two the host keeps, and its memory.
    assert limits["cpus"] == "2-31"
    assert limits["mems"] == "0"


async def test_the_guard_refuses_what_the_placer_would_never_book(
    db: Database, service: ReservationService
) -> None:
    """The last word, as the bookings' EXCLUDE is for devices: a host booking past the node's
    rows, written by hand around the placer, is refused and rolls back."""
    await world(db, nodes=1, quotas={"vcpu": 10_000})
    view = await create(service, "first", resources={"vcpu": 40})
    [alloc] = await allocations(db, view["id"])

    async def overbook() -> None:
        # 65 CPUs on a host of 64: what no placement would write.
        async with db.transaction() as conn:
            await conn.execute(
                "UPDATE bookings SET host_vcpu = 65 WHERE allocation_id = %s AND host_vcpu > 0",
                (alloc["id"],),
            )
            await conn.execute(
                "SELECT bc_check_hosts(pool_id, ARRAY[%s], lower(during), upper(during))"
                " FROM reservations WHERE id = %s",
                (alloc["node_id"], view["id"]),
            )

    with pytest.raises(psycopg.errors.ExclusionViolation, match="would give more than it has"):
        await overbook()
    assert (await host_booked(db, view["id"]))[0][1] == 40


async def test_an_extension_needs_the_hosts_cpus_for_the_added_time(
    db: Database, service: ReservationService
) -> None:
    await world(db, nodes=1, quotas={"vcpu": 10_000})
    first = await create(service, "now", resources={"vcpu": 40})
    # Another books 40 CPUs from when the first ends: its GPUs are free then, the CPUs not.
    later = await create(service, "later", resources={"vcpu": 40}, start=first["during"]["end"])
    assert later["state"] == "placed"
    assert (await host_booked(db, later["id"]))[0][0] == (await host_booked(db, first["id"]))[0][0]
    answer = await service.extend(
        caller(),
        {"tenantId": "acme", "reservationId": first["id"], "by": "1h", "idempotencyKey": "more"},
    )
    assert answer["extended"] is False
    assert answer["reservation"]["during"] == first["during"]
    # Without the CPUs in the way it extends.
    await service.release(caller(), {"tenantId": "acme", "reservationId": later["id"]})
    again = await service.extend(
        caller(),
        {"tenantId": "acme", "reservationId": first["id"], "by": "1h", "idempotencyKey": "again"},
    )
    assert again["extended"] is True


async def test_policies_see_the_host_resources_summed_over_a_gang(
    db: Database, service: ReservationService
) -> None:
    await world(db, quotas={"vcpu": 100})
    view = await create(service, "gang", resources={"vcpu": 10}, gang={"size": 2})
    assert view["state"] == "placed", view["conditions"]
    assert len(await host_booked(db, view["id"])) == 2  # each member on its own node
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT attributes FROM authz_resources WHERE id = %s", (view["id"],)
            )
        ).fetchone()
    assert row is not None
    # 10 CPUs and the 64 GiB share per member: what the decision saw.
    assert (row["attributes"]["vcpu"], row["attributes"]["memoryGiB"]) == (20, 128)
    # Quota: (10 - 7) CPUs above the share, per member.
    assert await used(db, "vcpu") == 6


async def test_a_re_inventoried_host_is_bookable_at_once(
    db: Database, service: ReservationService
) -> None:
    small = {**HOST, "vcpu": 16}
    await world(db, nodes=1, host=small, policy={"perGpu": {"vcpu": 1}}, quotas={"vcpu": 100})
    view = await create(service, "waits", resources={"vcpu": 40})
    assert view["state"] == "pending"
    async with db.connection() as conn:
        [row] = await (await conn.execute("SELECT id FROM nodes")).fetchall()
    node = row["id"]
    await node_again(db, node, resources=HOST)  # the agent now reports 64 CPUs
    await run(db)
    assert (await get(service, view["id"]))["state"] in ("placed", "binding")
