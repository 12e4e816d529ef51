"""The tables ``kubectl bcd`` prints, built from the objects as the API server returned them.

Why it exists: a person reads a reservation by its state, readiness, nodes and window, a pool by
what is free, a quota by what is left; ``kubectl get`` shows a future time as ``<invalid>`` and
cannot add ``in 3h``. Each table is a pure function of the objects and ``now``, in kubectl's
plain style (no borders, upper-case headers), so it is tested without a terminal.

What it must never do: I/O, read a clock, or let text from an object be read as rich markup
(every cell is a ``Text``: a message with ``[brackets]`` prints as written).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from bettercompute.core import durations, moments
from bettercompute.kube import dra
from bettercompute.kubectl import specs, times


def _table(*headers: str) -> Table:
    table = Table(
        box=None,
        show_edge=False,
        pad_edge=False,
        padding=(0, 3, 0, 0),
        header_style="bold",
    )
    for header in headers:
        table.add_column(header, no_wrap=True, overflow="fold")
    return table


def _cell(value: object) -> Text:
    return Text("-" if value is None or value == "" else str(value))


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def _namespace(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("namespace") or "")


def _when(value: object, *, now: dt.datetime) -> str | None:
    return None if value is None or value == "" else times.shown(value, now=now)


def ready_of(obj: Mapping[str, Any]) -> str:
    found = specs.condition(obj, "Ready")
    return str(found.get("status") or "Unknown") if found is not None else "-"


# --- reservations ----------------------------------------------------------------------------


def reservations(
    objs: Sequence[Mapping[str, Any]],
    *,
    now: dt.datetime,
    namespaces: bool = False,
    wide: bool = False,
) -> Table:
    """NAME, STATE, READY, GPUS, POOL, END (NAMESPACE first with ``-A``); ``wide`` adds NODES
    and START before END, and the reservation's ID last. The default fits 100 columns."""
    headers = ["NAME", "STATE", "READY", "GPUS", "POOL"]
    headers += ["NODES", "START", "END", "ID"] if wide else ["END"]
    table = _table(*(["NAMESPACE", *headers] if namespaces else headers))
    for obj in objs:
        status, spec = specs.status_of(obj), obj.get("spec") or {}
        row = [
            _cell(_name(obj)),
            _cell(status.get("state") or ("refused" if specs.refused(obj) else "new")),
            _cell(ready_of(obj)),
            _cell(status.get("gpus")),
            _cell(spec.get("poolId") or status.get("poolId")),
        ]
        end = _cell(times.shown(status.get("endTime"), now=now))
        if wide:
            row += [
                _cell(status.get("nodes")),
                _cell(times.shown(status.get("startTime"), now=now)),
                end,
                _cell(status.get("id")),
            ]
        else:
            row.append(end)
        table.add_row(*([_cell(_namespace(obj)), *row] if namespaces else row))
    return table


def _devices(spec: Mapping[str, Any]) -> str:
    parts = []
    for device in spec.get("devices") or ():
        shown = f"{device.get('count')} {device.get('class')}"
        if device.get("profile"):
            shown += f" {device.get('profile')}"
        if device.get("topology") == "nvlink-all":
            shown += " (NVLink)"
        parts.append(shown)
    gang = (spec.get("gang") or {}).get("size")
    joined = ", ".join(parts) or "-"
    return f"{joined} on each of {gang} nodes" if gang else joined


def _claim_template(name: object) -> str | None:
    """A dra pool's template, with the two lines a pod needs to get the devices."""
    if not name:
        return None
    request = dra.CLAIM_REQUEST
    return (
        f"{name} (pod: spec.resourceClaims [{{name: {request}, resourceClaimTemplateName:"
        f" {name}}}], container: resources.claims [{{name: {request}}}])"
    )


def reservation(obj: Mapping[str, Any], *, now: dt.datetime) -> RenderableType:
    """One reservation in detail: its fields, then its conditions."""
    status, spec = specs.status_of(obj), obj.get("spec") or {}
    meta = obj.get("metadata") or {}
    extension = status.get("extension") or {}
    fields: list[tuple[str, object]] = [
        ("Name", f"{_namespace(obj)}/{_name(obj)}"),
        ("Id", status.get("id")),
        ("State", status.get("state")),
        ("Ready", ready_of(obj)),
        ("Pool", spec.get("poolId")),
        ("Devices", _devices(spec)),
        ("Duration", durations.human_text(spec.get("duration")) or spec.get("duration")),
        ("Binding", spec.get("binding") or "hold"),
        ("Spot", "yes" if spec.get("spot") else None),
        ("GPUs", status.get("gpus")),
        ("Nodes", status.get("nodes")),
        ("Start", _when(status.get("startTime"), now=now)),
        ("End", _when(status.get("endTime"), now=now)),
        ("Lease expires", _when(status.get("leaseExpiresAt"), now=now)),
        ("Resource", status.get("resourceName")),
        ("Claim template", _claim_template(status.get("claimTemplate"))),
        ("Requested by", (meta.get("annotations") or {}).get("bcd.dev/requested-by")),
    ]
    if extension:
        verdict = "extended" if extension.get("extended") else "not extended"
        if extension.get("availableUntil") is not None:
            until = times.shown(extension.get("availableUntil"), now=now)
            verdict += f" (available until {until})"
        fields.append(("Last extend", f"{verdict}, key {extension.get('key')}"))
    details = _table("FIELD", "VALUE")
    details.show_header = False
    for label, value in fields:
        if value is not None and value != "":
            details.add_row(Text(f"{label}:", style="bold"), _cell(value))
    shown = specs.conditions(obj)
    if not shown:
        return Group(details, Text(""), Text("Conditions: none yet"))
    table = _table("TYPE", "STATUS", "REASON", "SINCE", "MESSAGE")
    for found in shown:
        since = found.get("lastTransitionTime")
        table.add_row(
            _cell(found.get("type")),
            _cell(found.get("status")),
            _cell(found.get("reason")),
            _cell(times.relative(moment, now=now) if (moment := times.read(since)) else since),
            _cell(specs.one_line(moments.readable_message(str(found.get("message") or "")))),
        )
        table.columns[-1].no_wrap = False
    return Group(details, Text(""), Text("Conditions:", style="bold"), table)


