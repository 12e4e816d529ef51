"""The resource types the operator reads and writes, for its API client.

Data only: no I/O. The names they are built from are ``kube.names``.
"""

from __future__ import annotations

from bettercompute.kube.names import GROUP, VERSION
from bettercompute.operator.kubeapi import Ref

RESERVATIONS = Ref(GROUP, VERSION, "reservations", namespaced=True, kind="Reservation")
GPUPOOLS = Ref(GROUP, VERSION, "gpupools", namespaced=False, kind="GPUPool")
GPUNODES = Ref(GROUP, VERSION, "gpunodes", namespaced=False, kind="GPUNode")
DEVICE_ALLOCATIONS = Ref(
    GROUP, VERSION, "deviceallocations", namespaced=True, kind="DeviceAllocation"
)
NAMESPACES = Ref("", "v1", "namespaces", namespaced=False, kind="Namespace")
