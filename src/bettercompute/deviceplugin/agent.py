"""The node agent process: ``better-compute-deviceplugin``, the DaemonSet's entry point.

Why it exists: it is the composition root of the node side. ``started`` wires, in order:

1. the inventory (a simulated file, else NVML), read once so a bad file stops the start with a
   one-line error instead of a retry loop nobody reads; around it, the critical-XID watcher
   (``health``: NVML's events, in a thread the agent stops on its way out) and the look-up of
   NVIDIA's CDI devices (``nvidiacdi``) in ``--nvidia-cdi-dirs``;
2. the node key (created on first start), the API credentials, and whether the node can
   enforce host limits in cgroup v2 slices: only then does it advertise ``devices.limits``,
   and otherwise it logs why and says so in the GPUNode's ``HostLimitsEnforced`` condition;
3. the HTTP server for ``/metrics`` (the ``CollectorRegistry`` the plugin's metrics use),
   ``/healthz`` (the process answers) and ``/readyz`` (registered with the kubelet for every
   resource and the first converger pass done);
4. the GPUNode (``publishing``), created if missing: while the API cannot be reached the agent
   says so and retries with backoff; with ``--refuse-foreign``, first the check for
   another path to the node's GPUs (``foreign``), which stops the start (exit 1, the message
   naming what it found) before the agent registers anything with the kubelet;
5. the ``NodePlugin`` (converger, kubelet servers, registration) over the DeviceAllocation
   adapter (``watching``), whose watch wakes the converger, and the GPUNode publisher; with
   ``--dra``, also the DRA plugin for ``gpu.bcd.dev`` (``draserving``, registered through the
   kubelet's plugin watcher by ``draregistering``), reading claims through the same client and
   keeping its prepared claims in ``dra-claims.json`` beside the node key, and the
   ResourceSlice publisher (``draslices``), which publishes the bound dra devices;
6. the enroller (``enrolling``), which asks the operator's CA for the node certificate through
   a CertificateSigningRequest, keeps it beside the key and renews it.

``main`` reads flags with environment fallbacks and runs until SIGTERM or Ctrl-C; it stops the
kubelet servers, marks the GPUNode not Ready and closes its connections before it exits.

What it must never do: hold logic of its own (the parts decide), print a traceback for a
problem a person can fix, or leave a task running after ``started`` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging
import os
import signal
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Annotated

import typer
from aiohttp import web
from lightkube.config.kubeconfig import KubeConfig
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from bettercompute import logformat, supervising
from bettercompute.deviceplugin import (
    cgroups,
    converging,
    draclaims,
    draregistering,
    draserving,
    enrolling,
    health,
    nvidiacdi,
    registering,
    serving,
)
from bettercompute.deviceplugin.allocations import RESOURCES
from bettercompute.deviceplugin.devicefiles import DeviceFiles
from bettercompute.deviceplugin.draslices import SlicePublisher
from bettercompute.deviceplugin.foreign import ForeignExposure
from bettercompute.deviceplugin.health import (
    HealthChecked,
    NvmlXidEvents,
    XidEventSource,
    XidHealth,
)
from bettercompute.deviceplugin.inventory import (
    FileInventory,
    InventoryError,
    InventorySource,
    NvmlInventory,
)
from bettercompute.deviceplugin.podresources import POD_RESOURCES_SOCKET, PodResourcesClient
from bettercompute.deviceplugin.publishing import (
    CAPABILITIES,
    HEARTBEAT_SECONDS,
    LIMITS_CAPABILITY,
    NodePublisher,
    parse_labels,
)
from bettercompute.deviceplugin.running import DraSetup, NodePlugin
from bettercompute.deviceplugin.signing import NodeKey, SigningError
from bettercompute.deviceplugin.watching import AllocationObjects
from bettercompute.kube.client import (
    CredentialsError,
    KubeClient,
    KubeError,
    kube_config,
    server_of,
)

log = logging.getLogger("bettercompute.deviceplugin.agent")  # the same under python -m


class AgentError(Exception):
    """The agent cannot start; the message says what to fix."""


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Everything the agent is told; ``main`` fills it from flags and the environment."""

    node_name: str
    #: Where the operator writes DeviceAllocations (its own namespace).
    namespace: str = "better-compute"
    #: A simulated inventory (YAML or JSON); None: ask NVML.
    inventory_file: Path | None = None
    plugin_dir: Path = serving.DEVICE_PLUGIN_DIR
    pod_resources_socket: Path = POD_RESOURCES_SOCKET
    cdi_dir: Path = Path("/etc/cdi")
    env_dir: Path = Path("/run/bcd/allocations")
    node_key: Path = Path("/var/lib/bcd/node-key.pem")
    #: Where the node certificate is kept; None: ``node-cert.pem`` beside the key.
    node_certificate: Path | None = None
    #: Ask for a node certificate through the CSR API (off: reports are signed but carry none).
    enrol: bool = True
    #: The lifetime the node certificate is asked for (the operator may give less).
    certificate_lifetime: dt.timedelta = enrolling.LIFETIME
    #: The host's cgroup v2 root, where each hold with limits gets its slice.
    cgroup_root: Path = cgroups.DEFAULT_ROOT
    #: Which slices this agent made (one empty file each), so it removes only its own.
    slice_records: Path = cgroups.DEFAULT_RECORDS
    #: /metrics, /healthz, /readyz; port 0 picks a free one.
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9400
    #: Labels for a GPUNode the agent creates (and merged into an existing one); None: copy
    #: the Kubernetes Node's labels when the agent may read them.
    node_labels: Mapping[str, str] | None = None
    capabilities: tuple[str, ...] = CAPABILITIES
    #: An explicit API server (tests, a proxy), else $KUBECONFIG, else the service account.
    api_server: str | None = None
    api_token: str | None = None
    kubeconfig: Path | None = None
    heartbeat_s: float = HEARTBEAT_SECONDS
    inventory_interval_s: float = 5.0
    #: Where NVIDIA's CDI specs are looked for; empty: not looked for (env-only).
    nvidia_cdi_dirs: tuple[Path, ...] = nvidiacdi.DEFAULT_DIRS
    #: Watch NVML's critical XID events (an NVML inventory only, unless events are given).
    xid_health: bool = True
    #: XIDs to ignore besides the application faults NVIDIA's plugin ignores.
    skip_xids: frozenset[int] = frozenset()
    #: How long a GPU an XID marked must read well, with no new XID, to be healthy again.
    health_recovery_s: float = health.RECOVERY_SECONDS
    pass_seconds: float = converging.PASS_SECONDS
    register_poll_seconds: float = registering.POLL_SECONDS
    #: Serve the DRA plugin (pools with ``policy.kubernetes.api: dra``).
    dra: bool = False
    kubelet_plugins_dir: Path = draserving.KUBELET_PLUGINS_DIR
    kubelet_registry_dir: Path = draregistering.KUBELET_REGISTRY_DIR
    #: The prepared claims' checkpoint; None: ``dra-claims.json`` beside the node key.
    dra_checkpoint: Path | None = None
    #: Refuse to start where another path already hands this node's GPUs to pods (another
    #: device plugin's socket, another vendor's GPU resource on the Node, a GPU DRA driver's
    #: ResourceSlice). Off: start anyway, with the GPUNode's ForeignGpuExposure condition True.
    refuse_foreign_exposure: bool = False

    def dra_setup(self, reader: draserving.ClaimReader) -> DraSetup | None:
        if not self.dra:
            return None
        return DraSetup(
            reader=reader,
            plugins_dir=self.kubelet_plugins_dir,
            registry_dir=self.kubelet_registry_dir,
            checkpoint=self.dra_checkpoint or self.node_key.parent / draclaims.CHECKPOINT_NAME,
        )


