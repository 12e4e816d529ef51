"""Soak: steady mixed load on ``better-compute dev`` for a long time, figures every minute.

Why: leaks and slow drifts (memory that only grows, latency that climbs with the tables, a
connection pool that slowly runs dry) do not show in a one-minute benchmark. This runs the
chaos harness's writers (keyed creates, ``until`` extends, releases, retried with the same key)
without kills, and prints every ``--every`` seconds: the RSS of the server process, the memory
of PostgreSQL (the sum of its processes' PSS, which counts shared buffers once, and their RSS),
p50/p99 latency of that interval's answered requests, operations acknowledged, and errors
(500s, 503s, connection errors, operations given up) and the reconciler's backlog (wake-ups
overdue by more than 10 s). At the end it reads the chaos invariants once. Not part of CI: it
runs for ``--minutes`` (default 30).

What it must never do: leave its server or PostgreSQL running (Ctrl-C stops both), or kill
anything it did not start.

    .venv/bin/python bench/soak.py                         # 30 minutes
    .venv/bin/python bench/soak.py --minutes 3 --writers 24
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil
import psycopg
import yaml

import chaos


def memory_mib(process: psutil.Process | None) -> float | None:
    if process is None:
        return None
    with contextlib.suppress(psutil.Error):
        return process.memory_info().rss / 2**20
    return None


def pg_memory_mib(postmaster: psutil.Process | None) -> tuple[float, float, int] | None:
    """(sum of PSS, sum of RSS, processes) of PostgreSQL's processes, in MiB."""
    if postmaster is None:
        return None
    pss = rss = 0.0
    processes = chaos.pg_tree(postmaster)
    for p in processes:
        with contextlib.suppress(psutil.Error):
            full = p.memory_full_info()
            pss += getattr(full, "pss", full.rss) / 2**20
            rss += full.rss / 2**20
    return pss, rss, len(processes)


async def overdue(server: chaos.Server) -> str:
    """Wake-ups due more than 10 s ago: the reconciler's backlog (``?`` when unreadable)."""
    try:
        async with await psycopg.AsyncConnection.connect(
            server.dsn(), autocommit=True, connect_timeout=3
        ) as conn:
            row = await (
                await conn.execute(
                    "SELECT count(*) FROM work_queue"
                    " WHERE due_at < compute_now() - interval '10 seconds'"
                )
            ).fetchone()
    except (psycopg.Error, OSError):
        return "?"
    return str(row[0]) if row else "?"


