"""The operator's settings: where its database, API server, HTTP API, metrics and webhooks
are.

Read from the command line with environment fallbacks (``better-compute-operator --help``
lists both), so the Helm chart sets environment variables and a person sets flags. Validated
once, at start, into one frozen value; nothing else in the operator reads the environment.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from bettercompute.core import attestation


@dataclass(frozen=True)
class OperatorConfig:
    #: ``postgresql://…``; required outside tests.
    database_url: str
    #: Where DeviceAllocations live (the operator's own namespace).
    namespace: str = "better-compute"
    #: The platform team's tenant: its members pass every tenant pre-check.
    root_tenant: str = "root"
    #: Cedar policy files added after the built-in policies (``--policies``).
    policy_files: tuple[Path, ...] = ()
    #: Leave out the built-in "members manage their own tenant's reservations" policies.
    no_default_policies: bool = False
    #: The HTTP API (reservations, /healthz, /readyz); port 0 picks a free one.
    http_host: str = "0.0.0.0"
    http_port: int = 8080
    #: ``/metrics``, on a port of its own (``api.metrics_server``): its figures name every
    #: tenant, so they are never on the API's port. Port 0 picks a free one.
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9464
    #: kopf's admission webhook server; ``webhook_port`` None turns webhooks off.
    webhook_host: str = "0.0.0.0"
    webhook_port: int | None = 9443
    #: TLS for the webhook server (the chart mounts them); without both it serves plain HTTP,
    #: which only a test or a TLS-terminating proxy should see.
    webhook_cert: Path | None = None
    webhook_key: Path | None = None
    #: Without ``webhook_cert``: the Secret (in ``namespace``) where the operator keeps the
    #: webhook certificate it makes and rotates itself (``operator.webhookcerts``).
    webhook_secret: str | None = None
    #: The Service the API server reaches the webhooks through: the certificate's names.
    webhook_service: str = "better-compute-operator"
    #: More names for the certificate (an IP address for a test, an external host name).
    webhook_extra_names: tuple[str, ...] = ()
    #: The Mutating- and ValidatingWebhookConfigurations whose caBundle it keeps current.
    webhook_configurations: tuple[str, ...] = ()
    #: How often the Secret is read again (a renewal due, another replica's, or the Secret
    #: deleted and made again): one GET a minute keeps replicas within a minute of each other.
    webhook_check_s: float = 60.0

    @property
    def webhook_names(self) -> tuple[str, ...]:
        """What the webhook certificate is for: the Service's names, then the extra ones."""
        service = f"{self.webhook_service}.{self.namespace}.svc"
        return (service, f"{service}.cluster.local", *self.webhook_extra_names)

    #: kopf peering between replicas; ``standalone`` runs without it.
    peering_name: str = "better-compute"
    priority: int = 0
    standalone: bool = False
    #: An explicit API server and token (tests, a proxy); else the pod's service account,
    #: else ``$KUBECONFIG``.
    api_server: str | None = None
    api_token: str | None = None
    #: The CA that signed ``api_server``'s serving certificate (PEM); without it, the
    #: system's trust store.
    api_ca: Path | None = None
    #: Groups naming a caller's tenant in TokenReview answers.
    tenant_group_prefix: str = "bcd.dev:tenant:"
    #: How often every node's DeviceAllocations are compared in full with the store.
    allocation_resync_s: float = 60.0
    #: How often each GPUPool's status.devices (free, booked, healthy, total) is brought up to
    #: date (written only when it changed).
    pool_status_s: float = 5.0
    #: Sign node certificates and revoke them (off: no CSR handlers are registered).
    node_certificates: bool = True
    #: The node agent's service account in ``namespace``: only its node-bound tokens get
    #: node certificates.
    node_agent_service_account: str = "better-compute-device-plugin"
    #: The longest node certificate the operator signs (a node may ask for less).
    node_certificate_lifetime: dt.timedelta = attestation.NODE_CERTIFICATE_LIFETIME
    #: The Secret (``tls.crt``/``tls.key``, in ``namespace``) holding the node-report authority
    #: that node certificates chain to (attested bindings).
    node_ca_secret: str = "better-compute-node-ca"
    #: Create the authority's Secret when it is missing; off when the platform provides it
    #: (for example issued by cert-manager): then a missing Secret stops the start.
    node_ca_create: bool = True
    #: How long after its expiry a node certificate still counts (a node offline for a while).
    node_certificate_grace_s: float = 3600.0
    #: Where event webhooks may be delivered beyond global addresses: CIDRs, addresses and
    #: host names (``core.egress``); loopback, private and link-local addresses are refused
    #: unless listed here, the cloud metadata addresses always.
    event_webhook_allow: tuple[str, ...] = ()
    #: Run the Kueue AdmissionCheck controller (``bcd.dev/reservation``) when the API server
    #: serves Kueue's ``v1beta1``; off, or Kueue absent: nothing of Kueue is watched.
    kueue_admission_check: bool = False
    #: How often every Workload with one of our checks is evaluated again without a hint.
    kueue_resync_s: float = 10.0
