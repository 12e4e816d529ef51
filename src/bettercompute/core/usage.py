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

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from bettercompute.core import errors, hosts, moments, requests

#: What a report groups by, besides the tenant: its pools, its projects, or UTC days.
By = Literal["pool", "project", "day"]
#: A report without ``from`` covers this much before its end.
DEFAULT_SPAN_MS = 30 * 86_400_000
#: The longest span a report covers (a year and a day): the answer stays bounded.
MAX_SPAN_MS = 366 * 86_400_000


class UsageReportInput(BaseModel):
    """``usage.report``: the tenant's billed usage in ``[from, to)``, optionally grouped.

    ``from`` and ``to`` are epoch milliseconds or RFC 3339 times with a zone; ``to`` defaults
    to now and ``from`` to 30 days before ``to``; at most 366 days apart.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    tenantId: requests.TenantId
    from_: StrictInt | str | None = Field(default=None, alias="from")
    to: StrictInt | str | None = None
    by: By | None = None

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        # JSON has one number type: 1.7e12 written as a float is the integer it equals.
        if not isinstance(data, dict):
            return data
        return {
            k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in data.items()
        }

    @field_validator("from_", "to")
    @classmethod
    def _moment(cls, value: int | str | None) -> int | None:
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = moments.parse_ms(value)
            except moments.MomentError as e:
                raise ValueError(str(e)) from None
        if not 0 <= value <= requests.MAX_EPOCH_MS:
            raise ValueError("must be an epoch millisecond between 1970 and 9999-12-31")
        return value


def report_span(value: UsageReportInput, *, now_ms: int) -> tuple[int, int]:
    """``[from, to)`` of a report in epoch ms, defaults filled; raises ``INVALID_INPUT``."""
    to = value.to if isinstance(value.to, int) else now_ms
    start = value.from_ if isinstance(value.from_, int) else max(0, to - DEFAULT_SPAN_MS)
    if start >= to:
        raise errors.invalid_input("from", "must be before 'to'")
    if to - start > MAX_SPAN_MS:
        raise errors.invalid_input("from", "a report covers at most 366 days")
    return start, to


def gpu_hours(attributes: Mapping[str, Any], *, sharing_mode: str, replicas: int) -> float:
    """The GPU-hours a request's decision attributes ask for: ``gpuCount`` whole GPUs and
    ``gpuSlices`` slices of the pool's kind (MIG in a ``mig`` pool, else slots), for
    ``durationHours``. What the budget check is asked, and what ``bc_budget_state`` books."""
    slice_kind = "mig" if sharing_mode == "mig" else "slot"
    per_hour = attributes["gpuCount"] + attributes["gpuSlices"] * hosts.device_worth(
        slice_kind, sharing_mode=sharing_mode, replicas=replicas
    )
    return float(per_hour * attributes["durationHours"])
