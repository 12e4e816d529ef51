"""The options the commands share, declared once: connection and output, the request a
reservation or a preview describes, and the checks that read a flag's value as it is parsed.

Why checks run as option callbacks: click runs them while it reads the command line, before it
looks for stray words, so ``--for 8 hours`` is reported against ``--for`` (exit 2) rather than as
an unexpected ``hours``.

What this module must never do: talk to a server, or accept a value the command would then read
differently (the callbacks validate with the same ``parsing`` readers the commands use).
"""

from __future__ import annotations

import enum
import time
from typing import Annotated

import typer

from bettercompute.cli import ids, parsing, settings
from bettercompute.cli.settings import Output

# --- options every command shares ----------------------------------------------------------

CONNECTION = "Connection and output"

UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        help=(
            "Server address (or $BETTER_COMPUTE_URL, or url in the config file;"
            f" default {settings.DEFAULT_URL})."
        ),
        show_default=False,
        rich_help_panel=CONNECTION,
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token",
        help="Bearer token (or $BETTER_COMPUTE_TOKEN, or token in the config file).",
        show_default=False,
        rich_help_panel=CONNECTION,
    ),
]
OutputOption = Annotated[
    Output | None,
    typer.Option(
        "--output",
        "-o",
        help="table for people (default), wide (the table with whole ids), or json / yaml: "
        "the server's data exactly.",
        case_sensitive=False,
        show_default=False,
        rich_help_panel=CONNECTION,
    ),
]
TenantOption = Annotated[
    str | None,
    typer.Option(
        "--tenant",
        help="Tenant id (or $BETTER_COMPUTE_TENANT, or tenant in the config file; else the "
        "tenant your token belongs to).",
        show_default=False,
    ),
]
IdArgument = Annotated[
    str,
    typer.Argument(
        metavar="ID",
        help="The reservation id (rsv_…), or a start of one of yours that no other shares:"
        " 4 characters or more after rsv_, which may be left out.",
        autocompletion=ids.complete_reservation,
        show_default=False,
    ),
]


def check_duration(value: str | None) -> str | None:
    if value is not None:
        try:
            parsing.parse_duration(value)
        except parsing.ParseError as e:
            raise typer.BadParameter(str(e)) from None
    return value


#: ``reserve --start earliest``: the first window ``capacity --find`` would answer.
EARLIEST = "earliest"


def check_time(value: str | None) -> str | None:
    if value is not None and value != EARLIEST:
        try:
            parsing.parse_time(value, now_ms=now_ms())
        except parsing.ParseError as e:
            raise typer.BadParameter(str(e)) from None
    return value


def check_key(value: str | None) -> str | None:
    if value is not None and (
        not 1 <= len(value) <= 256 or not all(0x21 <= ord(c) <= 0x7E for c in value)
    ):
        raise typer.BadParameter("a key is 1 to 256 printable characters without spaces")
    return value


def now_ms() -> int:
    return int(time.time() * 1000)


REQUEST = "Request"
OPTIONS = "Reservation options"

PoolOption = Annotated[
    str,
    typer.Option(
        "--pool",
        help="The pool to book from (pool_…).",
        autocompletion=ids.complete_pool,
        rich_help_panel=REQUEST,
    ),
]
GpusOption = Annotated[
    int | None,
    typer.Option("--gpus", help="Whole GPUs.", min=1, max=1024, rich_help_panel=REQUEST),
]
MigOption = Annotated[
    str | None,
    typer.Option(
        "--mig", help="MIG instances of this profile, such as 1g.10gb.", rich_help_panel=REQUEST
    ),
]
CountOption = Annotated[
    int | None,
    typer.Option(
        "--count",
        help="How many MIG instances (with --mig; default 1).",
        min=1,
        max=1024,
        rich_help_panel=REQUEST,
    ),
]
SlotsOption = Annotated[
    int | None,
    typer.Option(
        "--slots", help="Time-slice or MPS slots.", min=1, max=1024, rich_help_panel=REQUEST
    ),
]
ForOption = Annotated[
    str,
    typer.Option(
        "--for",
        help="How long: 8h, 90m, 2h30m, 1d.",
        callback=check_duration,
        show_default=False,
        rich_help_panel=REQUEST,
    ),
]
StartOption = Annotated[
    str | None,
    typer.Option(
        "--start",
        help=(
            "When the window begins: +2h (from now), an ISO 8601 time (local time without an"
            " offset) or epoch ms; for reserve also 'earliest' (the first window where it fits,"
            " as capacity --find answers). Default: as soon as it is placed."
        ),
        callback=check_time,
        rich_help_panel=REQUEST,
    ),
]
NvlinkOption = Annotated[
    bool,
    typer.Option(
        "--nvlink", help="All GPUs in one NVLink domain (with --gpus).", rich_help_panel=REQUEST
    ),
]
GangOption = Annotated[
    int | None,
    typer.Option(
        "--gang",
        help="A gang of N members, each with the devices asked for, placed all together.",
        min=1,
        max=1024,
        rich_help_panel=REQUEST,
    ),
]
CpusOption = Annotated[
    int | None,
    typer.Option(
        "--cpus",
        help="Host vCPUs per node to book with the GPUs, on their node (default, and least: "
        "the pool's per-GPU share; anything above it is charged to your vcpu quota).",
        min=0,
        max=4096,
        rich_help_panel=REQUEST,
    ),
]
MemoryOption = Annotated[
    int | None,
    typer.Option(
        "--memory",
        help="Host memory in GiB per node to book with the GPUs (default, and least: the "
        "pool's per-GPU share; anything above it is charged to your memoryGiB quota).",
        min=0,
        max=65_536,
        rich_help_panel=REQUEST,
    ),
]


