"""A CRD's printer columns rendered as ``kubectl get`` shows them, without a cluster.

Why it exists: the API stand-in does not serve the Table format ``kubectl get`` asks for, yet a
column that reads ``<invalid>`` for every future reservation is a bug a user sees first. This
module applies a CRD's ``additionalPrinterColumns`` to an object as the API server and kubectl
do: the column's JSONPath picks the value (``<none>`` when absent); a ``date`` column shows the
age of its timestamp, and ``<invalid>`` when that lies in the future (kubectl's
``translateTimestampSince`` over a negative duration); other types show the value as it is.

What it must never do: accept a JSONPath it does not understand (it raises), or read a clock:
``now`` is passed in.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence
from typing import Any

_STEP = re.compile(r'\.([A-Za-z0-9_-]+)|\[\?\(@\.([A-Za-z0-9_]+)=="([^"]*)"\)\]')


def pick(obj: Any, path: str) -> Any:
    """The value at ``path`` (``.status.window.start``, ``.status.conditions[?(@.type=="Ready")]
    .status``), or ``None``."""
    position, current = 0, obj
    while position < len(path):
        step = _STEP.match(path, position)
        if step is None:
            raise ValueError(f"unsupported JSONPath {path!r} at {path[position:]!r}")
        position = step.end()
        name, key, value = step.groups()
        if name is not None:
            current = current.get(name) if isinstance(current, Mapping) else None
        else:
            matches = [
                item
                for item in current or ()
                if isinstance(item, Mapping) and item.get(key) == value
            ]
            current = matches[0] if matches else None
    return current


def human_duration(seconds: float) -> str:
    """kubectl's ``duration.HumanDuration`` for an age (coarse: ``5s``, ``12m``, ``3h``,
    ``4d``); a negative age is ``<invalid>``."""
    if seconds < -1:
        return "<invalid>"
    if seconds < 0:
        return "0s"
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 48:
        return f"{hours}h"
    return f"{hours // 24}d"


def cells(
    columns: Sequence[Mapping[str, Any]], obj: Mapping[str, Any], *, now: dt.datetime
) -> dict[str, str]:
    """Each column's cell for ``obj``, by column name."""
    out = {}
    for column in columns:
        value = pick(obj, column["jsonPath"])
        if value is None:
            out[column["name"]] = "<none>"
        elif column["type"] == "date":
            at = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
            out[column["name"]] = human_duration((now - at).total_seconds())
        else:
            out[column["name"]] = str(value)
    return out
