"""1,000 Reservations applied through the Kubernetes API: seconds until every one is placed.

The real operator (kopf handlers, projector, reconciler) runs against the Kubernetes API
stand-in of the tests (kmock, over real HTTP) and an embedded PostgreSQL (or
``DATABASE_URL``). The pool has enough GPUs for every reservation, so each one places; the
figure is the time from the first ``POST`` until the last Reservation's ``status.state`` says
it was placed (``placed``, or ``binding`` once its window started), as ``kubectl get rsv``
would show. Target: ≤ 20 s for 1,000.

    .venv/bin/python bench/operator_apply.py [--reservations 1000]

(Not ``bench/operator.py``: run as a script, that name would shadow the standard library's
``operator`` module.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
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


async def _until(emulator: ApiServerStandIn, done: Callable[[], bool]) -> None:
    """Wait, woken by each write the stand-in commits, until ``done()``."""
    while True:
        seen = emulator.revision
        if done():
            return
        await emulator.written(since=seen)


async def run(count: int, dsn: str) -> None:
    emulator = ApiServerStandIn(request_history=16)
    emulator.declare_crds(CRDS_DIR)
    db = await Database.open(dsn, max_size=40)
    nodes = -(-count // GPUS_PER_NODE)
    async with emulator, kmock.Server(emulator, host="127.0.0.1") as server:
        url = str(server.url).rstrip("/")
        config = OperatorConfig(
            database_url=dsn,
            namespace=kubeworld.OPERATOR_NAMESPACE,
            http_host="127.0.0.1",
            http_port=0,
            webhook_host="127.0.0.1",
            webhook_port=_free_port(),
            standalone=True,
            api_server=url,
            api_token=TOKEN,
        )
        async with (
            httpx.AsyncClient(base_url=url, timeout=30) as client,
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
            await _until(
                emulator,
                lambda: (
                    (emulator.stored(GPUPOOLS, None, "h100") or {}).get("status", {}).get("nodes")
                    == nodes
                ),
            )
            print(f"{nodes} GPU nodes × {GPUS_PER_NODE} ready; applying {count} Reservations")

            started_at = time.perf_counter()
            path = RESERVATIONS.path(namespace="ml")
            sem = asyncio.Semaphore(32)

            async def apply(i: int) -> None:
                async with sem:
                    await _post(client, path, kubeworld.reservation(f"r{i:05d}").obj())

            await asyncio.gather(*(apply(i) for i in range(count)))
            applied_s = time.perf_counter() - started_at
            placed_at: dict[str, float] = {}
            while len(placed_at) < count:
                for i in range(count):
                    name = f"r{i:05d}"
                    if name in placed_at:
                        continue
                    obj = emulator.stored(RESERVATIONS, "ml", name)
                    if obj and (obj.get("status") or {}).get("state") in PLACED:
                        placed_at[name] = time.perf_counter() - started_at
                if time.perf_counter() - started_at > 300:
                    print(f"gave up after 300 s with {len(placed_at)} of {count} placed")
                    break
                await asyncio.sleep(0.05)
            times = sorted(placed_at.values())
            print(f"applied {count} Reservations in {applied_s:.1f} s")
            if times:
                print(
                    f"all {len(times)} placed after {times[-1]:.1f} s (target ≤ 20 s); "
                    f"half after {times[len(times) // 2]:.1f} s; "
                    f"{len(times) / times[-1]:.0f} Reservations/s end to end"
                )
    await db.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reservations", type=int, default=1000)
    args = parser.parse_args()
    url = os.environ.get("DATABASE_URL")
    if url:
        asyncio.run(run(args.reservations, url))
        return
    root = Path(tempfile.mkdtemp(prefix="bc-bench-pg-"))
    server = EmbeddedPostgres(root / "data", delete_on_stop=True)
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE bench_operator")
        info = psycopg.conninfo.conninfo_to_dict(server.dsn)
        info["dbname"] = "bench_operator"
        asyncio.run(run(args.reservations, psycopg.conninfo.make_conninfo(**info)))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
