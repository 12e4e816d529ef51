"""The resource types both programs read and write, declared once for lightkube.

Why: lightkube addresses an object by its resource class. Our custom resources are declared
here from ``kube.names``, so the operator and the node agent cannot disagree on a group, a
version or a plural; the built-in kinds come from lightkube's own typed models.

Data only: no I/O.
"""

from __future__ import annotations

from lightkube.generic_resource import create_global_resource, create_namespaced_resource
from lightkube.resources.admissionregistration_v1 import (
    MutatingWebhookConfiguration,
    ValidatingWebhookConfiguration,
)
from lightkube.resources.authentication_v1 import TokenReview
from lightkube.resources.certificates_v1 import (
    CertificateSigningRequest,
    CertificateSigningRequestApproval,
    CertificateSigningRequestStatus,
)
from lightkube.resources.core_v1 import Event, Namespace, Node, Secret, ServiceAccount
from lightkube.resources.resource_v1 import (
    DeviceClass,
    ResourceClaim,
    ResourceClaimTemplate,
    ResourceSlice,
)

from bettercompute.kube.names import GROUP, VERSION

RESERVATIONS = create_namespaced_resource(GROUP, VERSION, "Reservation", "reservations")
GPUPOOLS = create_global_resource(GROUP, VERSION, "GPUPool", "gpupools")
GPUNODES = create_global_resource(GROUP, VERSION, "GPUNode", "gpunodes")
GPUQUOTAS = create_global_resource(GROUP, VERSION, "GPUQuota", "gpuquotas")
EVENT_SUBSCRIPTIONS = create_namespaced_resource(
    GROUP, VERSION, "EventSubscription", "eventsubscriptions"
)
DEVICE_ALLOCATIONS = create_namespaced_resource(
    GROUP, VERSION, "DeviceAllocation", "deviceallocations"
)
NAMESPACES = Namespace
NODES = Node
EVENTS = Event
SECRETS = Secret
SERVICE_ACCOUNTS = ServiceAccount
MUTATING_WEBHOOKS = MutatingWebhookConfiguration
VALIDATING_WEBHOOKS = ValidatingWebhookConfiguration
TOKEN_REVIEWS = TokenReview
#: Node certificates: the request, and its two subresources (approval, the issued certificate).
CERTIFICATE_SIGNING_REQUESTS = CertificateSigningRequest
CSR_APPROVAL = CertificateSigningRequestApproval
CSR_STATUS = CertificateSigningRequestStatus
#: Dynamic Resource Allocation (``resource.k8s.io/v1``, ``kube.dra``): the node agent's slices,
#: the claims it prepares, the operator's claim templates, the chart's DeviceClass.
RESOURCE_SLICES = ResourceSlice
RESOURCE_CLAIMS = ResourceClaim
RESOURCE_CLAIM_TEMPLATES = ResourceClaimTemplate
DEVICE_CLASSES = DeviceClass