@dataclasses.dataclass
class Agent:
    """A running agent: its parts and the URL of its HTTP server."""

    config: AgentConfig
    plugin: NodePlugin
    publisher: NodePublisher
    objects: AllocationObjects
    client: KubeClient
    registry: CollectorRegistry
    url: str
    tasks: list[asyncio.Task[None]]
    enroller: enrolling.Enroller | None = None
    #: With ``--dra``: keeps this node's ResourceSlices equal to its bound dra devices.
    slices: SlicePublisher | None = None
    #: The node certificate in use (PEM), once the operator issued one.
    certificate_pem: bytes | None = None

    def use_certificate(self, pem: bytes) -> None:
        """A new node certificate: every report signed from now on carries it, and the ones
        already sent go again with it."""
        changed = pem != self.certificate_pem
        self.certificate_pem = pem
        if changed:
            self.plugin.converger.report_again()

    def use_key(self, key: NodeKey) -> None:
        """A new node key (its certificates were revoked): reports are signed with it, and
        carry no certificate until the new one arrives."""
        self.plugin.converger.key = key
        self.certificate_pem = None

    def certificate(self) -> str | None:
        """The certificate the converger sends with each signature (None until enrolled)."""
        return self.certificate_pem.decode("ascii") if self.certificate_pem else None

    def not_ready(self) -> str | None:
        """Why ``/readyz`` fails, or None when ready."""
        if not self.plugin.rebuilt.is_set():
            return "the first pass over the node's DeviceAllocations has not completed"
        kubelet = registering.identity(self.plugin.registrar.kubelet_socket)
        done = {name for name, seen in self.plugin.registrar.registrations if seen == kubelet}
        missing = [r.name for r in RESOURCES if kubelet is None or r.name not in done]
        if missing:
            return f"not registered with the kubelet for {', '.join(missing)}"
        return None


