"""What tables show of ids, times and durations (``cli/output.py``): the shortest unique id start
as git shows commits, whole with ``-o wide``; epoch-ms times and ms durations of error details
and condition messages as people read them."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.measure import Measurement

from bettercompute.cli import confirmations, output, usage
from bettercompute.cli.settings import Output
from bettercompute.core import moments
from tests.support import epochs

A = "rsv_abcdefgh" + "x" * 44
B = "rsv_abcdefgh" + "y" * 44
C = "rsv_zzzzzzzzzz" + "z" * 42


def test_ids_show_their_shortest_unique_start_of_at_least_eight_after_the_kind() -> None:
    assert output.short_ids([C]) == {C: "rsv_zzzzzzzz"}
    # A and B share eight characters after rsv_: one more tells them apart, for every row.
    assert output.short_ids([A, B, C]) == {A: A[:13], B: B[:13], C: C[:13]}
    assert output.short_ids(["cnf_01m94s49ma6g", "cnf_01m94s49zz"]) == {
        "cnf_01m94s49ma6g": "cnf_01m94s49m",
        "cnf_01m94s49zz": "cnf_01m94s49z",
    }


def _drawn(data: object, kind: Output) -> str:
    captured = io.StringIO()
    token = output._WIDE.set(kind == Output.WIDE)
    try:
        # -o wide is printed at its natural width (``emit``'s keep_whole), a table at 100 here.
        width = 300 if kind == Output.WIDE else 100
        Console(file=captured, width=width).print(output.reservation_list(data))
    finally:
        output._WIDE.reset(token)
    return captured.getvalue()


def test_a_list_fits_100_columns_and_wide_shows_whole_ids() -> None:
    during = {"start": 1_796_534_722_946, "end": 1_796_563_522_946}
    request = {"devices": [{"class": "gpu", "count": 4, "topology": "nvlink-all"}]}
    items = [
        {"id": i, "state": "placed", "poolId": "pool_h100", "request": request, "during": during}
        for i in (A, B, C)
    ]
    table = _drawn({"items": items}, Output.TABLE)
    assert max(len(line.rstrip()) for line in table.splitlines()) <= 100, table
    assert A not in table
    assert A[:13] in table
    assert epochs.found(table) == []
    assert moments.rfc3339(during["start"]) in table
    wide = _drawn({"items": items}, Output.WIDE)
    assert A in wide


def test_details_and_condition_messages_read_as_times_and_durations() -> None:
    shown = output.readable(
        {"expiresAt": 1_796_534_722_946, "duration": "1800000ms", "items": [{"n": 3}]}
    )
    assert shown == {
        "expiresAt": moments.rfc3339(1_796_534_722_946),
        "duration": "30m",
        "items": [{"n": 3}],
    }
    view = {"conditions": [{"type": "ConfirmationRequired", "message": "1796534722946"}]}
    captured = io.StringIO()
    Console(file=captured, width=100).print(output.reservation_table(view))
    assert "deadline 2026-" in captured.getvalue()
    assert epochs.found(captured.getvalue()) == []


T = 1_796_534_722_946
CONFIRMATIONS = {
    "items": [
        {
            "id": "cnf_01m94s49ma6g6js10xwf8t58e4",
            "state": "pending",
            "request": {"devices": [{"class": "gpu", "count": 6}], "duration": "7200000ms"},
            "agentId": "assistant@acme",
            "personId": "alice@acme",
            "expiresAt": T,
        }
    ]
}
SUBSCRIPTIONS = {
    "items": [
        {
            "id": "sub_01m94s44qrdg6mp6pmnwfd8jsa",
            "state": "active",
            "url": "https://hooks.example.com/compute",
            "eventTypes": ["reservation.placed", "reservation.released"],
            "createdAt": T,
        }
    ]
}
DELIVERIES = {
    "items": [
        {
            "eventId": 1234,
            "eventType": "reservation.released",
            "reservationId": A,
            "state": "failing",
            "attempts": 3,
            "lastError": "cannot connect: the receiver could not be reached",
            "nextAttemptAt": T,
        }
    ]
}
POOLS = {
    "items": [
        {
            "poolId": "pool_a100_mig",
            "gpuModel": "A100",
            "nodes": 1,
            "nodesReady": 1,
            "devices": {"mig": {"free": 0, "total": 28, "booked": 28, "healthy": 28}},
            "nextFreeAt": T,
        }
    ]
}
USAGE = {
    "tenantId": "acme",
    "from": T,
    "to": T,
    "by": "pool",
    "items": [{"poolId": "pool_a100_mig", "gpuHours": 12.5, "gpuSeconds": 45000}],
    "total": {"gpuHours": 12.5, "gpuSeconds": 45000},
}


@pytest.mark.parametrize(
    ("draw", "data"),
    [
        (confirmations.confirmation_list, CONFIRMATIONS),
        (output.subscription_list, SUBSCRIPTIONS),
        (output.delivery_list, DELIVERIES),
        (output.pools, POOLS),
        (output.quotas, {"quotas": [{"resource": "gpuSlices:A100", "used": 28, "limit": 28}]}),
        (output.search, {"windows": [{"start": T, "end": T, "nodeIds": ["node_sim-h100-01"]}]}),
        (usage.report_table, USAGE),
    ],
    ids=["confirmations", "subscriptions", "deliveries", "pools", "quota", "search", "usage"],
)
def test_every_column_table_fits_100_columns_and_shows_no_epoch_ms(draw, data) -> None:
    console = Console(width=100, file=io.StringIO(), record=True)
    drawn = draw(data)
    # What emit widens a table to: the width its columns that never wrap need.
    assert Measurement.get(console, console.options, drawn).minimum <= 100
    console.print(drawn)
    text = console.export_text()
    assert epochs.found(text) == [], text
    assert moments.rfc3339(T) in text or "quotas" in data