def summary(obj: Mapping[str, Any], *, outcome: str, now: dt.datetime) -> RenderableType:
    """What ``reserve`` prints once done: the name, the nodes, the window."""
    status = specs.status_of(obj)
    start, end = times.read(status.get("startTime")), times.read(status.get("endTime"))
    window = "-"
    if start is not None and end is not None:
        window = (
            f"{times.short(start)} to {times.short(end)}"
            f" (starts {times.relative(start, now=now)}, ends {times.relative(end, now=now)})"
        )
    table = _table("FIELD", "VALUE")
    table.show_header = False
    for label, value in (
        ("Reservation", f"{_namespace(obj)}/{_name(obj)}"),
        ("State", f"{status.get('state')} ({outcome})"),
        ("Nodes", status.get("nodes")),
        ("Window", window),
        ("Id", status.get("id")),
    ):
        table.add_row(Text(f"{label}:", style="bold"), _cell(value))
    return table


# --- pools, find, quotas ---------------------------------------------------------------------


def _counted(pool: Mapping[str, Any], key: str) -> str:
    """``free``/``total`` of the pool's class; each class named when it shows several."""
    devices = (pool.get("status") or {}).get("devices") or {}
    if not devices:
        return "-"
    if len(devices) == 1:
        return _cell(next(iter(devices.values())).get(key)).plain
    return ", ".join(f"{counts.get(key)} {kind}" for kind, counts in sorted(devices.items()))


def pools(objs: Sequence[Mapping[str, Any]], *, now: dt.datetime) -> Table:
    """NAME, MODEL, SHARING, NODES (ready/all), FREE, TOTAL, NEXT FREE."""
    table = _table("NAME", "MODEL", "SHARING", "NODES", "FREE", "TOTAL", "NEXT FREE")
    for pool in objs:
        spec, status = pool.get("spec") or {}, pool.get("status") or {}
        sharing = spec.get("sharing") or {}
        mode = str(sharing.get("mode") or "exclusive")
        if sharing.get("replicas") and mode in ("timeslice", "mps"):
            mode += f" x{sharing.get('replicas')}"
        nodes = "-"
        if status.get("nodes") is not None:
            nodes = f"{status.get('nodesReady', 0)}/{status.get('nodes')}"
        table.add_row(
            _cell(_name(pool)),
            _cell(spec.get("model")),
            _cell(mode),
            _cell(nodes),
            _cell(_counted(pool, "free")),
            _cell(_counted(pool, "total")),
            _cell(times.shown(status.get("nextFreeAt"), now=now)),
        )
    return table


def found(rows: Sequence[specs.Found], *, now: dt.datetime) -> Table:
    """POOL, MODEL, FREE/TOTAL, NOW, WINDOW, NOTE."""
    table = _table("POOL", "MODEL", "FREE", "FITS NOW", "FROM", "TO", "NOTE")
    for row in rows:
        counts = "-" if row.total is None else f"{row.free or 0}/{row.total} {row.device_class}"
        table.add_row(
            _cell(row.pool),
            _cell(row.model),
            _cell(counts),
            _cell("yes" if row.fits_now else "no"),
            _cell(
                "now" if row.fits_now else _when(row.start and times.rfc3339(row.start), now=now)
            ),
            _cell(times.short(row.end) if row.end else None),
            _cell(row.note),
        )
    return table


def quotas(rows: Sequence[specs.QuotaRow]) -> Table:
    """TENANT, RESOURCE, USED, LIMIT, FREE."""
    table = _table("TENANT", "RESOURCE", "USED", "LIMIT", "FREE")
    for row in rows:
        table.add_row(
            _cell(row.tenant),
            _cell(row.resource),
            _cell(row.used if row.used is not None else 0),
            _cell(row.limit),
            _cell(row.free),
        )
    return table
