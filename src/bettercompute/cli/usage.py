"""``better-compute usage``: what your tenant was billed for, by pool, project or day.

Why a module of its own: the usage report is a finance question, not a reservation one, and its
command is one API call (``usage/report``) with a table of its own. The figures are the
server's usage ledger: GPU time from the moment a node bound the devices to the release or the
end, never the hours a reservation asked for. What it must never do: compute figures itself,
or send a token anywhere but the configured API.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from bettercompute.cli import calls, client, options, output, parsing, settings

_TIME_HELP = (
    "-7d (before now), +DURATION, now, an ISO 8601 time (local without an offset) or epoch ms"
)


def _check_moment(value: str | None) -> str | None:
    if value is not None:
        try:
            _moment(value)
        except parsing.ParseError as e:
            raise typer.BadParameter(str(e)) from None
    return value


def _moment(text: str) -> int:
    """``text`` as epoch ms: ``-7d`` counts back from now, else as every command reads a time."""
    now = options.now_ms()
    value = text.strip()
    if value.startswith("-"):
        return max(0, now - parsing.parse_duration(value[1:]))
    return parsing.parse_time(value, now_ms=now)


EXAMPLES = (
    "Examples:\n\n"
    "  better-compute usage --tenant acme\n"
    "  better-compute usage --tenant acme --from -7d --by day\n"
    "  better-compute usage --tenant acme --from 2026-09-01 --to 2026-10-01 --by project -o json"
)


def usage(
    from_: Annotated[
        str | None,
        typer.Option(
            "--from",
            help=f"Start of the span: {_TIME_HELP}. Default: 30 days before --to.",
            callback=_check_moment,
        ),
    ] = None,
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            help=f"End of the span (exclusive): {_TIME_HELP}. Default: now.",
            callback=_check_moment,
        ),
    ] = None,
    by: Annotated[
        str | None,
        typer.Option(
            "--by", help="One row per pool, project or day (UTC). Default: the total only."
        ),
    ] = None,
    tenant: options.TenantOption = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """What your tenant was billed for: GPU time from bound to release or end.

    A reservation is billed from the moment its node bound the devices until it is released or
    its window ends, whichever comes first, never for the hours it only asked for. Devices pods
    keep past a release or the end are not billed, nor a node lease's GPUs while unhealthy.
    GPU-HOURS weighs a MIG instance as 1/7 of a GPU and a slot as 1/replicas; DEVICE-SECONDS
    counts every device alike. A span covers at most 366 days.
    """
    with calls.reporting(out):
        found = settings.resolve(url=url, token=token, tenant=tenant, output=out)
        body: dict[str, Any] = {"tenantId": calls.tenant(found)}
        if from_ is not None:
            body["from"] = _moment(from_)
        if to is not None:
            body["to"] = _moment(to)
        if by is not None:
            body["by"] = by
        with client.ApiClient(url=found.url, token=found.token) as api:
            answer = api.call("usage/report", body)
    output.emit(answer, output=found.output, table=report_table, keep_whole=True)


def report_table(data: Any) -> RenderableType:
    """``usage.report``: a row per bucket (when grouped) and the total."""
    if not isinstance(data, dict):
        return Text(str(data))
    by = data.get("by")
    # The title is a line of its own: as a table title it wraps to the table's width, mid-sentence.
    title = Text(
        f"{data.get('tenantId')}: {parsing.format_time(data.get('from'))}"
        f" to {parsing.format_time(data.get('to'))}",
        no_wrap=True,
    )
    table = Table(box=box.SIMPLE, pad_edge=False)
    table.add_column(str(by or "").upper() or "TOTAL")
    for figure in ("GPU-HOURS", "DEVICE-SECONDS"):
        table.add_column(figure, justify="right")
    for row in data.get("items") or []:
        key = {"pool": row.get("poolId"), "project": row.get("projectId")}.get(str(by))
        if by == "day":
            key = parsing.format_time(row.get("day"))[:10]
        table.add_row(str(key or "-"), _hours(row), _seconds(row))
    total = data.get("total") or {}
    table.add_row("total" if by else "all", _hours(total), _seconds(total), style="bold")
    return Group(title, table)


def _hours(figures: Any) -> str:
    return f"{float(figures.get('gpuHours') or 0):.3f}"


def _seconds(figures: Any) -> str:
    return f"{float(figures.get('gpuSeconds') or 0):.0f}"
