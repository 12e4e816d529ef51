"""A pool's timeline (``pools.timeline``) and a reservation's history (``reservations.history``):
their inputs, the window's rules, the device labels and the history's shape.

Why it exists: the web console draws every booking of a pool on one grid, rows the nodes and
their devices, and must get it in one request for a pool of 200 nodes × 8 GPUs with 20,000
bookings. So the answer is compact: devices are indexes into their node's list, bookings are
arrays ``[node, [device, …], start, end, stateCode, ref]``, one per reservation and node, and
only the caller's own bookings carry a ``ref`` into the list of its reservations. Everyone
else's is a ``busy`` bar and nothing more: the store builds the bookings in the database and
never reads another tenant's reservation columns (``store.timelines``, which numbers the
states as ``STATES`` and ``ENDED`` say).

What it must never do: I/O or clocks ("now" is the database's, passed in), or put anything of
a booking the caller may not see into the answer.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any

from pydantic import Field, WithJsonSchema, field_validator

from bettercompute.core import errors, requests

DAY_MS = 86_400_000
#: Without ``from``, a timeline starts this long before now (the past day).
DEFAULT_PAST_MS = DAY_MS
#: The horizon is at least this far ahead (capacity.search's default horizon), further when
#: a booking ends later.
MIN_HORIZON_MS = 14 * DAY_MS
#: The longest span one answer covers.
MAX_SPAN_MS = 62 * DAY_MS

#: What ``stateCode`` indexes. ``busy`` is every booking not the caller's; the caller's are
#: their reservation's state, ``spot`` for spot reservations, ``ended`` for one released,
#: expired, cancelled or failed (its past bookings stay on the grid).
STATES: tuple[str, ...] = ("busy", "placed", "binding", "active", "releasing", "spot", "ended")
#: The states whose bookings are ``ended``.
ENDED: tuple[str, ...] = ("released", "expired", "cancelled", "failed")


_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-]\d{2}:\d{2})"
)
_MOMENT_REASON = (
    "must be epoch milliseconds or an RFC 3339 time with its offset, e.g. 2026-12-06T09:00:00Z"
)


def _epoch_ms(text: str) -> int:
    """Epoch milliseconds of an RFC 3339 time. Any such time has an answer: a leap second is
    read as the second before it, and a time outside 1970-9999 as the nearest end."""
    match = _RFC3339.fullmatch(text.strip())
    if match is None:
        raise ValueError(_MOMENT_REASON)
    year, month, day, hour, minute, second = (int(match.group(i)) for i in range(1, 7))
    if year < 1970:
        return 0
    fraction, offset = match.group(7) or "", match.group(8).upper()
    try:
        moment = dt.datetime(year, month, day, hour, minute, min(second, 59), tzinfo=dt.UTC)
    except ValueError:
        raise ValueError(_MOMENT_REASON + " (this date does not exist)") from None
    ms = int(moment.timestamp()) * 1000 + int((fraction[1:] + "000")[:3])
    if offset != "Z":
        sign = 1 if offset[0] == "+" else -1
        ms -= sign * (int(offset[1:3]) * 3_600_000 + int(offset[4:6]) * 60_000)
    return min(max(ms, 0), requests.MAX_EPOCH_MS)


#: ``from`` and ``to``: epoch milliseconds or an RFC 3339 time with its offset.
Moment = Annotated[
    int | None,
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": requests.MAX_EPOCH_MS},
                {"type": "string", "format": "date-time"},
                {"type": "null"},
            ],
            "description": "Epoch milliseconds, or an RFC 3339 time with its offset.",
        }
    ),
]


class TimelineInput(requests.Input):
    """``pools.timeline``: the pool's bookings in ``[from, to)``. ``tenantId`` defaults to the
    caller's; ``from`` to a day before now, ``to`` to the pool's horizon (at most 62 days after
    ``from``); each as epoch milliseconds or an RFC 3339 time."""

    tenantId: requests.TenantId | None = None
    poolId: requests.ObjectId
    from_: Moment = Field(default=None, alias="from")
    to: Moment = None

    @field_validator("from_", "to", mode="before")
    @classmethod
    def _moment(cls, value: Any) -> int | None:
        # Before pydantic's own checks, so that an error names the field, not a union member.
        if value is None:
            return None
        if isinstance(value, str):
            return _epoch_ms(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(_MOMENT_REASON)
        if not 0 <= value <= requests.MAX_EPOCH_MS:
            raise ValueError("must be between 0 (1970-01-01) and 253402300799999 (9999-12-31)")
        return value


class HistoryInput(requests.Input):
    """``reservations.history``: a reservation's transitions and events. ``tenantId`` defaults
    to the caller's; ``id`` is the reservation's id (or a unique start of it, as ``get``)."""

    tenantId: requests.TenantId | None = None
    id: requests.ObjectId


def span(value: TimelineInput, *, now_ms: int, horizon_ms: int) -> tuple[int, int]:
    """``[from, to)`` of a timeline: the defaults filled, or ``INVALID_INPUT`` naming ``to``
    when it is not after ``from`` or more than 62 days after it."""
    given_from, given_to = value.from_, value.to
    if given_from is not None:
        start = given_from
    elif given_to is not None:
        start = min(now_ms, given_to) - DEFAULT_PAST_MS
    else:
        start = now_ms - DEFAULT_PAST_MS
    start = max(start, 0)
    if given_to is not None:
        end = given_to
    else:
        # To the horizon, and at least a day (a ``from`` past the horizon still shows a day).
        end = min(max(horizon_ms, start + DAY_MS), start + MAX_SPAN_MS)
    if end <= start:
        raise errors.invalid_input("to", "must be after 'from'", **{"from": start, "to": end})
    if end - start > MAX_SPAN_MS:
        raise errors.invalid_input(
            "to", "at most 62 days after 'from'", maxSpanMs=MAX_SPAN_MS, **{"from": start}
        )
    return start, end


def horizon(*, now_ms: int, last_end_ms: int | None) -> int:
    """The pool's booking horizon: two weeks ahead, or the end of its last booking if later."""
    return max(now_ms + MIN_HORIZON_MS, last_end_ms or 0)


