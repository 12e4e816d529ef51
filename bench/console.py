"""The console's pool timeline on a busy pool: the ``pools.timeline`` endpoint's p50/p99 over
HTTP, the API's own read of the same bookings (``reservations.list``, every page), and
Chromium's time from navigation to a drawn timeline. Goal: a drawn timeline within 1 s.

A pool of 200 nodes x 8 GPUs holds 20,000 bookings over the next 14 days (each GPU booked
back to back with random gaps, from a day ago on), every other one acme's, the rest globex's.
They are loaded the way ``bench/search.py`` loads its pool: one bulk transaction of plain
rows (reservations, allocations, bookings), which is what creates leave behind, written in
seconds instead of the many minutes 20,000 policy-decided creates take on this machine. The
API (``make_app``, the console's own pages and cookie sign-in) is then served on 127.0.0.1
and asked as acme, whose half comes by name and globex's as "busy".

    .venv/bin/python bench/console.py [--nodes 200] [--bookings 20000] [--requests 30]
    .venv/bin/python bench/console.py --small      # a smoke run: 20 nodes, 1,000 bookings

Chromium is Debian's (``/usr/bin/chromium`` or ``BCD_CHROMIUM``) under Playwright; without
it (or with ``--no-browser``) the browser line says so and the rest still runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import time
from typing import Any

import httpx
from aiohttp import web

from admission import bench_database
from bettercompute.api.app import make_app
from bettercompute.core import ports
from bettercompute.iam import identities, policies
from bettercompute.service.reservations import ReservationService
from bettercompute.store import inventory
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database

GPUS_PER_NODE = 8
HOUR_MS = 3_600_000
DAYS = 14
POOL = "pool_big"
TOKENS = {"bench-acme": ("acme", "alice@acme"), "bench-globex": ("globex", "gina@globex")}


async def setup(db: Database, *, nodes: int, bookings: int, seed: int) -> int:
    """The pool and its bookings, in one bulk transaction; answers how many were written."""
    for tenant in ("acme", "globex"):
        await inventory.upsert_tenant(db, tenant_id=tenant)
        await inventory.set_quota(db, tenant_id=tenant, resource="gpu:H100", limit=10**9)
    await inventory.upsert_pool(
        db, pool_id=POOL, owner_tenant_id="acme", region="eu-west-1", gpu_model="H100"
    )
    for n in range(nodes):
        name = f"big-{n:03d}"
        await inventory.upsert_node(
            db,
            inventory.NodeSpec(
                id=f"node_{name}",
                name=name,
                pool_id=POOL,
                atoms=[
                    inventory.AtomSpec(
                        device_id=f"GPU-{name}-{g}", numa_node=g // 4, nvlink_domain=None
                    )
                    for g in range(GPUS_PER_NODE)
                ],
                resources={"vcpu": 16 * GPUS_PER_NODE + 2, "memoryGiB": 128 * GPUS_PER_NODE},
            ),
        )
    rng = random.Random(seed)
    per_atom = max(1, -(-bookings // (nodes * GPUS_PER_NODE)))
    async with db.transaction(within_s=db.limits.bulk_s) as conn:
        atoms = await (
            await conn.execute(
                "SELECT a.id, a.node_id, a.device_id FROM atoms a JOIN nodes n ON n.id = a.node_id"
                " WHERE n.pool_id = %s ORDER BY a.id",
                (POOL,),
            )
        ).fetchall()
        now = await (await conn.execute("SELECT epoch_ms(compute_now()) AS ms")).fetchone()
        assert now is not None
        base = int(now["ms"]) - 24 * HOUR_MS
        end_of_span = base + (DAYS + 1) * 24 * HOUR_MS
        rows: dict[str, list[Any]] = {
            k: [] for k in ("rid", "tenant", "owner", "request", "alloc", "node", "device")
        }
        rows |= {"atom": [], "start": [], "end": []}
        for atom in atoms:
            at = base + rng.randrange(0, 12 * HOUR_MS)
            for _ in range(per_atom):
                length = rng.randrange(2, 25) * HOUR_MS
                if at + length > end_of_span or len(rows["rid"]) >= bookings:
                    break
                i = len(rows["rid"])
                tenant, owner = ("acme", "alice@acme") if i % 2 == 0 else ("globex", "gina@globex")
                rows["rid"].append(f"rsv_bench_{i:06d}")
                rows["tenant"].append(tenant)
                rows["owner"].append(owner)
                rows["request"].append(
                    json.dumps(
                        {
                            "poolId": POOL,
                            "devices": [{"class": "gpu", "count": 1}],
                            "duration": f"{length // HOUR_MS}h",
                            "binding": "hold",
                        }
                    )
                )
                rows["alloc"].append(f"alloc_bench_{i:06d}")
                rows["node"].append(atom["node_id"])
                rows["device"].append(atom["device_id"])
                rows["atom"].append(atom["id"])
                rows["start"].append(at)
                rows["end"].append(at + length)
                at += length + rng.randrange(0, 20) * HOUR_MS
        await conn.execute(
            "INSERT INTO reservations (id, tenant_id, pool_id, owner_identity_id,"
            " idempotency_key, request_hash, request, state, duration, during)"
            " SELECT r, t, %s, o, 'train-' || r, r, q::jsonb, 'placed',"
            " (e - s) * interval '1 millisecond',"
            " tstzrange(to_timestamp(s / 1000.0), to_timestamp(e / 1000.0))"
            " FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::bigint[],"
            " %s::bigint[]) AS x(r, t, o, q, s, e)",
            (
                POOL,
                rows["rid"],
                rows["tenant"],
                rows["owner"],
                rows["request"],
                rows["start"],
                rows["end"],
            ),
        )
        await conn.execute(
            "INSERT INTO allocations (id, reservation_id, node_id, device_class, device_ids,"
            " atom_ids, until)"
            " SELECT a, r, n, 'gpu', ARRAY[d], ARRAY[t], to_timestamp(e / 1000.0)"
            " FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[],"
            " %s::bigint[]) AS x(a, r, n, d, t, e)",
            (rows["alloc"], rows["rid"], rows["node"], rows["device"], rows["atom"], rows["end"]),
        )
        await conn.execute(
            "INSERT INTO bookings (atom_id, reservation_id, allocation_id, pool_id, during)"
            " SELECT t, r, a, %s, tstzrange(to_timestamp(s / 1000.0), to_timestamp(e / 1000.0))"
            " FROM unnest(%s::text[], %s::text[], %s::text[], %s::bigint[], %s::bigint[])"
            " AS x(t, r, a, s, e)",
            (POOL, rows["atom"], rows["rid"], rows["alloc"], rows["start"], rows["end"]),
        )
    # Fresh statistics, as autovacuum would gather after such a load: the planner otherwise
    # plans the timeline's query for empty tables.
    async with db.transaction(within_s=db.limits.bulk_s) as conn:
        for table in ("reservations", "allocations", "bookings", "atoms", "nodes"):
            await conn.execute(f"ANALYZE {table}")
    return len(rows["rid"])


def pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def timeline_http(
    url: str, token: str, requests: int, span: tuple[int, int] | None = None
) -> tuple[list[float], int, int]:
    """Seconds per pools.timeline answer (after one warm-up), its size and bookings; ``span``:
    only ``[from, to)`` (epoch ms), else the whole default span."""
    body: dict[str, Any] = {"poolId": POOL}
    if span is not None:
        body |= {"from": span[0], "to": span[1]}
    headers = {"Authorization": f"Bearer {token}", "X-Better-Compute": "1"}
    seconds: list[float] = []
    size = bookings = 0
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(requests + 1):
            t0 = time.perf_counter()
            answer = await client.post(
                f"{url}/api/compute/pools/timeline", json=body, headers=headers
            )
            elapsed = time.perf_counter() - t0
            if answer.status_code == 503:
                # The database did not answer within the interactive bound (a loaded machine):
                # said, and not counted; a client would retry after Retry-After.
                print(f"  a timeline request: 503 after {elapsed * 1000:.0f} ms", flush=True)
                await asyncio.sleep(1)
                continue
            answer.raise_for_status()
            if i:
                seconds.append(elapsed)
            size = len(answer.content)
            bookings = len(answer.json()["data"]["bookings"])
    return seconds, size, bookings


async def list_everything(url: str, token: str, tenant: str) -> tuple[float, int, int]:
    """reservations.list over every page (200 a page): seconds, items, pages."""
    headers = {"Authorization": f"Bearer {token}", "X-Better-Compute": "1"}
    items = pages = 0
    cursor: str | None = None
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=60) as client:
        while True:
            body: dict[str, Any] = {"tenantId": tenant, "scope": "all", "limit": 200}
            if cursor:
                body["cursor"] = cursor
            answer = await client.post(
                f"{url}/api/compute/reservations/list", json=body, headers=headers
            )
            answer.raise_for_status()
            data = answer.json()["data"]
            items += len(data["items"])
            pages += 1
            cursor = data["nextCursor"]
            if not cursor:
                break
    return time.perf_counter() - t0, items, pages


def chromium() -> str | None:
    path = os.environ.get("BCD_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    return path if os.path.exists(path) else None


async def browser_draws(
    url: str, token: str, runs: int, path: str
) -> tuple[list[float], list[float]] | str:
    """Chromium's milliseconds from navigation start to the page's 'timeline-drawn' mark (the
    grid on screen: the span first shown, half a day back to four days ahead) and to its
    'timeline-complete' mark (the whole span to the horizon drawn)."""
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        return "Playwright for Python is not installed (pip install -e '.[test]')"
    drawn: list[float] = []
    complete: list[float] = []
    async with async_playwright() as pw:
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        browser = await pw.chromium.launch(executable_path=path, args=args, headless=True)
        try:
            context = await browser.new_context(viewport={"width": 1280, "height": 800})
            signed = await context.request.post(
                f"{url}/console/session",
                data=json.dumps({"token": token}),
                headers={"X-Better-Compute": "1", "Content-Type": "application/json"},
            )
            assert signed.ok, await signed.text()
            for _ in range(runs + 1):  # the first run warms Chromium's caches: not counted
                page = await context.new_page()
                await page.goto(f"{url}/console/#/timeline/{POOL}")
                await page.wait_for_selector("body[data-timeline-drawn='1']", timeout=60_000)
                await page.wait_for_selector(
                    "body[data-timeline-complete='1']", state="attached", timeout=60_000
                )
                mark, whole = await page.evaluate(
                    "[performance.getEntriesByName('timeline-drawn')[0].startTime,"
                    " performance.getEntriesByName('timeline-complete')[0].startTime]"
                )
                drawn.append(float(mark))
                complete.append(float(whole))
                await page.close()
        finally:
            await browser.close()
    return drawn[1:], complete[1:]


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--bookings", type=int, default=20_000)
    parser.add_argument("--requests", type=int, default=30, help="timeline requests to time")
    parser.add_argument("--draws", type=int, default=5, help="Chromium page loads to time")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--small", action="store_true", help="20 nodes, 1,000 bookings")
    parser.add_argument("--no-browser", action="store_true", help="skip the Chromium line")
    args = parser.parse_args()
    if args.small:
        args.nodes, args.bookings, args.requests, args.draws = 20, 1_000, 5, 2

    server, dsn = bench_database("bc_console_bench")
    db = await Database.open(dsn, min_size=2, max_size=8)
    runner: web.AppRunner | None = None
    try:
        t0 = time.perf_counter()
        print(f"loading {args.bookings} bookings on {args.nodes} nodes x {GPUS_PER_NODE} GPUs…")
        written = await setup(db, nodes=args.nodes, bookings=args.bookings, seed=args.seed)
        print(f"{written} bookings over {DAYS} days loaded in {time.perf_counter() - t0:.1f} s")
        service = await ReservationService.start(
            db=db,
            policy=policies.CedarPolicyEngine.from_text(policies.DEFAULT_POLICIES),
            budget=DatabaseBudget(db),
        )
        callers = {
            token: ports.Caller(identity_id=who, tenant_id=tenant)
            for token, (tenant, who) in TOKENS.items()
        }
        app = make_app(service=service, authenticator=identities.StaticTokenAuthenticator(callers))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        url = f"http://{host}:{port}"

        # The HTTP clients share this event loop with the server: the figures include both.
        seconds, size, shown = await timeline_http(url, "bench-acme", args.requests)
        print(
            f"pools.timeline (acme)     p50 {pct(seconds, 50) * 1000:7.1f} ms  "
            f"p99 {pct(seconds, 99) * 1000:7.1f} ms  ({args.requests} requests, "
            f"{shown} bookings, {size / 1e6:.2f} MB)",
            flush=True,
        )
        now = int(time.time() * 1000)
        first = (now - 12 * HOUR_MS, now + 4 * 24 * HOUR_MS)  # what the page shows first
        seconds, size, shown_first = await timeline_http(url, "bench-acme", args.requests, first)
        print(
            f"pools.timeline first span p50 {pct(seconds, 50) * 1000:7.1f} ms  "
            f"p99 {pct(seconds, 99) * 1000:7.1f} ms  (-12h to +4d: {shown_first} bookings, "
            f"{size / 1e6:.2f} MB)",
            flush=True,
        )
        took, items, pages = await list_everything(url, "bench-acme", "acme")
        print(
            f"reservations.list (acme)  {took * 1000:7.1f} ms for all {pages} pages "
            f"({items} of acme's reservations; the same bookings, acme's half only)",
            flush=True,
        )
        if args.no_browser:
            print("chromium: skipped (--no-browser)")
            return
        path = chromium()
        if path is None:
            print("chromium: skipped: no Chromium at /usr/bin/chromium (or BCD_CHROMIUM)")
            return
        timed = await browser_draws(url, "bench-acme", args.draws, path)
        if isinstance(timed, str):
            print(f"chromium: skipped: {timed}")
            return
        drawn, complete = timed
        print(
            f"chromium navigation → drawn timeline  median {statistics.median(drawn):7.1f} ms  "
            f"max {max(drawn):7.1f} ms  ({len(drawn)} loads; goal ≤ 1000 ms)",
            flush=True,
        )
        print(
            f"chromium navigation → whole horizon   median {statistics.median(complete):7.1f} ms"
            f"  max {max(complete):7.1f} ms  (all {shown} bookings drawn)",
            flush=True,
        )
    finally:
        if runner is not None:
            await runner.cleanup()
        await db.close()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
