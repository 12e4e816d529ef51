"""The ``better-compute`` commands: reserve, capacity --preview, reservations get/list, extend,
renew, release, cancel, subscriptions create/list/delete/deliveries and dev.

Why this shape: each command only translates. Flags become the guide's JSON body (``bodies``),
one HTTP call answers (``client``), and the answer is printed (``output``). Every failure is a
``client.Failure`` reported in one place with its exit code from the table both CLIs share
(``core.exits``, docs/cli.md): 2 usage, 3 unreachable, 4 not found, 5 refused, 6 conflict,
7 a wait that ran out.

What this module must never do: import ``store``, ``service`` or ``api``, import
``bettercompute.dev`` outside the ``dev`` command (so ``--help`` works without it), retry a
create with a new key, or let a traceback reach the user.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import uuid
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any

import typer

from bettercompute import extras, helptext
from bettercompute.cli import (
    bodies,
    calls,
    client,
    confirmations,
    ids,
    options,
    output,
    parsing,
    settings,
    usage,
    waiting,
    watching,
)
from bettercompute.cli.settings import Output
from bettercompute.core.exits import Exit

helptext.plain_switches()

app = typer.Typer(
    name="better-compute",
    help=(
        "Reserve GPUs from a pool for a time window, and follow, extend, renew, release or"
        " cancel the reservation."
    ),
    epilog=(
        "Examples:\n\n"
        "  better-compute reserve --tenant acme --pool pool_h100 --gpus 4 --for 8h --nvlink\n"
        "  better-compute reservations list --tenant acme\n"
        "  better-compute dev --sim 2\n\n"
        "Settings: --url, --token and --tenant also come from $BETTER_COMPUTE_URL,"
        " $BETTER_COMPUTE_TOKEN and $BETTER_COMPUTE_TENANT, or from the keys url, token and"
        " tenant of ~/.config/better-compute/config.yaml ($BETTER_COMPUTE_CONFIG)."
        " A flag wins over the environment, which wins over the file."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # --install-completion / --show-completion for bash, zsh, fish and PowerShell.
    add_completion=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


#: How long ``--version`` waits for the server's version before it prints only its own.
VERSION_TIMEOUT_S = 2.0


def _version(value: bool) -> None:
    """The client's version, then the server's when one answers within ``VERSION_TIMEOUT_S``
    (the server of $BETTER_COMPUTE_URL or the config file); why not, on stderr."""
    if not value:
        return
    typer.echo(f"better-compute {_installed_version()}")
    try:
        found = settings.resolve(url=None, token=None, tenant=None, output=None)
        with client.ApiClient(url=found.url, token=None, timeout_s=VERSION_TIMEOUT_S) as api:
            typer.echo(f"server {api.server_version()} ({found.url})")
    except client.Failure as e:
        output.note(f"(no server version: {e.message})")
    raise typer.Exit()


def _installed_version() -> str:
    try:
        return metadata.version("better-compute")
    except metadata.PackageNotFoundError:
        return "0.0.0 (not installed)"


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print this client's version and, when it answers, the server's, and exit.",
            callback=_version,
            is_eager=True,
        ),
    ] = False,
) -> None:
    """Reserve GPUs from a pool for a time window, and follow, extend, renew, release or
    cancel the reservation."""


reservations_app = typer.Typer(
    help="Read reservations: get one, or list them.",
    epilog=(
        "Examples:\n\n"
        "  better-compute reservations get rsv_… --tenant acme --query binding\n"
        "  better-compute reservations list --tenant acme --all --state active"
    ),
    no_args_is_help=True,
)
app.add_typer(reservations_app, name="reservations")

subscriptions_app = typer.Typer(
    help="Webhooks: POST your tenant's reservation events, signed, to a URL of yours.",
    epilog=(
        "Examples:\n\n"
        "  better-compute subscriptions create --url https://hooks.example.com/compute"
        " --event reservation.placed\n"
        "  better-compute subscriptions deliveries sub_… --state dead\n"
        "  better-compute subscriptions disable sub_…"
    ),
    no_args_is_help=True,
)
app.add_typer(subscriptions_app, name="subscriptions")
# A person's side of delegated confirmation (cli/confirmations.py).
app.add_typer(confirmations.app, name="confirmations")
# What the tenant was billed for (cli/usage.py).
app.command("usage", epilog=usage.EXAMPLES)(usage.usage)

#: How long past the server's own wait a create may take to answer before we call it lost.
ANSWER_GRACE_S = 15.0
#: The longest the server holds a create (the guide's cap on ``wait.timeoutMs``).
SERVER_WAIT_CAP_S = 30.0
#: How long --wait-for waits when --timeout gives no time.
WAIT_FOR_DEFAULT_S = 600.0
#: How long reserve waits for a queued reservation when neither --timeout nor --no-wait is given.
DEFAULT_WAIT_S = 20.0


def _examples(*lines: str) -> str:
    """An epilog of examples; rich help keeps single line breaks in the epilog."""
    return "Examples:\n\n" + "\n".join(f"  {line}" for line in lines)


def new_key() -> str:
    """A fresh idempotency key: a new request every run, unless ``--key`` says otherwise."""
    return f"cli-{uuid.uuid4()}"


# --- running a command ---------------------------------------------------------------------


def _settings(
    *, url: str | None, token: str | None, tenant: str | None, out: Output | None
) -> settings.Settings:
    return settings.resolve(url=url, token=token, tenant=tenant, output=out)


def _client(found: settings.Settings, *, timeout_s: float = 30.0) -> client.ApiClient:
    return client.ApiClient(url=found.url, token=found.token, timeout_s=timeout_s)


def _print_key(key: str, *, given: bool) -> None:
    if given:
        output.note(f"Idempotency key: {key}")
    else:
        output.note(f"Idempotency key: {key} (to retry this same request safely, add --key {key})")


# --- reserve and capacity ------------------------------------------------------------------


def _ask(
    *,
    tenant: str,
    pool: str,
    duration: str,
    gpus: int | None,
    mig: str | None,
    count: int | None,
    slots: int | None,
    nvlink: bool,
    start: str | None,
    gang: int | None,
    cpus: int | None,
    memory: int | None,
    kubernetes: bool,
) -> bodies.Ask:
    return bodies.Ask(
        tenant=tenant,
        pool=pool,
        duration=duration.strip(),
        gpus=gpus,
        mig=mig,
        count=count,
        slots=slots,
        nvlink=nvlink,
        start_ms=None
        if start is None or start == options.EARLIEST
        else parsing.parse_time(start, now_ms=options.now_ms()),
        gang=gang,
        cpus=cpus,
        memory_gib=memory,
        kubernetes=kubernetes,
    )


@app.command(
    help=(
        "Reserve GPUs, MIG instances or slots of a pool for a time window.\n\n"
        "Sends reservations.create with a new idempotency key, printed, unless --key is"
        " given: running the same command again with that key reaches the same reservation."
        " It waits up to --timeout (20s) for a queued reservation to be placed; past it, the"
        " request stands and it exits 7."
    ),
    epilog=_examples(
        "better-compute reserve --tenant acme --pool pool_h100 --gpus 4 --for 8h --nvlink"
        " --key train-2026-09-24",
        "better-compute reserve --tenant acme --pool pool_h100 --gpus 2 --for 8h --cpus 32"
        " --memory 256",
        "better-compute reserve --tenant acme --pool pool_a100_mig --mig 1g.10gb --count 2"
        " --for 90m --start +2h",
    ),
)
def reserve(
    pool: options.PoolOption,
    duration: options.ForOption,
    tenant: options.TenantOption = None,
    gpus: options.GpusOption = None,
    mig: options.MigOption = None,
    count: options.CountOption = None,
    slots: options.SlotsOption = None,
    start: options.StartOption = None,
    nvlink: options.NvlinkOption = False,
    gang: options.GangOption = None,
    cpus: options.CpusOption = None,
    memory: options.MemoryOption = None,
    binding: options.BindingOption = None,
    kubernetes: options.KubernetesOption = False,
    wait_for_state: Annotated[
        options.WaitFor | None,
        typer.Option(
            "--wait-for",
            help="Wait until it is 'placed' or 'active' (its devices bound), or ends; for"
            " --timeout, else 10 minutes. Not reaching it exits 7 (the request stands).",
            rich_help_panel=options.OPTIONS,
        ),
    ] = None,
    spot: Annotated[
        bool,
        typer.Option(
            "--spot",
            help="Spot: gives way to regular requests (not started: waits pending; running:"
            " released after the pool's notice, 120 s by default).",
            rich_help_panel=options.OPTIONS,
        ),
    ] = False,
    lease: options.LeaseOption = None,
    project: Annotated[
        str | None,
        typer.Option("--project", help="Project id to charge.", rich_help_panel=options.OPTIONS),
    ] = None,
    key: Annotated[
        str | None,
        typer.Option(
            "--key",
            help=(
                "Idempotency key. Default: a new key on every run, printed so you can retry"
                " the same request with it."
            ),
            callback=options.check_key,
            rich_help_panel=options.OPTIONS,
        ),
    ] = None,
    timeout: options.TimeoutOption = None,
    no_wait: options.NoWaitOption = False,
    old_wait: options.OldWaitOption = None,
    cancel_if_never_fits: Annotated[
        bool,
        typer.Option(
            "--cancel-if-never-fits",
            help="Cancel it at once if no wait can ever place it in this pool (it would hold"
            " its quota while pending); either way that exits 5 with the reason. On a"
            " terminal, without this, you are asked.",
            rich_help_panel=options.OPTIONS,
        ),
    ] = False,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """Reserve GPUs, MIG instances or slots of a pool for a time window."""
    wait_for = None if wait_for_state is None else wait_for_state.value
    given_wait = options.wait_seconds(timeout, old_wait, no_wait=no_wait)
    wait = DEFAULT_WAIT_S if given_wait is None else given_wait
    kubernetes = options.kubernetes_binding(binding, kubernetes)
    with calls.reporting(out):
        found = _settings(url=url, token=token, tenant=tenant, out=out)
        tenant_id = calls.tenant(found)
        ask = _ask(
            tenant=tenant_id,
            pool=pool,
            duration=duration,
            gpus=gpus,
            mig=mig,
            count=count,
            slots=slots,
            nvlink=nvlink,
            start=start,
            gang=gang,
            cpus=cpus,
            memory=memory,
            kubernetes=kubernetes,
        )
        chosen_key = key or new_key()
        deadline = time.monotonic() + wait
        server_wait = min(float(wait), SERVER_WAIT_CAP_S)
        with _client(found, timeout_s=server_wait + ANSWER_GRACE_S) as api:
            if start == options.EARLIEST:
                ask = dataclasses.replace(ask, start_ms=_earliest(api, ask))
            body = bodies.create(
                ask,
                key=chosen_key,
                wait_s=wait,
                spot=spot,
                lease_seconds=options.lease_seconds(lease),
                project=project,
            )
            # Printed before sending: whatever happens next, the person can retry with it.
            _print_key(chosen_key, given=key is not None)
            view = api.call("reservations/create", body)
            never = output.never_fits(view)
            # A request no wait can place is not waited for: it is answered at once.
            if never is None and (wait > 0 or wait_for is not None):
                if wait_for is not None and given_wait is None:
                    deadline = time.monotonic() + WAIT_FOR_DEFAULT_S
                try:
                    view = waiting.follow(
                        api, tenant=tenant_id, view=view, deadline=deadline, until=wait_for
                    )
                except client.Failure as e:
                    e.hint = waiting.waited_line(view, tenant=tenant_id, created=True)
                    raise
                never = output.never_fits(view)
            output.emit(view, output=found.output, table=output.reservation_table)
            if never is not None:
                _never_fits(api, view, never, tenant=tenant_id, cancel=cancel_if_never_fits)
        if waiting.still_running(view):
            output.note(waiting.waited_line(view, tenant=tenant_id))
            if wait > 0:
                raise typer.Exit(Exit.WAIT_RAN_OUT)
        elif wait_for is not None and not waiting.reached(view, wait_for):
            output.note(
                f"{view.get('id')} is {view.get('state')}, not {wait_for}; follow it with"
                f" `better-compute reservations get {view.get('id')} --tenant {tenant_id}`"
            )
            ended = view.get("state") in waiting.ENDED
            raise typer.Exit(Exit.FAILED if ended else Exit.WAIT_RAN_OUT)


def _never_fits(
    api: client.ApiClient, view: dict[str, Any], never: str, *, tenant: str, cancel: bool
) -> None:
    """A reservation admitted pending that no wait will place: it holds its quota for nothing
    until its pending deadline, so say so, cancel it when asked (``--cancel-if-never-fits``, or
    yes to the question a terminal gets), and exit 5 (refused) either way."""
    rid = str(view.get("id"))
    output.note(f"Error: {rid} can never be placed: {never}")
    if not cancel and sys.stdin.isatty() and sys.stderr.isatty():
        cancel = typer.confirm(
            f"Cancel {rid} now? While pending it holds its quota", default=True, err=True
        )
    if cancel:
        cancelled = api.call("reservations/cancel", {"tenantId": tenant, "reservationId": rid})
        output.note(f"Cancelled {rid} ({cancelled.get('state')}); its quota is free again.")
    else:
        output.note(
            f"Hint: it stays pending and holds its quota: change the request or the pool, and"
            f" cancel it with `better-compute cancel {rid} --tenant {tenant}` (or reserve with"
            " --cancel-if-never-fits)"
        )
    raise typer.Exit(Exit.REFUSED)


def _earliest(api: client.ApiClient, ask: bodies.Ask) -> int:
    """The start of the first window ``capacity --find`` answers for ``ask``."""
    answer = api.call("capacity/search", {**bodies.request(ask), "limit": 1})
    windows = answer.get("windows") or []
    if not windows:
        raise client.Failure(
            code="NO_WINDOW",
            message=f"--start earliest: {answer.get('message') or 'no window'}",
        )
    start = int(windows[0]["start"])
    output.note(f"Earliest window: {parsing.format_time(start)}")
    return start


@app.command(
    help=(
        "Preview whether a reservation would fit, and where, or find the earliest windows "
        "where it would, without booking anything.\n\n"
        "Takes the same request options as reserve; a preview that fits is a create that fits, "
        "and so is each window --find answers (at that moment)."
    ),
    epilog=_examples(
        "better-compute capacity --tenant acme --preview --pool pool_h100 --gpus 2 --for 8h"
        " --cpus 32 --memory 256",
        "better-compute capacity --tenant acme --preview --pool pool_h100 --gpus 8 --gang 2"
        " --for 3d --start 2026-09-28T09:00:00Z",
        "better-compute capacity --tenant acme --find --pool pool_h100 --gpus 8 --for 24h"
        " --from +2d --horizon 7d",
    ),
)
def capacity(
    pool: options.PoolOption,
    duration: options.ForOption,
    preview: Annotated[
        bool,
        typer.Option(
            "--preview", help="Preview whether the request would fit now (nothing is booked)."
        ),
    ] = False,
    find: Annotated[
        bool,
        typer.Option(
            "--find",
            help="Find the earliest windows where the request would fit (nothing is booked).",
        ),
    ] = False,
    from_: options.FromOption = None,
    horizon: options.HorizonOption = None,
    limit: options.LimitOption = 5,
    tenant: options.TenantOption = None,
    gpus: options.GpusOption = None,
    mig: options.MigOption = None,
    count: options.CountOption = None,
    slots: options.SlotsOption = None,
    start: options.StartOption = None,
    nvlink: options.NvlinkOption = False,
    gang: options.GangOption = None,
    cpus: options.CpusOption = None,
    memory: options.MemoryOption = None,
    binding: options.BindingOption = None,
    kubernetes: options.KubernetesOption = False,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """Preview whether a reservation would fit, or find when it would, booking nothing."""
    kubernetes = options.kubernetes_binding(binding, kubernetes)
    if preview == find:
        raise typer.BadParameter(
            "capacity needs exactly one of --preview (now) or --find (the earliest windows)",
            param_hint="'--preview'",
        )
    if start == options.EARLIEST:
        raise typer.BadParameter("'earliest' is for reserve; use --find", param_hint="'--start'")
    if find and start is not None:
        raise typer.BadParameter("--find looks from --from, not --start", param_hint="'--start'")
    if preview and (from_ is not None or horizon is not None):
        raise typer.BadParameter("--from and --horizon are for --find", param_hint="'--from'")
    with calls.reporting(out):
        found = _settings(url=url, token=token, tenant=tenant, out=out)
        ask = _ask(
            tenant=calls.tenant(found),
            pool=pool,
            duration=duration,
            gpus=gpus,
            mig=mig,
            count=count,
            slots=slots,
            nvlink=nvlink,
            start=start,
            gang=gang,
            cpus=cpus,
            memory=memory,
            kubernetes=kubernetes,
        )
        body = bodies.request(ask)
        with _client(found) as api:
            if find:
                search: dict[str, Any] = {**body, "limit": limit}
                if from_ is not None:
                    search["from"] = parsing.parse_time(from_, now_ms=options.now_ms())
                if horizon is not None:
                    search["horizon"] = horizon.strip()
                answer = api.call("capacity/search", search)
                output.emit(answer, output=found.output, table=output.search)
                return
            answer = api.call("capacity/preview", body)
        output.emit(answer, output=found.output, table=output.preview)


# --- reservations get / list ---------------------------------------------------------------


@reservations_app.command(
    "get",
    epilog=_examples(
        "better-compute reservations get rsv_… --tenant acme",
        "better-compute reservations get rsv_… --tenant acme --query binding",
        "better-compute reservations get rsv_… --tenant acme --query during.end --output json",
    ),
)
def reservations_get(
    reservation_id: options.IdArgument,
    tenant: options.TenantOption = None,
    query: Annotated[
        str | None,
        typer.Option(
            "--query",
            help="Print only this part of the reservation: binding, during.end, conditions[0].",
        ),
    ] = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """Show one reservation: state, devices, window, nodes, conditions and operation."""
    with calls.reporting(out):
        steps: list[str | int] | None = None
        if query is not None:
            try:
                steps = parsing.parse_query(query)
            except parsing.ParseError as e:
                raise parsing.ParseError(str(e), option="--query") from None
        found = _settings(url=url, token=token, tenant=tenant, out=out)
        tenant_id = calls.tenant(found)
        with _client(found) as api:
            rid = ids.reservation(api, tenant_id, reservation_id)
            view = api.call("reservations/get", {"tenantId": tenant_id, "reservationId": rid})
        if steps is None:
            output.emit(view, output=found.output, table=output.reservation_table)
            return
        try:
            value = parsing.lookup(view, steps)
        except parsing.ParseError as e:
            raise client.Failure(f"--query {query}: {e}", exit_code=client.EXIT_USAGE) from None
        output.emit_value(value, output=found.output)


@reservations_app.command(
    "list",
    epilog=_examples(
        "better-compute reservations list --tenant acme",
        "better-compute reservations list --tenant acme --all --state active --pool pool_h100",
        "better-compute reservations list --tenant acme --limit 20 --cursor rsv_…",
    ),
)
def reservations_list(
    tenant: options.TenantOption = None,
    everyone: Annotated[
        bool,
        typer.Option("--all", help="The tenant's reservations, not only yours."),
    ] = False,
    state: Annotated[
        str | None,
        typer.Option("--state", help="Only this state: placed, pending, active, released, …"),
    ] = None,
    pool: Annotated[str | None, typer.Option("--pool", help="Only this pool.")] = None,
    limit: Annotated[
        int | None,
        typer.Option("--limit", help="At most this many (1 to 200; default 50).", min=1, max=200),
    ] = None,
    cursor: Annotated[
        str | None,
        typer.Option("--cursor", help="Continue after this id (the 'More:' line of a list)."),
    ] = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """List reservations, newest first: yours by default, the tenant's with --all."""
    with calls.reporting(out):
        found = _settings(url=url, token=token, tenant=tenant, out=out)
        body: dict[str, Any] = {"tenantId": calls.tenant(found)}
        if everyone:
            body["scope"] = "all"
        if state is not None:
            body["state"] = state
        if pool is not None:
            body["poolId"] = pool
        if limit is not None:
            body["limit"] = limit
        if cursor is not None:
            body["cursor"] = cursor
        with _client(found) as api:
            answer = api.call("reservations/list", body)
        output.emit(answer, output=found.output, table=output.reservation_list, keep_whole=True)


