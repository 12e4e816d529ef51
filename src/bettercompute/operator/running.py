"""The operator process: kopf handlers, the reconciler, the projector, the allocation sync,
the HTTP API and, on a port of its own, ``/metrics``, over one database, started and stopped
together.

``started`` is the composition root (the tests and the benchmark use it as a context manager);
``main`` is ``better-compute-operator``, which reads its settings from flags and environment
variables and runs until SIGTERM.

It survives its database (docs/operations.md): the reconciler, the projector, the allocation
sync and event delivery retry store errors and are restarted by the supervisor if they fail
anyway; ``/readyz`` says 503 while PostgreSQL does not answer. The first SIGTERM or SIGINT
stops it in order; a second one (or the grace period running out) exits at once.

What it must never do: hold a handler's logic, or leave a task running after it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import logging
import os
import signal
from collections.abc import AsyncIterator, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import kopf
import typer
from aiohttp import web

from bettercompute import logformat, supervising
from bettercompute.api import serving
from bettercompute.api.app import METRICS, make_app
from bettercompute.api.metrics_server import make_metrics_app
from bettercompute.core.attestation import Attestation
from bettercompute.core.egress import EgressPolicy
from bettercompute.core.errors import ComputeError, StoreError
from bettercompute.core.ports import PolicyEngine
from bettercompute.iam import policies
from bettercompute.kube import names
from bettercompute.kube.client import (
    SERVICE_ACCOUNT_DIR,
    CredentialsError,
    KubeClient,
    KubeError,
    from_kopf,
    in_cluster_server,
)
from bettercompute.operator import (
    certificates,
    claiming,
    handlers,
    kueuechecks,
    kueuesyncing,
    nodeca,
    nodecerts,
    webhookcerts,
)
from bettercompute.operator.allocating import AllocationSync
from bettercompute.operator.authenticating import TokenReviewAuthenticator
from bettercompute.operator.config import OperatorConfig
from bettercompute.operator.delegating import Delegations
from bettercompute.operator.projecting import Objects, Projector
from bettercompute.operator.reserving import ReservationDoor
from bettercompute.operator.runtime import Runtime
from bettercompute.service import backing
from bettercompute.service.backing import Database
from bettercompute.service.batching import PoolPlacer
from bettercompute.service.clusters import ClusterService
from bettercompute.service.collecting import Collector
from bettercompute.service.events import EventDelivery
from bettercompute.service.nodes import NodeService
from bettercompute.service.reconciling import Reconciler
from bettercompute.service.reservations import ReservationService
from bettercompute.service.webhooks import WebhookDelivery

log = logging.getLogger(__name__)


class OperatorError(Exception):
    """The operator cannot start; the message says what to fix."""


@dataclass
class Operator:
    """A running operator: its HTTP API's URL, its metrics' URL and its parts, for tests and
    the benchmark."""

    runtime: Runtime
    url: str
    #: Where ``/metrics`` is served (``{metrics_url}/metrics``): never the API's port.
    metrics_url: str
    tasks: list[asyncio.Task[None]]
    kopf_task: asyncio.Task[None]
    ready: asyncio.Event


def connection_info(
    config: OperatorConfig,
    *,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    environ: Mapping[str, str] | None = None,
) -> kopf.ConnectionInfo:
    """An explicit API server, else the pod's service account, else ``$KUBECONFIG``.

    kopf calls it again each time the API refuses its token, so the service account's token is
    read from its file each time: the kubelet rotates it, and a copy kept from the start would
    fail for good once it expires (kopf gives up on a token it saw refused)."""
    if config.api_server:
        return kopf.ConnectionInfo(
            server=config.api_server,
            ca_path=str(config.api_ca) if config.api_ca else None,
            token=config.api_token,
            scheme="Bearer" if config.api_token else None,
            default_namespace=config.namespace,
        )
    token_file = service_account_token(config, service_account_dir)
    if token_file is not None:
        ca_file = service_account_dir / "ca.crt"
        namespace_file = service_account_dir / "namespace"
        namespace = namespace_file.read_text().strip() if namespace_file.is_file() else ""
        return kopf.ConnectionInfo(
            server=in_cluster_server(os.environ if environ is None else environ),
            ca_path=str(ca_file) if ca_file.is_file() else None,
            token=token_file.read_text().strip() or None,
            default_namespace=namespace or None,
        )
    info = kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
    if info is None:
        raise OperatorError(
            "no Kubernetes API server: run in a pod with a service account, set KUBECONFIG, "
            "or give --api-server"
        )
    return info


def service_account_token(
    config: OperatorConfig, service_account_dir: Path = SERVICE_ACCOUNT_DIR
) -> Path | None:
    """The pod's token file, when the operator logs in with it."""
    token_file = service_account_dir / "token"
    return token_file if not config.api_server and token_file.is_file() else None


