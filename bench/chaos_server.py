"""The dev stack on a given ``DATABASE_URL``, as a process ``bench/chaos.py`` can kill.

Why: ``better-compute dev`` always brings its own embedded PostgreSQL; to run the chaos harness
against another PostgreSQL (a managed one, a different version) the same parts are composed
here around that URL: the dev config applied, the reservation service with its Cedar policies
and static tokens, the reconciler, one simulated agent per node and the HTTP API. It serves
until SIGINT or SIGTERM, then stops everything and exits 0 (1 when a part died).

What it must never do: create, drop or empty a database (it applies the config, as ``dev``
does: adds and updates, never deletes), or be used for anything but a scratch database.

    .venv/bin/python bench/chaos_server.py --database-url URL --config chaos.yaml --port 8090
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

from aiohttp import web

from bettercompute import supervising
from bettercompute.api.app import make_app
from bettercompute.dev import applying
from bettercompute.dev import config as dev_config
from bettercompute.iam.identities import StaticTokenAuthenticator
from bettercompute.service.nodes import NodeService
from bettercompute.service.reconciling import Reconciler
from bettercompute.service.reservations import ReservationService
from bettercompute.sim.binding import NodeAgent
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database, StoreError

log = logging.getLogger("chaos_server")


async def serve(args: argparse.Namespace) -> int:
    loaded = dev_config.load(args.config)
    nodes = tuple(dev_config.sim_nodes(loaded, sim=args.sim))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        db = await Database.open(args.database_url)
        stack.push_async_callback(db.close)
        await applying.apply(db, loaded, nodes=nodes)
        service = await ReservationService.start(
            db=db, policy=loaded.policy_engine(), budget=DatabaseBudget(db)
        )
        tasks: list[asyncio.Task[None]] = []
        stack.push_async_callback(supervising.cancel, tasks)
        tasks.append(supervising.task(Reconciler(db).run(), name="reconciler"))
        node_service = NodeService(db)
        for node in nodes:
            agent = NodeAgent(
                node_id=node.id,
                root=args.state_dir / "nodes" / node.name,
                desired=node_service,
                reports=service,
                retry_on=(StoreError, OSError),
            )
            tasks.append(supervising.task(agent.run(), name=f"agent {node.name}"))

        async def ready() -> bool:
            if any(t.done() for t in tasks):
                return False
            try:
                async with db.connection() as conn:
                    await conn.execute("SELECT 1")
            except StoreError:
                return False
            return True

        authenticator = StaticTokenAuthenticator(applying.callers(loaded))
        app = make_app(service=service, authenticator=authenticator, ready=ready)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, "127.0.0.1", args.port).start()
        print(f"serving on http://127.0.0.1:{args.port}", flush=True)
        stopping = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if stopping not in done:
            log.error("a part of the server stopped: %s", [t.get_name() for t in done])
            return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--database-url", required=True, help="a scratch database")
    parser.add_argument("--config", type=Path, required=True, help="a dev config file")
    parser.add_argument("--sim", type=int, default=2, help="simulated nodes for the first pool")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--state-dir", type=Path, required=True, help="the nodes' files")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
