"""The ``kubectl bcd`` commands: reserve, get, extend, renew, release, pools, quota, find.

Why this shape: kubectl runs ``kubectl-bcd`` (this module's ``main``) for ``kubectl bcd …``.
Each command reads the user's kubeconfig (``kube.client.kube_config``: ``--kubeconfig``,
``$KUBECONFIG``, the pod's service account, ``~/.kube/config``; ``--context`` picks a
context), writes or reads our custom resources with ``KubeClient`` as that identity, and waits
on the object's ``status`` where the operator answers. What to write and how to read the answer
is ``specs``; what to print is ``tables``. Exit codes are the table both CLIs share
(``core.exits``, docs/cli.md): 0 done, 2 usage, 3 unreachable, 4 not found, 5 refused,
6 conflict, 7 a wait that ran out, 1 anything else; the failure is one line naming the object.

What this module must never do: import ``store``, ``service``, ``operator``, ``api`` or the
HTTP CLI, stamp who asked (the admission webhook does, from the API server's own word), retry a
write the server refused, wait without a bound, or show a traceback to a user.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import enum
import json
import os
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
import yaml
from lightkube import ConfigError
from lightkube.config.kubeconfig import KubeConfig
from lightkube.resources.apps_v1 import StatefulSet
from rich.console import Console, RenderableType

from bettercompute import helptext
from bettercompute.core.exits import Exit, for_http_status
from bettercompute.kube import names, resources
from bettercompute.kube.client import (
    SERVICE_ACCOUNT_DIR,
    CredentialsError,
    KubeClient,
    KubeError,
    kube_config,
)
from bettercompute.kubectl import jsonpath, specs, tables, times

T = TypeVar("T")

#: Every namespace, in a list or watch of a namespaced resource (lightkube's word for it: without
#: it, lightkube lists the kubeconfig context's namespace only).
ALL_NAMESPACES = "*"
#: How often a wait reads the object again.
POLL_S = 0.5
#: A table piped to a file or another program is not cut to the terminal's width.
_PIPE_WIDTH = 1000
DEBUG_ENV = "BETTER_COMPUTE_DEBUG"

helptext.plain_switches()

app = typer.Typer(
    name="kubectl bcd",
    help=(
        "Reserve GPUs in a GPUPool and follow, extend, renew or release the reservation, as"
        " your own Kubernetes identity.\n\n"
        "Works on the cluster's better-compute custom resources (Reservation, GPUPool,"
        " GPUQuota; group bcd.dev, version v1alpha1) with your kubeconfig: no port-forward, no"
        " API token. The operator in the cluster answers in each object's status; the"
        " commands that change something wait for that answer."
    ),
    epilog=(
        "Examples:\n\n"
        "  kubectl bcd pools\n"
        "  kubectl bcd reserve --gpus 4 --for 8h --nvlink -n ml\n"
        "  kubectl bcd get -n ml\n"
        "  kubectl bcd extend rsv-x7k2p --by 4h -n ml\n"
        "  kubectl bcd release rsv-x7k2p -n ml\n\n"
        "Cluster: --kubeconfig (else $KUBECONFIG, the pod's service account, ~/.kube/config),"
        " --context (else the current context) and -n/--namespace (else the context's"
        " namespace, else default) go before or after the command.\n\n"
        "Exit codes (the same for better-compute): 0 done; 1 failed; 2 a usage error; 3 the"
        " API server cannot be reached; 4 not found; 5 refused (forbidden, policy, quota,"
        " never fits); 6 a conflict; 7 a wait that ran out (--timeout)."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _examples(*lines: str) -> str:
    return "Examples:\n\n" + "\n".join(f"  {line}" for line in lines)


class Output(enum.StrEnum):
    TABLE = "table"
    WIDE = "wide"
    YAML = "yaml"
    JSON = "json"
    NAME = "name"
    JSONPATH = "jsonpath"


@dataclass(frozen=True)
class Format:
    """``-o``: the kind of output, and the template of ``-o jsonpath=TEMPLATE``."""

    kind: Output
    template: str = ""

    @property
    def tabular(self) -> bool:
        return self.kind in (Output.TABLE, Output.WIDE)

    @property
    def structured(self) -> bool:
        """The objects themselves: as yaml, json, or through a jsonpath template."""
        return self.kind in (Output.JSON, Output.YAML, Output.JSONPATH)

    def __str__(self) -> str:
        return f"jsonpath={self.template}" if self.kind == Output.JSONPATH else self.kind.value


TABLE = Format(Output.TABLE)


def _parse_output(value: str | Format) -> Format:
    if isinstance(value, Format):
        return value
    kind, equals, template = value.partition("=")
    kind = kind.strip().lower()
    if kind == "jsonpath":
        if not equals or not template:
            raise typer.BadParameter("jsonpath needs a template: -o jsonpath='{.status.state}'")
        try:
            jsonpath.compile_template(template)
        except jsonpath.TemplateError as e:
            raise typer.BadParameter(f"jsonpath={template}: {e}") from None
        return Format(Output.JSONPATH, template)
    if equals or kind not in {o.value for o in Output} or kind == "jsonpath":
        known = "table, wide, yaml, json, name, jsonpath=TEMPLATE"
        raise typer.BadParameter(f"{value!r} is not one of: {known}")
    return Format(Output(kind))


class DeviceClass(enum.StrEnum):
    GPU = "gpu"
    MIG = "mig"
    SLOT = "slot"


class Binding(enum.StrEnum):
    HOLD = "hold"
    KUBERNETES = "kubernetes"
    NODE = "node"
    INSTANCE = "instance"


# --- failures --------------------------------------------------------------------------------


class Failure(Exception):
    """What a command reports on stderr as ``Error: message`` (and ``Hint: hint``), with its
    exit code."""

    def __init__(
        self, message: str, *, exit_code: int = Exit.FAILED, hint: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.hint = hint


def note(message: str) -> None:
    """A line for the person at the terminal that is not the answer: on stderr."""
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _reporting() -> Iterator[None]:
    """Every failure as one ``Error:`` line on stderr and its exit code."""
    try:
        yield
    except Failure as e:
        note(f"Error: {e.message}")
        if e.hint:
            note(f"Hint: {e.hint}")
        raise typer.Exit(e.exit_code) from None
    except CredentialsError as e:
        said = str(e)
        if said.startswith("no Kubernetes API server"):
            said = (
                "no kubeconfig: set $KUBECONFIG or pass --kubeconfig (or create ~/.kube/config,"
                " as your cluster's login tool does)"
            )
        note(f"Error: {said}")
        raise typer.Exit(Exit.USAGE) from None
    except specs.UsageError as e:
        raise typer.BadParameter(str(e), param_hint=f"'{e.option}'") from None


# --- options ---------------------------------------------------------------------------------

CLUSTER = "Cluster"


def _check_duration(value: str | None) -> str | None:
    if value is not None:
        try:
            times.parse_duration(value)
        except times.TimeError as e:
            raise typer.BadParameter(str(e)) from None
    return value


def _check_time(value: str | None) -> str | None:
    if value is not None:
        try:
            times.parse_when(value, now=dt.datetime.now(dt.UTC))
        except times.TimeError as e:
            raise typer.BadParameter(str(e)) from None
    return value


KubeconfigOption = Annotated[
    Path | None,
    typer.Option(
        "--kubeconfig",
        help="The kubeconfig file (else $KUBECONFIG, the pod's service account, ~/.kube/config).",
        show_default=False,
        rich_help_panel=CLUSTER,
    ),
]
ContextOption = Annotated[
    str | None,
    typer.Option(
        "--context",
        help="The kubeconfig context to use (else its current context).",
        show_default=False,
        rich_help_panel=CLUSTER,
    ),
]
NamespaceOption = Annotated[
    str | None,
    typer.Option(
        "--namespace",
        "-n",
        help="The namespace (else the context's namespace, else default).",
        show_default=False,
        rich_help_panel=CLUSTER,
    ),
]
OutputOption = Annotated[
    Format,
    typer.Option(
        "--output",
        "-o",
        metavar="FORMAT",
        help="table (for people), wide (the table with more columns), yaml or json (the"
        " objects as the API server returned them), name (kind.group/name, as kubectl prints"
        " it: reservation.bcd.dev/train-1) or jsonpath=TEMPLATE: kubectl's template, such as"
        " '{.status.state}' or '{range .items[*]}{.metadata.name}{\"\\n\"}{end}' (text,"
        ' {.path} with jsonpath-ng\'s paths: [*], [0], [?(@.a=="b")], ..; {"literal"},'
        " {range .path}…{end}, {@}; a list is {.items[*]…}).",
        parser=_parse_output,
        show_default=True,
    ),
]
TimeoutOption = Annotated[
    str,
    typer.Option(
        "--timeout",
        help="How long to wait for the operator's answer (5m, 90s); past it, exit 7.",
        callback=_check_duration,
    ),
]


def _check_selector(value: str | None) -> str | None:
    if value is not None:
        try:
            specs.label_selector(value)
        except specs.UsageError as e:
            raise typer.BadParameter(str(e)) from None
    return value


SelectorOption = Annotated[
    str | None,
    typer.Option(
        "--selector",
        "-l",
        help="Only objects whose labels match, in kubectl's syntax: key=value, key!=value,"
        " 'key in (a,b)', 'key notin (a,b)', key, !key; commas join (AND).",
        show_default=False,
        callback=_check_selector,
    ),
]
#: ``--class`` and ``--profile``: the old spellings of ``--mig PROFILE`` and ``--slots N``,
#: still read (docs/cli.md, "Renamed flags").
OldClassOption = Annotated[
    DeviceClass | None, typer.Option("--class", case_sensitive=False, hidden=True)
]
OldProfileOption = Annotated[str | None, typer.Option("--profile", hidden=True)]
NameArgument = Annotated[str, typer.Argument(metavar="NAME", help="The Reservation's name.")]
#: How long extend, renew and release wait for the operator's answer.
# reserve and find ask for devices with the same two options.
MigCountOption = Annotated[
    int | None,
    typer.Option(
        "--count",
        help="How many MIG instances (with --mig; default 1).",
        min=1,
        max=1024,
        show_default=False,
    ),
]
SlotsOption = Annotated[
    int | None,
    typer.Option("--slots", help="Time-slice or MPS slots.", min=1, max=1024, show_default=False),
]
AnswerTimeoutOption = Annotated[
    str,
    typer.Option(
        "--timeout",
        help="How long to wait for the operator's answer; past it, exit 7.",
        callback=_check_duration,
    ),
]


@dataclass(frozen=True)
class Cluster:
    """The kubeconfig options as given, before or after the command."""

    kubeconfig: Path | None = None
    context: str | None = None
    namespace: str | None = None


#: How long ``--version`` looks for the operator before it prints only its own version.
VERSION_TIMEOUT_S = 2.0
#: The labels the chart gives the operator's StatefulSet (``bcd.componentLabels``).
OPERATOR_LABELS = {
    "app.kubernetes.io/part-of": "better-compute",
    "app.kubernetes.io/component": "operator",
}


def _version(ctx: typer.Context, value: bool) -> None:
    """This plugin's version, then the operator's as the cluster runs it: the image tag of the
    ``operator`` container of the chart's StatefulSet (what runs, whatever the chart's
    appVersion says), found by the chart's labels within ``VERSION_TIMEOUT_S``. Not eager, so a
    ``--kubeconfig``/``--context`` before it on the line is used; why there is none, on stderr."""
    if not value:
        return
    try:
        version = metadata.version("better-compute")
    except metadata.PackageNotFoundError:
        version = "0.0.0 (not installed)"
    typer.echo(f"kubectl-bcd {version}")
    given = Cluster(kubeconfig=ctx.params.get("kubeconfig"), context=ctx.params.get("context"))
    try:
        session = _session(ctx, given)
        found = asyncio.run(asyncio.wait_for(_operators(session), VERSION_TIMEOUT_S))
    except Exception as e:  # whatever the cluster says (or fails to), --version answers
        said = e.message if isinstance(e, Failure) else str(e) or type(e).__name__
        note(f"(no operator version: {said or 'no answer within 2s'})")
        raise typer.Exit() from None
    if not found:
        note(
            "(no operator version: no StatefulSet labelled app.kubernetes.io/component=operator,"
            " app.kubernetes.io/part-of=better-compute that your identity may list)"
        )
    for line in found:
        typer.echo(line)
    raise typer.Exit()


async def _operators(session: Session) -> list[str]:
    """``operator TAG (StatefulSet NAMESPACE/NAME)`` for each operator the identity may list."""
    async with KubeClient(session.config) as kube:
        items = await kube.list(StatefulSet, namespace=ALL_NAMESPACES, labels=OPERATOR_LABELS)
    lines = []
    for item in sorted(items, key=lambda o: (o["metadata"].get("namespace", ""), _name_of(o))):
        containers = (((item.get("spec") or {}).get("template") or {}).get("spec") or {}).get(
            "containers"
        ) or []
        image = next(
            (str(c.get("image") or "") for c in containers if c.get("name") == "operator"), ""
        )
        where = f"{item['metadata'].get('namespace')}/{_name_of(item)}"
        lines.append(f"operator {_image_tag(image)} (StatefulSet {where})")
    return lines


def _image_tag(image: str) -> str:
    """The tag of ``repo/name:tag`` (or its digest, ``@sha256:…``); ``unknown`` without one."""
    if "@" in image:
        return image.split("@", 1)[1]
    last = image.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else "unknown"


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print this plugin's version and the operator's (from its StatefulSet's image)"
            " when your identity may list it, and exit.",
            callback=_version,
        ),
    ] = False,
    kubeconfig: KubeconfigOption = None,
    context: ContextOption = None,
    namespace: NamespaceOption = None,
) -> None:
    """Reserve GPUs in a GPUPool and follow, extend, renew or release the reservation."""
    ctx.obj = Cluster(kubeconfig=kubeconfig, context=context, namespace=namespace)


# --- the cluster -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Session:
    config: KubeConfig
    namespace: str
    source: str


def _kubeconfig_path(given: Path | None) -> Path | None:
    """``--kubeconfig``, else the first file of ``$KUBECONFIG`` (a list, as kubectl reads it)
    that exists, else ``None`` for ``kube_config``'s own search."""
    if given is not None:
        return given
    listed = [Path(p) for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    if not listed:
        return None
    return next((p for p in listed if p.is_file()), listed[0])


def _session(ctx: typer.Context, local: Cluster) -> Session:
    """The configuration and namespace, the command's options over the ones before it."""
    outer = ctx.obj if isinstance(ctx.obj, Cluster) else Cluster()
    path = _kubeconfig_path(local.kubeconfig or outer.kubeconfig)
    config, source = kube_config(kubeconfig=path)
    context = local.context or outer.context
    if context is not None:
        if context not in config.contexts:
            known = ", ".join(sorted(config.contexts)) or "none"
            raise Failure(
                f"--context {context}: {source} has no such context (it has: {known})",
                exit_code=Exit.USAGE,
            )
        config.current_context = context
        source = f"{source.split(' (context')[0]} (context {context!r})"
    try:
        current = config.get()
    except (ConfigError, KeyError) as e:  # a context naming a cluster or user the file lacks
        raise Failure(f"{source}: the context names no {e} entry", exit_code=Exit.USAGE) from None
    if current is None or not current.cluster.server:
        raise Failure(f"{source}: the context's cluster has no server", exit_code=Exit.USAGE)
    namespace = (
        local.namespace
        or outer.namespace
        or current.context.namespace
        or _pod_namespace(source)
        or "default"
    )
    return Session(config=config, namespace=namespace, source=source)


def _pod_namespace(source: str) -> str | None:
    """In a pod (its service account's credentials), the pod's namespace, as kubectl does."""
    if not source.startswith("the service account"):
        return None
    try:
        return (SERVICE_ACCOUNT_DIR / "namespace").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


class Api:
    """``KubeClient`` calls whose failures become one-line ``Failure`` s naming the object."""

    def __init__(self, kube: KubeClient, session: Session) -> None:
        self.kube = kube
        self.session = session
        self.namespace = session.namespace

    async def call(self, call: Awaitable[T], target: specs.Target) -> T:
        try:
            return await call
        except KubeError as e:
            raise Failure(
                specs.failed_call(e, target, server=self.kube.server),
                exit_code=for_http_status(e.status),
            ) from None

    def target(self, verb: str, name: str | None = None) -> specs.Target:
        return specs.Target(verb, "Reservation", "reservations", self.namespace, name)

    async def reservation(self, name: str) -> dict[str, Any] | None:
        return await self.call(
            self.kube.get(resources.RESERVATIONS, name, namespace=self.namespace),
            self.target("get", name),
        )

    async def patch(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        patched = await self.call(
            self.kube.patch(resources.RESERVATIONS, name, body, namespace=self.namespace),
            self.target("patch", name),
        )
        if patched is None:
            raise Failure(f"no Reservation {self.namespace}/{name} (404)", exit_code=Exit.NOT_FOUND)
        return patched

    async def wait(
        self,
        name: str,
        judge: Callable[[dict[str, Any] | None], T | None],
        *,
        timeout_s: float,
    ) -> tuple[dict[str, Any] | None, T | None]:
        """Read the Reservation every ``POLL_S`` until ``judge`` answers, or ``timeout_s``
        passes: (the last object seen, the answer or ``None``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            obj = await self.reservation(name)
            verdict = judge(obj)
            if verdict is not None:
                return obj, verdict
            left = deadline - loop.time()
            if left <= 0:
                return obj, None
            await asyncio.sleep(min(POLL_S, left))


def _run(ctx: typer.Context, local: Cluster, work: Callable[[Api], Awaitable[int | None]]) -> None:
    """Run ``work`` against the cluster; its number is the exit code."""
    with _reporting():
        session = _session(ctx, local)

        async def go() -> int | None:
            async with KubeClient(session.config) as kube:
                return await work(Api(kube, session))

        code = asyncio.run(go())
    if code:
        raise typer.Exit(code)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _seconds(duration: str) -> float:
    return times.parse_duration(duration)[1] / 1000


def _console() -> Console:
    width = None if sys.stdout.isatty() else _PIPE_WIDTH
    return Console(file=sys.stdout, width=width, highlight=False, soft_wrap=False)


def _print(renderable: RenderableType) -> None:
    """``renderable`` on stdout, without the blanks rich pads a table's last column with."""
    console = _console()
    with console.capture() as captured:
        console.print(renderable)
    lines = captured.get().splitlines()
    sys.stdout.write("".join(f"{line.rstrip()}\n" for line in lines))
    sys.stdout.flush()


def _dump(data: Any, output: Format) -> None:
    if output.kind == Output.JSONPATH:
        sys.stdout.write(jsonpath.render(output.template, data))
    elif output.kind == Output.JSON:
        sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def _listed(items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A list as ``kubectl get -o yaml`` prints one."""
    return {"apiVersion": "v1", "kind": "List", "items": list(items), "metadata": {}}


def _name_of(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def _qualified(kind: str, name: str) -> str:
    """``kind.group/name`` as ``kubectl get -o name`` prints it: ``reservation.bcd.dev/train``."""
    return f"{kind.lower()}.{names.GROUP}/{name}"


# --- reserve ---------------------------------------------------------------------------------


async def _only_pool(api: Api) -> str:
    """The cluster's only GPUPool, for a reserve without --pool."""
    target = specs.Target("list", "GPUPool", "gpupools")
    pools = await api.call(api.kube.list(resources.GPUPOOLS), target)
    live = sorted(_name_of(p) for p in pools if not (p.get("spec") or {}).get("archived"))
    if len(live) == 1:
        note(f"Pool: {live[0]} (the only GPUPool)")
        return live[0]
    if not live:
        raise Failure(
            "no GPUPool in this cluster: give --pool, or ask your platform team",
            exit_code=Exit.NOT_FOUND,
        )
    raise Failure(
        f"this cluster has {len(live)} GPUPools: give --pool (one of: {', '.join(live)})",
        exit_code=Exit.USAGE,
    )


@app.command(
    help=(
        "Reserve GPUs (or MIG instances, or slots) of a GPUPool for a time window, and wait"
        " until they are yours.\n\n"
        "Creates a Reservation in the namespace (named NAME, else rsv- and a random suffix)"
        " as your own identity, then waits until its Ready condition is True (its devices are"
        " bound) and prints its nodes and window. With --start later than now it returns once"
        " the window is booked (Placed), since Ready comes only at the start. A refusal (quota,"
        " policy; 4 for an unknown pool) or a reservation that can never fit the pool exits 5,"
        " one that ends exits 1, each with the operator's reason; the object stays, for"
        " `kubectl bcd get NAME`."
        " Without --pool, the cluster's only GPUPool is used."
    ),
    epilog=_examples(
        "kubectl bcd reserve --gpus 4 --for 8h --nvlink -n ml",
        "kubectl bcd reserve train-1 --pool h100 --gpus 8 --for 2d --start 2026-12-24T08:00:00Z",
        "kubectl bcd reserve --pool a100-mig --mig 1g.10gb --count 2 --for 90m",
        "kubectl bcd reserve --gpus 8 --gang 4 --for 12h --binding kubernetes --no-wait",
    ),
)
def reserve(
    ctx: typer.Context,
    duration: Annotated[
        str,
        typer.Option(
            "--for",
            help="How long: 8h, 90m, 2h30m, 3d.",
            callback=_check_duration,
            show_default=False,
        ),
    ],
    name: Annotated[
        str | None,
        typer.Argument(
            metavar="NAME",
            help="The Reservation's name; without it the API server makes one (rsv-…).",
            show_default=False,
        ),
    ] = None,
    gpus: Annotated[
        int | None,
        typer.Option(
            "--gpus",
            help="Whole GPUs on each node (default 1 when neither --mig nor --slots is given).",
            min=1,
            max=1024,
            show_default=False,
        ),
    ] = None,
    mig: Annotated[
        str | None,
        typer.Option(
            "--mig", help="MIG instances of this profile, such as 1g.10gb.", show_default=False
        ),
    ] = None,
    count: MigCountOption = None,
    slots: SlotsOption = None,
    pool: Annotated[
        str | None,
        typer.Option(
            "--pool", help="The GPUPool (else the cluster's only one).", show_default=False
        ),
    ] = None,
    nvlink: Annotated[
        bool, typer.Option("--nvlink", help="GPUs that all share one NVLink domain.")
    ] = False,
    start: Annotated[
        str | None,
        typer.Option(
            "--start",
            help="When the window starts: RFC 3339 (2026-12-24T08:00:00Z) or +2h from now;"
            " else at placement.",
            callback=_check_time,
            show_default=False,
        ),
    ] = None,
    binding: Annotated[
        Binding | None,
        typer.Option(
            "--binding",
            help="How the devices are handed over: hold (default), kubernetes (pods ask"
            " bcd.dev/gpu), node, instance.",
            case_sensitive=False,
            show_default=False,
        ),
    ] = None,
    device_class: OldClassOption = None,
    profile: OldProfileOption = None,
    gang: Annotated[
        int | None,
        typer.Option(
            "--gang",
            help="Book this many nodes alike, all or none (--gpus on each).",
            min=1,
            max=1024,
            show_default=False,
        ),
    ] = None,
    spot: Annotated[
        bool,
        typer.Option("--spot", help="Spot: cheaper, and gives way to regular requests."),
    ] = False,
    no_wait: Annotated[
        bool,
        typer.Option("--no-wait", help="Print the name once created; do not wait for Ready."),
    ] = False,
    timeout: TimeoutOption = "5m",
    output: OutputOption = TABLE,
    namespace: NamespaceOption = None,
    kubeconfig: KubeconfigOption = None,
    context: ContextOption = None,
) -> None:
    """Reserve GPUs of a GPUPool for a time window, and wait until they are yours."""
    if name is not None and not name.strip():
        raise typer.BadParameter("must not be empty", param_hint="'NAME'")
    wait_s = _seconds(timeout)
    start_at = None if start is None else times.rfc3339(times.parse_when(start, now=_now()))
    with _reporting():
        kind = specs.devices(
            gpus=gpus,
            mig=mig,
            count=count,
            slots=slots,
            old_class=None if device_class is None else device_class.value,
            old_profile=profile,
        )

    async def work(api: Api) -> int:
        ask = specs.Ask(
            pool=pool or await _only_pool(api),
            count=kind.count,
            duration=times.parse_duration(duration)[0],
            device_class=kind.device_class,
            start=start_at,
            nvlink=nvlink,
            profile=kind.profile,
            gang=gang,
            binding=None if binding is None else binding.value,
            spot=spot,
        )
        body = specs.reservation(ask, namespace=api.namespace, name=name)
        created = await api.call(
            api.kube.create(resources.RESERVATIONS, body, namespace=api.namespace),
            api.target("create", name),
        )
        made = _name_of(created)
        where = f"{api.namespace}/{made}"
        if no_wait:
            note(f"Reservation {where} created (not waiting)")
            _show_created(created, output)
            return 0
        note(f"Reservation {where} created; waiting up to {timeout} for it to be Ready …")
        obj, outcome = await api.wait(
            made, lambda o: specs.reserved(o, now=_now()), timeout_s=wait_s
        )
        if outcome is None:
            raise Failure(
                f"timed out after {timeout} waiting for Reservation {where} to be"
                f" {specs.waiting_for(obj, 'Ready')}",
                exit_code=Exit.WAIT_RAN_OUT,
                hint=f"it stays: follow it with `kubectl bcd get {made} -n {api.namespace}`,"
                f" or end it with `kubectl bcd release {made} -n {api.namespace}`",
            )
        if not outcome.ok:
            raise Failure(
                f"Reservation {where}: {outcome.message}",
                exit_code=outcome.exit,
                hint=f"the object stays: see `kubectl bcd get {made} -n {api.namespace}`;"
                f" delete it with `kubectl delete reservation {made} -n {api.namespace}`",
            )
        assert obj is not None
        if output.tabular:
            _print(tables.summary(obj, outcome=outcome.message, now=_now()))
        else:
            _show_created(obj, output)
        return 0

    with _reporting():
        # Checked before any call: a bad combination of options is a usage error (exit 2).
        specs.reservation(
            specs.Ask(
                pool="-",
                count=kind.count,
                duration=duration,
                device_class=kind.device_class,
                nvlink=nvlink,
                profile=kind.profile,
            ),
            namespace="-",
            name=None,
        )
    _run(ctx, Cluster(kubeconfig, context, namespace), work)


def _show_created(obj: Mapping[str, Any], output: Format) -> None:
    if output.structured:
        _dump(obj, output)
    elif output.kind == Output.NAME:
        print(_qualified("Reservation", _name_of(obj)), flush=True)
    else:
        print(_name_of(obj), flush=True)


# --- get -------------------------------------------------------------------------------------


@app.command(
    help=(
        "List Reservations, or show one with its conditions.\n\n"
        "START and END are the booked window in UTC with how far away it is (in 3h, 12m ago);"
        " READY is the Ready condition (True once the devices are bound)."
    ),
    epilog=_examples(
        "kubectl bcd get -n ml",
        "kubectl bcd get -A",
        "kubectl bcd get -l team=vision -n ml",
        "kubectl bcd get -w -n ml",
        "kubectl bcd get rsv-x7k2p -n ml",
        "kubectl bcd get rsv-x7k2p -n ml -o yaml",
    ),
)
def get(
    ctx: typer.Context,
    name: Annotated[
        str | None,
        typer.Argument(metavar="NAME", help="One Reservation, in detail.", show_default=False),
    ] = None,
    all_namespaces: Annotated[
        bool,
        typer.Option(
            "--all-namespaces",
            "-A",
            help="Every namespace you may list (a NAMESPACE column first).",
        ),
    ] = False,
    selector: SelectorOption = None,
    watch: Annotated[
        bool,
        typer.Option(
            "--watch",
            "-w",
            help="After the list (or the one object), print each change as it happens: a row"
            " (or a name, an object, a template's output) per change, until Ctrl-C.",
        ),
    ] = False,
    output: OutputOption = TABLE,
    namespace: NamespaceOption = None,
    kubeconfig: KubeconfigOption = None,
    context: ContextOption = None,
) -> None:
    """List Reservations, or show one with its conditions."""

    if name is not None and selector is not None:
        raise typer.BadParameter("give NAME or --selector, not both", param_hint="'--selector'")
    labels = None if selector is None else specs.label_selector(selector)

    async def work(api: Api) -> int:
        if watch:
            return await _watch(api, name, all_namespaces, labels, output)
        if name is not None:
            obj = await api.reservation(name)
            if obj is None:
                raise Failure(
                    f"no Reservation {api.namespace}/{name} (404)", exit_code=Exit.NOT_FOUND
                )
            if output.kind == Output.WIDE:  # one row with every column, as kubectl's
                _print(tables.reservations([obj], now=_now(), wide=True))
            elif output.tabular:
                _print(tables.reservation(obj, now=_now()))
            elif output.kind == Output.NAME:
                print(_qualified("Reservation", _name_of(obj)))
            else:
                _dump(obj, output)
            return 0
        scope = None if all_namespaces else api.namespace
        target = specs.Target("list", "Reservation", "reservations", scope)
        items = await api.call(
            api.kube.list(resources.RESERVATIONS, namespace=scope or ALL_NAMESPACES, labels=labels),
            target,
        )
        items.sort(key=lambda o: ((o.get("metadata") or {}).get("namespace") or "", _name_of(o)))
        if output.structured:
            _dump(_listed(items), output)
        elif output.kind == Output.NAME:
            for obj in items:
                print(_qualified("Reservation", _name_of(obj)))
        elif not items:
            where = "any namespace" if all_namespaces else f"namespace {api.namespace}"
            matching = "" if selector is None else f" matching {selector}"
            note(f"No reservations{matching} in {where}.")
        else:
            _print(
                tables.reservations(
                    items, now=_now(), namespaces=all_namespaces, wide=output.kind == Output.WIDE
                )
            )
        return 0

    _run(ctx, Cluster(kubeconfig, context, namespace), work)


def _show_each(
    items: Sequence[Mapping[str, Any]], output: Format, *, namespaces: bool, header: bool
) -> None:
    """Objects one by one, as ``kubectl get -w`` prints them: rows (the header once), names,
    or each object (yaml documents separated by ``---``)."""
    if output.tabular:
        table = tables.reservations(
            items, now=_now(), namespaces=namespaces, wide=output.kind == Output.WIDE
        )
        table.show_header = header
        _print(table)
        return
    for obj in items:
        if output.kind == Output.NAME:
            print(_qualified("Reservation", _name_of(obj)), flush=True)
        elif output.kind == Output.YAML:
            sys.stdout.write("---\n")
            _dump(obj, output)
        else:
            _dump(obj, output)
            if output.kind == Output.JSONPATH:
                sys.stdout.write("\n")
        sys.stdout.flush()


async def _watch(
    api: Api,
    name: str | None,
    all_namespaces: bool,
    labels: specs.Selector | None,
    output: Format,
) -> int:
    """``get -w``: the list (or the object) now, then each change, until interrupted; a watch
    the server ends is resumed from the last version seen, a version too old lists again."""
    scope = None if all_namespaces and name is None else api.namespace
    fields = None if name is None else {"metadata.name": name}
    target = specs.Target("watch", "Reservation", "reservations", scope, name)
    header = True
    version: str | None = None
    while True:
        if version is None:
            items, version = await api.call(
                api.kube.list_from(
                    resources.RESERVATIONS, namespace=scope or ALL_NAMESPACES, labels=labels
                ),
                target,
            )
            if name is not None:
                items = [o for o in items if _name_of(o) == name]
                if not items and header:
                    raise Failure(
                        f"no Reservation {api.namespace}/{name} (404)", exit_code=Exit.NOT_FOUND
                    )
            items.sort(
                key=lambda o: ((o.get("metadata") or {}).get("namespace") or "", _name_of(o))
            )
            if items:
                _show_each(items, output, namespaces=all_namespaces, header=header)
                header = False
            elif header:
                where = "any namespace" if scope is None else f"namespace {scope}"
                note(f"No reservations in {where} yet; watching (Ctrl-C stops) …")
        try:
            async for kind, obj in api.kube.watch(
                resources.RESERVATIONS,
                namespace=scope or ALL_NAMESPACES,
                labels=labels,
                fields=fields,
                resource_version=version,
            ):
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    _show_each([obj], output, namespaces=all_namespaces, header=header)
                    header = False
        except KubeError as e:
            if e.status != 410:
                raise Failure(
                    specs.failed_call(e, target, server=api.kube.server),
                    exit_code=for_http_status(e.status),
                ) from None
            version = None  # too old to resume: list again


# --- extend, renew, release ------------------------------------------------------------------


@app.command(
    help=(
        "Move a reservation's end later, decided by policy like a create.\n\n"
        "Give --by or --until. Sets spec.extendBy or spec.until with a new spec.extendKey and"
        " waits for the operator's answer in status.extension. Exit 0 when extended; exit 6"
        " when another booking starts first (it prints until when the devices are free);"
        " exit 5 when the extend is refused."
    ),
    epilog=_examples(
        "kubectl bcd extend rsv-x7k2p --by 4h -n ml",
        "kubectl bcd extend rsv-x7k2p --until 2026-12-25T08:00:00Z -n ml",
    ),
)
def extend(
    ctx: typer.Context,
    name: NameArgument,
    by: Annotated[
        str | None,
        typer.Option(
            "--by", help="Move the end later by this much: 4h, 30m.", callback=_check_duration
        ),
    ] = None,
    until: Annotated[
        str | None,
        typer.Option(
            "--until",
            help="The new end: RFC 3339 (2026-12-25T08:00:00Z) or +12h from now.",
            callback=_check_time,
        ),
    ] = None,
    timeout: AnswerTimeoutOption = "1m",
    namespace: NamespaceOption = None,
    kubeconfig: KubeconfigOption = None,
    context: ContextOption = None,
) -> None:
    """Move a reservation's end later, decided by policy like a create."""
    if (by is None) == (until is None):
        raise typer.BadParameter("give exactly one of --by or --until", param_hint="'--by'")
    key = f"kubectl-{uuid.uuid4()}"
    patch = specs.extend_patch(
        key=key,
        by=None if by is None else times.parse_duration(by)[0],
        until=None if until is None else times.rfc3339(times.parse_when(until, now=_now())),
    )

    async def work(api: Api) -> int:
        where = f"{api.namespace}/{name}"
        await api.patch(name, patch)

        def answered(obj: dict[str, Any] | None) -> bool | None:
            if obj is None:
                return True
            return (specs.status_of(obj).get("extension") or {}).get("key") == key or None

        obj, done = await api.wait(name, answered, timeout_s=_seconds(timeout))
        if done is None:
            raise Failure(
                f"timed out after {timeout} waiting for the operator to answer the extend of"
                f" Reservation {where} (status.extension.key {key})",
                exit_code=Exit.WAIT_RAN_OUT,
            )
        if obj is None:
            raise Failure(f"Reservation {where} was deleted while waiting")
        extension = specs.status_of(obj).get("extension") or {}
        end = times.shown(specs.status_of(obj).get("endTime"), now=_now())
        if extension.get("extended"):
            print(f"reservation.bcd.dev/{name} extended: it now ends {end}", flush=True)
            return 0
        why = specs.refused(obj, "extend")
        if why is not None:
            raise Failure(
                f"Reservation {where}: extend refused: {why}", exit_code=specs.refusal_exit(obj)
            )
        free = times.shown(extension.get("availableUntil"), now=_now())
        print(
            f"reservation.bcd.dev/{name} not extended: another booking starts first; its"
            f" devices are free until {free}; it still ends {end}",
            flush=True,
        )
        return Exit.CONFLICT

    _run(ctx, Cluster(kubeconfig, context, namespace), work)


@app.command(
    help=(
        "Renew a reservation's lease (only for reservations made with a lease).\n\n"
        "Sets the annotation bcd.dev/renew to the current time and waits until the operator"
        " shows it in status.renewed; prints when the lease now expires."
    ),
    epilog=_examples("kubectl bcd renew rsv-x7k2p -n ml"),
)
def renew(
    ctx: typer.Context,
    name: NameArgument,
    timeout: AnswerTimeoutOption = "1m",
    namespace: NamespaceOption = None,
    kubeconfig: KubeconfigOption = None,
    context: ContextOption = None,
) -> None:
    """Renew a reservation's lease."""

    async def work(api: Api) -> int:
        where = f"{api.namespace}/{name}"
        value = times.rfc3339(_now())
        await api.patch(name, specs.renew_patch(value))

        def answered(obj: dict[str, Any] | None) -> bool | None:
            return True if obj is None or specs.status_of(obj).get("renewed") == value else None

        obj, done = await api.wait(name, answered, timeout_s=_seconds(timeout))
        if done is None:
            raise Failure(
                f"timed out after {timeout} waiting for the operator to renew Reservation"
                f" {where} (status.renewed {value})",
                exit_code=Exit.WAIT_RAN_OUT,
            )
        if obj is None:
            raise Failure(f"Reservation {where} was deleted while waiting")
        why = specs.refused(obj, "renew")
        if why is not None:
            raise Failure(
                f"Reservation {where}: renew refused: {why}", exit_code=specs.refusal_exit(obj)
            )
        expires = times.shown(specs.status_of(obj).get("leaseExpiresAt"), now=_now())
        print(f"reservation.bcd.dev/{name} renewed: the lease now expires {expires}", flush=True)
        return 0

    _run(ctx, Cluster(kubeconfig, context, namespace), work)


@app.command(
    help=(
        "End a reservation now: its devices are freed, quota is refunded, billing stops.\n\n"
        "Sets spec.release: true (the object stays, released; `kubectl delete` also releases,"
        " and removes it) and waits until the reservation is in a final state."
    ),
    epilog=_examples("kubectl bcd release rsv-x7k2p -n ml"),
)
def release(
    ctx: typer.Context,
    name: NameArgument,
    timeout: AnswerTimeoutOption = "1m",
    namespace: NamespaceOption = None,
    kubeconfig: KubeconfigOption = None,
    context: ContextOption = None,
) -> None:
    """End a reservation now."""

    async def work(api: Api) -> int:
        where = f"{api.namespace}/{name}"
        current = await api.reservation(name)
        if current is None:
            raise Failure(f"no Reservation {where} (404)", exit_code=Exit.NOT_FOUND)
        already = specs.ended(current)
        if already is not None:
            print(f"reservation.bcd.dev/{name} is already {already}", flush=True)
            return 0
        if not specs.status_of(current).get("id"):
            said = specs.refused(current) or "the operator has not admitted it yet"
            note(
                f"Reservation {where} holds nothing ({said}); remove the object with"
                f" `kubectl delete reservation {name} -n {api.namespace}`"
            )
            return 0
        await api.patch(name, specs.RELEASE_PATCH)

        def answered(obj: dict[str, Any] | None) -> bool | None:
            if obj is None or specs.ended(obj) or specs.refused(obj, "release"):
                return True
            return None

        obj, done = await api.wait(name, answered, timeout_s=_seconds(timeout))
        if done is None:
            raise Failure(
                f"timed out after {timeout} waiting for Reservation {where} to be"
                f" {specs.waiting_for(obj, 'released')}",
                exit_code=Exit.WAIT_RAN_OUT,
            )
        if obj is None:
            print(f"reservation.bcd.dev/{name} released (the object is gone)", flush=True)
            return 0
        why = specs.refused(obj, "release")
        if why is not None and not specs.ended(obj):
            raise Failure(
                f"Reservation {where}: release refused: {why}", exit_code=specs.refusal_exit(obj)
            )
        print(f"reservation.bcd.dev/{name} {specs.state(obj)}", flush=True)
        return 0

    _run(ctx, Cluster(kubeconfig, context, namespace), work)


# --- pools, find, quota ----------------------------------------------------------------------


@app.command(
    help=(
        "The GPUPools and what they hold now.\n\n"
        "From each pool's status, which the operator keeps within seconds of a change: NODES"
        " ready/all, FREE (healthy, unbooked, on a ready node) and TOTAL devices of the pool's"
        " class, and NEXT FREE: when none is free, when the first booked device frees."
    ),
    epilog=_examples("kubectl bcd pools", "kubectl bcd pools -o yaml"),
)
def pools(
    ctx: typer.Context,
    output: OutputOption = TABLE,
    kubeconfig: KubeconfigOption = None,
    context: ContextOption = None,
) -> None:
    """The GPUPools and what they hold now."""

    async def work(api: Api) -> int:
        target = specs.Target("list", "GPUPool", "gpupools")
        items = await api.call(api.kube.list(resources.GPUPOOLS), target)
        items.sort(key=_name_of)
        if output.structured:
            _dump(_listed(items), output)
        elif output.kind == Output.NAME:
            for pool in items:
                print(_qualified("GPUPool", _name_of(pool)))
        elif not items:
            note("No GPUPools in this cluster.")
        else:
            _print(tables.pools(items, now=_now()))
        return 0

    _run(ctx, Cluster(kubeconfig, context, None), work)


@app.command(
    help=(
        "Where N devices are free now, else when each pool next frees one.\n\n"
        "Reads each GPUPool's status only: FITS NOW says whether the pool shows N free now (in"
        " the pool as a whole: a gang, NVLink or one node's share may still not fit), else FROM"
        " is the pool's nextFreeAt, the earliest time the pool shows one device freeing, which"
        " is no promise that N are free then or for --for. The HTTP API's capacity search"
        " (`better-compute capacity --find`) is exact: it places the request in each window."
    ),
    epilog=_examples(
        "kubectl bcd find --gpus 4 --for 8h",
        "kubectl bcd find --gpus 2 --for 90m --pool h100 -o json",
    ),
)
def find(
    ctx: typer.Context,
    gpus: Annotated[
        int | None,
        typer.Option(
            "--gpus", help="How many whole GPUs (default 1).", min=1, max=1024, show_default=False
        ),
    ] = None,
    mig: Annotated[
        str | None,
        typer.Option(
            "--mig",
            help="MIG instances (of this profile, such as 1g.10gb: pool status counts any).",
            show_default=False,
        ),
    ] = None,
    count: MigCountOption = None,
    slots: SlotsOption = None,
    duration: Annotated[
        str,
        typer.Option(
            "--for", help="How long: 8h, 90m (the window shown).", callback=_check_duration
        ),
    ] = "1h",
    pool: Annotated[
        str | None,
        typer.Option("--pool", help="Only this GPUPool.", show_default=False),
    ] = None,
    device_class: OldClassOption = None,
    output: OutputOption = TABLE,
    kubeconfig: KubeconfigOption = None,
    context: ContextOption = None,
) -> None:
    """Where N devices are free now, else when each pool next frees one (from pool status)."""
    length_ms = times.parse_duration(duration)[1]
    chosen: str | None = None
    wanted = count or 1
    if (gpus, mig, slots, device_class) != (None, None, None, None):
        with _reporting():
            kind = specs.devices(
                gpus=gpus,
                mig=mig,
                count=count,
                slots=slots,
                old_class=None if device_class is None else device_class.value,
            )
        chosen, wanted = kind.device_class, kind.count

    async def work(api: Api) -> int:
        if pool is not None:
            target = specs.Target("get", "GPUPool", "gpupools", None, pool)
            one = await api.call(api.kube.get(resources.GPUPOOLS, pool), target)
            if one is None:
                raise Failure(f"no GPUPool {pool} (404)", exit_code=Exit.NOT_FOUND)
            items = [one]
        else:
            target = specs.Target("list", "GPUPool", "gpupools")
            items = await api.call(api.kube.list(resources.GPUPOOLS), target)
        now = _now()
        rows = [
            specs.find(
                p,
                count=wanted,
                duration_ms=length_ms,
                device_class=chosen,
                now=now,
            )
            for p in sorted(items, key=_name_of)
            if not (p.get("spec") or {}).get("archived")
        ]
        rows.sort(key=lambda r: (not r.fits_now, r.start is None, r.start or now, r.pool))
        if output.structured:
            _dump([r.plain() for r in rows], output)
        elif output.kind == Output.NAME:
            for row in rows:
                if row.fits_now:
                    print(_qualified("GPUPool", row.pool))
        elif not rows:
            note("No GPUPools in this cluster.")
        else:
            _print(tables.found(rows, now=now))
        return 0

    _run(ctx, Cluster(kubeconfig, context, None), work)


@app.command(
    help=(
        "GPUQuotas: what each tenant may book, has booked, and has left.\n\n"
        "Without TENANT: the tenant of the namespace (its label bcd.dev/tenant) when you may"
        " read the namespace, else every GPUQuota you may list."
    ),
    epilog=_examples(
        "kubectl bcd quota -n ml", "kubectl bcd quota team-a", "kubectl bcd quota -o yaml"
    ),
)
def quota(
    ctx: typer.Context,
    tenant: Annotated[
        str | None,
        typer.Argument(metavar="TENANT", help="Only this tenant's quotas.", show_default=False),
    ] = None,
    output: OutputOption = TABLE,
    namespace: NamespaceOption = None,
    kubeconfig: KubeconfigOption = None,
    context: ContextOption = None,
) -> None:
    """GPUQuotas: what each tenant may book, has booked, and has left."""

    async def work(api: Api) -> int:
        chosen = tenant or await _tenant_of_namespace(api)
        target = specs.Target("list", "GPUQuota", "gpuquotas")
        items = await api.call(api.kube.list(resources.GPUQUOTAS), target)
        if chosen is not None:
            items = [
                q
                for q in items
                if (q.get("spec") or {}).get("tenant") == chosen or _name_of(q) == chosen
            ]
        items.sort(key=_name_of)
        if output.structured:
            _dump(_listed(items), output)
        elif output.kind == Output.NAME:
            for q in items:
                print(_qualified("GPUQuota", _name_of(q)))
        elif not items:
            note(f"No GPUQuotas{f' for tenant {chosen}' if chosen else ''}.")
        else:
            _print(tables.quotas(specs.quota_rows(items)))
        return 0

    _run(ctx, Cluster(kubeconfig, context, namespace), work)


async def _tenant_of_namespace(api: Api) -> str | None:
    """The namespace's tenant label, or ``None`` when it has none or may not be read."""
    try:
        found = await api.kube.get(resources.NAMESPACES, api.namespace)
    except KubeError as e:
        note(f"(cannot read namespace {api.namespace}: {e.status} {e.reason}; showing all)")
        return None
    tenant = ((found or {}).get("metadata") or {}).get("labels", {}).get(names.TENANT_LABEL)
    if not tenant:
        note(f"(namespace {api.namespace} has no {names.TENANT_LABEL} label; showing all)")
        return None
    note(f"Tenant {tenant} (label {names.TENANT_LABEL} of namespace {api.namespace})")
    return str(tenant)


# --- entry point -----------------------------------------------------------------------------


def main() -> None:
    """The ``kubectl-bcd`` console script: never a traceback for a user."""
    try:
        app(prog_name="kubectl bcd")
    except KeyboardInterrupt:
        note("Interrupted.")
        sys.exit(130)
    except Exception as e:
        if os.environ.get(DEBUG_ENV):
            raise
        note(
            f"Error: unexpected {type(e).__name__}: {e}\n"
            f"Hint: this is a bug in kubectl-bcd; run again with {DEBUG_ENV}=1 to see where"
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
