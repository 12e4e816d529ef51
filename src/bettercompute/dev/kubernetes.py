"""``better-compute dev --kube``: a real Kubernetes control plane beside the dev stack.

Why it exists: a newcomer should be able to ``kubectl apply`` a Reservation against a real API
server on a laptop and watch it placed, without a cluster. With ``--kube``, once the dev stack
runs, this module

- starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler on 127.0.0.1
  (``dev.controlplane``; the binary the checkout built, never a download) in ``kube/`` of the
  state dir, a new cluster at every start;
- installs the Helm chart's CRDs, RBAC and webhook configurations, as ``helm install`` would,
  with the webhooks pointed at 127.0.0.1;
- runs the real operator, ``better-compute-operator``, as a process of its own under the
  chart's operator service account, on the dev stack's database, with its webhook server and
  HTTP API on 127.0.0.1: Reservations applied with kubectl reach the same service, the same
  pools and the same simulated nodes as the HTTP API;
- registers every simulated node as a Node, as its kubelet would (``system:node:<name>``),
  with capacity and allocatable for its devices (``bcd.dev/gpu``, ``bcd.dev/gpu.mig``,
  ``bcd.dev/gpu.slot``), and heartbeats them;
- writes an admin kubeconfig, and says where it and kubectl are (``print_banner``).

The dev configuration stays the source of the world: pools, quotas, tenants and nodes come
from it, not from GPUPool, GPUQuota or GPUNode objects (there is no device plugin here; the
simulated nodes' agents bind). A Reservation names a pool of the configuration (the demo's
``pool_h100``) in a namespace labelled with a tenant (``examples/namespace.yaml``).

What it must never do: listen beyond 127.0.0.1, download or build anything, or leave a process
behind: every process it starts is ended when the block ends, and killed at once when the
command is forced to stop (a second Ctrl-C). It removes only the ``kube/`` directory it made.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from bettercompute import supervising
from bettercompute.dev.config import LoadedConfig
from bettercompute.dev.controlplane import binary, chart
from bettercompute.dev.controlplane.nodes import HEALTHY, KUBELET_VERSION, KubeletNode
from bettercompute.dev.controlplane.plane import ControlPlane, ControlPlaneError, free_port
from bettercompute.kube import names
from bettercompute.sim.inventories import SimNode

if TYPE_CHECKING:
    from bettercompute.dev.running import Dev

log = logging.getLogger(__name__)

#: The directory in the state dir; made new at every start, removed at the end.
DIRECTORY = "kube"
#: Written into it, so that only a directory this module made is ever emptied.
MARKER = ".better-compute-dev-kube"
#: The cluster's certificates and the operator's token last this long: a dev stack may run
#: for days, and the cluster is made new at every start anyway.
LIFETIME = dt.timedelta(days=30)
#: How long the operator has to say it is ready (its /readyz).
OPERATOR_READY_S = 120.0
#: The kubelet posts its node status this often; ours the same.
HEARTBEAT_S = 60.0
#: How long each process has to stop after SIGTERM before it is killed.
STOP_WAIT_S = 8.0
#: The Signals grace a dev stack with --kube has: the operator and four processes to stop.
GRACE_S = 15.0


class KubeError(Exception):
    """The control plane, the chart or the operator did not start; the message says why."""


@dataclass(frozen=True)
class KubeOptions:
    """What ``--kube`` was given."""

    #: ``--kube-binary``; without it ``$BCD_KUBE_BINARY``, then the checkout's build.
    binary: Path | None = None
    #: The chart; without it the checkout's.
    chart: Path | None = None

    def resolved(self) -> KubeOptions:
        """The binary and the chart found, and Helm's engine importable, before anything
        starts; a ``KubeError`` saying what is missing and how to get it otherwise."""
        try:
            found = KubeOptions(binary=binary.find(self.binary), chart=self.chart or chart.find())
            chart.engine()
        except (binary.BinaryMissing, chart.ChartError) as e:
            raise KubeError(str(e)) from None
        return found


@dataclass
class Kube:
    """The running cluster, as a person uses it."""

    url: str
    kubeconfig: Path
    kubectl: Path
    root: Path
    operator_url: str
    operator_log: Path
    nodes: tuple[str, ...]
    #: Lines to paste: the environment, then kubectl commands.
    try_lines: tuple[str, ...] = field(default=())


@contextlib.asynccontextmanager
async def beside(
    dev: Dev, options: KubeOptions | None, *, signals: supervising.Signals | None = None
) -> AsyncIterator[Kube | None]:
    """The cluster of ``dev`` while the block runs (``None`` without ``options``).

    A process of it that dies stops ``dev`` (a task in ``dev.tasks`` fails, naming it).
    """
    if options is None:
        yield None
        return
    async with started(
        options,
        state_dir=dev.state_dir,
        loaded=dev.loaded,
        nodes=dev.nodes,
        database_url=dev.db.dsn,
        tasks=dev.tasks,
        signals=signals,
    ) as kube:
        yield kube


@contextlib.asynccontextmanager
async def started(
    options: KubeOptions,
    *,
    state_dir: Path,
    loaded: LoadedConfig,
    nodes: Sequence[SimNode],
    database_url: str,
    tasks: list[asyncio.Task[None]],
    signals: supervising.Signals | None = None,
) -> AsyncIterator[Kube]:
    """Control plane, chart, operator and Nodes, stopped in reverse when the block ends."""
    options = options.resolved()
    path, chart_dir = options.binary, options.chart
    assert path is not None
    assert chart_dir is not None
    root = state_dir / DIRECTORY
    _prepare(root)
    plane = ControlPlane(root=root / "cluster", binary=path, lifetime=LIFETIME)
    operator: subprocess.Popen[bytes] | None = None

    def kill() -> None:
        # A forced stop: quick and synchronous, nothing awaited.
        if operator is not None and operator.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(operator.pid, signal.SIGKILL)
        plane.kill()

    if signals is not None:
        signals.on_force(kill)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        stack.push_async_callback(asyncio.to_thread, plane.stop)
        plane.root.mkdir(mode=0o700)
        try:
            await asyncio.to_thread(plane.start)
        except ControlPlaneError as e:
            raise KubeError(f"the Kubernetes control plane did not start: {e}") from None
        try:
            objects = await asyncio.to_thread(chart.render, chart_dir)
            applied = await asyncio.to_thread(
                chart.apply, plane, objects, chart=chart_dir, webhook_port=free_port()
            )
            token = await asyncio.to_thread(
                plane.service_account_token,
                chart.NAMESPACE,
                applied.operator_account,
                seconds=int(LIFETIME.total_seconds()),
            )
        except (chart.ChartError, OSError, ValueError) as e:
            raise KubeError(f"installing the chart {chart_dir}: {e}") from None

        policies = root / "policies"
        policies.mkdir()
        http_port = free_port()
        log_path = root / "operator.log"
        operator = _start_operator(
            _operator_args(
                plane,
                applied,
                loaded=loaded,
                policy_files=_write_policies(policies, loaded.policy_texts),
                http_port=http_port,
            ),
            env=_operator_env(database_url=database_url, token=token),
            log=log_path,
        )
        stack.push_async_callback(_stop_operator, operator)
        operator_url = f"http://127.0.0.1:{http_port}"
        await _operator_ready(operator, operator_url, log_path)

        registered = await _register_nodes(plane, nodes)
        kubeconfig = plane.admin_kubeconfig()
        watcher = asyncio.create_task(
            _watch(plane, operator, log_path, registered), name="kubernetes"
        )
        tasks.append(watcher)
        stack.push_async_callback(_cancel, watcher)
        kubectl = _kubectl(path, root)
        yield Kube(
            url=plane.url,
            kubeconfig=kubeconfig,
            kubectl=kubectl,
            root=root,
            operator_url=operator_url,
            operator_log=log_path,
            nodes=tuple(n.name for n in registered),
            try_lines=tuple(try_lines(kubeconfig, kubectl, loaded, checkout=chart_dir.parents[1])),
        )


def _prepare(root: Path) -> None:
    """An empty ``kube/``: the last run's is removed if it was ours (a forced stop leaves it)."""
    if root.exists():
        if not (root / MARKER).exists():
            raise KubeError(
                f"refusing to empty {root} for --kube: it was not made by better-compute dev "
                f"(no {MARKER} file in it); move it away"
            )
        shutil.rmtree(root)
    root.mkdir(mode=0o700)
    (root / MARKER).write_text("Made by better-compute dev --kube; emptied at every start.\n")