# --- the answer ---------------------------------------------------------------------------


def device_labels(atoms: Sequence[Mapping[str, Any]]) -> list[str]:
    """Labels for a node's atoms, in the order given: ``GPU 0`` for a whole GPU, ``GPU 0 ·
    1g.10gb #2`` for a MIG instance, ``GPU 0 · slot 3`` for a time slice. GPUs are numbered in
    the order their first atom comes (the store orders them by NUMA node, NVLink domain and
    UUID: the inventory keeps no index)."""
    gpu_index: dict[str, int] = {}
    seen: dict[tuple[str, str], int] = {}
    labels = []
    for atom in atoms:
        parent = str(atom["parent_gpu"])
        number = gpu_index.setdefault(parent, len(gpu_index))
        kind = atom["kind"]
        if kind == "gpu":
            labels.append(f"GPU {number}")
            continue
        group = (parent, str(atom.get("profile") or kind))
        nth = seen.get(group, 0)
        seen[group] = nth + 1
        if kind == "mig":
            labels.append(f"GPU {number} · {atom.get('profile')} #{nth}")
        else:
            labels.append(f"GPU {number} · slot {nth}")
    return labels


def nodes(atom_rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The answer's ``nodes`` from the inventory rows: one per atom (or one with no atom for a
    node without any), in the order the store numbered them, which the bookings' indexes
    follow (``store.timelines``)."""
    out: list[dict[str, Any]] = []
    atoms_of: list[list[Mapping[str, Any]]] = []
    for row in atom_rows:
        if not out or out[-1]["id"] != row["node_id"]:
            atoms_of.append([])
            out.append(
                {
                    "id": row["node_id"],
                    "name": row["node_name"],
                    # The placer books only on nodes that are ready and connected.
                    "healthy": bool(row["ready"] and row["connected"]),
                    # Reporting, but taken out of service (Kubernetes says not ready: cordoned,
                    # drained, or failing its checks): no new booking lands on it.
                    "maintenance": bool(row["connected"] and not row["ready"]),
                    "devices": [],
                }
            )
        if row.get("atom_id") is not None:
            atoms_of[-1].append(row)
    for node, atoms in zip(out, atoms_of, strict=True):
        node["devices"] = [
            {
                "id": atom["device_id"],
                "label": label,
                "kind": atom["kind"],
                "healthy": bool(atom["healthy"]),
            }
            for atom, label in zip(atoms, device_labels(atoms), strict=True)
        ]
    return out


def pending(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``pending`` of the answer: the caller's reservations waiting in the pool's queue."""
    return [
        {
            "id": row["rid"],
            "name": row["name"],
            "state": row["state"],
            "gpus": int(row["gpus"]),
            "requestedStart": row["requested_start_ms"],
        }
        for row in rows
    ]


def rfc3339(ms: int) -> str:
    """Epoch milliseconds as RFC 3339 in UTC, to the millisecond: ``2026-12-06T09:00:00.000Z``."""
    moment = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def history(
    transitions: Iterable[Mapping[str, Any]], events: Iterable[Mapping[str, Any]]
) -> dict[str, Any]:
    """``reservations.history``'s answer from the store's rows (``store.timelines.history``)."""
    items = [
        {
            "at": rfc3339(int(row["at_ms"])),
            "from": row["from_state"],
            "to": row["to_state"],
            "reason": row["reason"],
            "actor": row["actor"],
        }
        for row in transitions
    ]
    shown = []
    for row in events:
        event: dict[str, Any] = {"type": row["type"], "at": rfc3339(int(row["at_ms"]))}
        data = row["data"] or {}
        message = data.get("message") or data.get("reason")
        if isinstance(message, str) and message:
            event["message"] = message
        shown.append(event)
    return {"items": items, "events": shown}
