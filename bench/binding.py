"""Bind latency: how long a placed reservation takes to become active, with and without a
backlog of pending reservations, in one run.

Why: under a soak with ~1,500 pending reservations, ``placed → active`` took seconds (up to
half a minute) where it takes well under one with none pending. A bind goes through the
reconciler twice (``placed → binding`` at the start, ``binding → active`` after the node's
report) and through a node agent once; this bench measures all three legs from the database's
own timestamps, so a regression says which leg it is in.

It runs the whole ``dev`` stack in this process (embedded PostgreSQL, reconciler, simulated
node agents, the real converger) on one pool of ``--nodes`` 8-GPU nodes. One GPU is booked for
hours, so the backlog (``--pending`` requests for every GPU of the pool each) can never place,
while a one-GPU request always can. The measured requests come one at a time, each
released once active: every release frees capacity and wakes the backlog, as it does in
production. Phase one has no backlog; phase two creates the backlog and measures again.

Printed per phase: p50/p99/max of placed → active, and of each leg (placed → binding,
binding → bound report, bound report → active), and their ratio against phase one (this
machine is shared and noisy: compare ratios, not milliseconds across runs).

What it must never do: leave its PostgreSQL running or write outside its temporary state dir.

    .venv/bin/python bench/binding.py                       # 0 and 2,000 pending, 40 binds
    .venv/bin/python bench/binding.py --pending 500 --binds 20
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bettercompute.core import ports
from bettercompute.dev import running

POOL = "pool_h100"
TENANT = "acme"


def config(nodes: int) -> dict[str, Any]:
    return {
        "tenants": [{"id": "root", "name": "Platform", "root": True}, {"id": TENANT}],
        "identities": [{"id": "bench@acme", "tenant": TENANT, "token": "bcbench_acme"}],
        "pools": [
            {"id": POOL, "owner": TENANT, "region": "eu-west-1", "model": "H100"},
        ],
        "quotas": [{"tenant": TENANT, "resource": "gpu:H100", "limit": 1_000_000}],
        "nodes": [{"pool": POOL, "count": nodes, "gpus": 8}],
        "defaultPolicies": True,
    }


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


class Bench:
    def __init__(self, dev: running.Dev) -> None:
        self.dev = dev
        self.caller = ports.Caller(identity_id="bench@acme", tenant_id=TENANT)
        self.keys = 0
        self.verbose = False

    async def create(self, gpus: int, duration: str) -> dict[str, Any]:
        self.keys += 1
        view = await self.dev.service.create(
            self.caller,
            {
                "tenantId": TENANT,
                "poolId": POOL,
                "devices": [{"class": "gpu", "count": gpus}],
                "duration": duration,
                "binding": "hold",
                "idempotencyKey": f"bench-{self.keys}",
            },
        )
        return dict(view)

    async def state(self, rid: str) -> str:
        async with self.dev.db.connection() as conn:
            row = await (
                await conn.execute("SELECT state FROM reservations WHERE id = %s", (rid,))
            ).fetchone()
        return str(row["state"]) if row else "?"

    async def legs(self, rid: str) -> tuple[float, float, float, float]:
        """(placed → active, placed → binding, binding → bound, bound → active) in seconds, from
        the database's timestamps (one clock: the server's)."""
        async with self.dev.db.connection() as conn:
            row = await (
                await conn.execute(
                    "SELECT"
                    " (SELECT min(created_at) FROM outbox WHERE subject = 'reservation/' || %(r)s"
                    "   AND type = 'reservation.placed') AS placed,"
                    " (SELECT min(created_at) FROM outbox WHERE subject = 'reservation/' || %(r)s"
                    "   AND type = 'reservation.binding') AS binding,"
                    " (SELECT max(bound_at) FROM allocations WHERE reservation_id = %(r)s)"
                    "   AS bound,"
                    " (SELECT min(created_at) FROM outbox WHERE subject = 'reservation/' || %(r)s"
                    "   AND type = 'reservation.active') AS active",
                    {"r": rid},
                )
            ).fetchone()
        assert row is not None
        assert None not in row.values(), row
        s = {k: v.timestamp() for k, v in row.items()}
        return (
            s["active"] - s["placed"],
            s["binding"] - s["placed"],
            s["bound"] - s["binding"],
            s["active"] - s["bound"],
        )

    async def release(self, rid: str) -> None:
        await self.dev.service.release(self.caller, {"tenantId": TENANT, "reservationId": rid})

    async def measure(self, binds: int, *, timeout_s: float) -> list[tuple[float, ...]]:
        """``binds`` one-GPU reservations one after another, each released once active."""
        out: list[tuple[float, ...]] = []
        for _ in range(binds):
            view = await self.create(1, "1h")
            assert view["state"] in ("placed", "binding", "active"), view
            deadline = time.monotonic() + timeout_s
            while (state := await self.state(view["id"])) != "active":
                if time.monotonic() > deadline:
                    raise SystemExit(f"{view['id']} not active after {timeout_s:g} s ({state})")
                await asyncio.sleep(0.01)
            out.append(await self.legs(view["id"]))
            if self.verbose:
                print(f"  bind {len(out)}: {out[-1][0] * 1000:.0f} ms", flush=True)
            await self.release(view["id"])
        return out

    async def backlog(self, pending: int, gpus: int, *, concurrency: int = 8) -> None:
        """``pending`` requests for the whole pool, which cannot place while one GPU is kept."""
        left = iter(range(pending))

        async def worker() -> None:
            for _ in left:
                view = await self.create(gpus, "1h")
                assert view["state"] == "pending", view["state"]

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def report(name: str, rows: list[tuple[float, ...]], reference: list[tuple[float, ...]]) -> None:
    labels = ("placed→active", "placed→binding", "binding→bound", "bound→active")
    print(f"{name}: {len(rows)} binds")
    for i, label in enumerate(labels):
        values = [r[i] * 1000 for r in rows]
        ref = [r[i] * 1000 for r in reference]
        ratio = pct(values, 99) / pct(ref, 99) if reference and pct(ref, 99) > 0 else 1.0
        print(
            f"  {label:<15} p50 {pct(values, 50):8.1f} ms  p99 {pct(values, 99):8.1f} ms"
            f"  max {max(values):8.1f} ms  mean {statistics.fmean(values):8.1f} ms"
            f"  p99 x{ratio:.1f} of no backlog"
        )


async def bench(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="bc-binding-"))
    path = root / "dev.yaml"
    path.write_text(yaml.safe_dump(config(args.nodes), sort_keys=False))
    try:
        async with running.started(
            port=0, metrics_port=0, sim=0, config=path, state_dir=root / "state"
        ) as dev:
            b = Bench(dev)
            # One GPU booked for hours: a request for the whole pool never fits.
            kept = await b.create(1, "8h")
            assert kept["state"] == "placed", kept
            quiet = await b.measure(args.binds, timeout_s=args.timeout)
            report("0 pending", quiet, [])
            sys.stdout.flush()
            t0 = time.monotonic()
            await b.backlog(args.pending, args.nodes * 8)
            took = time.monotonic() - t0
            print(f"(backlog of {args.pending} pending created in {took:.0f} s)", flush=True)
            b.verbose = args.verbose
            busy = await b.measure(args.binds, timeout_s=args.timeout)
            report(f"{args.pending} pending", busy, quiet)
            p99 = pct([r[0] for r in busy], 99)
            print(f"p99 placed→active with {args.pending} pending: {p99 * 1000:.0f} ms")
            return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="bench/binding.py",
        description=(__doc__ or "").split("\n\n")[0],
        epilog=(__doc__ or "").split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pending", type=int, default=2000, help="the backlog (2000)")
    parser.add_argument("--binds", type=int, default=40, help="binds measured per phase (40)")
    parser.add_argument("--nodes", type=int, default=4, help="simulated 8-GPU nodes (4)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a bind may take")
    parser.add_argument("--verbose", action="store_true", help="print each bind under backlog")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    return asyncio.run(bench(args))


if __name__ == "__main__":
    sys.exit(main())
