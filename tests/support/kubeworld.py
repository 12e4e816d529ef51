"""Fluent builders for the custom resources the operator tests apply (kueue's wrappers style):
``reservation("train").gpus(4).nvlink().obj()`` instead of hand-written dicts.

Also the node's side of a DeviceAllocation (a report as the device plugin writes it), so
operator tests can play the node without the device plugin.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from bettercompute.core import moments
from bettercompute.deviceplugin import signing
from bettercompute.kube import names
from tests.support import nodecerts

OPERATOR_NAMESPACE = "better-compute"


def namespace(name: str, *, tenant: str | None) -> dict[str, Any]:
    labels = {names.TENANT_LABEL: tenant} if tenant else {}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def gpupool(
    name: str,
    *,
    owner: str = "acme",
    model: str = "H100",
    mode: str = "exclusive",
    replicas: int = 1,
    kubernetes: bool = True,
    offers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": "GPUPool",
        "metadata": {"name": name},
        "spec": {
            "model": model,
            "region": "eu-west-1",
            "sharing": {"mode": mode, "replicas": replicas},
            "policy": {"kubernetes": kubernetes},
            "nodeSelector": {"matchLabels": {"bcd.dev/pool": name}},
            "owner": {"tenant": owner},
            "offers": offers or [],
        },
    }


def gpuquota(tenant: str, limits: dict[str, int], *, name: str | None = None) -> dict[str, Any]:
    """A tenant's GPUQuota (named after the tenant unless ``name`` is given)."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": "GPUQuota",
        "metadata": {"name": name or tenant},
        "spec": {"tenant": tenant, "limits": dict(limits)},
    }


