"""The names the operator, the node agent and the chart agree on: API group and version, labels,
annotations and the finalizer (``docs/kubernetes.md`` describes them to users).

Data only: no I/O, no imports of ours but ``core.ids`` (a reservation's resource name).
"""

from __future__ import annotations

from bettercompute.core import ids

GROUP = "bcd.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

#: A namespace's tenant.
TENANT_LABEL = "bcd.dev/tenant"
#: Stamped by the mutating webhook from the API server's userInfo.
REQUESTED_BY = "bcd.dev/requested-by"
REQUESTED_BY_GROUPS = "bcd.dev/requested-by-groups"
STAMPS = (REQUESTED_BY, REQUESTED_BY_GROUPS)
#: On a ServiceAccount: the username of the person this service account is an agent for
#: (delegated confirmation, ``operator/delegating.py``).
ACTING_FOR = "bcd.dev/acting-for"
#: On a Reservation awaiting confirmation: ``approve`` or ``deny``, set by the person; the
#: mutating webhook stamps who set it in ``CONFIRMED_BY`` (``kubectl annotate`` is enough).
CONFIRMATION = "bcd.dev/confirmation"
CONFIRMED_BY = "bcd.dev/confirmed-by"
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

#: The CDI kind of every device a node exposes: a pod's container sees ``bcd.dev/gpu=<id>``
#: (a reservation's ``binding.cdiDevices``).
CDI_KIND = "bcd.dev/gpu"
#: The extended resource a ``kubernetes`` binding's devices are advertised as, by device class:
#: what a pod asks for in ``resources.limits``.
RESOURCE_NAMES = {"gpu": "bcd.dev/gpu", "mig": "bcd.dev/gpu.mig", "slot": "bcd.dev/gpu.slot"}

#: A pod names the Reservation (in its own namespace) whose devices it uses with this label;
#: the same key labels a DeviceAllocation with its reservation's id.
POD_RESERVATION_LABEL = RESERVATION_LABEL
#: The pod webhook records the pod's original device requests here (JSON) when it rewrites them.
ORIGINAL_RESOURCES = "bcd.dev/original-resources"
#: Every resource a pool in ``reservation`` pod-access mode advertises starts with this prefix;
#: ``reservation_resource_name`` makes a reservation's (``core.ids``, so the store can name it).
RESERVATION_RESOURCE_PREFIX = ids.RESERVATION_RESOURCE_PREFIX
reservation_resource_name = ids.reservation_resource_name


#: The CertificateSigningRequest signer the operator answers for node certificates.
NODE_REPORT_SIGNER = "bcd.dev/node-report"
#: Annotate a GPUNode with a new value to revoke every certificate of the node.
REVOKE_CERTIFICATES = "bcd.dev/revoke-certificates"
#: The last value of ``REVOKE_CERTIFICATES`` the operator acted on, and when (RFC 3339): the
#: node's agent replaces its key and enrols again when its certificate is older.
REVOKED_CERTIFICATES = "bcd.dev/revoked-certificates"
REVOKED_CERTIFICATES_AT = "bcd.dev/revoked-certificates-at"
#: The GPUNode condition a node agent sets when something besides bcd can hand its GPUs out.
FOREIGN_GPU_EXPOSURE = "ForeignGpuExposure"
