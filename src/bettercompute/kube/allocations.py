"""DeviceAllocation objects: a node's desired allocation in, its report out.

Why here: the operator builds these objects from the service's desired allocations and relays
their ``status`` back; the node agent reads the ``spec`` and writes the ``status``; ``dev`` runs
the node agent in-process on the same shapes. Pure functions, tested table by table. Nothing here
does I/O or reads a clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bettercompute.kube import names


def allocation_name(allocation_id: str) -> str:
    """A DNS-1123 name for an allocation id: ``alloc_01K…`` → ``alloc-01k…``."""
    return allocation_id.replace("_", "-").lower()


def allocation_manifest(item: Mapping[str, Any], *, node: str, namespace: str) -> dict[str, Any]:
    """The ``DeviceAllocation`` for one of a node's desired allocations."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": "DeviceAllocation",
        "metadata": {
            "name": allocation_name(item["allocationId"]),
            "namespace": namespace,
            "labels": {
                names.NODE_LABEL: node,
                names.RESERVATION_LABEL: item["reservationId"],
            },
        },
        "spec": allocation_spec(item, node=node),
    }


def allocation_spec(item: Mapping[str, Any], *, node: str) -> dict[str, Any]:
    return {
        "allocationId": item["allocationId"],
        "nodeName": node,
        "reservationId": item["reservationId"],
        "tenantId": item["tenantId"],
        "class": item["deviceClass"],
        "binding": item["binding"] or "hold",
        "deviceIds": list(item["deviceIds"]),
        "parentGpus": list(item["parentGpus"]),
        "until": int(item["until"]),
        "release": item["state"] == "releasing",
    }


#: A DeviceAllocation's ``status.phase`` → the core's report kind.
REPORT_KINDS = {
    "Bound": "bound",
    "Failed": "failed",
    "Releasing": "releasing",
    "Released": "released",
}


def report(status: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(kind, details) of a node's report in a DeviceAllocation's status; ``None`` if none."""
    kind = REPORT_KINDS.get(str(status.get("phase") or ""))
    if kind is None:
        return None
    details: dict[str, Any] = {}
    if kind == "bound":
        details["cdiDevices"] = list(status.get("cdiDevices") or ())
        if status.get("envFile"):
            details["envFile"] = status["envFile"]
    if kind == "failed":
        details["reason"] = str(status.get("reason") or "the node did not say why")
    if kind == "releasing":
        details["pods"] = list(status.get("pods") or ())
        if status.get("since") is not None:
            details["since"] = status["since"]
    if status.get("signature"):
        details["signature"] = dict(status["signature"])
    return kind, details
