"""The names the operator, the node agent and the chart agree on for Dynamic Resource Allocation.

Why here: a pool with ``policy.kubernetes.api: dra`` reaches pods through ``resource.k8s.io/v1``
claims instead of extended resources. Three parts must spell the same things the same way: the
node agent publishes ResourceSlices and answers ``NodePrepareResources``, the operator writes a
ResourceClaimTemplate per Reservation, and the chart's DeviceClass and admission policies guard
them. ``docs/dra.md`` describes these names to users.

- ``DRIVER`` (``gpu.bcd.dev``): the driver of every device we publish, and the name of the
  DeviceClass the chart installs.
- ``device_name``: a device id (a GPU UUID, a MIG UUID, a slot ``<gpu uuid>::<k>``) as a
  ResourceSlice device name, which must be a DNS label. The real id travels as the ``uuid``
  attribute, and the node maps names back by computing them for the devices it has bound.
- The attributes a user can select on, under the driver's domain
  (``device.attributes["gpu.bcd.dev"].<name>`` in CEL).
- ``namespace_selector``: the one CEL expression every claim for our class must carry, naming
  the claim's own namespace; the chart's admission policy compares it as a string, and since a
  request's selectors are all ANDed, no other selector can widen it.

What it must never do: I/O, or import anything of ours but the standard library.
"""

from __future__ import annotations

import hashlib
import re

DRIVER = "gpu.bcd.dev"
#: The DeviceClass the chart installs; it selects ``device.driver == DRIVER``.
DEVICE_CLASS = DRIVER
#: The ``DeviceAllocation.spec.kubernetesApi`` value (and ``policy.kubernetes.api`` of a pool)
#: for devices reached through claims; ``devicePlugin`` (the default) is extended resources.
API_DRA = "dra"
API_DEVICE_PLUGIN = "devicePlugin"

#: Device attributes (all under the driver's domain).
ATTR_UUID = "uuid"
ATTR_CLASS = "class"  # gpu | mig | slot
ATTR_PRODUCT = "productName"
ATTR_MIG_PROFILE = "migProfile"
ATTR_PARENT_UUID = "parentUuid"
ATTR_NVLINK_DOMAIN = "nvlinkDomain"
ATTR_NUMA_NODE = "numaNode"
ATTR_RESERVATION = "reservation"
ATTR_NAMESPACE = "namespace"
#: Capacity (a quantity): the device's memory.
CAPACITY_MEMORY = "memory"

#: A Reservation's claim template carries these labels; the admission policy refuses writes to
#: an object carrying ``MANAGED_BY_LABEL: MANAGED_BY`` by anyone but the operator.
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "bcd-operator"
#: The one request of a Reservation's ResourceClaimTemplate; a pod's containers list it in
#: ``resources.claims`` (the operator writes it, ``kubectl bcd get`` shows how to use it).
CLAIM_REQUEST = "gpus"
#: A namespace the cluster admin marked may make ``adminAccess`` claims for our driver.
ADMIN_ACCESS_LABEL = "bcd.dev/dra-admin-access"

_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_UNSAFE = re.compile(r"[^a-z0-9-]+")


def device_name(device_id: str) -> str:
    """A device id as a ResourceSlice device name (a DNS label), the same on every call.

    ``GPU-8f3c…`` becomes ``gpu-8f3c…``, a slot ``GPU-8f3c…::2`` becomes ``gpu-8f3c…-slot-2``.
    An id that does not fit a label that way (too long, or empty once cleaned) becomes
    ``dev-`` and 20 hex digits of its SHA-256, so names never collide in practice.
    """
    gpu, separator, slot = device_id.rpartition("::")
    text = f"{gpu}-slot-{slot}" if separator else device_id
    cleaned = _UNSAFE.sub("-", text.lower()).strip("-")
    if _LABEL.match(cleaned) and not cleaned.startswith("dev-"):
        return cleaned
    return "dev-" + hashlib.sha256(device_id.encode("utf-8")).hexdigest()[:20]


def attribute(name: str) -> str:
    """The CEL path of one of our attributes."""
    return f'device.attributes["{DRIVER}"].{name}'


def namespace_selector(namespace: str) -> str:
    """The CEL expression that limits a request to the devices booked for ``namespace``."""
    return f'{attribute(ATTR_NAMESPACE)} == "{namespace}"'


def reservation_selector(reservation_id: str) -> str:
    """The CEL expression that limits a request to one reservation's devices."""
    return f'{attribute(ATTR_RESERVATION)} == "{reservation_id}"'


def slice_name(node_name: str) -> str:
    """The name of the one ResourceSlice a node publishes (its pool is the node's name)."""
    return f"{node_name}-{DRIVER}"
