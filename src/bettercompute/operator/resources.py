"""The names the operator, the device plugin and the chart agree on: resource types, labels,
annotations and the finalizer (``docs/kubernetes.md`` is their contract).

Data only: no I/O.
"""

from __future__ import annotations

from bettercompute.operator.kubeapi import Ref

GROUP = "bcd.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

RESERVATIONS = Ref(GROUP, VERSION, "reservations", namespaced=True, kind="Reservation")
GPUPOOLS = Ref(GROUP, VERSION, "gpupools", namespaced=False, kind="GPUPool")
GPUNODES = Ref(GROUP, VERSION, "gpunodes", namespaced=False, kind="GPUNode")
DEVICE_ALLOCATIONS = Ref(
    GROUP, VERSION, "deviceallocations", namespaced=True, kind="DeviceAllocation"
)
NAMESPACES = Ref("", "v1", "namespaces", namespaced=False, kind="Namespace")

#: A namespace's tenant.
TENANT_LABEL = "bcd.dev/tenant"
#: Stamped by the mutating webhook from the API server's userInfo.
REQUESTED_BY = "bcd.dev/requested-by"
REQUESTED_BY_GROUPS = "bcd.dev/requested-by-groups"
STAMPS = (REQUESTED_BY, REQUESTED_BY_GROUPS)
#: Each new value renews the reservation's lease once.
RENEW = "bcd.dev/renew"
#: A DeviceAllocation's node and reservation, so a node lists only its own.
NODE_LABEL = "bcd.dev/node"
RESERVATION_LABEL = "bcd.dev/reservation"
#: Where kopf keeps its handler progress and last-handled spec (annotations, not status).
KOPF_PREFIX = "kopf.bcd.dev"
FINALIZER = "bcd.dev/release"

#: ``spec`` fields a Reservation may change after creation; the rest is the request.
MUTABLE_SPEC = frozenset({"until", "extendBy", "extendKey", "release"})
#: ``spec`` fields that are not part of the core's create request.
NOT_THE_REQUEST = MUTABLE_SPEC | {"idempotencyKey"}
