"""``better-compute dev``: the whole system on one machine, from one command.

Why: a newcomer must be able to reserve GPUs within a minute of installing, with nothing else
to set up. This is the composition root: it starts an embedded PostgreSQL on the state dir
(kept between runs, so a restart loses nothing), applies the dev configuration, builds the
reservation service with the configured Cedar policies and static tokens, and runs the
reconciler, one agent per simulated node, the HTTP API and, on a port of its own, ``/metrics``
(``api.metrics_server``: the figures name every tenant, so never on the API's port), until
Ctrl-C.

``run`` is the command (blocks, prints what to try, exits 0 on SIGINT/SIGTERM); ``started`` is
the same stack as an async context manager, for tests and embedding.

It survives its database (docs/operations.md): every loop retries store errors and is restarted
by the supervisor if it fails anyway, ``/readyz`` says 503 while PostgreSQL does not answer, and
a watchdog starts the embedded PostgreSQL again when it dies. Stopping: the first SIGINT or
SIGTERM stops everything in order within a few seconds; a second one (or the grace period
running out) stops PostgreSQL fast and exits at once. PostgreSQL never outlives the command.

What it must never do: show a traceback for a mistake a person can fix (a bad config, a port
in use, a state dir in use): those are one clear line and a non-zero exit. It never deletes a
directory it did not create (``--fresh`` only empties a state dir it marked as its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import errno
import fcntl
import functools
import json
import logging
import os
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from bettercompute import logformat, supervising
from bettercompute.api import serving
from bettercompute.api.app import make_app
from bettercompute.api.metrics_server import DEFAULT_PORT as DEFAULT_METRICS_PORT
from bettercompute.api.metrics_server import make_metrics_app
from bettercompute.core.attestation import Attestation, CertificateAuthority
from bettercompute.core.errors import StoreError
from bettercompute.dev import applying, kubernetes
from bettercompute.dev import config as dev_config
from bettercompute.dev.config import ConfigError, LoadedConfig
from bettercompute.deviceplugin.converging import Converger
from bettercompute.iam.identities import StaticTokenAuthenticator
from bettercompute.service import backing
from bettercompute.service.backing import Database, EmbeddedPostgres
from bettercompute.service.batching import PoolPlacer
from bettercompute.service.clusters import ClusterService
from bettercompute.service.collecting import Collector
from bettercompute.service.nodes import NodeService
from bettercompute.service.reconciling import Reconciler
from bettercompute.service.reservations import ReservationService
from bettercompute.service.webhooks import WebhookDelivery
from bettercompute.sim import inventories
from bettercompute.sim.agents import NodeAgentError, Wakeups, node_agent

log = logging.getLogger(__name__)

#: How often the watchdog looks whether the embedded PostgreSQL is still there.
POSTGRES_WATCH_S = 1.0

#: Where state lives when no ``--state-dir`` is given (``.state/`` is ignored by git).
DEFAULT_STATE_DIR = Path(".state") / "dev"
#: Written into a state dir this command created; ``--fresh`` empties only such a dir.
MARKER = ".better-compute-dev"
LOCK = "dev.lock"

#: The guide's create example ("Reserve GPUs", HTTP), with the demo pool filled in.
GUIDE_CREATE: Mapping[str, Any] = {
    "tenantId": "acme",
    "poolId": "pool_01k…",
    "devices": [{"class": "gpu", "count": 4, "topology": "nvlink-all"}],
    "duration": "8h",
    "idempotencyKey": "train-2026-09-24",
}


class DevError(Exception):
    """The stack cannot start; the message says why and what to do, for people."""


@dataclass
class Dev:
    """A running dev stack."""

    url: str
    host: str
    port: int
    #: Where ``/metrics`` is served (``{metrics_url}/metrics``), apart from the API.
    metrics_url: str
    metrics_port: int
    state_dir: Path
    loaded: LoadedConfig
    nodes: tuple[inventories.SimNode, ...]
    #: identity id → token
    tokens: dict[str, str]
    service: ReservationService
    db: Database
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def node_root(self, node_id: str) -> Path:
        """Where the agent of node ``node_id`` writes its CDI specs (``cdi/``) and env files
        (``run/allocations/``)."""
        node = next(n for n in self.nodes if n.id == node_id)
        return self.state_dir / "nodes" / node.name

    async def watch(self, stop: asyncio.Event) -> BaseException | None:
        """Wait until ``stop`` is set (``None``) or a background task dies (its exception)."""
        stopping = asyncio.create_task(stop.wait(), name="dev-stop")
        try:
            done, _ = await asyncio.wait(
                [stopping, *self.tasks], return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stopping.cancel()
        for task in done:
            if task is not stopping and not task.cancelled():
                return task.exception() or RuntimeError(f"{task.get_name()} stopped")
        return None


# --- the command ------------------------------------------------------------------------------


def run(
    *,
    port: int = 8080,
    metrics_port: int = DEFAULT_METRICS_PORT,
    sim: int = 2,
    config: Path | None = None,
    state_dir: Path | None = None,
    fresh: bool = False,
    host: str = "127.0.0.1",
    database_url: str | None = None,
    kube: kubernetes.KubeOptions | None = None,
) -> None:
    """Start the dev stack and block until SIGINT or SIGTERM, then stop it cleanly (exit 0).

    A mistake a person can fix (config, port, state dir) prints one line and exits 1.
    """
    _configure_logging()
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        failure = asyncio.run(
            _serve_until_stopped(
                port=port,
                metrics_port=metrics_port,
                sim=sim,
                config=config,
                state_dir=state_dir,
                fresh=fresh,
                host=host,
                database_url=database_url,
                kube=kube,
            )
        )
    except (ConfigError, DevError, kubernetes.KubeError) as e:
        err.print(f"[red]Error:[/red] {escape(str(e))}")
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        # Ctrl-C before the signal handlers were in place: nothing was started yet.
        err.print("Stopped.")
        return
    if failure is not None:
        err.print(f"[red]Error:[/red] the dev server stopped: {escape(str(failure))}")
        raise SystemExit(1)
    err.print("Stopped.")


async def _serve_until_stopped(
    *,
    port: int,
    metrics_port: int,
    sim: int,
    config: Path | None,
    state_dir: Path | None,
    fresh: bool,
    host: str,
    database_url: str | None,
    kube: kubernetes.KubeOptions | None = None,
) -> BaseException | None:
    # --kube: found before anything starts; the operator and the control plane have to stop too.
    kube = kube.resolved() if kube else None
    signals = supervising.Signals(grace_s=kubernetes.GRACE_S) if kube else supervising.Signals()
    signals.install()
    try:
        async with started(
            port=port,
            metrics_port=metrics_port,
            sim=sim,
            config=config,
            state_dir=state_dir,
            fresh=fresh,
            host=host,
            signals=signals,
            database_url=database_url,
        ) as dev:
            return await _until_stopped(dev, signals, kube=kube)
    finally:
        signals.remove()


async def _until_stopped(
    dev: Dev, signals: supervising.Signals, *, kube: kubernetes.KubeOptions | None
) -> BaseException | None:
    """Print the banner, then wait for a signal or a failure. With ``kube``, the cluster runs
    beside the stack meanwhile and stops before it (``dev/kubernetes.py``)."""
    async with kubernetes.beside(dev, kube, signals=signals) as cluster:
        print_banner(_stdout(), dev, kube=cluster)
        failure = await dev.watch(signals.stop)
        Console(stderr=True, highlight=False).print("Stopping…")
        return failure


# --- the stack --------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def started(
    *,
    port: int = 8080,
    metrics_port: int = DEFAULT_METRICS_PORT,
    sim: int = 2,
    config: Path | None = None,
    state_dir: Path | None = None,
    fresh: bool = False,
    host: str = "127.0.0.1",
    signals: supervising.Signals | None = None,
    database_url: str | None = None,
) -> AsyncIterator[Dev]:
    """The dev stack, running while the block runs; ``port=0`` takes a free port, and so does
    ``metrics_port=0`` for ``/metrics`` (served on ``host`` too, never on the API's port).

    Everything started is stopped when the block ends, in reverse order: the API, the node
    agents, the reconciler and the PostgreSQL watchdog, the connection pool, the embedded
    PostgreSQL. ``signals``, when given, stops PostgreSQL too if the process is forced to exit.

    With ``database_url`` the stack runs on that PostgreSQL instead of an embedded one (no
    watchdog: that server is someone else's to keep up); ``fresh`` is then refused, since dev
    never empties a database it did not create.
    """
    loaded = dev_config.load(config)
    nodes = tuple(dev_config.sim_nodes(loaded, sim=sim))
    engine = loaded.policy_engine()
    authenticator = StaticTokenAuthenticator(applying.callers(loaded))
    state = (state_dir or DEFAULT_STATE_DIR).expanduser().resolve()
    if port and port == metrics_port:
        raise DevError(f"--port and --metrics-port are both {port}: give them different ports")
    if port:
        _check_port(host, port)
    if metrics_port:
        _check_port(host, metrics_port, option="--metrics-port")
    try:
        limits = backing.limits_from_environ(os.environ)
        http_limits = serving.HttpLimits.from_environ(os.environ)
    except ValueError as e:
        raise DevError(str(e)) from None
    if database_url is not None and fresh:
        raise DevError(
            "--fresh empties only dev's own embedded PostgreSQL; with --database-url, empty "
            "that database yourself"
        )
    async with contextlib.AsyncExitStack() as stack:
        stack.enter_context(_locked(state))
        _prepare(state, fresh=fresh)
        pg: EmbeddedPostgres | None = None
        if database_url is None:
            pg = await _start_postgres(state / "pg")
            stack.push_async_callback(asyncio.to_thread, pg.stop)
            if signals is not None:
                # Forced, the process waits a second for a fast shutdown, then kills the server.
                signals.on_force(functools.partial(pg.kill_fast, wait_s=1.0))
        try:
            db = await backing.open_database(pg.dsn if pg else str(database_url), limits=limits)
        except StoreError as e:
            where = f"the embedded PostgreSQL in {state / 'pg'}" if pg else "--database-url"
            raise DevError(f"cannot open {where}: {e}") from e
        stack.push_async_callback(db.close)
        applied = await applying.apply(ClusterService(db), loaded, nodes=nodes)
        if applied.retired_nodes:
            log.info("nodes no longer simulated: %s", ", ".join(applied.retired_nodes))
        # A dev node-report authority, new each start: simulated nodes are certified by it and
        # their bound reports checked exactly as the operator checks real nodes'.
        authority = CertificateAuthority.generate(
            now=dt.datetime.now(dt.UTC), name="bcd dev node-report CA"
        )
        service = await ReservationService.start(
            db=db,
            policy=engine,
            budget=backing.budget_check(db),
            attestation=Attestation(authorities=(authority.certificate,)),
            # An internal webhook URL is refused when a subscription is made, not only when
            # delivered, unless the dev config's webhooks.allow takes it.
            webhook_allowlist=loaded.config.webhooks.policy(),
        )
        stack.push_async_callback(service.close)

        tasks: list[asyncio.Task[None]] = []
        stack.push_async_callback(supervising.cancel, tasks)
        if pg is not None:
            embedded = pg
            tasks.append(
                supervising.restarting(lambda: keep_postgres_up(embedded), name="postgres-watchdog")
            )
        tasks.append(supervising.restarting(Reconciler(db).run, name="reconciler"))
        placer = PoolPlacer(db, signals=service.signals)
        tasks.append(supervising.restarting(placer.run, name="placer"))
        tasks.append(supervising.restarting(Collector(db).run, name="collector"))
        delivery = WebhookDelivery(db, egress=loaded.config.webhooks.policy())
        tasks.append(supervising.restarting(delivery.run, name="webhooks"))
        node_service = NodeService(db)
        agents: dict[str, Converger] = {}
        for node in nodes:
            try:
                agent = node_agent(
                    node,
                    root=state / "nodes" / node.name,  # as Dev.node_root
                    desired=node_service,
                    reports=service,
                    retry_on=(StoreError, OSError),
                    authority=authority,
                )
            except NodeAgentError as e:
                raise DevError(str(e)) from None
            agents[node.id] = agent
            tasks.append(supervising.restarting(agent.run, name=f"agent {node.name}"))
        wakeups = Wakeups(nodes=node_service, agents=agents)
        tasks.append(supervising.restarting(wakeups.run, name="agent-wakeups"))
        tasks.append(
            supervising.restarting(
                lambda: backing.reservation_changes(db, wakeups.changed), name="agent-hints"
            )
        )

        async def ready() -> bool:
            # Bounded well under a second: a probe must not wait on a database that is away.
            return not any(t.done() for t in tasks) and await db.reachable()

        app = make_app(
            service=service,
            authenticator=authenticator,
            ready=ready,
        )
        bound_port = await _listen(stack, app, http_limits, host, port, option="--port")
        # The metrics name every tenant (quota use, billed GPU-seconds): a port of their own.
        metrics_app = make_metrics_app(app, token=serving.metrics_token_from_env())
        bound_metrics_port = await _listen(
            stack, metrics_app, http_limits, host, metrics_port, option="--metrics-port"
        )
        yield Dev(
            url=f"http://{_url_host(host)}:{bound_port}",
            host=host,
            port=bound_port,
            metrics_url=f"http://{_url_host(host)}:{bound_metrics_port}",
            metrics_port=bound_metrics_port,
            state_dir=state,
            loaded=loaded,
            nodes=nodes,
            tokens={i.id: i.token for i in loaded.config.identities},
            service=service,
            db=db,
            tasks=tasks,
        )


async def keep_postgres_up(pg: EmbeddedPostgres, *, every_s: float = POSTGRES_WATCH_S) -> None:
    """Start the embedded PostgreSQL again whenever it dies, until cancelled.

    The connection pool and the LISTEN loops reconnect by themselves; until they do, requests
    get 503 and ``/readyz`` says not ready.
    """
    backoff = supervising.Backoff(first_s=0.5, max_s=5.0)
    while True:
        await asyncio.sleep(every_s)
        if pg.alive():
            continue
        log.warning("the embedded PostgreSQL (pid %s) died: starting it again", pg.pid)
        while True:
            try:
                await asyncio.to_thread(pg.restart)
                break
            except (OSError, subprocess.SubprocessError, AssertionError) as e:
                log.warning("the embedded PostgreSQL did not start yet, retrying: %s", e)
                await backoff.wait()
        backoff.reset()


async def _start_postgres(data_dir: Path) -> EmbeddedPostgres:
    try:
        # In a thread: initdb and pg_ctl take a second or two, and the loop has signals to see.
        return await asyncio.to_thread(EmbeddedPostgres, data_dir)
    except (OSError, subprocess.SubprocessError, AssertionError) as e:
        raise DevError(
            f"the embedded PostgreSQL did not start in {data_dir}: {e} (its log: "
            f"{data_dir / 'log'}); --fresh starts over with an empty database"
        ) from e


@contextlib.contextmanager
def _locked(state: Path) -> Iterator[None]:
    """One dev stack per state dir: two would run two sets of agents on one database."""
    state.mkdir(parents=True, exist_ok=True)
    fd = os.open(state / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DevError(
                f"another better-compute dev is already running on {state}; stop it, or give "
                "this one another --state-dir"
            ) from None
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _prepare(state: Path, *, fresh: bool) -> None:
    """Mark a new state dir as ours; with ``fresh``, empty it first (if it is ours)."""
    others = [p for p in state.iterdir() if p.name != LOCK]
    if fresh and others:
        if not (state / MARKER).exists():
            raise DevError(
                f"refusing to empty {state} for --fresh: it was not created by better-compute "
                "dev (no .better-compute-dev file in it)"
            )
        for path in others:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        others = []
    if not others:
        (state / MARKER).write_text("A better-compute dev state dir; --fresh may empty it.\n")


async def _listen(
    stack: contextlib.AsyncExitStack,
    app: web.Application,
    limits: serving.HttpLimits,
    host: str,
    port: int,
    *,
    option: str,
) -> int:
    """Serve ``app`` on ``host:port`` until ``stack`` closes; the port bound (0: a free one)."""
    try:
        return await serving.listen(stack, app, limits, host, port)
    except OSError as e:
        raise DevError(_listen_problem(host, port, e, option=option)) from None


def _check_port(host: str, port: int, *, option: str = "--port") -> None:
    """Fail before anything starts when the port is taken (the bind below still decides)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise DevError(f"cannot listen on {host}: {e.strerror}; check --host") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # As aiohttp binds: a port left in TIME_WAIT by the last run is free to reuse.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise DevError(_listen_problem(host, port, e, option=option)) from None


def _listen_problem(host: str, port: int, error: OSError, *, option: str = "--port") -> str:
    if error.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is already in use (another better-compute dev?); "
            f"choose another with {option}, for example {option} {port + 1}"
        )
    if error.errno == errno.EACCES:
        return f"not allowed to listen on port {port}; choose a port above 1023 with {option}"
    return f"cannot listen on {host}:{port}: {error.strerror or error}; check --host and {option}"


def _url_host(host: str) -> str:
    # The address to listen on is not always one to connect to.
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _stdout() -> Console:
    # Piped to a file, a table is not cut to 80 columns: ids and tokens stay whole.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 1000)


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logformat.formatter("text"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    # Our own activity (binds, releases) is what a person running dev wants to watch.
    logging.getLogger("bettercompute").setLevel(logging.INFO)


# --- what to print ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """Who and where the printed examples reserve."""

    identity: str
    token: str
    tenant: str
    pool: str


def example(dev: Dev) -> Example | None:
    """The first exclusive pool whose owner has an identity, and that identity (the demo's
    alice@acme and pool_h100)."""
    config = dev.loaded.config
    for pool in sorted(config.pools, key=lambda p: (p.sharing != "exclusive", p.archived)):
        identity = next((i for i in config.identities if i.tenant == pool.owner), None)
        if identity is not None:
            return Example(identity.id, identity.token, pool.owner, pool.id)
    return None


def try_it(dev: Dev) -> list[str]:
    """Shell lines a newcomer can paste: the environment, a CLI reserve and the guide's curl."""
    ex = example(dev)
    if ex is None:
        return []
    body = {**GUIDE_CREATE, "tenantId": ex.tenant, "poolId": ex.pool}
    return [
        f"export BETTER_COMPUTE_URL={shlex.quote(dev.url)} "
        f"BETTER_COMPUTE_TOKEN={shlex.quote(ex.token)}",
        f"better-compute reserve --tenant {shlex.quote(ex.tenant)} --pool "
        f"{shlex.quote(ex.pool)} --gpus 4 --for 8h --nvlink",
        f"curl -X POST {dev.url}/api/compute/reservations/create \\\n"
        '  -H "Authorization: Bearer $BETTER_COMPUTE_TOKEN" \\\n'
        '  -H "Content-Type: application/json" \\\n'
        '  -H "X-Better-Compute: 1" \\\n'
        f"  -d {shlex.quote(json.dumps(body, separators=(',', ':')))}",
    ]


def print_banner(console: Console, dev: Dev, *, kube: kubernetes.Kube | None = None) -> None:
    """Everything a newcomer needs: URL, tenants, pools, tokens, and lines to paste (printed
    unwrapped, so a narrow terminal does not break them); with ``kube``, the cluster's."""
    config = dev.loaded.config
    say = console.print
    say(f"[bold green]Better Compute dev[/] is running at [bold]{escape(dev.url)}[/]")
    say(f"Console: [bold]{escape(dev.url)}/console/[/] (sign in with a token below)")
    # On a port of its own: the figures name every tenant, so the API's port never shows them.
    say(f"Metrics: {escape(dev.metrics_url)}/metrics")
    source = (
        "the shipped demo" if dev.loaded.source == dev_config.demo_path() else dev.loaded.source
    )
    say(f"Config: {escape(str(source))}")
    say(f"State:  {escape(str(dev.state_dir))} (kept between runs; --fresh starts over)")
    tenants = ", ".join(f"{t.id} (root)" if t.root else t.id for t in config.tenants)
    say(f"\n[bold]Tenants[/]  {escape(tenants)}\n")
    pools = Table(box=None, padding=(0, 2), show_edge=False)
    for column in ("Pool", "Owner", "Region", "GPUs", "Nodes", "Offered to"):
        pools.add_column(column, style="bold" if column == "Pool" else None, no_wrap=True)
    for pool in config.pools:
        nodes = [n for n in dev.nodes if n.pool_id == pool.id]
        offered = ", ".join(o.tenant for o in config.offers if o.pool == pool.id) or "-"
        pools.add_row(
            escape(pool.id),
            escape(pool.owner),
            escape(pool.region),
            escape(f"{pool.model or ''} {pool.sharing}".strip()),
            escape(inventories.summary(nodes)),
            escape(offered),
        )
    say(pools)
    people = Table(box=None, padding=(0, 2), show_edge=False)
    for column in ("Identity", "Tenant", "Kind", "Token"):
        people.add_column(column, style="bold" if column == "Identity" else None, no_wrap=True)
    for identity in config.identities:
        people.add_row(
            escape(identity.id), escape(identity.tenant), identity.kind, escape(identity.token)
        )
    say()
    say(people)
    lines = try_it(dev)
    if lines:
        say("\n[bold]Try it[/] (paste into another shell):")
        for line in lines:
            say(Text(line, style="cyan"), soft_wrap=True)
    if kube is not None:
        kubernetes.print_banner(console, kube)
    say("\nPress Ctrl-C to stop.")
