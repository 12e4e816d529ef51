"""``POST /api/compute/usage/report`` and the billed GPU-seconds on ``/metrics``, over HTTP.

A reservation is created through the API, bound by its node's report (as a node agent sends
it), used for ten minutes of business time and released; the report and the metric must say
ten minutes of four GPUs, not the eight requested hours.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import TypeAdapter

from bettercompute.core import answers
from bettercompute.store import inventory
from tests.api.conftest import POOL, Api, create_body
from tests.store.test_lifecycle import activate

SLACK = 10.0


async def used_ten_minutes(api: Api) -> str:
    rid = str((await api.ok("reservations/create", create_body()))["id"])
    await activate(api.service, api.db, rid)
    await inventory.advance_clock(api.db, seconds=600)
    await api.ok("reservations/release", {"tenantId": "acme", "reservationId": rid})
    return rid


async def test_the_report_says_what_was_used(api: Api):
    await used_ten_minutes(api)
    data = await api.ok("usage/report", {"tenantId": "acme", "by": "pool"})
    TypeAdapter(answers.UsageReport).validate_python(data)
    [row] = data["items"]
    assert row["poolId"] == POOL
    assert row["gpuEquivalentSeconds"] == pytest.approx(4 * 600, abs=4 * SLACK)
    assert row["gpuSeconds"] == pytest.approx(row["gpuEquivalentSeconds"])
    assert row["gpuHours"] == pytest.approx(row["gpuEquivalentSeconds"] / 3600, abs=1e-5)
    assert data["total"] == {k: row[k] for k in ("gpuSeconds", "gpuEquivalentSeconds", "gpuHours")}
    assert data["to"] - data["from"] == 30 * 86_400_000
    # The same span given explicitly answers alike, without rows when not grouped.
    span = {"from": data["from"], "to": data["to"]}
    again = await api.ok("usage/report", {"tenantId": "acme", **span})
    assert again["items"] == []
    assert again["total"]["gpuSeconds"] == pytest.approx(row["gpuSeconds"], abs=1)
    # An inverted span is empty, and a span of more than 366 days starts 366 days before 'to'.
    empty = await api.ok("usage/report", {"tenantId": "acme", "from": data["to"], "to": 1000})
    assert (empty["from"], empty["to"], empty["total"]["gpuSeconds"]) == (1000, 1000, 0)
    long = await api.ok("usage/report", {"tenantId": "acme", "from": 0, "to": data["to"]})
    assert long["from"] == data["to"] - 366 * 86_400_000
    assert long["total"]["gpuSeconds"] == pytest.approx(row["gpuSeconds"], abs=1)
    early = await api.ok("usage/report", {"tenantId": "acme", "from": 0, "to": 1000})
    assert early["total"]["gpuSeconds"] == 0


async def test_billed_gpu_seconds_on_metrics(api: Api):
    await used_ten_minutes(api)
    text = (await api.metrics.get("/metrics")).text
    found = re.search(
        r'^bettercompute_billed_gpu_seconds_total\{pool="(.+?)",tenant="(.+?)"\} (\S+)$',
        text,
        re.MULTILINE,
    )
    assert found is not None, text
    assert found.group(1, 2) == (POOL, "acme")
    assert float(found.group(3)) == pytest.approx(4 * 600, abs=4 * SLACK)


async def test_another_tenant_cannot_read_acme_usage(api: Api):
    await used_ten_minutes(api)
    theirs = await api.error(
        "usage/report", {"tenantId": "acme"}, status=403, code="ACCESS_DENIED", who="gina"
    )
    nobody = await api.error(
        "usage/report", {"tenantId": "nosuch"}, status=403, code="ACCESS_DENIED", who="gina"
    )
    # The same answer as for a tenant that does not exist, the name asked aside.
    assert theirs == {**nobody, "message": nobody["message"].replace("nosuch", "acme")}
    assert "gpuSeconds" not in str(theirs)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tenantId": "acme", "by": "week"}, "by"),
        ({"tenantId": "acme", "from": "2026-09-01T00:00:00Z"}, "from"),
        ({"tenantId": "acme", "to": -5}, "to"),
        ({"tenantId": "acme", "to": 10**15}, "to"),
        ({"tenantId": "acme", "from": 1.5}, "from"),
        ({"tenantId": "acme", "group": "pool"}, "group"),
        ({}, "tenantId"),
    ],
)
async def test_bad_input_names_the_field(api: Api, body: dict[str, Any], field: str):
    err = await api.error("usage/report", body, status=400, code="INVALID_INPUT")
    assert err["details"]["field"] == field, err
