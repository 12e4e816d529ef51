"""1,000 Reservations applied through the Kubernetes API: seconds until every one is placed.

The real operator (kopf handlers, projector, reconciler) runs against the Kubernetes API
stand-in of the tests (kmock, over real HTTP, in a process of its own) and an embedded
PostgreSQL (or ``DATABASE_URL``). The pool has a GPU for every reservation, and each books one
for an hour from tomorrow (the product's headline: a GPU booked for a future window). The figure
is the time from the first ``POST`` until the last Reservation's ``status.state`` says
``placed``, as ``kubectl get rsv`` would show. Target: ≤ 20 s for 1,000. The stand-in keeps
only the request it is serving (kmock matches each request against its whole history, which
would make the stand-in, not the operator, the thing measured).

    .venv/bin/python bench/operator_apply.py [--reservations 1000]

(Not ``bench/operator.py``: run as a script, that name would shadow the standard library's
``operator`` module.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx
import kmock
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support import kubeworld
from tests.support.kube import ApiServerStandIn
from tests.support.kubeobjects import GPUNODES, GPUPOOLS, RESERVATIONS
from tests.support.kubeserver import CRDS_DIR, TOKEN

from bettercompute.operator.config import OperatorConfig
from bettercompute.operator.running import started
from bettercompute.store.database import Database
from bettercompute.store.embedded import EmbeddedPostgres

GPUS_PER_NODE = 8
PLACED = {"placed", "binding", "active"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _post(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> None:
    response = await client.post(url, json=body)
    response.raise_for_status()


def _serve_stand_in(urls: multiprocessing.Queue[str], stop: multiprocessing.Event) -> None:  # type: ignore[type-arg]
    """The API stand-in in a process of its own, as a real API server is: the operator's loop
    then measures the operator, not the stand-in sharing its CPU."""

    async def serve() -> None:
        emulator = ApiServerStandIn(request_history=1)
        emulator.declare_crds(CRDS_DIR)
        async with emulator, kmock.Server(emulator, host="127.0.0.1") as server:
            urls.put(str(server.url).rstrip("/"))
            # A multiprocessing Event cannot be awaited: wait for it in a thread.
            await asyncio.to_thread(stop.wait)

    asyncio.run(serve())


async def run(count: int, dsn: str, url: str) -> None:
    db = await Database.open(dsn, max_size=40)
    nodes = -(-count // GPUS_PER_NODE)
    config = OperatorConfig(
        database_url=dsn,
        namespace=kubeworld.OPERATOR_NAMESPACE,
        http_host="127.0.0.1",
        http_port=0,
        metrics_host="127.0.0.1",
        metrics_port=0,
        webhook_host="127.0.0.1",
        webhook_port=_free_port(),
        standalone=True,
        api_server=url,
        api_token=TOKEN,
    )
    async with (
        httpx.AsyncClient(base_url=url, timeout=60) as client,
        started(config, db=db) as op,
    ):
        await op.ready.wait()
        await _post(client, "/api/v1/namespaces", kubeworld.namespace("ml", tenant="acme"))
        await _post(client, GPUPOOLS.path(), kubeworld.gpupool("h100", quota=count))
        for i in range(nodes):
            name = f"h100-node-{i:03d}"
            await _post(client, GPUNODES.path(), kubeworld.gpunode(name, pool="h100"))
            await client.patch(
                GPUNODES.path(name=name, subresource="status"),
                json={"status": kubeworld.gpunode_status(name)},
                headers={"Content-Type": "application/merge-patch+json"},
            )
        while len(op.runtime.applied_nodes) < nodes:  # noqa: ASYNC110 - another process writes
            await asyncio.sleep(0.1)
        print(f"{nodes} GPU nodes × {GPUS_PER_NODE} ready; applying {count} Reservations")

        # Windows that start tomorrow (the product's headline: book a GPU for a future window),
        # so what is measured is admission and projection, not the binding that follows a start.
        tomorrow_ms = int(time.time() * 1000) + 86_400_000
        started_at = time.perf_counter()
        path = RESERVATIONS.path(namespace="ml")
        sem = asyncio.Semaphore(16)

        applied_at: dict[str, float] = {}

        async def apply(i: int) -> None:
            async with sem:
                manifest = kubeworld.reservation(f"r{i:05d}").start(tomorrow_ms).obj()
                await _post(client, path, manifest)
                applied_at[manifest["metadata"]["name"]] = time.perf_counter() - started_at

        placed_at: dict[str, float] = {}

        async def watch_placements() -> None:
            # A watch, as kubectl get -w would: polling a list of 1,000 objects would load the
            # stand-in more than the operator does.
            query = {"watch": "true", "timeoutSeconds": "300"}
            async with client.stream("GET", path, params=query, timeout=None) as stream:
                async for line in stream.aiter_lines():
                    if not line:
                        continue
                    obj = json.loads(line)["object"]
                    if (obj.get("status") or {}).get("state") in PLACED:
                        name = obj["metadata"]["name"]
                        placed_at.setdefault(name, time.perf_counter() - started_at)
                        if len(placed_at) == count:
                            return

        watcher = asyncio.create_task(watch_placements())
        await asyncio.gather(*(apply(i) for i in range(count)))
        applied_s = time.perf_counter() - started_at
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(watcher, timeout=300)
        times = sorted(placed_at.values())
        lags = sorted(placed_at[n] - applied_at[n] for n in placed_at)
        print(f"applied {count} Reservations in {applied_s:.1f} s")
        if len(times) < count:
            print(f"gave up after 300 s with {len(times)} of {count} placed")
        if times:
            print(
                f"all {len(times)} placed after {times[-1]:.1f} s (target ≤ 20 s); "
                f"half after {times[len(times) // 2]:.1f} s; "
                f"{len(times) / times[-1]:.0f} Reservations/s end to end"
            )
            print(
                f"applied → placed in status, per Reservation: p50 {lags[len(lags) // 2]:.2f} s, "
                f"p99 {lags[int(len(lags) * 0.99)]:.2f} s"
            )
    await db.close()


def _with_stand_in(count: int, dsn: str) -> None:
    urls: multiprocessing.Queue[str] = multiprocessing.Queue()
    stop = multiprocessing.Event()
    server = multiprocessing.Process(target=_serve_stand_in, args=(urls, stop), daemon=True)
    server.start()
    try:
        asyncio.run(run(count, dsn, urls.get(timeout=30)))
    finally:
        stop.set()
        server.join(timeout=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reservations", type=int, default=1000)
    args = parser.parse_args()
    url = os.environ.get("DATABASE_URL")
    if url:
        _with_stand_in(args.reservations, url)
        return
    root = Path(tempfile.mkdtemp(prefix="bc-bench-pg-"))
    server = EmbeddedPostgres(root / "data", delete_on_stop=True)
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE bench_operator")
        info = psycopg.conninfo.conninfo_to_dict(server.dsn)
        info["dbname"] = "bench_operator"
        _with_stand_in(args.reservations, psycopg.conninfo.make_conninfo(**info))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