def policy_engine(config: OperatorConfig) -> policies.CedarPolicyEngine:
    texts = [] if config.no_default_policies else [policies.DEFAULT_POLICIES]
    for path in config.policy_files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise OperatorError(f"cannot read the policy file {path}: {e.strerror}") from e
    try:
        return policies.CedarPolicyEngine.from_texts(texts, validate=True)
    except (ValueError, ComputeError) as e:
        raise OperatorError(f"the Cedar policies are not valid: {e}") from e


def kopf_settings(
    config: OperatorConfig, *, certificates_kept: webhookcerts.WebhookCertificates | None = None
) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # Progress and the last-handled spec in annotations: status is the reservation's alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=names.KOPF_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.KOPF_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = names.FINALIZER
    # Our own Events say what happened; kopf's "Handler succeeded" would drown them.
    settings.posting.level = logging.WARNING
    settings.peering.name = config.peering_name
    settings.peering.priority = config.priority
    settings.peering.standalone = config.standalone
    settings.peering.mandatory = not config.standalone
    if config.webhook_port is not None and certificates_kept is not None:
        # The operator's own certificate: kopf loads the first pair into this context at
        # start; renewals are loaded into the same context in place.
        cert, key = certificates_kept.files()
        settings.admission.server = kopf.WebhookServer(
            addr=config.webhook_host,
            port=config.webhook_port,
            context=certificates_kept.context,
            certfile=str(cert),
            pkeyfile=str(key),
        )
    elif config.webhook_port is not None:
        tls = config.webhook_cert is not None and config.webhook_key is not None
        settings.admission.server = kopf.WebhookServer(
            addr=config.webhook_host,
            port=config.webhook_port,
            certfile=str(config.webhook_cert) if tls else None,
            pkeyfile=str(config.webhook_key) if tls else None,
            insecure=not tls,
        )
    return settings