def _write_policies(directory: Path, texts: Sequence[str]) -> list[Path]:
    """The dev configuration's Cedar policies (the built-in ones first, when it keeps them)
    as files, for the operator's ``--policies``: both decide alike."""
    paths = []
    for i, text in enumerate(texts):
        path = directory / f"{i:02d}.cedar"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def _operator_args(
    plane: ControlPlane,
    applied: chart.Applied,
    *,
    loaded: LoadedConfig,
    policy_files: Sequence[Path],
    http_port: int,
) -> list[str]:
    """``better-compute-operator``'s flags: the chart's settings, our loopback addresses."""
    setting = applied.operator_setting
    root = next((t.id for t in loaded.config.tenants if t.root), None)
    args = [
        "--standalone",
        f"--namespace={chart.NAMESPACE}",
        "--no-default-policies",
        *(f"--policies={p}" for p in policy_files),
        "--http-host=127.0.0.1",
        f"--http-port={http_port}",
        "--webhook-host=127.0.0.1",
        f"--webhook-port={applied.webhook_port}",
        # The operator makes its webhook certificate, with 127.0.0.1 among its names, and
        # writes its CA into the configurations' caBundle, as in a cluster.
        f"--webhook-secret={setting('BCD_WEBHOOK_SECRET')}",
        f"--webhook-service={setting('BCD_WEBHOOK_SERVICE')}",
        "--webhook-extra-name=127.0.0.1",
        *(
            f"--webhook-configuration={name}"
            for name in setting("BCD_WEBHOOK_CONFIGURATIONS").split(",")
        ),
        f"--api-server={plane.url}",
        f"--api-ca={plane.ca}",
        f"--node-agent-service-account={setting('BCD_NODE_AGENT_SERVICE_ACCOUNT')}",
        f"--node-ca-secret={setting('BCD_NODE_CA_SECRET')}",
        *(f"--event-webhook-allow={entry}" for entry in loaded.config.webhooks.allow),
    ]
    if root is not None:
        args.append(f"--root-tenant={root}")
    return args


