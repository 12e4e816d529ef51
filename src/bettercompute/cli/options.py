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

from bettercompute.cli import parsing, settings
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
        help="table for people (default), or json / yaml: the server's data exactly.",
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
        help="The reservation id (rsv_…), or a start of one of yours that no other shares"
        " (8 characters or more).",
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
    typer.Option("--pool", help="The pool to book from (pool_…).", rich_help_panel=REQUEST),
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
KubernetesOption = Annotated[
    bool,
    typer.Option(
        "--kubernetes",
        help="binding: kubernetes, for pods through the bcd.dev device plugin.",
        rich_help_panel=REQUEST,
    ),
]

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