@contextlib.asynccontextmanager
async def started(
    config: OperatorConfig,
    *,
    db: Database | None = None,
    policy: PolicyEngine | None = None,
    signals: supervising.Signals | None = None,
    certificate_clock: webhookcerts.Clock | None = None,
) -> AsyncIterator[Operator]:
    """The operator, running while the block runs; every part stops when it ends.

    ``db`` and ``policy`` replace the ones ``config`` names (tests share their database and
    count decisions); kopf's shutdown cancels every task started after it, so kopf is started
    last and stopped first. ``signals``, when given, keeps SIGINT and SIGTERM from kopf, which
    takes them for itself when it starts and would swallow the second one.
    """
    engine = policy or policy_engine(config)
    try:
        egress = EgressPolicy.parse(config.event_webhook_allow)
    except ValueError as e:
        raise OperatorError(f"--event-webhook-allow: {e}") from None
    connection = connection_info(config)
    try:
        kube = KubeClient(from_kopf(connection, token_file=service_account_token(config)))
    except CredentialsError as e:
        raise OperatorError(f"Kubernetes API {connection.server}: {e}") from e
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(kube.close)
        if db is None:
            try:
                db = await backing.open_database(
                    config.database_url, limits=backing.limits_from_environ(os.environ)
                )
            except (StoreError, ValueError) as e:
                raise OperatorError(f"cannot open the database: {e}") from e
            stack.push_async_callback(db.close)
        clusters = ClusterService(db)
        await clusters.ensure_root_tenant(config.root_tenant)
        service = await ReservationService.start(
            db=db,
            policy=engine,
            budget=backing.budget_check(db),
            attestation=await node_attestation(kube, config),
            # An internal webhook URL is refused when a subscription is made, not only when
            # delivered, unless the operator allowed it (--event-webhook-allow).
            webhook_allowlist=egress,
        )
        stack.push_async_callback(service.close)
        nodes = NodeService(db)
        objects = Objects()
        claims = claiming.ClaimTemplates(kube=kube, pool_api=clusters.kubernetes_api)
        projector = Projector(
            service=service, nodes=nodes, kube=kube, objects=objects, claims=claims
        )
        delegations = Delegations(kube)
        allocations = AllocationSync(
            service=service,
            nodes=nodes,
            kube=kube,
            namespace=config.namespace,
            resync_s=config.allocation_resync_s,
        )
        runtime = Runtime(
            config=config,
            login=functools.partial(connection_info, config),
            service=service,
            clusters=clusters,
            nodes=nodes,
            kube=kube,
            objects=objects,
            projector=projector,
            claims=claims,
            allocations=allocations,
            door=ReservationDoor(
                service=service, projector=projector, kube=kube, delegations=delegations
            ),
            signer=nodecerts.NodeSigner(
                kube=kube,
                agent=nodecerts.agent_username(config.namespace, config.node_agent_service_account),
                # Read for each signature: the same Secret the verifier trusts (node_attestation).
                authority=functools.partial(
                    nodeca.load_or_create_ca,
                    kube,
                    config.namespace,
                    config.node_ca_secret,
                    create=config.node_ca_create,
                ),
                lifetime=config.node_certificate_lifetime,
                revocation=nodes,
            ),
        )

        kueue_state = await _kueue_checks(config, runtime)

        def changed(rid: str) -> None:
            projector.mark(rid)
            allocations.mark_reservation(rid)
            if runtime.kueue is not None:
                runtime.kueue.wake()

        async def listen(_: Any) -> None:
            await backing.reservation_changes(db, changed)

        tasks: list[asyncio.Task[None]] = []
        stack.push_async_callback(supervising.cancel, tasks)
        # Loops that must never end: a failure is logged and the loop restarted.
        tasks.append(supervising.restarting(Reconciler(db).run, name="reconciler"))
        placer = PoolPlacer(db, signals=service.signals)
        tasks.append(supervising.restarting(placer.run, name="placer"))
        tasks.append(supervising.restarting(Collector(db).run, name="collector"))
        tasks.append(supervising.restarting(lambda: projector.run(listen=listen), name="projector"))
        tasks.append(supervising.restarting(allocations.run, name="allocations"))
        events = EventDelivery(db, subscriber="operator-events", handler=projector.announce)
        tasks.append(supervising.restarting(events.run, name="events"))
        delivery = WebhookDelivery(db, egress=egress)
        tasks.append(supervising.restarting(delivery.run, name="webhooks"))
        if runtime.kueue is not None:
            tasks.append(supervising.restarting(runtime.kueue.run, name="kueue-checks"))
        kept: webhookcerts.WebhookCertificates | None = None
        if config.webhook_port is not None and config.webhook_cert and config.webhook_key:
            # Ends on purpose, so that the process restarts with the new certificate.
            renewed = certificates.exit_when_renewed([config.webhook_cert, config.webhook_key])
            tasks.append(supervising.task(renewed, name="webhook-certificate"))
        elif config.webhook_port is not None and config.webhook_secret:
            kept = webhookcerts.WebhookCertificates(
                kube,
                namespace=config.namespace,
                secret_name=config.webhook_secret,
                names=config.webhook_names,
                configurations=config.webhook_configurations,
                clock=certificate_clock or webhookcerts.utc_now,
            )
            stack.callback(kept.close)
            try:
                await kept.refresh()
            except KubeError as e:
                raise OperatorError(f"the webhook certificate ({kept.where}): {e}") from e
            keeping = functools.partial(kept.run, interval_s=config.webhook_check_s)
            tasks.append(supervising.restarting(keeping, name="webhook-certificate"))

        stop, ready = asyncio.Event(), asyncio.Event()
        kopf_task = asyncio.create_task(
            _run_kopf(
                config=config,
                runtime=runtime,
                stop=stop,
                ready=ready,
                signals=signals,
                certificates_kept=kept,
            ),
            name="kopf",
        )
        # Pushed first, so it runs once kopf stopped (or was cut short): from then on a
        # handler of this kopf that still runs does nothing.
        stack.callback(setattr, runtime, "stopped", True)
        stack.push_async_callback(_stop_kopf, kopf_task, stop, signals)

        async def is_ready() -> bool:
            if not ready.is_set() or kopf_task.done() or any(t.done() for t in tasks):
                return False
            # Bounded well under a second: a probe must not wait on a database that is away.
            return await db.reachable()

        app = make_app(
            service=service,
            authenticator=TokenReviewAuthenticator(
                kube,
                tenant_group_prefix=config.tenant_group_prefix,
                delegations=delegations,
            ),
            ready=is_ready,
        )
        app[METRICS].kueue_checks_state(kueue_state)
        if config.webhook_cert:
            # Read once: a renewed certificate restarts the process (exit_when_renewed).
            expires = certificates.expiry(Path(config.webhook_cert))
            if expires is not None:
                app[METRICS].certificate_expires(expires)
        if kept is not None:
            held = kept
            # None while no certificate is held: the series is absent, never 0 ("expired").
            app[METRICS].certificate_expires(
                lambda: (
                    held.current.serving().not_valid_after_utc.timestamp()
                    if held.current is not None
                    else None
                )
            )
        try:
            http_limits = serving.HttpLimits.from_environ(os.environ)
        except ValueError as e:
            raise OperatorError(str(e)) from None
        url = await _listen(stack, app, http_limits, config.http_host, config.http_port)
        # The metrics name every tenant (quota use, billed GPU-seconds): on a port of their
        # own, which the chart exposes to Prometheus only, never on the API's.
        metrics_app = make_metrics_app(app, token=serving.metrics_token_from_env())
        metrics_url = await _listen(
            stack, metrics_app, http_limits, config.metrics_host, config.metrics_port
        )
        yield Operator(
            runtime=runtime,
            url=url,
            metrics_url=metrics_url,
            tasks=tasks,
            kopf_task=kopf_task,
            ready=ready,
        )


