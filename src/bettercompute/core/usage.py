"""Usage reports and budgets on what was used: the report's input and the GPU-hours of a request.

Why it exists: the usage report (``usage.report``) and the budget check both count GPU-hours,
and both must count a device alike: a whole GPU is 1, a MIG instance 1/7, a slot 1/replicas
(``core.hosts.device_worth``). The report's input is validated here, once, for the HTTP API,
the CLI and anything else that asks.

What it must never do: I/O or clocks. "Now" is the database's, passed in by the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, StrictInt

from bettercompute.core import hosts, requests

#: What a report groups by, besides the tenant: its pools, its projects, or UTC days.
By = Literal["pool", "project", "day"]
#: A report without ``from`` covers this much before its end.
DEFAULT_SPAN_MS = 30 * 86_400_000
#: The longest span a report covers (a year and a day): the answer stays bounded.
MAX_SPAN_MS = 366 * 86_400_000


class UsageReportInput(requests.Input):
    """``usage.report``: the tenant's billed usage in ``[from, to)``, optionally grouped.

    ``from`` and ``to`` are epoch milliseconds, as every time in the API; ``to`` defaults to
    now and ``from`` to 30 days before ``to``. Every well-formed span has an answer (the
    answer's own ``from`` and ``to`` say which span it covers): ``from`` at or after ``to`` is
    an empty span, and one longer than 366 days starts 366 days before ``to``.
    """

    tenantId: requests.TenantId
    from_: StrictInt | None = Field(default=None, alias="from", ge=0, le=requests.MAX_EPOCH_MS)
    to: StrictInt | None = Field(default=None, ge=0, le=requests.MAX_EPOCH_MS)
    by: By | None = None


def report_span(value: UsageReportInput, *, now_ms: int) -> tuple[int, int]:
    """``[from, to)`` of a report in epoch ms, defaults filled, at most 366 days; an inverted
    span is empty (``from == to``)."""
    to = value.to if value.to is not None else now_ms
    start = value.from_ if value.from_ is not None else max(0, to - DEFAULT_SPAN_MS)
    start = max(start, to - MAX_SPAN_MS)
    return min(start, to), to


def gpu_hours(attributes: Mapping[str, Any], *, sharing_mode: str, replicas: int) -> float:
    """The GPU-hours a request's decision attributes ask for: ``gpuCount`` whole GPUs and
    ``gpuSlices`` slices of the pool's kind (MIG in a ``mig`` pool, else slots), for
    ``durationHours``. What the budget check is asked, and what ``bc_budget_state`` books."""
    slice_kind = "mig" if sharing_mode == "mig" else "slot"
    per_hour = attributes["gpuCount"] + attributes["gpuSlices"] * hosts.device_worth(
        slice_kind, sharing_mode=sharing_mode, replicas=replicas
    )
    return float(per_hour * attributes["durationHours"])