# --- subscriptions ---------------------------------------------------------------------------

#: Where a subscription's start is looked up: the tenant's subscriptions.
_SUBSCRIPTIONS = "events/subscriptions/list"
SubscriptionArgument = Annotated[
    str,
    typer.Argument(
        metavar="ID",
        help="The subscription id (sub_…), or a unique start of one (4 characters or more"
        " after sub_, which may be left out).",
        autocompletion=ids.complete_subscription,
        show_default=False,
    ),
]


@subscriptions_app.command(
    "create",
    epilog=_examples(
        "better-compute subscriptions create --url https://hooks.example.com/compute",
        "better-compute subscriptions create --url https://hooks.example.com/compute"
        " --event reservation.placed --event reservation.released",
    ),
)
def subscriptions_create(
    hook_url: Annotated[
        str,
        typer.Option(
            "--url",
            help="Where to POST the events: an http:// or https:// URL.",
            show_default=False,
        ),
    ],
    event: Annotated[
        list[str] | None,
        typer.Option(
            "--event",
            help="Only this event type (repeat for more): reservation.placed, "
            "reservation.released, … (default: every type).",
        ),
    ] = None,
    tenant: options.TenantOption = None,
    server: Annotated[
        str | None,
        typer.Option(
            "--server",
            help="Base URL of the API (or $BETTER_COMPUTE_URL): --url names the webhook here.",
            rich_help_panel=options.CONNECTION,
            show_default=False,
        ),
    ] = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """Subscribe a URL to your tenant's events; prints the signing secret, once."""
    with calls.reporting(out):
        found = _settings(url=server, token=token, tenant=tenant, out=out)
        body: dict[str, Any] = {"tenantId": calls.tenant(found), "url": hook_url}
        if event:
            body["eventTypes"] = list(event)
        with _client(found) as api:
            made = api.call("events/subscriptions/create", body)
        output.emit(made, output=found.output, table=output.subscription)


@subscriptions_app.command(
    "list", epilog=_examples("better-compute subscriptions list --tenant acme")
)
def subscriptions_list(
    tenant: options.TenantOption = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """Your tenant's webhook subscriptions (their secrets are never shown again)."""
    with calls.reporting(out):
        found = _settings(url=url, token=token, tenant=tenant, out=out)
        with _client(found) as api:
            answer = api.call("events/subscriptions/list", {"tenantId": calls.tenant(found)})
        output.emit(answer, output=found.output, table=output.subscription_list, keep_whole=True)


@subscriptions_app.command(
    "disable",
    epilog=_examples("better-compute subscriptions disable sub_… --tenant acme"),
)
# 'delete' is its old name (docs/cli.md, "Renamed flags"): the server keeps the subscription,
# disabled, with its delivery log, so 'disable' says what happens.
@subscriptions_app.command("delete", hidden=True)
def subscriptions_disable(
    subscription_id: SubscriptionArgument,
    tenant: options.TenantOption = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """Stop delivering to a subscription, for good: it is kept, disabled, with its delivery
    log; what is still pending ends dead."""
    with calls.reporting(out):
        found = _settings(url=url, token=token, tenant=tenant, out=out)
        chosen = calls.tenant(found)
        with _client(found) as api:
            sid = ids.listed(api, chosen, subscription_id, ids.SUBSCRIPTION, _SUBSCRIPTIONS)
            body = {"tenantId": chosen, "subscriptionId": sid}
            gone = api.call("events/subscriptions/delete", body)
        output.emit(gone, output=found.output, table=output.subscription)


@subscriptions_app.command(
    "deliveries",
    epilog=_examples(
        "better-compute subscriptions deliveries sub_… --tenant acme",
        "better-compute subscriptions deliveries sub_… --state dead",
    ),
)
def subscriptions_deliveries(
    subscription_id: SubscriptionArgument,
    state: Annotated[
        str | None,
        typer.Option("--state", help="Only deliveries in this state: pending, delivered, dead."),
    ] = None,
    tenant: options.TenantOption = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """A subscription's delivery log, newest event first: attempts, last answer, next try."""
    with calls.reporting(out):
        found = _settings(url=url, token=token, tenant=tenant, out=out)
        chosen = calls.tenant(found)
        with _client(found) as api:
            sid = ids.listed(api, chosen, subscription_id, ids.SUBSCRIPTION, _SUBSCRIPTIONS)
            body: dict[str, Any] = {"tenantId": chosen, "subscriptionId": sid}
            if state is not None:
                body["state"] = state
            answer = api.call("events/deliveries/list", body)
        output.emit(answer, output=found.output, table=output.delivery_list, keep_whole=True)


@app.command(
    epilog=_examples(
        "better-compute watch --tenant acme",
        "better-compute watch rsv_01k4z9xq --tenant acme",
        "better-compute watch --tenant acme --all --pool pool_h100 --every 5s",
    ),
)
def watch(
    reservation_id: Annotated[
        str | None,
        typer.Argument(
            help="Only this reservation: its id, or a unique start of one of yours (4 characters"
            " or more after rsv_, which may be left out).",
            autocompletion=ids.complete_reservation,
        ),
    ] = None,
    tenant: options.TenantOption = None,
    everyone: Annotated[
        bool,
        typer.Option("--all", help="The tenant's reservations, not only yours."),
    ] = False,
    pool: Annotated[str | None, typer.Option("--pool", help="Only this pool.")] = None,
    ended: Annotated[
        bool,
        typer.Option("--ended", help="Also the released, cancelled, failed and expired ones."),
    ] = False,
    every: Annotated[
        str, typer.Option("--every", help="How often to look again (at least 1s).")
    ] = "2s",
    stop_after: Annotated[
        str | None,
        typer.Option("--for", help="Stop after this long (default: until Ctrl-C)."),
    ] = None,
    events: Annotated[
        bool,
        typer.Option(
            "--events",
            help="Print the tenant's events as they happen (one line each: id, time, type,"
            " reservation, state) instead of the table.",
        ),
    ] = False,
    after: Annotated[
        int | None,
        typer.Option("--after", help="With --events: resume after this event id.", min=0),
    ] = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """Follow reservations as they move: a table that updates in place until Ctrl-C.

    Shows your live reservations (placed, pending, binding, active), newest first; with an id,
    that one whatever its state. Piped to a file, it prints a new table, headed by the time,
    each time something changed. With --events, the tenant's events stream in as they
    commit (the server's GET /api/compute/events/watch); -o json prints each as JSON.
    """
    if events:
        _watch_events(
            reservation_id,
            tenant=tenant,
            after=after,
            stop_after=stop_after,
            url=url,
            token=token,
            out=out,
        )
        return
    with calls.reporting(None):
        every_ms = _duration(every, option="--every")
        if every_ms < 1000:
            raise parsing.ParseError("look again at most once a second (1s)", option="--every")
        limit_ms = _duration(stop_after, option="--for") if stop_after is not None else None
        found = _settings(url=url, token=token, tenant=tenant, out=None)
        chosen = calls.tenant(found)
        with _client(found) as api:
            rid = None if reservation_id is None else ids.reservation(api, chosen, reservation_id)

            def poll() -> dict[str, Any]:
                if rid is not None:
                    target = {"tenantId": chosen, "reservationId": rid}
                    one = api.call("reservations/get", target)
                    return {"items": [one]}
                body: dict[str, Any] = {"tenantId": chosen, "limit": 200}
                if everyone:
                    body["scope"] = "all"
                if pool is not None:
                    body["poolId"] = pool
                answer = dict(api.call("reservations/list", body))
                if not ended:
                    answer["items"] = [
                        r for r in answer.get("items") or () if r.get("state") in _LIVE
                    ]
                return answer

            watching.follow(
                poll,
                console=output.console(),
                every_s=every_ms / 1000,
                stop_after_s=None if limit_ms is None else limit_ms / 1000,
            )


def _watch_events(
    reservation_id: str | None,
    *,
    tenant: str | None,
    after: int | None,
    stop_after: str | None,
    url: str | None,
    token: str | None,
    out: Output | None,
) -> None:
    with calls.reporting(out):
        limit_ms = _duration(stop_after, option="--for") if stop_after is not None else None
        found = _settings(url=url, token=token, tenant=tenant, out=out)
        chosen = calls.tenant(found)
        ends = None if limit_ms is None else time.monotonic() + limit_ms / 1000
        with _client(found) as api:
            rid = None if reservation_id is None else ids.normalize(reservation_id, ids.RESERVATION)
            stream = api.events(chosen, after=after)
            try:
                for event in _until(stream, ends):
                    if rid and not str(event.get("reservationId")).startswith(rid):
                        continue
                    output.event_line(event, output=found.output)
            except KeyboardInterrupt:
                pass


def _until(stream: Iterator[dict[str, Any]], ends: float | None) -> Iterator[dict[str, Any]]:
    """The stream's events until ``ends`` (monotonic), however quiet the stream is."""
    if ends is None:
        yield from stream
        return
    yield from watching.bounded(stream, ends=ends)


def _duration(text: str, *, option: str) -> int:
    try:
        return parsing.parse_duration(text)
    except parsing.ParseError as e:
        raise parsing.ParseError(str(e), option=option) from None


#: What ``watch`` shows without --ended.
_LIVE = ("pending", "placed", "binding", "active", "releasing", "awaiting-confirmation")


# --- extend, renew, release, cancel --------------------------------------------------------


@app.command(
    help=(
        "Move a reservation's end later, decided by policy like a create.\n\n"
        "Give exactly one of --until or --by. When another booking starts first, nothing"
        " changes and the answer says until when the devices are free."
    ),
    epilog=_examples(
        "better-compute extend rsv_… --tenant acme --until +12h",
        "better-compute extend rsv_… --tenant acme --by 4h --key train-2026-09-24-ext-1",
        "better-compute extend rsv_… --tenant acme --until 2026-09-25T08:00:00Z",
    ),
)
def extend(
    reservation_id: options.IdArgument,
    tenant: options.TenantOption = None,
    until: Annotated[
        str | None,
        typer.Option(
            "--until",
            help=(
                "The new end: +12h (from now), an ISO 8601 time or epoch ms. Safe to retry: an"
                " end already reached changes nothing."
            ),
            callback=options.check_time,
        ),
    ] = None,
    by: Annotated[
        str | None,
        typer.Option(
            "--by",
            help="Move the end later by this much: 4h, 30m. Each new key extends again.",
            callback=options.check_duration,
        ),
    ] = None,
    key: Annotated[
        str | None,
        typer.Option(
            "--key",
            help="Idempotency key. Default: a new key on every run, printed so you can retry.",
            callback=options.check_key,
        ),
    ] = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """Move a reservation's end later, decided by policy like a create."""
    with calls.reporting(out):
        found = _settings(url=url, token=token, tenant=tenant, out=out)
        tenant_id = calls.tenant(found)
        chosen_key = key or new_key()
        # Resolved once, to the second: the retry line names this very time, so a retry sends
        # the same body with the same key (``+12h`` again would be another request).
        until_ms = (
            None
            if until is None
            else parsing.parse_time(until, now_ms=options.now_ms()) // 1000 * 1000
        )
        with _client(found) as api:
            rid = ids.reservation(api, tenant_id, reservation_id)
            body = bodies.extend(
                tenant=tenant_id,
                reservation_id=rid,
                key=chosen_key,
                until_ms=until_ms,
                by=None if by is None else by.strip(),
            )
            exact = parsing.format_time(until_ms)
            what = f"--by {by.strip()}" if by is not None else f"--until {exact}"
            if until is not None and until.strip() != exact:
                output.note(f"Until: {exact} ({until.strip()})")
            # Printed before sending: whatever happens next, this retries the same extend.
            output.note(
                f"Idempotency key: {chosen_key} (to retry this same extend safely:"
                f" better-compute extend {rid} --tenant {tenant_id} {what} --key {chosen_key})"
            )
            answer = api.call("reservations/extend", body)
        output.emit(answer, output=found.output, table=output.extend_result)
        if not answer.get("extended") and answer.get("availableUntil") is not None:
            # Another booking blocks it: a conflict with the pool's state (docs/cli.md).
            raise typer.Exit(Exit.CONFLICT)


def _change(
    operation: str,
    *,
    reservation_id: str,
    tenant: str | None,
    url: str | None,
    token: str | None,
    out: Output | None,
) -> None:
    with calls.reporting(out):
        found = _settings(url=url, token=token, tenant=tenant, out=out)
        chosen = calls.tenant(found)
        with _client(found) as api:
            rid = ids.reservation(api, chosen, reservation_id)
            view = api.call(f"reservations/{operation}", {"tenantId": chosen, "reservationId": rid})
        output.emit(view, output=found.output, table=output.reservation_table)


@app.command(epilog=_examples("better-compute renew rsv_… --tenant acme"))
def renew(
    reservation_id: options.IdArgument,
    tenant: options.TenantOption = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """Renew a lease: it now runs out its --lease from now (only a reservation made with one)."""
    _change("renew", reservation_id=reservation_id, tenant=tenant, url=url, token=token, out=out)


@app.command(epilog=_examples("better-compute release rsv_… --tenant acme"))
def release(
    reservation_id: options.IdArgument,
    tenant: options.TenantOption = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """End a reservation now: future bookings go, quota is refunded, billing stops."""
    _change("release", reservation_id=reservation_id, tenant=tenant, url=url, token=token, out=out)


@app.command(epilog=_examples("better-compute cancel rsv_… --tenant acme"))
def cancel(
    reservation_id: options.IdArgument,
    tenant: options.TenantOption = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """Withdraw a reservation that has not started (pending or placed)."""
    _change("cancel", reservation_id=reservation_id, tenant=tenant, url=url, token=token, out=out)


@app.command(epilog=_examples("better-compute pools --tenant acme"))
def pools(
    tenant: options.TenantOption = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """Your pools (owned or offered) and what they hold now: free, booked, healthy, total."""
    with calls.reporting(out):
        found = _settings(url=url, token=token, tenant=tenant, out=out)
        with _client(found) as api:
            answer = api.call("pools/list", {"tenantId": calls.tenant(found)})
        output.emit(answer, output=found.output, table=output.pools, keep_whole=True)


@app.command(epilog=_examples("better-compute quota", "better-compute quota --tenant acme -o json"))
def quota(
    tenant: options.TenantOption = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """Your tenant's quota: per resource (gpu:<model>, vcpu, memoryGiB …) the limit, what live
    reservations have charged, and what is left. A resource not listed grants nothing."""
    with calls.reporting(out):
        found = _settings(url=url, token=token, tenant=tenant, out=out)
        with _client(found) as api:
            answer = api.call("quotas/get", {"tenantId": calls.tenant(found)})
        output.emit(answer, output=found.output, table=output.quotas, keep_whole=True)


# --- dev -----------------------------------------------------------------------------------


@app.command(
    help=(
        "Run a complete server on this machine: embedded PostgreSQL, the API and simulated"
        " GPU nodes.\n\n"
        "Blocks until Ctrl-C. Point the other commands at it with --url http://127.0.0.1:PORT."
    ),
    epilog=_examples(
        "better-compute dev",
        "better-compute dev --sim 4 --port 9090 --metrics-port 9465",
        "better-compute dev --state-dir ./bc-state --fresh --config dev.yaml",
        "better-compute dev --database-url postgresql://bcd@localhost/bcd_scratch",
        "better-compute dev --kube   # and a real Kubernetes API server: kubectl apply works",
    ),
)
def dev(
    port: Annotated[
        int, typer.Option("--port", help="Port of the HTTP API.", min=1, max=65_535)
    ] = 8080,
    metrics_port: Annotated[
        int,
        typer.Option(
            "--metrics-port",
            help="Port of /metrics, apart from the HTTP API's (its figures name every tenant); "
            "0 picks a free one.",
            min=0,
            max=65_535,
        ),
    ] = 9464,
    sim: Annotated[
        int, typer.Option("--sim", help="How many simulated GPU nodes to run.", min=0, max=1024)
    ] = 3,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="A dev config file (tenants, pools, tokens).",
            exists=True,
            dir_okay=False,
            readable=True,
        ),
    ] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            "--state-dir", help="Where the embedded PostgreSQL keeps its data.", file_okay=False
        ),
    ] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Start from an empty database.")] = False,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    database_url: Annotated[
        str | None,
        typer.Option(
            "--database-url",
            help="Run on this PostgreSQL instead of the embedded one (a scratch database: "
            "the dev config is applied to it). --state-dir still holds the nodes' files.",
        ),
    ] = None,
    kube: Annotated[
        bool,
        typer.Option(
            "--kube",
            help="Also start a real Kubernetes control plane on 127.0.0.1 (built in the "
            "checkout: .venv/bin/python -m tests.controlplane.build), the chart's CRDs, RBAC "
            "and webhooks and the operator in it, and the simulated nodes as Nodes; prints "
            "the KUBECONFIG to export and where kubectl is.",
        ),
    ] = False,
    kube_binary: Annotated[
        Path | None,
        typer.Option(
            "--kube-binary",
            help="The control plane's binary for --kube (default: $BCD_KUBE_BINARY, else "
            ".cache/controlplane/controlplane of the checkout).",
            dir_okay=False,
        ),
    ] = None,
) -> None:
    """Run a complete server on this machine: embedded PostgreSQL, the API and simulated nodes."""
    with calls.reporting(None):
        # Imported here, not at the top: --help and every other command must work without the
        # dev server's dependencies (the 'dev' extra: embedded PostgreSQL, the simulator).
        with extras.needs(extras.DEV, program="better-compute dev"):
            from bettercompute.dev import kubernetes, running
        try:
            running.run(
                port=port,
                metrics_port=metrics_port,
                sim=sim,
                config=config,
                state_dir=state_dir,
                fresh=fresh,
                host=host,
                database_url=database_url,
                kube=kubernetes.KubeOptions(binary=kube_binary) if kube else None,
            )
        except KeyboardInterrupt:
            output.note("Stopped.")


# --- mcp -----------------------------------------------------------------------------------


@app.command(
    "mcp",
    help=(
        "Serve the reservations to an AI agent as MCP tools on stdin/stdout: reserve_gpus,"
        " get_reservation, list_reservations, extend_reservation, release_reservation and"
        " find_capacity.\n\n"
        "An MCP client (Claude Desktop, an IDE) starts it and talks to it; it calls the server"
        " with this token, for this tenant. Needs the 'mcp' extra."
    ),
    epilog=_examples(
        "better-compute mcp",
        "BETTER_COMPUTE_URL=https://compute.example.com BETTER_COMPUTE_TOKEN=… better-compute mcp",
    ),
)
def mcp_command(
    tenant: options.TenantOption = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
) -> None:
    """Serve the reservations to an AI agent as MCP tools on stdin/stdout."""
    with calls.reporting(None):
        # Imported here, not at the top: every other command must work without the MCP SDK
        # (the 'mcp' extra).
        with extras.needs("mcp", program="better-compute mcp"):
            from bettercompute.mcp import server as mcp_server
        found = _settings(url=url, token=token, tenant=tenant, out=None)
        # The server is told where and as whom; the tools reach it through this one client.
        with _client(found, timeout_s=SERVER_WAIT_CAP_S + ANSWER_GRACE_S) as api:
            mcp_server.serve(api, refusal=client.Failure, tenant=found.tenant)


# --- entry point ---------------------------------------------------------------------------


def main() -> None:
    """The console script: run the command, and never show a traceback to a user."""
    try:
        app(prog_name="better-compute")
    except KeyboardInterrupt:
        output.note("Interrupted.")
        sys.exit(130)
    except Exception as e:
        if os.environ.get("BETTER_COMPUTE_DEBUG"):
            raise
        output.note(
            f"Error: unexpected {type(e).__name__}: {e}\n"
            "Hint: this is a bug in better-compute; run again with BETTER_COMPUTE_DEBUG=1"
            " to see where it happened"
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