async def _listen(
    stack: contextlib.AsyncExitStack,
    app: web.Application,
    limits: serving.HttpLimits,
    host: str,
    port: int,
) -> str:
    """Serve ``app`` on ``host:port`` until ``stack`` closes; its URL (port 0: the one taken)."""
    try:
        bound = await serving.listen(stack, app, limits, host, port)
    except OSError as e:
        raise OperatorError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"http://{shown}:{bound}"


class _EveryTask(Collection["asyncio.Task[Any]"]):
    """Tells kopf that no task of the loop is its to stop but its own.

    ``kopf.operator`` treats every task created after it started as a sub-task of its own and
    cancels whatever is left when it exits: our HTTP API's connections, the reconciler's
    queries, a test's fixture teardown. Its root tasks stop their own sub-tasks; the rest of
    the process stops its parts itself.
    """

    def __contains__(self, item: object) -> bool:
        return True

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(())

    def __len__(self) -> int:
        return 0


async def node_attestation(kube: KubeClient, config: OperatorConfig) -> Attestation:
    """The trust bound reports are checked against: the node-report authority in its Secret
    (created on first start), and the grace after a node certificate's expiry."""
    try:
        authority = await nodeca.load_or_create_ca(
            kube, config.namespace, config.node_ca_secret, create=config.node_ca_create
        )
    except (KubeError, nodeca.NodeAuthorityError) as e:
        raise OperatorError(f"node-report authority: {e}") from e
    return Attestation(
        authorities=(authority.certificate,),
        grace=dt.timedelta(seconds=config.node_certificate_grace_s),
    )


async def _kueue_checks(config: OperatorConfig, runtime: Runtime) -> str:
    """Start the Kueue AdmissionCheck controller when asked and Kueue is served; its state
    (the metric's): ``running``, ``disabled`` or ``kueue-missing``. Never a failed start: a
    cluster without Kueue runs everything else."""
    if not config.kueue_admission_check:
        return "disabled"
    try:
        served = await kueuesyncing.kueue_served(runtime.kube)
    except KubeError as e:
        log.warning("Kueue admission checks are off: asking for Kueue's API failed: %s", e)
        return "kueue-missing"
    if not served:
        log.warning(
            "Kueue admission checks are off: the API server serves no kueue.x-k8s.io/v1beta1 "
            "AdmissionChecks (install Kueue, then restart the operator)"
        )
        return "kueue-missing"
    runtime.kueue = kueuesyncing.KueueChecks(
        kube=runtime.kube,
        service=runtime.service,
        nodes=runtime.nodes,
        clock=runtime.projector.clock,
        resync_s=config.kueue_resync_s,
    )
    log.info("Kueue admission checks are on (controllerName %s)", kueuechecks.CONTROLLER_NAME)
    return "running"


