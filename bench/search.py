"""``capacity.search`` latency on a busy pool: p50 and p99 of the earliest-window search.

A pool of 200 nodes x 8 GPUs (with host rows) holds 20,000 bookings spread over the next 14
days (each GPU booked back to back with random gaps, every tenth booking also booking host
CPUs); the search asks, through ``ReservationService.search`` as the API does, for the 5
earliest windows of requests from 1 GPU for an hour to a whole node for a day. Targets: p50
under 50 ms, p99 under 200 ms. The reference in the same run: a preview of the same requests
(one placement), so the ratio says what the sweep adds.

    .venv/bin/python bench/search.py [--nodes 200] [--bookings 20000] [--searches 60]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from admission import bench_database
from bettercompute.core import ports
from bettercompute.core.pools import CAP_DEVICES_LIMITS
from bettercompute.iam import policies
from bettercompute.service.reservations import ReservationService
from bettercompute.store import inventory
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database

GPUS_PER_NODE = 8
HOUR_MS = 3_600_000
DAYS = 14
ASKS = [
    ({"class": "gpu", "count": 1}, "1h"),
    ({"class": "gpu", "count": 4}, "8h"),
    ({"class": "gpu", "count": 8}, "24h"),
]


async def setup(db: Database, *, nodes: int, bookings: int, seed: int) -> None:
    await inventory.upsert_tenant(db, tenant_id="acme")
    await inventory.set_quota(db, tenant_id="acme", resource="gpu:H100", limit=10**9)
    await inventory.upsert_pool(
        db, pool_id="pool_big", owner_tenant_id="acme", region="eu-west-1", gpu_model="H100"
    )
    for n in range(nodes):
        name = f"big-{n:03d}"
        await inventory.upsert_node(
            db,
            inventory.NodeSpec(
                id=f"node_{name}",
                name=name,
                pool_id="pool_big",
                atoms=[
                    inventory.AtomSpec(
                        device_id=f"GPU-{name}-{g}", numa_node=g // 4, nvlink_domain=None
                    )
                    for g in range(GPUS_PER_NODE)
                ],
                resources={"vcpu": 16 * GPUS_PER_NODE + 2, "memoryGiB": 128 * GPUS_PER_NODE},
                labels={CAP_DEVICES_LIMITS: ("true", "system")},
            ),
        )
    rng = random.Random(seed)
    per_atom = max(1, bookings // (nodes * GPUS_PER_NODE))
    # A bulk load (every booking of the benchmark in one transaction): a bulk load's bound.
    async with db.transaction(within_s=db.limits.bulk_s) as conn:
        atoms = await (
            await conn.execute(
                "SELECT a.id, a.node_id, a.device_id FROM atoms a JOIN nodes n ON n.id = a.node_id"
                " WHERE n.pool_id = 'pool_big' ORDER BY a.id"
            )
        ).fetchall()
        now = await (await conn.execute("SELECT epoch_ms(compute_now()) AS ms")).fetchone()
        assert now is not None
        base = int(now["ms"])
        span = DAYS * 24 * HOUR_MS
        rids, allocs, nodes_, devices, atom_ids, starts, ends, vcpus = ([] for _ in range(8))
        for atom in atoms:
            at = base + rng.randrange(0, 12 * HOUR_MS)
            for k in range(per_atom):
                length = rng.randrange(2, 25) * HOUR_MS
                if at + length > base + span:
                    break
                i = len(rids)
                rids.append(f"rsv_bench_{i}")
                allocs.append(f"alloc_bench_{i}")
                nodes_.append(atom["node_id"])
                devices.append(atom["device_id"])
                atom_ids.append(atom["id"])
                starts.append(at)
                ends.append(at + length)
                vcpus.append(16 if k % 10 == 0 else 0)
                at += length + rng.randrange(0, 20) * HOUR_MS
        await conn.execute(
            "INSERT INTO reservations (id, tenant_id, pool_id, owner_identity_id,"
            " idempotency_key, request_hash, request, state, duration, during)"
            " SELECT r, 'acme', 'pool_big', 'bench', r, r, '{}', 'placed',"
            " (e - s) * interval '1 millisecond',"
            " tstzrange(to_timestamp(s / 1000.0), to_timestamp(e / 1000.0))"
            " FROM unnest(%s::text[], %s::bigint[], %s::bigint[]) AS x(r, s, e)",
            (rids, starts, ends),
        )
        await conn.execute(
            "INSERT INTO allocations (id, reservation_id, node_id, device_class, device_ids,"
            " atom_ids, until, host_vcpu)"
            " SELECT a, r, n, 'gpu', ARRAY[d], ARRAY[t], to_timestamp(e / 1000.0), v"
            " FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[],"
            " %s::bigint[], %s::int[]) AS x(a, r, n, d, t, e, v)",
            (allocs, rids, nodes_, devices, atom_ids, ends, vcpus),
        )
        await conn.execute(
            "INSERT INTO bookings (atom_id, reservation_id, allocation_id, pool_id, during,"
            " host_node, host_vcpu)"
            " SELECT t, r, a, 'pool_big',"
            " tstzrange(to_timestamp(s / 1000.0), to_timestamp(e / 1000.0)),"
            " CASE WHEN v > 0 THEN n END, v"
            " FROM unnest(%s::text[], %s::text[], %s::text[], %s::bigint[], %s::bigint[],"
            " %s::text[], %s::int[]) AS x(t, r, a, s, e, n, v)",
            (atom_ids, rids, allocs, starts, ends, nodes_, vcpus),
        )
    print(f"{len(rids)} bookings on {nodes} nodes x {GPUS_PER_NODE} GPUs over {DAYS} days")


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--bookings", type=int, default=20_000)
    parser.add_argument("--searches", type=int, default=60)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    server, dsn = bench_database("bc_search_bench")
    db = await Database.open(dsn, min_size=2, max_size=4)
    try:
        await setup(db, nodes=args.nodes, bookings=args.bookings, seed=args.seed)
        service = await ReservationService.start(
            db=db,
            policy=policies.CedarPolicyEngine.from_text(policies.DEFAULT_POLICIES),
            budget=DatabaseBudget(db),
        )
        who = ports.Caller(identity_id="bench", tenant_id="acme")
        print(f"{'request':>16} {'op':>8} {'p50 ms':>8} {'p99 ms':>8} {'windows':>8}")
        for device, duration in ASKS:
            body = {
                "tenantId": "acme",
                "poolId": "pool_big",
                "devices": [device],
                "duration": duration,
            }
            await service.search(who, body)  # warm: the inventory cache, prepared plans
            timings: dict[str, list[float]] = {"search": [], "preview": []}
            found = 0
            for _ in range(args.searches):
                t0 = time.perf_counter()
                answer = await service.search(who, body)
                timings["search"].append(time.perf_counter() - t0)
                found = len(answer["windows"])
                t0 = time.perf_counter()
                await service.preview(who, body)
                timings["preview"].append(time.perf_counter() - t0)
            label = f"{device['count']} gpu x {duration}"
            for op, values in timings.items():
                print(
                    f"{label:>16} {op:>8} {pct(values, 50):>8.1f} {pct(values, 99):>8.1f} "
                    f"{found if op == 'search' else '':>8}",
                    flush=True,
                )
            ratio = statistics.median(timings["search"]) / statistics.median(timings["preview"])
            print(f"{label:>16} {'ratio':>8} {ratio:>8.1f}  (search p50 / preview p50)")
    finally:
        await db.close()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
