"""1,000 Reservations applied through the Kubernetes API: seconds until every one is placed,
against the API server stand-in and against the real control plane, in one run.

The real operator (kopf handlers, projector, reconciler, in this process) runs on an embedded
PostgreSQL (or ``DATABASE_URL``: a database of its own is made there for each target) against
each API server in turn, with the same workload:

- ``stand-in``: the Kubernetes API stand-in of the tests (kmock, over real HTTP, in a process
  of its own). It keeps only the request it is serving (kmock matches each request against its
  whole history, which would make the stand-in, not the operator, the thing measured), and
  calls no webhooks;
- ``real``: etcd, kube-apiserver, kube-controller-manager and kube-scheduler of Kubernetes
  1.34 on loopback (``bettercompute.dev.controlplane``, the binary of
  ``python -m tests.controlplane.build``), with the chart installed as ``helm install`` would
  (CRDs, RBAC, the webhook configurations and the admission policy): every Reservation goes
  through the real admission chain, the operator's mutating and validating webhooks over TLS
  included, and the operator acts under the chart's service account. Its processes are its
  own, as the stand-in's process is.

The pool has a GPU for every reservation, and each books one for an hour from tomorrow (the
product's headline: a GPU booked for a future window). The figure is the time from the first
``POST`` until the last Reservation's ``status.state`` says ``placed``, as ``kubectl get rsv``
would show, seen through a watch. Target: ≤ 20 s for 1,000 on the stand-in. Printed: each
target's figures, then the ratio real / stand-in (this machine is shared and noisy: the ratio
of one run is the figure to compare).

    .venv/bin/python bench/operator_apply.py [--count 1000] [--against both|stand-in|real]

Without the control plane's binary the real target is skipped, saying how to build it.
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
import shutil
import socket
import ssl
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import kmock
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support import kubeworld
from tests.support.kube import ApiServerStandIn
from tests.support.kubeobjects import GPUNODES, GPUPOOLS, GPUQUOTAS, RESERVATIONS
from tests.support.kubeserver import CRDS_DIR, TOKEN

from bettercompute.dev.controlplane import binary, chart
from bettercompute.dev.controlplane.plane import ControlPlane
from bettercompute.operator.config import OperatorConfig
from bettercompute.operator.running import started
from bettercompute.store.database import Database
from bettercompute.store.embedded import EmbeddedPostgres

GPUS_PER_NODE = 8
PLACED = {"placed", "binding", "active"}
WATCH_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Target:
    """One API server: how to call it as its admin, and how the operator logs in to it."""

    name: str
    url: str
    #: httpx.AsyncClient keyword arguments (credentials, TLS).
    client: dict[str, Any]
    #: OperatorConfig fields beyond the common ones.
    operator: dict[str, Any]
    #: Reservations as a person writes them (the real mutating webhook stamps the requester)
    #: or as the webhook would have stamped them (the stand-in calls none).
    stamped: bool


@dataclass
class Result:
    target: str
    count: int
    applied_s: float
    placed: list[float] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)

    @property
    def all_placed_s(self) -> float | None:
        return self.placed[-1] if len(self.placed) == self.count else None


async def _post(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> None:
    response = await client.post(url, json=body)
    if response.is_error:
        raise RuntimeError(f"POST {url}: {response.status_code} {response.text[:500]}")


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


async def run(count: int, dsn: str, target: Target) -> Result:
    db = await Database.open(dsn, max_size=40)
    nodes = -(-count // GPUS_PER_NODE)
    settings: dict[str, Any] = {
        "database_url": dsn,
        "namespace": kubeworld.OPERATOR_NAMESPACE,
        "http_host": "127.0.0.1",
        "http_port": 0,
        "metrics_host": "127.0.0.1",
        "metrics_port": 0,
        "webhook_host": "127.0.0.1",
        "webhook_port": _free_port(),
        "standalone": True,
        "api_server": target.url,
        **target.operator,
    }
    config = OperatorConfig(**settings)
    try:
        async with (
            httpx.AsyncClient(base_url=target.url, timeout=60, **target.client) as client,
            started(config, db=db) as op,
        ):
            await op.ready.wait()
            await _post(client, "/api/v1/namespaces", kubeworld.namespace("ml", tenant="acme"))
            await _post(client, GPUQUOTAS.path(), kubeworld.gpuquota("acme", {"gpu:H100": count}))
            await _post(client, GPUPOOLS.path(), kubeworld.gpupool("h100"))
            for i in range(nodes):
                name = f"h100-node-{i:03d}"
                await _post(client, GPUNODES.path(), kubeworld.gpunode(name, pool="h100"))
                response = await client.patch(
                    GPUNODES.path(name=name, subresource="status"),
                    json={"status": kubeworld.gpunode_status(name)},
                    headers={"Content-Type": "application/merge-patch+json"},
                )
                response.raise_for_status()
            while len(op.runtime.applied_nodes) < nodes:  # noqa: ASYNC110 - the operator writes
                await asyncio.sleep(0.1)
            print(
                f"[{target.name}] {nodes} GPU nodes × {GPUS_PER_NODE} ready; "
                f"applying {count} Reservations",
                flush=True,
            )
            return await _apply_and_watch(client, target, count)
    finally:
        await db.close()


async def _apply_and_watch(client: httpx.AsyncClient, target: Target, count: int) -> Result:
    # Windows that start tomorrow (the product's headline: book a GPU for a future window), so
    # what is measured is admission and projection, not the binding that follows a start.
    tomorrow_ms = int(time.time() * 1000) + 86_400_000
    path = RESERVATIONS.path(namespace="ml")
    sem = asyncio.Semaphore(16)
    applied_at: dict[str, float] = {}
    placed_at: dict[str, float] = {}
    started_at = time.perf_counter()

    async def apply(i: int) -> None:
        async with sem:
            manifest = kubeworld.reservation(f"r{i:05d}").start(tomorrow_ms).obj()
            if not target.stamped:
                # As a person writes it: the mutating webhook stamps who asked.
                manifest["metadata"].pop("annotations", None)
            await _post(client, path, manifest)
            applied_at[manifest["metadata"]["name"]] = time.perf_counter() - started_at

    def seen(obj: Mapping[str, Any]) -> None:
        if (obj.get("status") or {}).get("state") in PLACED:
            placed_at.setdefault(obj["metadata"]["name"], time.perf_counter() - started_at)

    async def watch_placements() -> None:
        # A watch, as kubectl get -w would: polling a list of 1,000 objects would load the API
        # server more than the operator does. The real API server closes a watch whose reader
        # falls behind (this loop also runs the operator): it is watched again from the last
        # version seen, or listed again when that is gone.
        version = ""
        while len(placed_at) < count:
            if version:
                query = {"watch": "true", "resourceVersion": version}
            else:
                listed = await client.get(path)
                listed.raise_for_status()
                body = listed.json()
                for item in body["items"]:
                    seen(item)
                version = str((body.get("metadata") or {}).get("resourceVersion") or "0")
                continue
            query["timeoutSeconds"] = str(WATCH_S)
            async with client.stream("GET", path, params=query, timeout=None) as stream:
                async for line in stream.aiter_lines():
                    if not line:
                        continue
                    event = json.loads(line)
                    if event["type"] == "ERROR":  # 410 Gone: list again
                        version = ""
                        break
                    seen(event["object"])
                    version = event["object"]["metadata"]["resourceVersion"]
                    if len(placed_at) == count:
                        return
            # Closed by the server: watch again from the last version seen.
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch_placements())
    await asyncio.gather(*(apply(i) for i in range(count)))
    applied_s = time.perf_counter() - started_at
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(watcher, timeout=WATCH_S)
    watcher.cancel()
    return Result(
        target=target.name,
        count=count,
        applied_s=applied_s,
        placed=sorted(placed_at.values()),
        lags=sorted(placed_at[n] - applied_at[n] for n in placed_at if n in applied_at),
    )


def report(result: Result) -> None:
    times, lags = result.placed, result.lags
    print(f"[{result.target}] applied {result.count} Reservations in {result.applied_s:.1f} s")
    if len(times) < result.count:
        print(f"[{result.target}] gave up after {WATCH_S} s with {len(times)} placed")
    if times:
        print(
            f"[{result.target}] all {len(times)} placed after {times[-1]:.1f} s "
            f"(target ≤ 20 s for 1,000 on the stand-in); half after "
            f"{times[len(times) // 2]:.1f} s; {len(times) / times[-1]:.0f} Reservations/s "
            "end to end"
        )
    if lags:
        print(
            f"[{result.target}] applied → placed in status, per Reservation: "
            f"p50 {lags[len(lags) // 2]:.2f} s, p99 {lags[int(len(lags) * 0.99)]:.2f} s"
        )


# --- the targets ---------------------------------------------------------------------------


@contextlib.contextmanager
def stand_in() -> Iterator[Target]:
    urls: multiprocessing.Queue[str] = multiprocessing.Queue()
    stop = multiprocessing.Event()
    server = multiprocessing.Process(target=_serve_stand_in, args=(urls, stop), daemon=True)
    server.start()
    try:
        url = urls.get(timeout=30)
        yield Target(
            name="stand-in",
            url=url,
            client={"headers": {"Authorization": f"Bearer {TOKEN}"}},
            operator={"api_token": TOKEN},
            stamped=True,
        )
    finally:
        stop.set()
        server.join(timeout=5)


@contextlib.contextmanager
def real(path: Path) -> Iterator[Target]:
    """The real control plane with the chart installed; the operator under its account."""
    began = time.monotonic()
    with ControlPlane.running(binary=path) as plane:
        chart_dir = chart.find()
        webhook_port = _free_port()
        applied = chart.apply(
            plane, chart.render(chart_dir), chart=chart_dir, webhook_port=webhook_port
        )
        token = plane.service_account_token(chart.NAMESPACE, applied.operator_account)
        print(
            f"[real] control plane up and chart installed in {time.monotonic() - began:.1f} s",
            flush=True,
        )
        assert plane.admin is not None
        context = ssl.create_default_context(cafile=str(plane.ca))
        context.load_cert_chain(str(plane.admin.cert), str(plane.admin.key))
        setting = applied.operator_setting
        yield Target(
            name="real",
            url=plane.url,
            client={"verify": context},
            operator={
                "namespace": chart.NAMESPACE,
                "api_token": token,
                "api_ca": plane.ca,
                "webhook_port": webhook_port,
                "webhook_secret": setting("BCD_WEBHOOK_SECRET"),
                "webhook_service": setting("BCD_WEBHOOK_SERVICE"),
                "webhook_extra_names": ("127.0.0.1",),
                "webhook_configurations": tuple(setting("BCD_WEBHOOK_CONFIGURATIONS").split(",")),
                "node_agent_service_account": setting("BCD_NODE_AGENT_SERVICE_ACCOUNT"),
                "node_ca_secret": setting("BCD_NODE_CA_SECRET"),
            },
            stamped=False,
        )


# --- databases -----------------------------------------------------------------------------


@contextlib.contextmanager
def databases(server_dsn: str, targets: list[str]) -> Iterator[Mapping[str, str]]:
    """A new database per target on the server (dropped afterwards): name → DSN."""
    made: dict[str, str] = {}
    info = psycopg.conninfo.conninfo_to_dict(server_dsn)
    stem = f"bench_operator_{os.getpid()}"
    try:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            for name in targets:
                database = f"{stem}_{name.replace('-', '_')}"
                conn.execute(f'CREATE DATABASE "{database}"')
                made[name] = psycopg.conninfo.make_conninfo(**{**info, "dbname": database})
        yield made
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            for dsn in made.values():
                database = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
                conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


@contextlib.contextmanager
def server() -> Iterator[str]:
    url = os.environ.get("DATABASE_URL")
    if url:
        yield url
        return
    root = Path(tempfile.mkdtemp(prefix="bc-bench-pg-"))
    embedded = EmbeddedPostgres(root / "data", delete_on_stop=True)
    try:
        yield embedded.dsn
    finally:
        embedded.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--count",
        "--reservations",
        dest="count",
        type=int,
        default=1000,
        help="how many Reservations (default 1000)",
    )
    parser.add_argument(
        "--against",
        choices=("both", "stand-in", "real"),
        default="both",
        help="which API server(s), one after the other in this process (default both)",
    )
    args = parser.parse_args()
    targets = ["stand-in", "real"] if args.against == "both" else [args.against]
    path: Path | None = None
    if "real" in targets:
        try:
            path = binary.find()
        except binary.BinaryMissing as e:
            print(f"[real] skipped: {e}", flush=True)
            targets.remove("real")
    results: dict[str, Result] = {}
    with server() as dsn, databases(dsn, targets) as dsns:
        for name in targets:
            if name == "stand-in":
                with stand_in() as target:
                    results[name] = asyncio.run(run(args.count, dsns[name], target))
            else:
                assert path is not None
                with real(path) as target:
                    results[name] = asyncio.run(run(args.count, dsns[name], target))
            report(results[name])
    first, second = results.get("stand-in"), results.get("real")
    if first and second and first.all_placed_s and second.all_placed_s:
        print(
            f"real / stand-in: {second.all_placed_s / first.all_placed_s:.2f}x "
            f"({second.all_placed_s:.1f} s / {first.all_placed_s:.1f} s for {args.count} "
            f"Reservations; per Reservation p50 {second.lags[len(second.lags) // 2]:.2f} s / "
            f"{first.lags[len(first.lags) // 2]:.2f} s)"
        )


if __name__ == "__main__":
    main()
