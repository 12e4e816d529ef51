"""The attributes a policy decides on, computed from a normalised request and its pool.

This is the guide's attribute table, in one function, so "at most 8 H100s for at most 72 hours
in these regions" can be one Cedar policy on the reservation instead of code. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bettercompute.core import durations


def reservation_attributes(
    *, request: Mapping[str, Any], gpu_model: str | None, region: str, duration_ms: int
) -> dict[str, Any]:
    """``gpuModel``, ``gpuCount``, ``gpuSlices``, ``gangSize``, ``durationHours``, ``region``,
    ``binding``, ``spot``, ``renewable``, ``projectId`` (and ``vcpu``/``memoryGiB`` summed over a
    gang when the request books host resources)."""
    gang = int(request.get("gang", {}).get("size", 1))
    whole = sum(d["count"] for d in request["devices"] if d["class"] == "gpu")
    slices = sum(d["count"] for d in request["devices"] if d["class"] != "gpu")
    attrs: dict[str, Any] = {
        "gpuModel": gpu_model or "other",
        "gpuCount": whole * gang,
        "gpuSlices": slices * gang,
        "gangSize": gang,
        "durationHours": durations.hours(duration_ms),
        "region": region,
        "binding": request.get("binding", "hold"),
        "spot": bool(request.get("spot", False)),
        "renewable": request.get("leaseSeconds") is not None,
    }
    if request.get("projectId") is not None:
        attrs["projectId"] = request["projectId"]
    resources = request.get("resources")
    if resources:
        attrs["vcpu"] = int(resources.get("vcpu", 0)) * gang
        attrs["memoryGiB"] = int(resources.get("memoryGiB", 0)) * gang
    return attrs


def quota_demand(request: Mapping[str, Any], *, gpu_model: str | None) -> dict[str, int]:
    """What one reservation charges to quota, by resource name.

    Whole GPUs are charged as ``gpu:<model>`` and MIG instances and slots as
    ``gpuSlices:<model>``, so a tenant's quota of H100s is one row whatever pool they come from.
    """
    model = gpu_model or "other"
    gang = int(request.get("gang", {}).get("size", 1))
    demand: dict[str, int] = {}
    for d in request["devices"]:
        key = f"gpu:{model}" if d["class"] == "gpu" else f"gpuSlices:{model}"
        demand[key] = demand.get(key, 0) + int(d["count"]) * gang
    return demand
