"""``kubectl bcd get <name>`` shows times as RFC 3339 and durations with units, whatever form the
object carries them in (pure: ``kubectl.tables`` on an object, rendered to text at 100 columns)."""

from __future__ import annotations

import datetime as dt
import re

from rich.console import Console

from bettercompute.kubectl import tables
from tests.support import epochs

NOW = dt.datetime(2026, 12, 6, 12, 0, tzinfo=dt.UTC)


def shown(spec: dict[str, object], status: dict[str, object]) -> str:
    obj = {
        "metadata": {"name": "train", "namespace": "ml"},
        "spec": {"poolId": "h100", **spec},
        "status": {"id": "rsv_1", "state": "placed", **status},
    }
    console = Console(width=100, record=True, color_system=None)
    console.print(tables.reservation(obj, now=NOW))
    console.print(tables.reservations([obj], now=NOW, wide=True))
    return console.export_text()


def test_a_duration_in_milliseconds_and_an_epoch_ms_message_read_with_units_and_rfc_3339():
    text = shown(
        {"duration": "28800000ms"},
        {
            "startTime": "2026-12-06T12:00:00Z",
            "endTime": "2026-12-06T20:00:00.250Z",
            "conditions": [
                {
                    "type": "ConfirmationRequired",
                    "status": "True",
                    "reason": "cnf_1",
                    "message": "1796536800000",
                    "lastTransitionTime": "2026-12-06T11:59:00Z",
                }
            ],
        },
    )
    assert epochs.found(text) == [], text
    assert re.search(r"Duration:\s+8h\b", text), text
    assert "deadline 2026-12-06T" in text
    assert "2026-12-06T20:00:00Z" in text