def gpunode(name: str, *, pool: str) -> dict[str, Any]:
    """A GPUNode object (create it, then write ``gpunode_status`` to its status)."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": "GPUNode",
        "metadata": {"name": name, "labels": {"bcd.dev/pool": pool}},
        "spec": {},
    }


def gpu_uuid(node: str, index: int) -> str:
    return f"GPU-{node}-{index:02d}"


def gpunode_status(name: str, *, gpus: int = 8, domains: int = 2, ready: bool = True) -> dict:
    per = max(1, gpus // max(1, domains))
    return {
        "inventory": {
            "gpus": [
                {
                    "uuid": gpu_uuid(name, i),
                    "index": i,
                    "model": "H100",
                    "memoryMiB": 81559,
                    "numaNode": i * 2 // gpus,
                    "nvlinkDomain": f"{name}-nvl{i // per}" if domains else None,
                    "healthy": True,
                    "mig": [],
                }
                for i in range(gpus)
            ],
            "numaNodes": [{"id": 0, "cpus": "0-63"}, {"id": 1, "cpus": "64-127"}],
            "host": {"vcpu": 128, "memoryGiB": 2048},
        },
        "gpus": gpus,
        "capabilities": ["binding.kubernetes", "devices.limits"],
        "conditions": [
            {
                "type": "Ready",
                "status": "True" if ready else "False",
                "reason": "AgentRunning",
                "message": "",
                "lastTransitionTime": "2026-12-02T00:00:00Z",
            }
        ],
    }


class ReservationBuilder:
    def __init__(self, name: str, namespace: str):
        self._obj: dict[str, Any] = {
            "apiVersion": names.API_VERSION,
            "kind": "Reservation",
            "metadata": {"name": name, "namespace": namespace, "annotations": {}},
            "spec": {
                "poolId": "h100",
                "devices": [{"class": "gpu", "count": 1}],
                "duration": "1h",
            },
        }

    def pool(self, pool_id: str) -> ReservationBuilder:
        self._obj["spec"]["poolId"] = pool_id
        return self

    def gpus(self, count: int) -> ReservationBuilder:
        self._obj["spec"]["devices"] = [{"class": "gpu", "count": count}]
        return self

    def nvlink(self) -> ReservationBuilder:
        self._obj["spec"]["devices"][0]["topology"] = "nvlink-all"
        return self

    def duration(self, value: str | int) -> ReservationBuilder:
        self._obj["spec"]["duration"] = value
        return self

    def start(self, epoch_ms: int) -> ReservationBuilder:
        # Written as the CRD takes it (RFC 3339), to the millisecond.
        self._obj["spec"]["start"] = moments.rfc3339(epoch_ms, exact=True)
        return self

    def key(self, key: str) -> ReservationBuilder:
        self._obj["spec"]["idempotencyKey"] = key
        return self

    def kubernetes(self) -> ReservationBuilder:
        self._obj["spec"]["binding"] = "kubernetes"
        return self

    def lease(self, seconds: int) -> ReservationBuilder:
        self._obj["spec"]["leaseSeconds"] = seconds
        return self

    def by(self, user: str, *groups: str) -> ReservationBuilder:
        """Stamped as the mutating webhook would for ``user`` (the stand-in calls webhooks
        only where a test registers their configurations)."""
        annotations = self._obj["metadata"]["annotations"]
        annotations[names.REQUESTED_BY] = user
        annotations[names.REQUESTED_BY_GROUPS] = json.dumps(sorted(groups))
        return self

    def obj(self) -> dict[str, Any]:
        return copy.deepcopy(self._obj)


def reservation(name: str, namespace: str = "ml") -> ReservationBuilder:
    return ReservationBuilder(name, namespace).by("alice@acme")


def bound(node: str, spec: dict[str, Any], *, at: str = "2026-12-02T00:00:01Z") -> dict:
    """A node's Bound report on a DeviceAllocation, as the device plugin writes it: signed with
    the node's key and carrying its certificate from the test authority."""
    allocation = spec["allocationId"]
    cdi_devices = [f"bcd.dev/gpu={d}" for d in spec["deviceIds"]]
    env_file = f"/run/bcd/allocations/{allocation}.env"
    report = signing.Report(
        node_name=node,
        allocation_id=allocation,
        reservation_id=spec["reservationId"],
        phase="Bound",
        cdi_devices=tuple(cdi_devices),
        env_file=env_file,
        reported_at=at,
    )
    return {
        "nodeName": node,
        "phase": "Bound",
        "cdiDevices": cdi_devices,
        "envFile": env_file,
        "reportedAt": at,
        "signature": nodecerts.sign(node, report),
    }


def _signed(node: str, spec: dict[str, Any], phase: str, at: str, **fields: Any) -> dict:
    """The signature block of a report of ``phase``, as the device plugin signs it."""
    report = signing.Report(
        node_name=node,
        allocation_id=spec["allocationId"],
        reservation_id=spec["reservationId"],
        phase=phase,
        reported_at=at,
        **fields,
    )
    return nodecerts.sign(node, report)


def releasing(node: str, spec: dict[str, Any], *, pods: list[str], since: int, at: str) -> dict:
    """A node's signed Releasing report: ``pods`` still hold the devices."""
    return {
        "nodeName": node,
        "phase": "Releasing",
        "pods": pods,
        "since": since,
        "reportedAt": at,
        "signature": _signed(node, spec, "Releasing", at, pods=tuple(pods), since=since),
    }


def released(node: str, spec: dict[str, Any], *, at: str) -> dict:
    """A node's signed Released report: the devices are free."""
    return {
        "nodeName": node,
        "phase": "Released",
        "pods": [],
        "reportedAt": at,
        "signature": _signed(node, spec, "Released", at),
    }


def failed(node: str, spec: dict[str, Any], *, reason: str, at: str) -> dict:
    """A node's signed Failed report (``reason`` is for people: not signed)."""
    return {
        "nodeName": node,
        "phase": "Failed",
        "reason": reason,
        "reportedAt": at,
        "signature": _signed(node, spec, "Failed", at),
    }
