"""``better-compute confirmations list|approve|deny``: a person answers what an agent asked.

Why a command group of its own: an agent acting for you (the MCP server, a bot with its own
token) may be held by a policy until you confirm; the agent then answers with a confirmation id
(``cnf_…``) and waits. These commands are the person's side of that loop: see what waits for
you, say yes or no. The agent's side needs nothing new: it sends the same request again with the
same idempotency key.

Each command is a few lines around one API call (``confirmations/list``, ``/approve``,
``/deny``), printed as a table, JSON or YAML like every other command. What it must never do:
decide anything itself, or send a token anywhere but the configured API.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich import box
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from bettercompute.cli import calls, client, ids, options, output, parsing, settings
from bettercompute.cli.settings import Output
from bettercompute.core import durations

app = typer.Typer(
    help=(
        "Confirm or refuse what an agent acting for you asked. When a policy holds an agent's "
        "request for your confirmation, the agent is answered CONFIRMATION_REQUIRED with a "
        "confirmation id (cnf_…); approve it and the agent's retry with the same idempotency "
        "key is placed, deny it and the request is denied. Unanswered, it expires at its "
        "deadline (at most 30 minutes)."
    ),
    epilog=(
        "Examples:\n\n"
        "  better-compute confirmations list\n"
        "  better-compute confirmations approve cnf_01k…\n"
        "  better-compute confirmations deny cnf_01k… --tenant acme"
    ),
    no_args_is_help=True,
)

ConfirmationArgument = Annotated[
    str,
    typer.Argument(
        metavar="ID",
        help="The confirmation id (cnf_…), as the agent was told or 'confirmations list' shows"
        " (a unique start of it will do: 4 characters or more after cnf_, which may be left out).",
        autocompletion=ids.complete_confirmation,
        show_default=False,
    ),
]


def _call(found: settings.Settings, operation: str, body: dict[str, Any]) -> Any:
    with client.ApiClient(url=found.url, token=found.token) as api:
        return api.call(operation, body)


@app.command(
    "list",
    epilog=(
        "Examples:\n\n"
        "  better-compute confirmations list\n"
        "  better-compute confirmations list --state pending -o json"
    ),
)
def list_(
    state: Annotated[
        str | None,
        typer.Option(
            "--state", help="Only confirmations in this state: pending, approved, denied, expired."
        ),
    ] = None,
    tenant: options.TenantOption = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """Confirmations that name you, as the person asked or the agent that asked.

    Newest first; a pending one past its deadline shows as expired."""
    with calls.reporting(out):
        found = settings.resolve(url=url, token=token, tenant=tenant, output=out)
        body: dict[str, Any] = {"tenantId": calls.tenant(found)}
        if state is not None:
            body["state"] = state
        answer = _call(found, "confirmations/list", body)
    output.emit(answer, output=found.output, table=confirmation_list, keep_whole=True)


@app.command(
    "approve",
    epilog="Examples:\n\n  better-compute confirmations approve cnf_01k… --tenant acme",
)
def approve(
    confirmation_id: ConfirmationArgument,
    tenant: options.TenantOption = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """Approve what an agent asked for you; its retry with the same key is placed.

    Only the person the confirmation names may approve it; approving twice is harmless. Past the
    deadline, or after a deny, it is refused (INVALID_STATE)."""
    _decide("confirmations/approve", confirmation_id, tenant, url, token, out)


@app.command(
    "deny",
    epilog="Examples:\n\n  better-compute confirmations deny cnf_01k… --tenant acme",
)
def deny(
    confirmation_id: ConfirmationArgument,
    tenant: options.TenantOption = None,
    url: options.UrlOption = None,
    token: options.TokenOption = None,
    out: options.OutputOption = None,
) -> None:
    """Deny what an agent asked for you; the reservation is denied for good.

    Only the person the confirmation names may deny it; denying twice is harmless. After an
    approval, or past the deadline, it is refused (INVALID_STATE)."""
    _decide("confirmations/deny", confirmation_id, tenant, url, token, out)


def _decide(
    operation: str,
    confirmation_id: str,
    tenant: str | None,
    url: str | None,
    token: str | None,
    out: Output | None,
) -> None:
    with calls.reporting(out):
        found = settings.resolve(url=url, token=token, tenant=tenant, output=out)
        chosen = calls.tenant(found)
        with client.ApiClient(url=found.url, token=found.token) as api:
            cid = ids.listed(api, chosen, confirmation_id, ids.CONFIRMATION, "confirmations/list")
            answer = api.call(operation, {"tenantId": chosen, "confirmationId": cid})
    output.emit(answer, output=found.output, table=confirmation)


# --- tables -----------------------------------------------------------------------------------


def _what(request: Any) -> str:
    """What the reservation asks for, in a few words: '6 x gpu for 2h in pool_a'."""
    if not isinstance(request, dict):
        return "-"
    devices = request.get("devices") or []
    parts = [
        f"{d.get('count', 1)} x {d.get('profile') or d.get('class', '?')}"
        for d in devices
        if isinstance(d, dict)
    ]
    words = " + ".join(parts) or "-"
    duration = durations.human_text(request.get("duration"))
    if duration is not None:
        words += f" for {duration}"
    if request.get("poolId"):
        words += f" in {request['poolId']}"
    return words


def confirmation(data: Any) -> RenderableType:
    """One confirmation as a key/value table, with what to do next."""
    if not isinstance(data, dict):
        return Text(str(data))
    table = Table(box=box.SIMPLE, show_header=False, pad_edge=False)
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    rows = [
        ("id", data.get("id")),
        ("state", data.get("state")),
        ("reservation", data.get("reservationId")),
        ("asks for", _what(data.get("request"))),
        ("agent", data.get("agentId")),
        ("person", data.get("personId")),
        ("deadline", parsing.format_time(data.get("expiresAt"))),
        ("decided by", data.get("decidedBy")),
        ("decided", parsing.format_time(data["decidedAt"]) if data.get("decidedAt") else None),
    ]
    for name, value in rows:
        if value is not None:
            table.add_row(name, Text(str(value)))
    return table


def confirmation_list(data: Any) -> RenderableType:
    """``confirmations.list``: ID, STATE, ASKS FOR, AGENT, PERSON, DEADLINE."""
    items = data.get("items") if isinstance(data, dict) else None
    if not items:
        return Text("No confirmations.")
    table = Table(box=box.SIMPLE, pad_edge=False)
    for column in ("ID", "STATE", "ASKS FOR", "AGENT", "PERSON", "DEADLINE"):
        table.add_column(column, no_wrap=column in ("ID", "DEADLINE"))
    ids = output.short_ids(str(item.get("id")) for item in items)
    for item in items:
        table.add_row(
            Text(ids[str(item.get("id"))]),
            Text(str(item.get("state"))),
            Text(_what(item.get("request"))),
            Text(str(item.get("agentId"))),
            Text(str(item.get("personId"))),
            Text(parsing.format_time(item.get("expiresAt"))),
        )
    return table