def inventory_source(config: AgentConfig, *, xid: XidHealth | None = None) -> InventorySource:
    """The simulated file or NVML, judged by ``xid``'s events too when given, with NVIDIA's CDI
    devices looked up when ``nvidia_cdi_dirs`` names folders."""
    source: InventorySource
    if config.inventory_file is not None:
        source = FileInventory(path=config.inventory_file, node_name=config.node_name)
    else:
        source = NvmlInventory(node_name=config.node_name)
    if xid is not None:
        source = HealthChecked(source, xid)
    if config.nvidia_cdi_dirs:
        source = nvidiacdi.WithNvidiaCdi(source, dirs=config.nvidia_cdi_dirs)
    return source


def xid_health(config: AgentConfig, events: XidEventSource | None = None) -> XidHealth | None:
    """The critical-XID watcher: over ``events`` when given, else over NVML's for an NVML
    inventory; none for a simulated inventory (no driver to ask) or with ``xid_health`` off."""
    if not config.xid_health:
        return None
    if events is None:
        if config.inventory_file is not None:
            return None
        events = NvmlXidEvents()
    return XidHealth(
        events,
        skip=health.SKIPPED_XIDS | config.skip_xids,
        recovery_s=config.health_recovery_s,
    )


def refusal(found: str) -> str:
    """Why the agent does not start where ``found`` (``foreign.describe``'s message) hands
    this node's GPUs to pods, and the two ways on."""
    return (
        f"{found}; refusing to start (--refuse-foreign): turn that path off on this "
        "node (NVIDIA's GPU operator: label the node nvidia.com/gpu.deploy.device-plugin=false; "
        "docs/nvidia.md), or run beside it without --refuse-foreign (chart: "
        "devicePlugin.refuseForeignExposure=false) and the GPUNode's ForeignGpuExposure "
        "condition True"
    )


def _credentials(config: AgentConfig) -> tuple[KubeConfig, str]:
    try:
        return kube_config(
            api_server=config.api_server, api_token=config.api_token, kubeconfig=config.kubeconfig
        )
    except CredentialsError as e:
        raise AgentError(str(e)) from e


