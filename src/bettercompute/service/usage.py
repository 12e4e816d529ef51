"""``usage.report``: a tenant's billed GPU usage over a span, by pool, project or day.

Why a module of its own: the report is a read of the usage ledger (``store/usage.py``) with the
reservation API's tenancy rules, and nothing of admission; the reservation service hands it its
``read_tenant`` (pre-check and policy decision), so both stay the same rules everywhere.

Tenancy: the caller's tenant must be the asked tenant (or the root tenant), answered before
anything is read, then the policy engine decides ``read`` on the tenant, as
``reservations.list`` does. Another tenant's caller gets ``ACCESS_DENIED`` whether or not the
tenant exists or used anything. What it must never do: speak SQL, or write.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

from bettercompute.core import answers, ports, requests, usage
from bettercompute.store import usage as ledger
from bettercompute.store.database import Database

#: The reservation service's ``read_tenant``: its pre-check and the policy's ``read``.
MayRead = Callable[..., Awaitable[None]]


async def report(
    db: Database,
    caller: ports.Caller,
    data: Mapping[str, Any],
    *,
    may_read: MayRead,
) -> answers.UsageReport:
    value = requests.parse(usage.UsageReportInput, data)
    await may_read(caller, value.tenantId, what="read the usage of")
    start, end = usage.report_span(value, now_ms=await ledger.now_ms(db))
    billed = await ledger.report(
        db, tenant_id=value.tenantId, from_ms=start, to_ms=end, by=value.by
    )
    items = [_row(b, by=value.by) for b in billed if value.by is not None]
    total = _figures(
        sum(b.gpu_seconds for b in billed), sum(b.gpu_equivalent_seconds for b in billed)
    )
    # "from" is the JSON key; the type names it from_ (a Python keyword), alias "from".
    answer: dict[str, Any] = {
        "tenantId": value.tenantId,
        "from": start,
        "to": end,
        "by": value.by,
        "items": items,
        "total": total,
    }
    return cast(answers.UsageReport, answer)


def _figures(gpu_seconds: float, equivalent_seconds: float) -> answers.UsageFigures:
    # Rounded to the millisecond's worth: the sums of many rows carry float noise.
    return {
        "gpuSeconds": round(gpu_seconds, 3),
        "gpuEquivalentSeconds": round(equivalent_seconds, 3),
        "gpuHours": round(equivalent_seconds / 3600, 6),
    }


def _row(billed: ledger.Billed, *, by: usage.By | None) -> answers.UsageRow:
    figures = _figures(billed.gpu_seconds, billed.gpu_equivalent_seconds)
    row: answers.UsageRow = {
        "gpuSeconds": figures["gpuSeconds"],
        "gpuEquivalentSeconds": figures["gpuEquivalentSeconds"],
        "gpuHours": figures["gpuHours"],
    }
    if by == "pool":
        row["poolId"] = billed.key
    elif by == "project":
        row["projectId"] = billed.key
    elif by == "day" and billed.key is not None:
        row["day"] = int(billed.key)
    return row