async def soak(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="bc-soak-"))
    writers = chaos.writers_for(args.writers)
    config = root / "soak.yaml"
    capacity = args.sim * chaos.GPUS_PER_NODE
    # A budget globex does not run out of: the load stays mixed for the whole soak.
    world = chaos.dev_config(
        writers, acme_quota=capacity * 5 // 8, globex_quota=capacity // 4, budget=1e9
    )
    config.write_text(yaml.safe_dump(world, sort_keys=False))
    server = chaos.Server(
        state=root / "state",
        config=config,
        port=chaos.free_port(),
        sim=args.sim,
        database_url=args.database_url,
    )
    figures = chaos.Figures()
    clients: list[chaos.Client] = []
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
    failed = False
    try:
        server.start()
        if not await server.ready(60):
            print(f"the server did not start:\n{server.tail(30)}")
            return 1
        print(
            f"soak: {args.minutes:g} min, {args.writers} writers (think up to {args.think:g} s), "
            f"{args.sim} simulated nodes x {chaos.GPUS_PER_NODE} H100, figures every "
            f"{args.every:g} s; state in {root}",
            flush=True,
        )
        print(
            f"{'min':>5} {'server MiB':>10} {'pg PSS MiB':>10} {'pg RSS MiB':>10} {'pg procs':>8} "
            f"{'acked':>6} {'ops/s':>6} {'p50 ms':>7} {'p99 ms':>7} {'500':>4} {'503':>4} "
            f"{'conn err':>8} {'gave up':>7} {'overdue':>7}",
            flush=True,
        )
        clients = [
            chaos.Client(
                server.url, w, figures, op_timeout=60.0, request_timeout=args.request_timeout
            )
            for w in writers
        ]
        run = f"soak-{int(time.time())}"
        tasks = [
            asyncio.create_task(
                chaos.write(c, random.Random(f"soak/{c.writer.index}"), stop, run, think=args.think)
            )
            for c in clients
        ]
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        seen = 0
        last = (0, 0, 0, 0, 0)
        while not stop.is_set() and time.monotonic() < end:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(args.every, end - time.monotonic()))
            if not server.alive():
                print(f"the server died (exit {server.proc and server.proc.returncode}):")
                print(server.tail(20))
                failed = True
                break
            window = sorted(s for _, s in figures.latencies[seen:])
            seen = len(figures.latencies)
            now = (
                sum(figures.acked.values()),
                figures.status_500,
                figures.status_503,
                sum(figures.transport_errors.values()),
                sum(figures.gave_up.values()),
            )
            delta = [a - b for a, b in zip(now, last, strict=True)]
            last = now
            srv = memory_mib(psutil.Process(server.proc.pid) if server.proc else None)
            pg = pg_memory_mib(None if args.database_url else server.postmaster())
            p50 = chaos.pct(window, 50) * 1000 if window else float("nan")
            p99 = chaos.pct(window, 99) * 1000 if window else float("nan")
            print(
                f"{(time.monotonic() - t0) / 60:>5.1f} {srv or 0:>10.0f} "
                f"{pg[0] if pg else 0:>10.0f} {pg[1] if pg else 0:>10.0f} "
                f"{pg[2] if pg else 0:>8} {delta[0]:>6} {delta[0] / args.every:>6.1f} "
                f"{p50:>7.1f} {p99:>7.1f} {delta[1]:>4} {delta[2]:>4} {delta[3]:>8} "
                f"{delta[4]:>7} {await overdue(server):>7}",
                flush=True,
            )
        stop.set()
        await asyncio.wait(tasks, timeout=70)
        # As the chaos harness: the reconciler gets up to --settle s to catch up first.
        deadline = time.monotonic() + args.settle
        checks: list[chaos.Check] = []
        while server.alive():
            checks = await chaos.sql_checks(server.dsn(), figures, final=True)
            if all(c.ok for c in checks) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(1.0)
        if server.alive():
            for c in checks:
                print(f"  {'PASS' if c.ok else 'FAIL'}  {c.name}: {c.detail}")
            failed = failed or not all(c.ok for c in checks)
        failed = failed or figures.status_500 > 0
        print(
            f"total: {sum(figures.acked.values())} operations acknowledged, "
            f"{figures.status_500} 500s, {figures.status_503} 503s; "
            f"{'FAIL' if failed else 'PASS'}"
        )
        return 1 if failed else 0
    finally:
        for c in clients:
            await c.close()
        postmaster = None if args.database_url else server.postmaster()
        if server.alive():
            server.expected_exit = True
            code, _ = await server.stop(signal.SIGINT, 15)
            if code is None:
                await server.stop(signal.SIGKILL, 10)
        if postmaster is not None and postmaster.is_running():
            postmaster.send_signal(signal.SIGINT)
            with contextlib.suppress(psutil.TimeoutExpired):
                postmaster.wait(15)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="bench/soak.py",
        description=(__doc__ or "").split("\n\n")[0],
        epilog=(__doc__ or "").split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--minutes", type=float, default=30.0, help="how long (default 30)")
    parser.add_argument("--writers", type=int, default=16, help="concurrent writers (16)")
    parser.add_argument(
        "--think",
        type=float,
        default=0.2,
        help="each writer's pause between rounds, up to "
        "this many seconds (default 0.2): a steady load, not a flood",
    )
    parser.add_argument("--every", type=float, default=60.0, help="seconds per figures line")
    parser.add_argument("--sim", type=int, default=8, help="simulated 8-GPU nodes (8)")
    parser.add_argument("--request-timeout", type=float, default=10.0)
    parser.add_argument(
        "--settle",
        type=float,
        default=30.0,
        help="seconds the reconciler gets to catch up "
        "after the load, before the final invariants (default 30)",
    )
    parser.add_argument(
        "--database-url", default=None, help="serve on this scratch PostgreSQL instead of dev's"
    )
    parser.add_argument("--keep", action="store_true", help="keep the state dir and server logs")
    args = parser.parse_args()
    if args.minutes <= 0 or args.every <= 0 or not 1 <= args.writers <= 64:
        parser.error("--minutes and --every above 0, --writers between 1 and 64")
    return asyncio.run(soak(args))


if __name__ == "__main__":
    sys.exit(main())