@contextlib.asynccontextmanager
async def started(
    config: AgentConfig, *, xid_events: XidEventSource | None = None
) -> AsyncIterator[Agent]:
    """The agent, running while the block runs; everything stops when it ends.
    ``xid_events``: where critical XIDs come from (None: NVML's, for an NVML inventory)."""
    if not config.plugin_dir.is_dir():
        raise AgentError(
            f"no device-plugin folder {config.plugin_dir}: mount the kubelet's "
            "/var/lib/kubelet/device-plugins there, or give --plugin-dir"
        )
    if config.dra and not config.kubelet_registry_dir.is_dir():
        raise AgentError(
            f"no plugin registry folder {config.kubelet_registry_dir}: mount the kubelet's "
            "/var/lib/kubelet/plugins_registry there, give --kubelet-registry-dir, or --no-dra"
        )
    xid = xid_health(config, xid_events)
    source = inventory_source(config, xid=xid)
    try:
        inventory = await asyncio.to_thread(source.read)
    except InventoryError as e:
        raise AgentError(f"cannot read the GPU inventory: {e}") from e
    try:
        key = await asyncio.to_thread(NodeKey.load_or_create, config.node_key)
    except SigningError as e:
        raise AgentError(str(e)) from e
    kube, where = _credentials(config)
    slices = cgroups.Cgroups(config.cgroup_root, records=config.slice_records)
    limits_problem = await asyncio.to_thread(slices.enforcement_problem)
    capabilities = config.capabilities
    if limits_problem is not None:
        capabilities = tuple(c for c in capabilities if c != LIMITS_CAPABILITY)
        log.warning(
            "host limits are not enforced, so %s is not advertised: %s",
            LIMITS_CAPABILITY,
            limits_problem,
        )
    log.info(
        "node %s: %d GPUs; node key %s; Kubernetes API %s from %s",
        config.node_name,
        len(inventory.gpus),
        key.key_id,
        server_of(kube),
        where,
    )
    async with contextlib.AsyncExitStack() as stack:
        try:
            client = KubeClient(kube)
        except CredentialsError as e:
            raise AgentError(f"{where}: {e}") from e
        stack.push_async_callback(client.close)
        foreign = ForeignExposure(
            client=client, node_name=config.node_name, plugin_dir=config.plugin_dir
        )
        if config.refuse_foreign_exposure:
            found = await foreign.check()
            if found is not None:
                raise AgentError(refusal(found))
        if xid is not None:
            xid.start()
            # Joining the thread takes up to one NVML wait: not on the event loop.
            stack.push_async_callback(asyncio.to_thread, xid.stop)
        registry = CollectorRegistry()

        def current_certificate() -> str | None:
            return agent.certificate()  # called by the converger once the agent exists

        objects = AllocationObjects(
            client=client, namespace=config.namespace, node_name=config.node_name
        )
        try:
            plugin = NodePlugin(
                node_name=config.node_name,
                inventory_source=source,
                desired=objects,
                reporter=objects,
                key=key,
                files=DeviceFiles(config.cdi_dir, cdi_dir=config.cdi_dir, env_dir=config.env_dir),
                registry=registry,
                plugin_dir=config.plugin_dir,
                pods=PodResourcesClient(socket_path=config.pod_resources_socket),
                pass_seconds=config.pass_seconds,
                inventory_interval_s=config.inventory_interval_s,
                register_poll_seconds=config.register_poll_seconds,
                retry_on=(OSError, KubeError),
                certificate=current_certificate,
                cgroups=None if limits_problem is not None else slices,
                no_limits_reason=f"this node does not enforce host limits: {limits_problem}",
                warnings=objects,
                dra=config.dra_setup(draserving.KubeClaimReader(client)),
            )
        except draclaims.CheckpointError as e:
            raise AgentError(str(e)) from e
        plugin.allocations.set_inventory(inventory)
        publisher = NodePublisher(
            client=client,
            node_name=config.node_name,
            registry=registry,
            labels=config.node_labels,
            capabilities=capabilities,
            heartbeat_s=config.heartbeat_s,
            limits_problem=limits_problem,
            foreign=foreign,
        )
        tasks: list[asyncio.Task[None]] = []
        agent = Agent(
            config=config,
            plugin=plugin,
            publisher=publisher,
            objects=objects,
            client=client,
            registry=registry,
            url="",
            tasks=tasks,
        )
        agent.url = await _serve_http(agent, stack)
        await publisher.connect()

        stack.push_async_callback(publisher.stopped)
        stack.push_async_callback(_stop_servers, plugin)
        stack.push_async_callback(supervising.cancel, tasks)
        tasks.append(
            supervising.task(objects.follow(wake=plugin.converger.wake), name="allocation-watch")
        )
        tasks.append(supervising.task(plugin.run(), name="node-plugin"))
        tasks.append(
            supervising.task(publisher.run(allocations=plugin.allocations), name="gpunode")
        )
        if config.dra:
            agent.slices = SlicePublisher(
                client=client, node_name=config.node_name, registry=registry
            )
            tasks.append(
                supervising.task(
                    agent.slices.run(allocations=plugin.allocations), name="resourceslices"
                )
            )
        if config.enrol:
            agent.enroller = enrolling.Enroller(
                client=client,
                node_name=config.node_name,
                key=key,
                certificate_file=config.node_certificate
                or enrolling.certificate_path(config.node_key),
                on_certificate=agent.use_certificate,
                key_file=config.node_key,
                on_key=agent.use_key,
                lifetime=config.certificate_lifetime,
            )
            # Restarted if anything unforeseen ends it: a node without a certificate is one
            # whose reports nobody can trust.
            tasks.append(supervising.restarting(agent.enroller.run, name="node-certificate"))
        yield agent


