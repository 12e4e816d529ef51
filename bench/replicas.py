"""Creates per second with one service replica and with two, on the same database.

Every replica is a process of its own (its own event loop, connection pool, policy engine and,
for the pool-lease placer, its own placer loop competing for the pool's lease), as replicas of
the operator or of ``better-compute serve`` are. The same number of callers in all: one
replica runs them all; two replicas run half each, starting at the same moment. Creates are
``bench/admission.py``'s (the full sequence, 1 GPU for an hour, placed; a pool-lease create
waits until its batch placed it), each replica in windows of its own so nothing collides.

It prints creates/s, p50 and p99 for each, and the ratio two/one, per placer: two replicas on
one database must not do worse than one. With ``--rounds N`` it measures one, two, one, two …
N times each, so a machine whose speed drifts within the minute weighs on both alike, and the
ratio is of the medians.

``--db-cpus N`` keeps the embedded PostgreSQL on the last N CPUs and the replicas on the others,
as when the database runs on machines of its own. Why: on a small machine shared by both, a
second replica process can take CPU the database needed, and the ratio then measures that
starvation rather than what two replicas cost each other (pool locks, leases, notifications).

    .venv/bin/python bench/replicas.py [--seconds 10] [--callers 32] [--placer both]
        [--db-cpus N] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import itertools
import multiprocessing
import statistics
import time

import psutil

from admission import (
    GPUS_PER_NODE,
    HOUR_MS,
    PLACER_POOLS,
    bench_database,
    pct,
    run_level,
    setup,
)
from bettercompute import supervising
from bettercompute.iam import policies
from bettercompute.service.batching import PoolPlacer
from bettercompute.service.reservations import ReservationService
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database

#: Each replica's creates start this far apart in their counters (and so in their windows).
REPLICA_STRIDE = 1_000_000


async def _replica(
    dsn: str,
    *,
    replica: int,
    round_: int,
    pool_id: str,
    callers: int,
    seconds: float,
    start_at: float,
    capacity: int,
    base_ms: int,
    pool_lease: bool,
) -> tuple[int, float, list[float]]:
    db = await Database.open(dsn, min_size=2, max_size=callers + 4)
    loop_task = None
    try:
        service = await ReservationService.start(
            db=db,
            policy=policies.CedarPolicyEngine.from_text(policies.DEFAULT_POLICIES),
            budget=DatabaseBudget(db),
        )
        if pool_lease:
            loop_task = asyncio.create_task(PoolPlacer(db, signals=service.signals).run())
        # Keys and windows of this replica and round only: two replicas never share a key.
        counter = itertools.count((round_ * 16 + replica) * REPLICA_STRIDE)
        # Warm-up (prepared statements, Cedar, the pool, the lease) until the common start.
        warm_until = start_at - time.time() - 0.2
        if warm_until > 0:
            await run_level(
                service,
                callers=min(callers, 4),
                seconds=warm_until,
                counter=counter,
                base_ms=base_ms,
                capacity=capacity,
                pool_id=pool_id,
            )
        await asyncio.sleep(max(0.0, start_at - time.time()))
        return await run_level(
            service,
            callers=callers,
            seconds=seconds,
            counter=counter,
            base_ms=base_ms,
            capacity=capacity,
            pool_id=pool_id,
        )
    finally:
        if loop_task is not None:
            await supervising.cancel([loop_task])
        await db.close()


def replica_process(kwargs: dict[str, object]) -> tuple[int, float, list[float]]:
    """A replica's whole life in its own process (what the pool runs)."""
    return asyncio.run(_replica(**kwargs))  # type: ignore[arg-type]


def measure(
    pool: concurrent.futures.ProcessPoolExecutor,
    dsn: str,
    *,
    replicas: int,
    round_: int,
    pool_id: str,
    callers: int,
    seconds: float,
    capacity: int,
    base_ms: int,
    pool_lease: bool,
) -> tuple[float, list[float]]:
    """Creates/s of ``replicas`` processes sharing ``callers``, and every create's latency."""
    start_at = time.time() + 4.0  # every process started and warmed up by then
    jobs = [
        pool.submit(
            replica_process,
            {
                "dsn": dsn,
                "replica": r,
                "round_": round_,
                "pool_id": pool_id,
                "callers": callers // replicas,
                "seconds": seconds,
                "start_at": start_at,
                "capacity": capacity,
                "base_ms": base_ms,
                "pool_lease": pool_lease,
            },
        )
        for r in range(replicas)
    ]
    done = [job.result() for job in jobs]
    creates = sum(n for n, _, _ in done)
    elapsed = max(e for _, e, _ in done)
    return creates / elapsed, [x for _, _, lat in done for x in lat]


