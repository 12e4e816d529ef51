"""What the CLI prints: tables for people, the server's data unchanged for programs.

Why one module: every command answers in the format of ``--output``. ``json`` and ``yaml`` print
the ``data`` of the server's answer exactly (so scripts see the API's own shape); ``table`` draws
a reservation as a key/value table, a list as columns (ID, STATE, POOL, DEVICES, START, END),
with times as RFC 3339 UTC and durations with units (``8h``, ``2d3h``). A column table shows
each id as its shortest start no other row shares (at least 8 characters after the kind, as
git shows commits), so the default tables fit 100 columns; ``wide`` shows them whole. Errors go
to stderr as ``Error CODE: message``, their details readable the same way.

What this module must never do: change the data in ``json``/``yaml`` output, let text from the
server be read as rich markup (a condition message with ``[brackets]`` is printed as written),
or print anything but the answer on stdout (keys, hints and progress go to stderr).
"""

from __future__ import annotations

import contextvars
import itertools
import json
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TextIO

import yaml
from rich import box
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from bettercompute.cli import client, parsing
from bettercompute.cli.settings import Output
from bettercompute.core import durations, moments

if TYPE_CHECKING:
    # Annotations only: the CLI starts without loading pydantic.
    from bettercompute.core import answers

# A table piped to a file or another program is not cut to 80 columns: ids stay whole.
_PIPE_WIDTH = 1000
#: The fewest characters after an id's kind (``rsv_``) a table shows.
ID_CHARS = 8
# Whether the table being drawn is ``-o wide`` (whole ids); set by ``emit`` around one drawing.
_WIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("wide", default=False)


def console(*, stream: TextIO | None = None) -> Console:
    out = stream or sys.stdout
    width = None if out.isatty() else _PIPE_WIDTH
    return Console(file=out, width=width, highlight=False, soft_wrap=False)


def dumps(data: Any, output: Output) -> str:
    """``data`` as JSON or YAML text, unchanged."""
    if output == Output.YAML:
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, default_flow_style=False)
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def emit(
    data: Any,
    *,
    output: Output,
    table: Callable[[Any], RenderableType],
    keep_whole: bool = False,
) -> None:
    """Print the answer: the server's data for json/yaml, ``table(data)`` for people.

    ``keep_whole`` is for column tables: rich would otherwise fit one to a narrow terminal by
    cutting ids to ``rsv_ab…``, which makes them useless. Its columns that may wrap (devices,
    URLs, event types) wrap to fit the terminal; only when the columns that never wrap (ids,
    states, times) are wider than it is the table drawn wider, and the terminal wraps the lines.
    """
    if output not in (Output.TABLE, Output.WIDE):
        sys.stdout.write(dumps(data, output))
        return
    wide = _WIDE.set(output == Output.WIDE)
    try:
        renderable = table(data)
    finally:
        _WIDE.reset(wide)
    out = console()
    if keep_whole:
        unbounded = out.options.update_width(_PIPE_WIDTH)
        needed = Measurement.get(out, unbounded, renderable).minimum
        if needed > out.width:
            out = Console(file=sys.stdout, width=needed, highlight=False, soft_wrap=False)
    out.print(renderable)