async def _serve_http(agent: Agent, stack: contextlib.AsyncExitStack) -> str:
    async def metrics(_: web.Request) -> web.Response:
        # On the loop, not in a thread: the gauges read Allocations, which only the loop
        # changes, and a scrape is a few hundred bytes.
        body = generate_latest(agent.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        problem = agent.not_ready()
        if problem is not None:
            return web.Response(status=503, text=f"not ready: {problem}\n")
        return web.Response(text="ready\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    host, port = agent.config.metrics_host, agent.config.metrics_port
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        raise AgentError(f"cannot serve /metrics on {host}:{port}: {e.strerror or e}") from e
    bound = int(runner.addresses[0][1])
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    url = f"http://{shown}:{bound}"
    log.info("serving /metrics, /healthz and /readyz on %s", url)
    return url


async def _stop_servers(plugin: NodePlugin) -> None:
    await plugin.stop_servers()


# --- better-compute-deviceplugin -------------------------------------------------------------

cli = typer.Typer(add_completion=False)


def _labels(text: str | None) -> dict[str, str] | None:
    if text is None:
        return None
    try:
        return parse_labels(text)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--node-labels") from None


def _xids(text: str) -> frozenset[int]:
    xids = set()
    for entry in filter(None, (part.strip() for part in text.split(","))):
        if not entry.isdigit():
            raise typer.BadParameter(f"{entry!r} is not an XID number", param_hint="--skip-xids")
        xids.add(int(entry))
    return frozenset(xids)


@cli.command()
def run(
    log_format: Annotated[
        str,
        typer.Option(
            envvar="BCD_LOG_FORMAT",
            help="text, or json: one JSON object per line (time, level, logger, message).",
        ),
    ] = "text",
    node_name: Annotated[
        str | None,
        typer.Option(
            envvar="NODE_NAME",
            help="This node's name, as Kubernetes knows it (set it from spec.nodeName).",
            show_default=False,
        ),
    ] = None,
    namespace: Annotated[
        str,
        typer.Option(envvar="POD_NAMESPACE", help="The operator's namespace (DeviceAllocations)."),
    ] = "better-compute",
    inventory_file: Annotated[
        Path | None,
        typer.Option(
            envvar="BCD_INVENTORY_FILE",
            help="A simulated GPU inventory (YAML, or JSON by its .json name) for a machine "
            "without GPUs; without it the agent asks the NVIDIA driver (NVML).",
        ),
    ] = None,
    plugin_dir: Annotated[
        Path,
        typer.Option(envvar="BCD_DEVICE_PLUGIN_DIR", help="The kubelet's device-plugin folder."),
    ] = serving.DEVICE_PLUGIN_DIR,
    pod_resources_socket: Annotated[
        Path,
        typer.Option(envvar="BCD_POD_RESOURCES_SOCKET", help="The kubelet's PodResources socket."),
    ] = POD_RESOURCES_SOCKET,
    cdi_dir: Annotated[
        Path, typer.Option(envvar="BCD_CDI_DIR", help="Where CDI specs are written.")
    ] = Path("/etc/cdi"),
    env_dir: Annotated[
        Path, typer.Option(envvar="BCD_ENV_DIR", help="Where allocation env files are written.")
    ] = Path("/run/bcd/allocations"),
    node_key: Annotated[
        Path,
        typer.Option(
            envvar="BCD_NODE_KEY",
            help="The node's Ed25519 key (PEM, mode 0600), created on first start; it signs "
            "every report. Keep it on the host.",
        ),
    ] = Path("/var/lib/bcd/node-key.pem"),
    node_certificate: Annotated[
        Path | None,
        typer.Option(
            envvar="BCD_NODE_CERTIFICATE",
            help="Where the node certificate (PEM) is kept; default: node-cert.pem beside the "
            "node key.",
            show_default=False,
        ),
    ] = None,
    enrol: Annotated[
        bool,
        typer.Option(
            envvar="BCD_ENROL",
            help="Ask the operator for a node certificate through a CertificateSigningRequest "
            "(signer bcd.dev/node-report) and renew it at 2/3 of its lifetime.",
        ),
    ] = True,
    certificate_lifetime_hours: Annotated[
        float,
        typer.Option(
            envvar="BCD_CERTIFICATE_LIFETIME_HOURS",
            min=1.0,
            help="The node certificate's lifetime to ask for, in hours (the operator may give "
            "less).",
        ),
    ] = enrolling.LIFETIME.total_seconds() / 3600,
    cgroup_root: Annotated[
        Path,
        typer.Option(
            envvar="BCD_CGROUP_ROOT",
            help="The host's cgroup v2 root (mounted read-write): each hold with host limits "
            "gets its slice bcd-alloc-<id>.slice there. Without a writable cgroup v2 the node "
            "does not advertise devices.limits.",
        ),
    ] = cgroups.DEFAULT_ROOT,
    slice_records: Annotated[
        Path,
        typer.Option(
            envvar="BCD_SLICE_RECORDS",
            help="Where the agent records the slices it made, so it removes only its own.",
        ),
    ] = cgroups.DEFAULT_RECORDS,
    metrics_port: Annotated[
        int,
        typer.Option(envvar="BCD_METRICS_PORT", help="Port of /metrics, /healthz and /readyz."),
    ] = 9400,
    metrics_host: Annotated[
        str, typer.Option(envvar="BCD_METRICS_HOST", help="Address of /metrics and the probes.")
    ] = "0.0.0.0",
    node_labels: Annotated[
        str | None,
        typer.Option(
            envvar="BCD_NODE_LABELS",
            help="Labels for this node's GPUNode, such as bcd.dev/pool=h100 (a GPUPool's "
            "nodeSelector matches them), comma-separated. Without it a new GPUNode copies the "
            "Kubernetes Node's labels, when the agent may read Nodes.",
            show_default=False,
        ),
    ] = None,
    heartbeat_seconds: Annotated[
        float,
        typer.Option(envvar="BCD_HEARTBEAT_SECONDS", help="How often GPUNode status is rewritten."),
    ] = HEARTBEAT_SECONDS,
    nvidia_cdi_dirs: Annotated[
        str,
        typer.Option(
            envvar="BCD_NVIDIA_CDI_DIRS",
            help="Folders holding NVIDIA's CDI specs (kind nvidia.com/gpu, from nvidia-ctk cdi "
            "generate or the GPU operator), comma-separated. Where they name the GPUs, "
            "Allocate asks for nvidia.com/gpu devices beside bcd.dev/gpu; empty: env-only.",
        ),
    ] = ",".join(str(d) for d in nvidiacdi.DEFAULT_DIRS),
    skip_xids: Annotated[
        str,
        typer.Option(
            envvar="BCD_SKIP_XIDS",
            help="Critical XIDs (NVML events) to ignore, comma-separated, besides the "
            "application faults NVIDIA's device plugin ignores (13, 31, 43, 45, 68, 109); "
            "'all': do not watch XID events (health from NVML reads only). A GPU reporting "
            "another is unhealthy until it has read well for --health-recovery-seconds.",
        ),
    ] = "",
    health_recovery_seconds: Annotated[
        float,
        typer.Option(
            envvar="BCD_HEALTH_RECOVERY_SECONDS",
            min=0.0,
            help="How long a GPU a critical XID made unhealthy must read well, with no new "
            "XID, before it is healthy again.",
        ),
    ] = health.RECOVERY_SECONDS,
    api_server: Annotated[
        str | None,
        typer.Option(envvar="BCD_API_SERVER", help="Kubernetes API server URL (overrides all)."),
    ] = None,
    api_token: Annotated[
        str | None, typer.Option(envvar="BCD_API_TOKEN", help="Bearer token for --api-server.")
    ] = None,
    dra: Annotated[
        bool,
        typer.Option(
            envvar="BCD_DRA",
            help="Serve the DRA plugin for driver gpu.bcd.dev (pools with policy.kubernetes.api: "
            "dra): register it in --kubelet-registry-dir and prepare the ResourceClaims the "
            "scheduler allocated this node's booked devices.",
        ),
    ] = False,
    refuse_foreign_exposure: Annotated[
        bool,
        typer.Option(
            "--refuse-foreign",
            envvar="BCD_REFUSE_FOREIGN_EXPOSURE",
            help="Exit at start (status 1) when another path already hands this node's GPUs "
            "to pods: another device plugin's socket in --plugin-dir, another vendor's GPU "
            "resource on the Node, a GPU DRA driver's ResourceSlice. Off: start anyway and "
            "say so in the GPUNode's ForeignGpuExposure condition.",
        ),
    ] = False,
    kubelet_plugins_dir: Annotated[
        Path,
        typer.Option(
            envvar="BCD_KUBELET_PLUGINS_DIR",
            help="The kubelet's plugins folder; the DRA socket is gpu.bcd.dev/dra.sock in it.",
        ),
    ] = draserving.KUBELET_PLUGINS_DIR,
    kubelet_registry_dir: Annotated[
        Path,
        typer.Option(
            envvar="BCD_KUBELET_REGISTRY_DIR",
            help="The kubelet plugin watcher's folder (plugins_registry).",
        ),
    ] = draregistering.KUBELET_REGISTRY_DIR,
    kubeconfig: Annotated[
        Path | None,
        typer.Option(
            envvar="KUBECONFIG",
            help="A kubeconfig (a token, a token file, a client certificate or an exec "
            "credential plugin such as EKS's, GKE's or AKS's). "
            "Without this or --api-server the pod's service account is used.",
        ),
    ] = None,
) -> None:
    """Run the node agent of a GPU node until SIGTERM or Ctrl-C (a DaemonSet's pod).

    It publishes the node's GPUs on its GPUNode (created if missing), follows the node's
    DeviceAllocations in the operator's namespace, writes each allocation's CDI spec and env
    file, advertises the devices of `binding: kubernetes` allocations to the kubelet as
    bcd.dev/gpu, bcd.dev/gpu.mig and bcd.dev/gpu.slot, keeps released devices booked while
    pods hold them, and reports every allocation on its DeviceAllocation, signed with the
    node key. It asks the operator for the node key's certificate through a
    CertificateSigningRequest and renews it before it expires.

    It needs the kubelet's device-plugin folder and PodResources socket, write access to the
    CDI and env folders, and RBAC to get, list and watch deviceallocations, patch
    deviceallocations/status, get, create and patch gpunodes and gpunodes/status, create, get,
    list and watch certificatesigningrequests (and get nodes, to copy their labels). With
    --dra it also serves the kubelet's DRA plugin API for gpu.bcd.dev, which needs the kubelet's
    plugins and plugins_registry folders and RBAC to get resourceclaims.

    Without a GPU, write a simulated inventory (gpus: [{uuid, index, model, memoryMiB,
    numaNode, nvlinkPeers, healthy, mig}]) and point the folders somewhere harmless:

    better-compute-deviceplugin --node-name gpu-node-1 --inventory-file node.yaml
    --plugin-dir /tmp/plugins --pod-resources-socket /tmp/pod-resources.sock --cdi-dir /tmp/cdi
    --env-dir /tmp/env --node-key /tmp/node-key.pem --node-labels bcd.dev/pool=h100
    --cgroup-root /tmp/cgroup --slice-records /tmp/slices

    Exit status: 0 after a clean stop; 1 when the agent cannot start or a part of it failed
    (the message says why); 2 for a missing node name or a bad flag.
    """
    if not node_name:
        typer.echo("Error: no node name: give --node-name or set NODE_NAME", err=True)
        raise typer.Exit(2)
    try:
        logformat.configure(level=os.environ.get("LOG_LEVEL", "INFO"), log_format=log_format)
    except ValueError as e:
        typer.echo(f"Error: --log-format: {e}", err=True)
        raise typer.Exit(2) from None
    config = AgentConfig(
        node_name=node_name,
        namespace=namespace,
        inventory_file=inventory_file,
        plugin_dir=plugin_dir,
        pod_resources_socket=pod_resources_socket,
        cdi_dir=cdi_dir,
        env_dir=env_dir,
        node_key=node_key,
        node_certificate=node_certificate,
        enrol=enrol,
        certificate_lifetime=dt.timedelta(hours=certificate_lifetime_hours),
        cgroup_root=cgroup_root,
        slice_records=slice_records,
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        node_labels=_labels(node_labels),
        heartbeat_s=heartbeat_seconds,
        nvidia_cdi_dirs=tuple(Path(d.strip()) for d in nvidia_cdi_dirs.split(",") if d.strip()),
        xid_health=skip_xids.strip() != "all",
        skip_xids=frozenset() if skip_xids.strip() == "all" else _xids(skip_xids),
        health_recovery_s=health_recovery_seconds,
        api_server=api_server,
        api_token=api_token,
        kubeconfig=kubeconfig,
        dra=dra,
        refuse_foreign_exposure=refuse_foreign_exposure,
        kubelet_plugins_dir=kubelet_plugins_dir,
        kubelet_registry_dir=kubelet_registry_dir,
    )
    try:
        failed = asyncio.run(_serve(config))
    except AgentError as e:
        typer.echo(f"Error: {e}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        failed = False
    if failed:
        raise typer.Exit(1)


async def _serve(config: AgentConfig) -> bool:
    """Run until a signal; whether a part of the agent failed on its own."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return await _run_until(config, stop)


async def _run_until(config: AgentConfig, stop: asyncio.Event) -> bool:
    stopping = asyncio.create_task(stop.wait())
    try:
        async with contextlib.AsyncExitStack() as stack:
            entering = asyncio.create_task(stack.enter_async_context(started(config)))
            await asyncio.wait({entering, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not entering.done():  # stopped while still connecting
                entering.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await entering
                return False
            agent = entering.result()
            await asyncio.wait([stopping, *agent.tasks], return_when=asyncio.FIRST_COMPLETED)
            crashed = [t for t in agent.tasks if t.done()]
            if crashed:
                log.error("stopping: %s ended", ", ".join(t.get_name() for t in crashed))
            else:
                log.info("stopping")
            return bool(crashed)
    finally:
        stopping.cancel()


def main() -> None:
    cli()


if __name__ == "__main__":  # python -m bettercompute.deviceplugin.agent
    main()