def _operator_env(*, database_url: str, token: str) -> dict[str, str]:
    """Secrets in the environment, never on the command line (``ps`` shows that)."""
    # The rest as dev has it (the HTTP server's and the database's limits); flags win.
    env = dict(os.environ)
    env.update(
        {
            "DATABASE_URL": database_url,
            "BCD_API_TOKEN": token,
            # /metrics on a free loopback port (never dev's own metrics port).
            "BCD_METRICS_HOST": "127.0.0.1",
            "BCD_METRICS_PORT": "0",
        }
    )
    return env


def _operator_command() -> list[str]:
    """``better-compute-operator`` of this very installation."""
    script = Path(sys.executable).parent / "better-compute-operator"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-c", "from bettercompute.programs import operator; operator()"]


def _start_operator(
    args: Sequence[str], *, env: Mapping[str, str], log: Path
) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [*_operator_command(), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env),
            # Its own process group: a Ctrl-C in the terminal reaches dev, which stops it.
            start_new_session=True,
        )


def _tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _exited(operator: subprocess.Popen[bytes], log: Path) -> KubeError:
    return KubeError(
        f"the operator exited with {operator.returncode} (its log: {log}):\n{_tail(log)}"
    )


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


async def _operator_ready(operator: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + OPERATOR_READY_S
    while time.monotonic() < deadline:
        if operator.poll() is not None:
            raise _exited(operator, log)
        if await asyncio.to_thread(_http_ok, f"{url}/readyz"):
            return
        await asyncio.sleep(0.25)
    raise KubeError(
        f"the operator was not ready within {OPERATOR_READY_S:.0f} s (its log: {log}):\n"
        f"{_tail(log)}"
    )


async def _stop_operator(operator: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the operator stops in order), then SIGKILL after ``STOP_WAIT_S``."""
    if operator.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(operator.pid, signal.SIGTERM)
    try:
        await asyncio.to_thread(operator.wait, STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(operator.pid, signal.SIGKILL)
        await asyncio.to_thread(operator.wait)


def node_resources(node: SimNode) -> dict[str, dict[str, str]]:
    """What the device plugin of a simulated node would list: resource → device id → health
    (every simulated device is healthy)."""
    found: dict[str, dict[str, str]] = {}
    for atom in node.atoms:
        resource = names.RESOURCE_NAMES.get(atom.kind)
        if resource is not None:
            found.setdefault(resource, {})[atom.device_id] = HEALTHY
    return found


def node_host(node: SimNode) -> dict[str, str]:
    """The simulated host's CPUs and memory as the kubelet reports them."""
    host: dict[str, str] = {}
    if node.host.get("vcpu"):
        host["cpu"] = str(int(node.host["vcpu"]))
    if node.host.get("memoryGiB"):
        host["memory"] = f"{int(node.host['memoryGiB'])}Gi"
    return host


#: The label naming a node's pool, as the examples label GPU nodes.
POOL_LABEL = "bcd.dev/pool"


async def _register_nodes(plane: ControlPlane, nodes: Sequence[SimNode]) -> list[KubeletNode]:
    registered = []
    for sim in nodes:
        node = KubeletNode(
            plane,
            sim.name,
            labels={**sim.labels, POOL_LABEL: sim.pool_id},
            host=node_host(sim),
        )
        node.devices = node_resources(sim)
        await node.register()
        registered.append(node)
    return registered


async def _watch(
    plane: ControlPlane,
    operator: subprocess.Popen[bytes],
    log_path: Path,
    nodes: Sequence[KubeletNode],
) -> None:
    """Fail when a process dies (it stops dev, naming it); heartbeat the Nodes meanwhile."""
    beat = time.monotonic()
    while True:
        await asyncio.sleep(1.0)
        if operator.poll() is not None:
            raise _exited(operator, log_path)
        gone = plane.exited()
        if gone is not None:
            raise KubeError(f"{gone.name} exited with {gone.popen.returncode}:\n{gone.tail()}")
        if time.monotonic() - beat >= HEARTBEAT_S:
            beat = time.monotonic()
            for node in nodes:
                try:
                    await node.publish()
                except Exception as e:  # the next beat tries again; a dead server is seen above
                    log.warning("the heartbeat of Node %s failed: %s", node.name, e)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


def _kubectl(path: Path, root: Path) -> Path:
    """The build's ``kubectl`` beside the binary, else a link to it in ``kube/bin``."""
    try:
        return binary.command(path, "kubectl")
    except FileNotFoundError:
        bin_dir = root / "bin"
        bin_dir.mkdir(exist_ok=True)
        link = bin_dir / "kubectl"
        link.symlink_to(path)
        return link


#: The demo's pool and tenant the dev example Reservation uses (examples/dev/reservation.yaml).
EXAMPLE_POOL, EXAMPLE_TENANT, EXAMPLE_NAMESPACE = "pool_h100", "acme", "ml"


def try_lines(
    kubeconfig: Path, kubectl: Path, loaded: LoadedConfig, *, checkout: Path
) -> list[str]:
    """Shell lines to paste: the environment, the nodes, an example Reservation applied and
    listed (the demo's; another configuration gets the namespace and a hint)."""
    lines = [
        f"export KUBECONFIG={shlex.quote(str(kubeconfig))} "
        f"PATH={shlex.quote(str(kubectl.parent))}:$PATH",
        "kubectl get nodes -L bcd.dev/pool",
    ]
    examples = checkout / "examples"
    namespace = _shown(examples / "namespace.yaml")
    config = loaded.config
    has_pool = any(
        p.id == EXAMPLE_POOL
        and (
            p.owner == EXAMPLE_TENANT
            or any(o.pool == p.id and o.tenant == EXAMPLE_TENANT for o in config.offers)
        )
        for p in config.pools
    )
    if has_pool:
        reservation = _shown(examples / "dev" / "reservation.yaml")
        lines.append(f"kubectl apply -f {namespace} -f {reservation}")
        lines.append(f"kubectl get rsv -n {EXAMPLE_NAMESPACE}")
    else:
        lines.append(
            f"# a namespace labelled {names.TENANT_LABEL}=<tenant> ({namespace}), then a "
            "Reservation naming one of the pools above in spec.poolId"
        )
    return lines


def _shown(path: Path) -> str:
    """``path`` relative to the current directory when it is below it."""
    try:
        return shlex.quote(str(path.relative_to(Path.cwd())))
    except ValueError:
        return shlex.quote(str(path))


def print_banner(console: Console, kube: Kube) -> None:
    """Where the cluster, its kubeconfig and kubectl are, and lines to paste."""
    say = console.print
    say(
        f"\n[bold]Kubernetes[/] {KUBELET_VERSION} (--kube) at [bold]{escape(kube.url)}[/]: "
        f"the chart's CRDs, RBAC and webhooks, the operator ({escape(kube.operator_url)}), "
        f"{len(kube.nodes)} simulated Nodes"
    )
    say(f"Kubeconfig: {escape(str(kube.kubeconfig))} (the cluster admin; new at every start)")
    say(f"kubectl:    {escape(str(kube.kubectl))}")
    say(f"Operator log: {escape(str(kube.operator_log))}")
    say("\n[bold]Try it with kubectl[/] (paste into another shell):")
    for line in kube.try_lines:
        say(Text(line, style="cyan"), soft_wrap=True)