async def _run_kopf(
    *,
    config: OperatorConfig,
    runtime: Runtime,
    stop: asyncio.Event,
    ready: asyncio.Event,
    signals: supervising.Signals | None,
    certificates_kept: webhookcerts.WebhookCertificates | None = None,
) -> None:
    tasks = await kopf.spawn_tasks(
        registry=handlers.make_registry(
            node_certificates=config.node_certificates,
            pool_status_s=config.pool_status_s,
            kueue_checks=runtime.kueue is not None,
        ),
        settings=kopf_settings(config, certificates_kept=certificates_kept),
        clusterwide=True,
        memo=kopf.Memo(runtime=runtime),
        stop_flag=stop,
        ready_flag=ready,
    )
    if signals is not None:
        # kopf just took SIGINT/SIGTERM; ours stop kopf through ``stop`` and, the second
        # time, the whole process.
        signals.install()
    await kopf.run_tasks(tasks, ignored=_EveryTask())


async def _stop_kopf(
    task: asyncio.Task[None], stop: asyncio.Event, signals: supervising.Signals | None
) -> None:
    stop.set()
    # Within the process's grace period (a second signal ends it sooner). ``asyncio.wait``
    # neither cancels the task nor raises what it raised (a kopf already cancelled included).
    done, _ = await asyncio.wait({task}, timeout=3)
    if not done:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    # kopf may have installed SIGINT/SIGTERM handlers on the loop; the loop outlives it.
    if signals is not None:
        signals.install()
        return
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(signum)


# --- better-compute-operator ---------------------------------------------------------------

# One command: typer shows the command's help (below) as the program's.
cli = typer.Typer(add_completion=False)


