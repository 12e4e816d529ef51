"""Creates per second and p50/p99 latency through the HTTP API, beside the same creates in-process.

Both runs do the guide's whole create sequence on one embedded PostgreSQL (or ``DATABASE_URL``)
with the pool and requests of ``bench/admission.py`` (one GPU for an hour each, in future
windows that still have room, so every create is placed):

* in-process: ``admission.run_level`` calls ``ReservationService.create`` from 32 tasks;
* HTTP: 32 httpx clients, one keep-alive connection each, POST the guide's JSON with a bearer
  token and ``X-Better-Compute: 1`` to ``make_app`` served by aiohttp on 127.0.0.1. The
  clients run in a child process, so their own JSON and HTTP work does not share the server's
  event loop (on a small machine they still share its CPUs, as PostgreSQL does).

    .venv/bin/python bench/http.py [--seconds 8] [--nodes 64] [--clients 32]

Why the lines before the imports: this file is named ``http.py``. Run as a script, its folder
comes first on ``sys.path``, and it would shadow the standard library's ``http`` package that
aiohttp and httpx import. So the folder is taken off ``sys.path`` first, and ``admission.py``
is loaded from its path.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import concurrent.futures  # noqa: E402
import importlib.util  # noqa: E402
import itertools  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
from aiohttp import web  # noqa: E402

from bettercompute.api.app import make_app  # noqa: E402
from bettercompute.core import ports  # noqa: E402
from bettercompute.iam import identities, policies  # noqa: E402
from bettercompute.service.reservations import ReservationService  # noqa: E402
from bettercompute.store.budgets import DatabaseBudget  # noqa: E402
from bettercompute.store.database import Database  # noqa: E402


def _load_admission() -> Any:
    spec = importlib.util.spec_from_file_location("bench_admission", _HERE / "admission.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


admission = _load_admission()

Result = tuple[int, float, list[float]]


# --- the clients (in a child process) ----------------------------------------------------------


def http_load(
    *, url: str, clients: int, seconds: float, base_ms: int, capacity: int, first: int
) -> Result:
    """``clients`` httpx clients creating for ``seconds``; indexes count up from ``first``."""
    return asyncio.run(
        _http_load(
            url=url,
            clients=clients,
            seconds=seconds,
            base_ms=base_ms,
            capacity=capacity,
            first=first,
        )
    )


async def _http_load(
    *, url: str, clients: int, seconds: float, base_ms: int, capacity: int, first: int
) -> Result:
    counter = itertools.count(first)
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds

    async def client_loop(c: int) -> None:
        headers = {"Authorization": f"Bearer bench-token-{c}", "X-Better-Compute": "1"}
        async with httpx.AsyncClient(
            base_url=url, headers=headers, timeout=60, limits=httpx.Limits(max_connections=1)
        ) as client:
            while time.perf_counter() < stop_at:
                i = next(counter)
                body = {
                    "tenantId": "acme",
                    "poolId": "pool_bench",
                    "devices": [{"class": "gpu", "count": 1}],
                    "duration": "1h",
                    "start": base_ms + (i // capacity) * admission.HOUR_MS,
                    "idempotencyKey": f"http-{i}",
                }
                t0 = time.perf_counter()
                response = await client.post("/api/compute/reservations/create", json=body)
                latencies.append(time.perf_counter() - t0)
                if response.status_code != 200 or response.json()["data"]["state"] != "placed":
                    raise RuntimeError(f"create {i}: {response.status_code} {response.text}")

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop(c) for c in range(clients)))
    return len(latencies), time.perf_counter() - t0, latencies


# --- the server and the side-by-side -----------------------------------------------------------


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per measured run")
    parser.add_argument("--nodes", type=int, default=64, help="nodes of 8 GPUs in the pool")
    parser.add_argument("--clients", type=int, default=32, help="concurrent callers")
    args = parser.parse_args()

    server, dsn = admission.bench_database("bc_bench_http")
    db = await Database.open(dsn, min_size=4, max_size=args.clients + 8)
    runner: web.AppRunner | None = None
    # Spawn, not fork: the child must not inherit this process's event loop and pool.
    clients = concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn")
    )
    try:
        await admission.setup(db, args.nodes)
        service = await ReservationService.start(
            db=db,
            policy=policies.CedarPolicyEngine.from_text(policies.DEFAULT_POLICIES),
            budget=DatabaseBudget(db),
        )
        tokens = {
            f"bench-token-{c}": ports.Caller(identity_id=f"http-{c}", tenant_id="acme")
            for c in range(args.clients)
        }
        runner = web.AppRunner(
            make_app(service=service, authenticator=identities.StaticTokenAuthenticator(tokens)),
            access_log=None,
        )
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        url = f"http://{host}:{port}"

        base_ms = int(time.time() * 1000) + 86_400_000
        counter = itertools.count()
        capacity = args.nodes * admission.GPUS_PER_NODE
        level = {"callers": args.clients, "counter": counter, "base_ms": base_ms}
        loop = asyncio.get_running_loop()

        http_runs = itertools.count(1)

        async def over_http(seconds: float) -> Result:
            # Indexes (so keys and windows) far beyond the in-process run's: no run shares a
            # key with another or fills a window another uses.
            first = next(http_runs) * 10_000_000
            result: Result = await loop.run_in_executor(
                clients, _call_http_load, url, args.clients, seconds, base_ms, capacity, first
            )
            return result

        # Warm-up: prepared statements, Cedar, the connection pool, the child process.
        await admission.run_level(service, seconds=1.0, capacity=capacity, **level)
        await over_http(1.0)

        print(
            f"http: reservations.create, 1 GPU x 1h each, pool of {args.nodes} nodes x "
            f"{admission.GPUS_PER_NODE} GPUs, {args.seconds:g} s per run, "
            f"{args.clients} concurrent callers, {os.cpu_count()} CPUs"
        )
        print(f"{'path':<14} {'creates':>8} {'creates/s':>10} {'p50 ms':>8} {'p99 ms':>8}")
        rows: dict[str, tuple[float, float]] = {}
        for name in ("in-process", "HTTP (httpx)"):
            if name == "in-process":
                n, elapsed, lat = await admission.run_level(
                    service, seconds=args.seconds, capacity=capacity, **level
                )
            else:
                n, elapsed, lat = await over_http(args.seconds)
            p50, p99 = admission.pct(lat, 50), admission.pct(lat, 99)
            rows[name] = (n / elapsed, p50)
            print(f"{name:<14} {n:>8} {n / elapsed:>10.0f} {p50:>8.2f} {p99:>8.2f}", flush=True)
        (direct, direct_p50), (http, http_p50) = rows["in-process"], rows["HTTP (httpx)"]
        print(
            f"HTTP costs {http_p50 - direct_p50:+.2f} ms at p50 and keeps "
            f"{100 * http / direct:.0f}% of the in-process creates/s"
        )
    finally:
        clients.shutdown()
        if runner is not None:
            await runner.cleanup()
        await db.close()
        if server is not None:
            server.stop()


def _call_http_load(
    url: str, clients: int, seconds: float, base_ms: int, capacity: int, first: int
) -> Result:
    # Positional, for run_in_executor.
    return http_load(
        url=url,
        clients=clients,
        seconds=seconds,
        base_ms=base_ms,
        capacity=capacity,
        first=first,
    )


if __name__ == "__main__":
    asyncio.run(main())