def pin(postmaster_pid: int, db_cpus: int) -> tuple[list[int], list[int]]:
    """The server (postmaster and every process it runs; backends forked later inherit it) on
    the last ``db_cpus`` CPUs, this process (and the replicas it spawns) on the others."""
    cpus = sorted(psutil.Process().cpu_affinity() or [])
    if not 0 < db_cpus < len(cpus):
        raise SystemExit(f"--db-cpus must leave the replicas a CPU: {len(cpus)} CPUs here")
    ours, theirs = cpus[:-db_cpus], cpus[-db_cpus:]
    server = psutil.Process(postmaster_pid)
    for process in [server, *server.children(recursive=True)]:
        process.cpu_affinity(theirs)
    psutil.Process().cpu_affinity(ours)
    return ours, theirs


async def prepare(dsn: str, nodes: int) -> None:
    db = await Database.open(dsn, min_size=1, max_size=2)
    try:
        await setup(db, nodes)
    finally:
        await db.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per measurement")
    parser.add_argument("--nodes", type=int, default=64, help="nodes of 8 GPUs in each pool")
    parser.add_argument("--callers", type=int, default=32, help="callers in all (even)")
    parser.add_argument(
        "--placer", choices=("inline", "pool-lease", "both"), default="both", help="placers"
    )
    parser.add_argument(
        "--db-cpus",
        type=int,
        default=0,
        help="keep the embedded PostgreSQL on this many CPUs, the replicas on the rest (0: shared)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="one and two replicas, alternated this many times"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.callers < 2 or args.callers % 2:
        parser.error("--callers must be even and at least 2: two replicas take half each")
    placers = list(PLACER_POOLS) if args.placer == "both" else [args.placer]
    server, dsn = bench_database("bc_replicas")
    try:
        asyncio.run(prepare(dsn, args.nodes))
        capacity = args.nodes * GPUS_PER_NODE
        base_ms = int(time.time() * 1000) + 24 * HOUR_MS
        print(
            f"replicas: full create sequence, 1 GPU x 1h each, {args.callers} callers in all,"
            f" pools of {args.nodes} nodes x {GPUS_PER_NODE} GPUs, {args.seconds:g} s each"
        )
        if args.db_cpus:
            if server is None or server.pid is None:
                parser.error("--db-cpus needs the embedded server (DATABASE_URL is set)")
            ours, theirs = pin(server.pid, args.db_cpus)
            print(f"CPUs: PostgreSQL {theirs}, replicas {ours}")
        print(f"{'placer':>10} {'replicas':>8} {'creates/s':>10} {'p50 ms':>8} {'p99 ms':>8}")
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=spawn) as pool:
            round_ = 0
            for placer in placers:
                pool_id = next(iter(PLACER_POOLS[placer]))  # the devices-only pool
                rates: dict[int, list[float]] = {1: [], 2: []}
                for _ in range(args.rounds):
                    for replicas in (1, 2):
                        rate, latencies = measure(
                            pool,
                            dsn,
                            replicas=replicas,
                            round_=round_,
                            pool_id=pool_id,
                            callers=args.callers,
                            seconds=args.seconds,
                            capacity=capacity,
                            base_ms=base_ms,
                            pool_lease=placer == "pool-lease",
                        )
                        round_ += 1
                        rates[replicas].append(rate)
                        print(
                            f"{placer:>10} {replicas:>8} {rate:>10.0f}"
                            f" {pct(latencies, 50):>8.2f} {pct(latencies, 99):>8.2f}",
                            flush=True,
                        )
                one, two = statistics.median(rates[1]), statistics.median(rates[2])
                print(
                    f"{placer:>10} two replicas / one = {two / one:.2f}"
                    f" (medians {two:.0f} / {one:.0f} creates/s over {args.rounds} round(s))"
                )
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
