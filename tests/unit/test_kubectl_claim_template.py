"""``kubectl bcd get <name>`` of a dra pool's Reservation names its claim template and the two
lines a pod needs (pure: ``kubectl.tables`` on an object, rendered to text)."""

from __future__ import annotations

import datetime as dt
import re

from rich.console import Console

from bettercompute.kubectl import tables

NOW = dt.datetime(2026, 12, 6, 12, 0, tzinfo=dt.UTC)


def shown(status: dict[str, object]) -> str:
    obj = {
        "metadata": {"name": "train", "namespace": "ml"},
        "spec": {"poolId": "h100", "binding": "kubernetes"},
        "status": {"id": "rsv_1", "state": "placed", **status},
    }
    console = Console(width=240, record=True, color_system=None)
    console.print(tables.reservation(obj, now=NOW))
    return console.export_text()


def test_a_dra_reservation_shows_its_claim_template_and_how_a_pod_uses_it():
    text = shown({"claimTemplate": "train"})
    assert re.search(r"Claim template:\s+train \(pod: spec\.resourceClaims", text), text
    assert "resourceClaimTemplateName: train" in text
    assert "resources.claims [{name: gpus}]" in text


def test_a_device_plugin_reservation_shows_none():
    assert "Claim template" not in shown({"resourceName": "bcd.dev/rsv-1"})