class Binding(enum.StrEnum):
    """``--binding``: how the devices are handed over (the spelling ``kubectl bcd`` shares)."""

    hold = "hold"
    kubernetes = "kubernetes"


BindingOption = Annotated[
    Binding | None,
    typer.Option(
        "--binding",
        help="How the devices are handed over: hold (default: to software on the node) or"
        " kubernetes (to pods, through the bcd.dev device plugin).",
        case_sensitive=False,
        show_default=False,
        rich_help_panel=REQUEST,
    ),
]
#: The old spelling of ``--binding kubernetes``, still read (docs/cli.md, "Renamed flags").
KubernetesOption = Annotated[bool, typer.Option("--kubernetes", hidden=True)]


def kubernetes_binding(binding: Binding | None, kubernetes: bool) -> bool:
    """Whether ``--binding kubernetes`` (or its old spelling ``--kubernetes``) was given."""
    if kubernetes and binding == Binding.hold:
        raise typer.BadParameter(
            "--kubernetes is the old spelling of --binding kubernetes: give one",
            param_hint="'--binding'",
        )
    return kubernetes or binding == Binding.kubernetes


def check_wait(value: str | None) -> str | None:
    """``--timeout``: a duration (20s, 5m); 0 answers at once, at most a day."""
    if value is not None and value.strip() != "0":
        check_duration(value)
        if parsing.parse_duration(value) > 86_400_000:
            raise typer.BadParameter("wait at most a day (24h)")
    return value


def wait_seconds(timeout: str | None, old_wait: int | None, *, no_wait: bool) -> float | None:
    """The wait in seconds from ``--timeout``, ``--no-wait`` or the old ``--wait SECONDS``;
    ``None`` when none was given (the command's default applies)."""
    given = [
        name
        for name, value in (("--timeout", timeout), ("--wait", old_wait), ("--no-wait", no_wait))
        if value not in (None, False)
    ]
    if len(given) > 1:
        raise typer.BadParameter(
            f"give one of --timeout or --no-wait (got {' and '.join(given)})",
            param_hint=f"'{given[-1]}'",
        )
    if no_wait:
        return 0.0
    if old_wait is not None:
        return float(old_wait)
    if timeout is None:
        return None
    return 0.0 if timeout.strip() == "0" else parsing.parse_duration(timeout) / 1000


TimeoutOption = Annotated[
    str | None,
    typer.Option(
        "--timeout",
        help="How long to wait for the answer (20s, 5m; 0 answers at once). Past it the"
        " request stands and the command exits 7. Default 20s.",
        callback=check_wait,
        show_default=False,
        rich_help_panel=OPTIONS,
    ),
]
NoWaitOption = Annotated[
    bool,
    typer.Option(
        "--no-wait",
        help="Answer at once: do not wait for a queued reservation (as --timeout 0).",
        rich_help_panel=OPTIONS,
    ),
]


def check_lease(value: str | None) -> str | None:
    if value is not None:
        try:
            seconds = lease_seconds(value)
        except parsing.ParseError as e:
            raise typer.BadParameter(str(e)) from None
        if seconds is not None and not 60 <= seconds <= 30 * 86_400:
            raise typer.BadParameter("a lease is 1m to 30d")
    return value


def lease_seconds(value: str | None) -> int | None:
    """``--lease 1h`` in seconds; a bare number is the old form, in seconds."""
    if value is None:
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():
        return int(text)
    return parsing.parse_duration(text) // 1000


LeaseOption = Annotated[
    str | None,
    typer.Option(
        "--lease",
        help="A renewable lease this long (30m, 2h; 1m to 30d): renew it before it lapses.",
        callback=check_lease,
        show_default=False,
        rich_help_panel=OPTIONS,
    ),
]
#: The old ``--wait SECONDS``, still read (docs/cli.md, "Renamed flags").
OldWaitOption = Annotated[int | None, typer.Option("--wait", min=0, max=86_400, hidden=True)]

FromOption = Annotated[
    str | None,
    typer.Option(
        "--from",
        help="capacity --find: the earliest start to consider (+2d, an ISO 8601 time or epoch "
        "ms). Default: now.",
        callback=check_time,
        rich_help_panel=REQUEST,
    ),
]
HorizonOption = Annotated[
    str | None,
    typer.Option(
        "--horizon",
        help="capacity --find: how far after --from a window may start (7d, 36h). Default 14d; "
        "at most 90d.",
        rich_help_panel=REQUEST,
    ),
]
LimitOption = Annotated[
    int,
    typer.Option(
        "--limit",
        help="capacity --find: windows to show (1-50).",
        min=1,
        max=50,
        rich_help_panel=REQUEST,
    ),
]


class WaitFor(enum.StrEnum):
    """``reserve --wait-for``: the state to wait for."""

    placed = "placed"
    active = "active"