@cli.command(
    help=(
        "Run the Better Compute operator until SIGTERM or Ctrl-C: the Reservation, GPUPool, "
        "GPUNode and DeviceAllocation handlers, the signer of node certificates "
        "(CertificateSigningRequests of bcd.dev/node-report), the admission webhooks "
        "(Reservations: /stamp, /check; pods: /pod-rewrite, /pod-check), the "
        "reconciler, the HTTP API (with /healthz and /readyz) and, on --metrics-port, "
        "/metrics, against the "
        "cluster of the pod's service account, or $KUBECONFIG, or --api-server. Install the "
        "CRDs first (kubectl apply -f crds/).\n\n"
        "Example: DATABASE_URL=postgresql://bcd@db/bcd better-compute-operator --standalone"
    )
)
def run(
    database_url: Annotated[
        str, typer.Option(envvar="DATABASE_URL", help="PostgreSQL URL (postgresql://…).")
    ],
    namespace: Annotated[
        str,
        typer.Option(envvar="POD_NAMESPACE", help="The namespace DeviceAllocations live in."),
    ] = "better-compute",
    root_tenant: Annotated[
        str, typer.Option(envvar="BCD_ROOT_TENANT", help="The platform team's tenant.")
    ] = "root",
    policies_: Annotated[
        list[Path] | None,
        typer.Option(
            "--policies",
            envvar="BCD_POLICY_FILES",
            help="Cedar policy files added after the built-in ones (repeat the flag).",
        ),
    ] = None,
    no_default_policies: Annotated[
        bool, typer.Option(help="Leave out the built-in policies.")
    ] = False,
    http_port: Annotated[
        int, typer.Option(envvar="BCD_HTTP_PORT", help="Port of the HTTP API and probes.")
    ] = 8080,
    metrics_port: Annotated[
        int,
        typer.Option(
            envvar="BCD_METRICS_PORT",
            min=0,
            max=65_535,
            help="Port of /metrics, apart from the HTTP API's (its figures name every tenant); "
            "0 picks a free one.",
        ),
    ] = 9464,
    metrics_host: Annotated[
        str,
        typer.Option(envvar="BCD_METRICS_HOST", help="Address /metrics listens on."),
    ] = "0.0.0.0",
    webhook_port: Annotated[
        int, typer.Option(envvar="BCD_WEBHOOK_PORT", help="Port of the admission webhooks.")
    ] = 9443,
    webhook_cert: Annotated[
        Path | None, typer.Option(envvar="BCD_WEBHOOK_CERT", help="TLS certificate (PEM).")
    ] = None,
    webhook_key: Annotated[
        Path | None, typer.Option(envvar="BCD_WEBHOOK_KEY", help="TLS private key (PEM).")
    ] = None,
    webhook_secret: Annotated[
        str | None,
        typer.Option(
            envvar="BCD_WEBHOOK_SECRET",
            help="Without --webhook-cert: make the webhook certificate and keep it in this "
            "Secret (in --namespace), renewing it in place months before it expires.",
        ),
    ] = None,
    webhook_service: Annotated[
        str,
        typer.Option(
            envvar="BCD_WEBHOOK_SERVICE",
            help="The Service the webhooks are reached through (the certificate's name).",
        ),
    ] = "better-compute-operator",
    webhook_configurations: Annotated[
        list[str] | None,
        typer.Option(
            "--webhook-configuration",
            envvar="BCD_WEBHOOK_CONFIGURATIONS",
            help="A Mutating-/ValidatingWebhookConfiguration whose caBundle to keep current "
            "(repeat; the variable takes names separated by spaces).",
        ),
    ] = None,
    # --- listening on one address (better-compute dev --kube: 127.0.0.1 only) ---
    http_host: Annotated[
        str, typer.Option(envvar="BCD_HTTP_HOST", help="Address the HTTP API listens on.")
    ] = "0.0.0.0",
    webhook_host: Annotated[
        str, typer.Option(envvar="BCD_WEBHOOK_HOST", help="Address the webhooks listen on.")
    ] = "0.0.0.0",
    webhook_extra_names: Annotated[
        list[str] | None,
        typer.Option(
            "--webhook-extra-name",
            envvar="BCD_WEBHOOK_EXTRA_NAMES",
            help="Another name or IP address for the webhook certificate made with "
            "--webhook-secret, beside the Service's (repeat; the variable takes names "
            "separated by spaces).",
        ),
    ] = None,
    # --- end of the listening options ---
    priority: Annotated[
        int, typer.Option(envvar="BCD_PEERING_PRIORITY", help="kopf peering priority.")
    ] = 0,
    standalone: Annotated[
        bool, typer.Option(help="Run without kopf peering (a single replica).")
    ] = False,
    api_server: Annotated[
        str | None, typer.Option(envvar="BCD_API_SERVER", help="Kubernetes API server URL.")
    ] = None,
    api_token: Annotated[
        str | None, typer.Option(envvar="BCD_API_TOKEN", help="Bearer token for --api-server.")
    ] = None,
    api_ca: Annotated[
        Path | None,
        typer.Option(
            envvar="BCD_API_CA",
            help="The CA file (PEM) that signed --api-server's certificate; default: the "
            "system's trust store.",
        ),
    ] = None,
    node_agent_service_account: Annotated[
        str,
        typer.Option(
            envvar="BCD_NODE_AGENT_SERVICE_ACCOUNT",
            help="The node agent's service account in the operator's namespace: only its "
            "node-bound tokens get node certificates.",
        ),
    ] = "better-compute-device-plugin",
    node_certificate_lifetime_hours: Annotated[
        float,
        typer.Option(
            envvar="BCD_NODE_CERTIFICATE_LIFETIME_HOURS",
            min=1.0,
            help="The longest node certificate signed, in hours.",
        ),
    ] = 168.0,
    node_certificate_grace_minutes: Annotated[
        float,
        typer.Option(
            envvar="BCD_NODE_CERTIFICATE_GRACE_MINUTES",
            min=0.0,
            help="How long after its expiry a node certificate's reports still count.",
        ),
    ] = 60.0,
    node_certificates: Annotated[
        bool,
        typer.Option(
            envvar="BCD_NODE_CERTIFICATES",
            help="Sign node certificates (CertificateSigningRequests of bcd.dev/node-report) "
            "and revoke them with their GPUNode.",
        ),
    ] = True,
    kueue_admission_check: Annotated[
        bool,
        typer.Option(
            envvar="BCD_KUEUE_ADMISSION_CHECK",
            help="Run the Kueue AdmissionCheck controller (controllerName bcd.dev/reservation) "
            "when the API server serves Kueue's v1beta1; without Kueue it stays off.",
        ),
    ] = False,
    node_ca_secret: Annotated[
        str,
        typer.Option(
            envvar="BCD_NODE_CA_SECRET",
            help="Secret (tls.crt, tls.key) in --namespace holding the node-report CA that "
            "node certificates chain to.",
        ),
    ] = "better-compute-node-ca",
    node_ca_create: Annotated[
        bool,
        typer.Option(
            envvar="BCD_NODE_CA_CREATE",
            help="Create the node-report CA's Secret if missing (--no-node-ca-create: it "
            "must exist, e.g. issued by cert-manager).",
        ),
    ] = True,
    event_webhook_allow: Annotated[
        list[str] | None,
        typer.Option(
            "--event-webhook-allow",
            envvar="BCD_EVENT_WEBHOOK_ALLOW",
            help="A CIDR, address or host name event webhooks may be delivered to beyond "
            "global addresses (repeat; the variable takes entries separated by spaces).",
        ),
    ] = None,
    log_format: Annotated[
        str,
        typer.Option(
            envvar="BCD_LOG_FORMAT",
            help="text, or json: one JSON object per line (time, level, logger, message).",
        ),
    ] = "text",
    pool_status_s: Annotated[
        float,
        typer.Option(
            envvar="BCD_POOL_STATUS_S",
            min=0.5,
            help="How often each GPUPool's status.devices (free, booked, total) is refreshed "
            "(written only when it changed).",
        ),
    ] = 5.0,
) -> None:
    try:
        logformat.configure(level=os.environ.get("LOG_LEVEL", "INFO"), log_format=log_format)
    except ValueError as e:
        typer.echo(f"Error: --log-format: {e}", err=True)
        raise typer.Exit(2) from None
    config = OperatorConfig(
        database_url=database_url,
        namespace=namespace,
        root_tenant=root_tenant,
        policy_files=tuple(policies_ or ()),
        no_default_policies=no_default_policies,
        http_port=http_port,
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        webhook_port=webhook_port,
        webhook_cert=webhook_cert,
        webhook_key=webhook_key,
        webhook_secret=webhook_secret,
        webhook_service=webhook_service,
        webhook_configurations=tuple(webhook_configurations or ()),
        http_host=http_host,
        webhook_host=webhook_host,
        webhook_extra_names=tuple(webhook_extra_names or ()),
        priority=priority,
        standalone=standalone,
        api_server=api_server,
        api_token=api_token,
        api_ca=api_ca,
        node_agent_service_account=node_agent_service_account,
        node_certificate_lifetime=dt.timedelta(hours=node_certificate_lifetime_hours),
        node_certificate_grace_s=node_certificate_grace_minutes * 60,
        node_ca_secret=node_ca_secret,
        node_ca_create=node_ca_create,
        node_certificates=node_certificates,
        kueue_admission_check=kueue_admission_check,
        pool_status_s=pool_status_s,
        event_webhook_allow=tuple(event_webhook_allow or ()),
    )
    try:
        asyncio.run(_serve(config))
    except OperatorError as e:
        typer.echo(f"Error: {e}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        pass


async def _serve(config: OperatorConfig) -> None:
    signals = supervising.Signals()
    signals.install()
    try:
        async with started(config, signals=signals) as operator:
            log.info(
                "operator running; HTTP API on %s, metrics on %s/metrics",
                operator.url,
                operator.metrics_url,
            )
            stopping = asyncio.create_task(signals.stop.wait())
            await asyncio.wait(
                [stopping, operator.kopf_task, *operator.tasks],
                return_when=asyncio.FIRST_COMPLETED,
            )
            stopping.cancel()
    finally:
        signals.remove()


def main() -> None:
    cli()