def emit_value(value: Any, *, output: Output) -> None:
    """One queried value: raw text for a scalar in table mode, else JSON or YAML."""
    if output in (Output.TABLE, Output.WIDE):
        if isinstance(value, dict | list):
            sys.stdout.write(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
        else:
            sys.stdout.write(_scalar(value) + "\n")
    else:
        sys.stdout.write(dumps(value, output))


def note(message: str) -> None:
    """A line for the person at the terminal that is not part of the answer."""
    print(message, file=sys.stderr, flush=True)


#: How the server starts a ``NoFit`` message no wait can cure (``core.placement.NEVER``).
NEVER_FITS = "never fits this pool"


def never_fits(view: Any) -> str | None:
    """The reason a reservation can never fit its pool as the pool is, or ``None``."""
    if not isinstance(view, Mapping):
        return None
    for condition in view.get("conditions") or ():
        message = condition.get("message") if isinstance(condition, Mapping) else None
        if isinstance(message, str) and message.startswith(NEVER_FITS):
            return message
    return None


def failure(error: client.Failure, *, output: Output) -> None:
    """``Error CODE: message`` on stderr, then details and a hint when there are any."""
    prefix = f"Error {error.code}" if error.code else "Error"
    lines = [f"{prefix}: {error.message}"]
    if error.details:
        if output == Output.JSON:
            lines.append(json.dumps({"details": error.details}, indent=2, ensure_ascii=False))
        elif output == Output.YAML:
            lines.append(dumps({"details": error.details}, Output.YAML).rstrip("\n"))
        else:
            text = dumps({"details": readable(error.details)}, Output.YAML).rstrip("\n")
            lines.append(text)
    if error.hint:
        lines.append(f"Hint: {error.hint}")
    print("\n".join(lines), file=sys.stderr, flush=True)


#: Epoch milliseconds of 2017-07 to 2128: an integer there in an answer is a time.
_EPOCH_MS = range(1_500_000_000_000, 5_000_000_000_001)


def readable(value: Any) -> Any:
    """``value`` (error details, a field no table knows) as people read it: epoch
    milliseconds as RFC 3339, durations the API writes as ``'1800000ms'`` as ``30m``."""
    if isinstance(value, Mapping):
        return {k: readable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [readable(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and value in _EPOCH_MS:
        return parsing.format_time(value)
    if isinstance(value, str) and value.endswith("ms") and value[:-2].isdigit():
        return durations.human_text(value) or value
    return value


def short_ids(ids: Iterable[str]) -> dict[str, str]:
    """Each id and what a table shows of it: whole with ``-o wide``, else the shortest start
    (at least ``ID_CHARS`` after the kind) that no other id of the rows shares, one length for
    all (as git shows commits). The CLI accepts such a start wherever it takes an id."""
    every = sorted(set(ids))
    if _WIDE.get():
        return {i: i for i in every}
    length = 0
    for one, other in itertools.pairwise(every):
        # Sorted, an id shares its longest start with a neighbour: one more tells them apart.
        same = next((n for n, (a, b) in enumerate(zip(one, other, strict=False)) if a != b), None)
        length = max(length, (min(len(one), len(other)) if same is None else same) + 1)
    shown = {}
    for i in every:
        kind = i.index("_") + 1 if "_" in i else 0
        shown[i] = i[: max(length, kind + ID_CHARS)]
    return shown


# --- tables --------------------------------------------------------------------------------


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _kv_table() -> Table:
    table = Table(box=box.SIMPLE, show_header=False, pad_edge=False)
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    return table


def describe_devices(request: Mapping[str, Any] | None) -> str:
    """``4 × gpu (nvlink-all)``, ``2 × mig 1g.10gb``, ``8 × slot``, with the gang size."""
    if not request:
        return "-"
    parts = []
    for device in request.get("devices") or []:
        text = f"{device.get('count', '?')} × {device.get('class', '?')}"
        if device.get("profile"):
            text += f" {device['profile']}"
        if device.get("topology") and device["topology"] != "any":
            text += f" ({device['topology']})"
        parts.append(text)
    described = ", ".join(parts) or "-"
    gang = (request.get("gang") or {}).get("size")
    if gang and gang > 1:
        described += f", gang of {gang}"
    return described


def describe_window(during: Mapping[str, Any] | None) -> str:
    if not during:
        return "-"
    start, end = during.get("start"), during.get("end")
    text = f"{parsing.format_time(start)} → {parsing.format_time(end)}"
    if isinstance(start, int) and isinstance(end, int):
        text += f" ({parsing.format_duration(end - start)})"
    return text


def _nodes(view: Mapping[str, Any]) -> str:
    binding = view.get("binding") or {}
    nodes = binding.get("nodeIds") or ([binding["nodeId"]] if binding.get("nodeId") else [])
    return ", ".join(str(n) for n in nodes) or "-"


def _host(view: Mapping[str, Any]) -> str | None:
    """What each node books of its host, and the part of it that is the pool's share."""
    return _host_text((view.get("request") or {}).get("resources"), view.get("hostShare"))


def _host_text(resources: Any, share: Any) -> str | None:
    booked = _resources_text(resources)
    if booked is None:
        return None
    share_text = _resources_text(share)
    return f"{booked} (share {share_text})" if share_text else booked


def _resources_text(resources: Any) -> str | None:
    if not isinstance(resources, Mapping) or not resources:
        return None
    parts = []
    if resources.get("vcpu"):
        parts.append(f"{resources['vcpu']} vCPU")
    if resources.get("memoryGiB"):
        parts.append(f"{resources['memoryGiB']} GiB memory")
    if resources.get("hugepages1Gi"):
        parts.append(f"{resources['hugepages1Gi']} × 1 GiB huge pages")
    return ", ".join(parts) or None


def _conditions(view: Mapping[str, Any]) -> str:
    lines = []
    for c in view.get("conditions") or []:
        line = str(c.get("type", "?"))
        if c.get("reason"):
            line += f" ({c['reason']})"
        if c.get("message"):
            line += f": {moments.readable_message(str(c['message']))}"
        lines.append(line)
    return "\n".join(lines) or "none"


def _operation(view: Mapping[str, Any]) -> str:
    op = view.get("operation") or {}
    text = str(op.get("state", "-"))
    error = op.get("error")
    if isinstance(error, dict):
        text += f" ({error.get('code')}: {error.get('message')})"
    return text


def _binding(view: Mapping[str, Any]) -> str:
    kind = str((view.get("request") or {}).get("binding", "hold"))
    binding = view.get("binding") or {}
    # An ended reservation's binding is history, not devices it holds now.
    ended = binding and view.get("state") in ("released", "expired", "cancelled", "failed")
    lines = [f"{kind} (past: bound until it was {view.get('state')})" if ended else kind]
    for device in binding.get("cdiDevices") or []:
        lines.append(str(device))
    for key in ("envFile", "cgroupParent"):
        if binding.get(key):
            lines.append(f"{key}: {binding[key]}")
    if "attested" in binding:
        lines.append(f"attested: {'yes' if binding['attested'] else 'no'}")
    return "\n".join(lines)


def reservation_table(view: answers.Reservation) -> RenderableType:
    """One reservation as a key/value table."""
    table = _kv_table()
    rows: list[tuple[str, str | None]] = [
        ("id", view.get("id")),
        ("state", view.get("state")),
        ("pool", view.get("poolId")),
        ("devices", describe_devices(view.get("request"))),
        ("host", _host(view)),
        ("during", describe_window(view.get("during"))),
        ("requested start", _optional_time(view.get("requestedStart"))),
        ("lease until", _optional_time(view.get("leaseExpiresAt"))),
        ("nodes", _nodes(view)),
        ("binding", _binding(view)),
        ("pod resource", view.get("resourceName")),
        ("conditions", _conditions(view)),
        ("operation", _operation(view)),
        ("released because", view.get("releaseReason")),
        ("key", view.get("idempotencyKey")),
    ]
    for name, value in rows:
        if value is not None:
            table.add_row(name, Text(str(value)))
    return table


def _optional_time(ms: Any) -> str | None:
    return parsing.format_time(ms) if isinstance(ms, int) else None


def reservation_list(data: answers.ReservationList) -> RenderableType:
    """``reservations.list``: columns ID, STATE, POOL, DEVICES, START, END, then the cursor."""
    items = data.get("items") or []
    if not items:
        return Text("No reservations.")
    table = Table(box=box.SIMPLE, pad_edge=False)
    for column in ("ID", "STATE", "POOL", "DEVICES", "START", "END"):
        # Ids and times are copied and compared: they never wrap; the rest may.
        table.add_column(column, no_wrap=column in ("ID", "STATE", "START", "END"), min_width=6)
    ids = short_ids(str(item.get("id")) for item in items)
    for item in items:
        during: Mapping[str, Any] = item.get("during") or {}
        table.add_row(
            Text(ids[str(item.get("id"))]),
            Text(str(item.get("state"))),
            Text(str(item.get("poolId"))),
            Text(describe_devices(item.get("request"))),
            Text(parsing.format_time(during.get("start"))),
            Text(parsing.format_time(during.get("end"))),
        )
    cursor = data.get("nextCursor")
    if cursor:
        return Group(table, Text(f"More: add --cursor {cursor}"))
    return table


def extend_result(data: answers.ExtendResult) -> RenderableType:
    """``reservations.extend``: whether it moved, then the reservation."""
    if data.get("extended"):
        headline = "Extended."
    elif data.get("availableUntil") is not None:
        headline = (
            "Not extended: another booking starts first; available until "
            + parsing.format_time(data["availableUntil"])
            + "."
        )
    else:
        headline = "Not extended: the reservation already reaches that time."
    return Group(Text(headline), reservation_table(data.get("reservation") or {}))


def preview(data: Any) -> RenderableType:
    """``capacity.preview``: whether it fits, the window, where, and why not."""
    if not isinstance(data, dict):
        return Text(_scalar(data))
    table = _kv_table()
    fits = data.get("fits")
    never = " (never: no node of the pool could hold it)" if data.get("never") else ""
    table.add_row("fits", Text("yes" if fits else f"no{never}"))
    known = {"fits", "poolId", "during", "nodeIds", "devices", "message", "rejected"}
    known |= {"resources", "hostShare", "never"}
    rows: list[tuple[str, str | None]] = [
        ("pool", data.get("poolId")),
        ("during", describe_window(data.get("during")) if data.get("during") else None),
        ("nodes", ", ".join(str(n) for n in data.get("nodeIds") or []) or None),
        ("devices", _preview_devices(data.get("devices"))),
        ("host", _host_text(data.get("resources"), data.get("hostShare"))),
        ("message", data.get("message")),
        ("rejected", _rejected(data.get("rejected"))),
    ]
    # Fields a newer server adds still show, so the table never hides part of an answer.
    rows += [(k, _compact(readable(v))) for k, v in data.items() if k not in known]
    for name, value in rows:
        if value is not None:
            table.add_row(name, Text(str(value)))
    return table


def pools(data: Any) -> RenderableType:
    """``pools.list``: one row per pool, devices as free/total by class."""
    if not isinstance(data, dict):
        return Text(_scalar(data))
    items = data.get("items") or []
    if not items:
        return Text("no pools")
    table = Table(box=box.SIMPLE, pad_edge=False)
    for column in ("POOL", "MODEL", "NODES", "FREE/TOTAL", "BOOKED", "UNHEALTHY", "NEXT FREE"):
        table.add_column(column)
    for pool in items:
        devices = pool.get("devices") or {}
        classes = sorted(devices)
        table.add_row(
            str(pool.get("poolId")),
            str(pool.get("gpuModel") or "-"),
            f"{pool.get('nodesReady', 0)}/{pool.get('nodes', 0)} ready",
            ", ".join(f"{devices[c]['free']}/{devices[c]['total']} {c}" for c in classes) or "-",
            ", ".join(str(devices[c]["booked"]) for c in classes) or "-",
            ", ".join(str(devices[c]["total"] - devices[c]["healthy"]) for c in classes) or "-",
            parsing.format_time(pool["nextFreeAt"]) if pool.get("nextFreeAt") else "-",
        )
    return table


def event_line(event: dict[str, Any], *, output: Output) -> None:
    """One event of ``watch --events``: a JSON line, or ``ID  TIME  TYPE  RESERVATION  STATE``."""
    if output in (Output.JSON, Output.YAML):
        sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    else:
        data = event.get("data") or {}
        parts = [
            str(event.get("id")),
            parsing.format_time(event.get("at")),
            str(event.get("type")),
            str(event.get("reservationId")),
            str(data.get("state") or ""),
        ]
        sys.stdout.write("  ".join(parts).rstrip() + "\n")
    sys.stdout.flush()


def quotas(data: Any) -> RenderableType:
    """``quotas.get``: one row per resource: used, limit and what is left."""
    if not isinstance(data, dict):
        return Text(_scalar(data))
    items = data.get("quotas") or []
    if not items:
        return Text(f"no quota for tenant {data.get('tenantId')}: every charge is refused")
    table = Table(box=box.SIMPLE, pad_edge=False)
    for column in ("RESOURCE", "USED", "LIMIT", "LEFT"):
        table.add_column(column)
    for row in items:
        used, limit = int(row.get("used") or 0), int(row.get("limit") or 0)
        table.add_row(str(row.get("resource")), str(used), str(limit), str(max(limit - used, 0)))
    return table


def search(data: Any) -> RenderableType:
    """``capacity.search``: the windows found, one row each, or why there are none."""
    if not isinstance(data, dict):
        return Text(_scalar(data))
    found = data.get("windows") or []
    if not found:
        return Text(str(data.get("message") or "no window"))
    table = Table(box=box.SIMPLE, pad_edge=False)
    for column in ("START", "END", "NODES"):
        table.add_column(column)
    for window in found:
        table.add_row(
            parsing.format_time(window.get("start")),
            parsing.format_time(window.get("end")),
            ", ".join(str(n) for n in window.get("nodeIds") or []),
        )
    return table


def _preview_devices(devices: Any) -> str | None:
    if not isinstance(devices, list) or not devices:
        return None
    lines = []
    for entry in devices:
        if isinstance(entry, dict):
            ids = ", ".join(str(d) for d in entry.get("deviceIds") or [])
            lines.append(f"{entry.get('nodeId')}: {ids}")
    return "\n".join(lines) or None


def _rejected(rejected: Any) -> str | None:
    if not isinstance(rejected, dict) or not rejected:
        return None
    return ", ".join(f"{name}: {count}" for name, count in rejected.items())


def _compact(value: Any) -> str:
    if not isinstance(value, dict | list):
        return _scalar(value)
    if isinstance(value, list) and all(not isinstance(v, dict | list) for v in value):
        return ", ".join(_scalar(v) for v in value) or "-"
    return yaml.safe_dump(value, sort_keys=False, allow_unicode=True).rstrip("\n")


# --- event subscriptions -----------------------------------------------------------------------


def subscription(data: Any) -> RenderableType:
    """``events.subscriptions.create`` and ``delete``: one subscription as a key/value table;
    the secret (create only) with a reminder that it is shown once."""
    if not isinstance(data, dict):
        return Text(_scalar(data))
    table = _kv_table()
    types = data.get("eventTypes") or []
    rows: list[tuple[str, str | None]] = [
        ("id", data.get("id")),
        ("state", data.get("state")),
        ("url", data.get("url")),
        ("events", ", ".join(str(t) for t in types) or "all"),
        ("created", parsing.format_time(data.get("createdAt"))),
        ("created by", data.get("createdBy")),
        ("secret", data.get("secret")),
    ]
    for name, value in rows:
        if value is not None:
            table.add_row(name, Text(str(value)))
    if data.get("secret"):
        return Group(table, Text("Keep the secret now: it is never shown again."))
    return table


def subscription_list(data: Any) -> RenderableType:
    """``events.subscriptions.list``: ID, STATE, URL, EVENTS, CREATED."""
    items = data.get("items") if isinstance(data, dict) else None
    if not items:
        return Text("No subscriptions.")
    table = Table(box=box.SIMPLE, pad_edge=False)
    for column in ("ID", "STATE", "URL", "EVENTS", "CREATED"):
        table.add_column(column, no_wrap=column in ("ID", "STATE", "CREATED"))
    ids = short_ids(str(item.get("id")) for item in items)
    for item in items:
        types = item.get("eventTypes") or []
        table.add_row(
            Text(ids[str(item.get("id"))]),
            Text(str(item.get("state") or "-")),
            Text(str(item.get("url"))),
            Text(", ".join(str(t) for t in types) or "all"),
            Text(parsing.format_time(item.get("createdAt"))),
        )
    return table


def delivery_list(data: Any) -> RenderableType:
    """``events.deliveries.list``: EVENT, TYPE, RESERVATION, STATE, ATTEMPTS, LAST ANSWER (the
    receiver's HTTP status or the error), NEXT ATTEMPT."""
    items = data.get("items") if isinstance(data, dict) else None
    if not items:
        return Text("No deliveries.")
    table = Table(box=box.SIMPLE, pad_edge=False)
    for column in (
        "EVENT",
        "TYPE",
        "RESERVATION",
        "STATE",
        "ATTEMPTS",
        "LAST ANSWER",
        "NEXT ATTEMPT",
    ):
        table.add_column(column, no_wrap=column != "LAST ANSWER")
    reservations = short_ids(str(item.get("reservationId")) for item in items)
    events = short_ids(str(item.get("eventId")) for item in items)
    for item in items:
        status, error = item.get("lastStatus"), item.get("lastError")
        last = error or (str(status) if status is not None else "-")
        table.add_row(
            Text(events[str(item.get("eventId"))]),
            Text(str(item.get("eventType"))),
            Text(reservations[str(item.get("reservationId"))]),
            Text(str(item.get("state"))),
            Text(str(item.get("attempts"))),
            Text(last),
            Text(parsing.format_time(item.get("nextAttemptAt"))),
        )
    return table
