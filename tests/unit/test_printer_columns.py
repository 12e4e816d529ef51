"""``kubectl get rsv`` and ``kubectl get gp`` as a user reads them, for past and future times.

The Reservation's projected status (``operator.statuses``, what the operator writes) is rendered
through the CRD's own printer columns the way kubectl renders a Table
(``tests/support/printercolumns``): no cell may read ``<invalid>``, and a window shows as
``2026-12-24T08:00:00Z`` whether it is over or still to come.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import yaml

from bettercompute.operator import statuses
from tests.support import printercolumns

CRDS = Path(__file__).resolve().parents[2] / "crds"
NOW = dt.datetime(2026, 12, 4, 12, 0, tzinfo=dt.UTC)
NOW_MS = int(NOW.timestamp() * 1000)
HOUR = 3_600_000


def columns(kind_file: str) -> list[dict]:
    crd = yaml.safe_load((CRDS / kind_file).read_text())
    return crd["spec"]["versions"][0]["additionalPrinterColumns"]


def reservation(state: str, start: int, end: int, **view) -> dict:
    status = statuses.reservation_status(
        {
            "id": "rsv_1",
            "state": state,
            "tenantId": "acme",
            "poolId": "h100",
            "during": {"start": start, "end": end},
            "request": {"devices": [{"class": "gpu", "count": 4}]},
            "conditions": [],
            "leaseExpiresAt": view.get("lease"),
        },
        nodes=["gpu-node-1"],
        generation=1,
        previous=None,
        now="2026-12-04T11:00:00Z",
    )
    return {
        "metadata": {"name": "train-1", "creationTimestamp": "2026-12-04T11:00:00Z"},
        "spec": {"poolId": "h100", "binding": "kubernetes"},
        "status": status,
    }


@pytest.mark.parametrize(
    ("state", "start", "end", "shown_start", "shown_end", "ready"),
    [
        # Over: both ends in the past.
        (
            "released",
            NOW_MS - 5 * HOUR,
            NOW_MS - 2 * HOUR,
            "2026-12-04T07:00:00Z",
            "2026-12-04T10:00:00Z",
            "False",
        ),
        # Running: started, ends in the future.
        (
            "active",
            NOW_MS - HOUR,
            NOW_MS + 7 * HOUR,
            "2026-12-04T11:00:00Z",
            "2026-12-04T19:00:00Z",
            "True",
        ),
        # Booked for later: both ends in the future.
        (
            "placed",
            NOW_MS + 20 * HOUR,
            NOW_MS + 28 * HOUR,
            "2026-12-05T08:00:00Z",
            "2026-12-05T16:00:00Z",
            "False",
        ),
    ],
    ids=["past", "running", "future"],
)
def test_reservation_columns_read_the_same_in_the_past_and_the_future(
    state, start, end, shown_start, shown_end, ready
):
    obj = reservation(state, start, end, lease=end)
    row = printercolumns.cells(columns("reservations.yaml"), obj, now=NOW)
    assert "<invalid>" not in row.values(), row
    assert row["Start"] == shown_start
    assert row["End"] == shown_end
    assert row["Lease"] == shown_end
    assert row["Ready"] == ready
    assert (row["State"], row["GPUs"], row["Pool"], row["Node(s)"]) == (
        state,
        "4",
        "h100",
        "gpu-node-1",
    )
    assert row["Age"] == "60m"


def test_a_date_column_over_a_future_time_is_what_kubectl_shows_as_invalid():
    # Why the columns are strings: the renderer reproduces the bug they avoid.
    future = reservation("placed", NOW_MS + 20 * HOUR, NOW_MS + 28 * HOUR)
    as_dates = [{"name": "End", "type": "date", "jsonPath": ".status.endTime"}]
    assert printercolumns.cells(as_dates, future, now=NOW) == {"End": "<invalid>"}


def test_an_unplaced_reservation_shows_none_rather_than_a_time():
    obj = reservation("pending", 0, 0)
    obj["status"] = statuses.reservation_status(
        {"id": "rsv_1", "state": "pending", "tenantId": "acme", "poolId": "h100", "conditions": []},
        nodes=[],
        generation=1,
        previous=None,
        now="2026-12-04T11:00:00Z",
    )
    row = printercolumns.cells(columns("reservations.yaml"), obj, now=NOW)
    assert (row["Start"], row["End"], row["Ready"]) == ("<none>", "<none>", "False")


def test_the_renderer_refuses_a_path_it_cannot_read():
    with pytest.raises(ValueError, match="unsupported JSONPath"):
        printercolumns.pick({}, ".status.items[0]")
