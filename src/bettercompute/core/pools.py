"""What a pool is and what it allows: its models, its offers and quotas, and the admission rules.

The pool, offer and quota models are the one validation of a pool, whoever describes it: the dev
configuration file (``dev.config``) and the operator's ``GPUPool`` (``PoolSpec``) both parse with
them, so a mistake gets the same words everywhere, and ``PoolPolicy`` is what the store's JSON
reads back as (``PoolInfo.policy``), never a dict read by string keys.

The rules of the guide's "Transaction 1" that need only the pool's row are kept pure so they are
tested as a table. The store reads the pool under the transaction and calls them.

What it must never do: I/O. pydantic is the only library here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from bettercompute.core import durations, errors, hosts, placement

#: Which device class each sharing mode books.
CLASS_FOR_MODE = {"exclusive": "gpu", "mig": "mig", "timeslice": "slot", "mps": "slot"}

#: Running spot work's notice when the pool's ``policy.spot.noticeSeconds`` names none.
DEFAULT_SPOT_NOTICE_S = 120
#: The pool's ``maxPending`` when its policy names none: 24 hours.
DEFAULT_MAX_PENDING_MS = 24 * 3_600_000
#: The pool-lease placer's defaults: how often its holder looks for queued work without a
#: wake-up, and the most reservations one batch places.
DEFAULT_BATCH_MS = 200
DEFAULT_MAX_BATCH = 256

CAP_BINDING_KUBERNETES = "bc.dev/cap.binding.kubernetes"
CAP_DEVICES_LIMITS = "bc.dev/cap.devices.limits"
#: The node's agent finds NVIDIA's CDI specs for every device: containers get device nodes,
#: driver libraries and hooks (a pool's nodeSelector or a request may ask for it).
CAP_CDI_NVIDIA = "bc.dev/cap.cdi.nvidia"

_ID = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
Id = Annotated[str, Field(min_length=1, max_length=128, pattern=_ID)]
Region = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9-]*$")]
GpuModel = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][\w.-]*$")]
QuotaResource = Annotated[
    str,
    Field(pattern=r"^((gpu|gpuSlices):[A-Za-z0-9][\w.-]*|vcpu|memoryGiB|hugepages1Gi)$"),
]
QuotaLimit = Annotated[int, Field(ge=0, le=2**62)]
#: Why a pool may not share its GPUs by MPS yet (docs/nvidia.md). The mode stays in the model
#: and the CRD only to be refused with this message: a node would hand out an 'mps' slot as a
#: plain time slice, since nothing starts the MPS control daemon or gives a slot its limits
#: (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT), and a node cannot
#: tell an allocation's sharing mode or replicas from its DeviceAllocation.
MPS_REFUSED = (
    "'mps' is not available yet: bcd nodes do not run the MPS control daemon or give a slot its "
    "MPS limits, so an 'mps' slot would only be a time slice; use 'timeslice' (docs/nvidia.md)"
)


def _not_mps(mode: str) -> str:
    if mode == "mps":
        raise ValueError(MPS_REFUSED)
    return mode


SharingMode = Annotated[Literal["exclusive", "mig", "timeslice", "mps"], AfterValidator(_not_mps)]
OnBudgetExceeded = Literal["allow", "stop-new", "drain"]
SLOT_SHARING = ("timeslice", "mps")


class Model(BaseModel):
    """The base of every model a person writes: strict, so a YAML "yes" or "16" is not silently
    a bool or an int, and closed, so a misspelt key is refused naming it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class PerGpu(Model):
    vcpu: int | None = Field(default=None, ge=0, le=4096)
    memoryGiB: int | None = Field(default=None, ge=0, le=65_536)
    hugepages1Gi: int | None = Field(default=None, ge=0, le=65_536)


class Admission(Model):
    budgetCheck: Literal["meter", "off"] | None = None


class Spot(Model):
    #: How long running spot work keeps its devices once a regular request preempts it.
    noticeSeconds: int | None = Field(default=None, ge=0, le=3600)


class HostReserve(Model):
    vcpu: int | None = Field(default=None, ge=0, le=4096)


#: How a ``kubernetes`` binding's devices reach pods (``policy.kubernetes.api``): extended
#: resources from our device plugin, or ``resource.k8s.io/v1`` claims (Kubernetes 1.34+). The
#: same words as ``kube.dra.API_DEVICE_PLUGIN`` and ``API_DRA``, which the core may not import.
KubernetesApi = Literal["devicePlugin", "dra"]
API_DEVICE_PLUGIN: KubernetesApi = "devicePlugin"
API_DRA: KubernetesApi = "dra"


class KubernetesPolicy(Model):
    """``policy.kubernetes`` written as an object: the pool takes ``binding: kubernetes``
    reservations and says how their devices reach pods."""

    api: KubernetesApi | None = None


class PoolPolicy(Model):
    """The pool policy keys the guide names; anything else is a typo, so it is refused."""

    #: ``true`` (extended resources, as before objects were allowed) or ``{api: …}``.
    kubernetes: bool | KubernetesPolicy | None = None
    #: Which pods may use a ``kubernetes`` binding's devices: ``reservation`` (the default) only
    #: pods that name the reservation, through its own extended resource; ``shared`` any pod
    #: that asks ``bcd.dev/gpu`` (the pool's owner accepts that).
    podAccess: Literal["reservation", "shared"] | None = None
    tenantRoot: bool | None = None
    maxPending: str | int | None = None
    perGpu: PerGpu | None = None
    admission: Admission | None = None
    hostReserve: HostReserve | None = None
    spot: Spot | None = None
    #: Who places: ``inline`` (the default) in the create's own transaction, or ``pool-lease``:
    #: the create is queued and the replica holding the pool's lease places queued requests in
    #: batches (``batchMs``, ``maxBatch``).
    placer: Literal["inline", "pool-lease"] | None = None
    batchMs: int | None = Field(default=None, ge=10, le=60_000)
    maxBatch: int | None = Field(default=None, ge=1, le=4096)

    @field_validator("maxPending")
    @classmethod
    def _duration(cls, value: str | int | None) -> str | int | None:
        if value is not None:
            durations.parse_duration_ms(value)  # DurationError is a ValueError: reported
        return value

    def as_json(self) -> dict[str, Any]:
        """What the store keeps: the keys given, as given."""
        return self.model_dump(exclude_none=True)

    @property
    def takes_kubernetes(self) -> bool:
        """Whether the pool takes ``binding: kubernetes`` (``true``, or any object)."""
        return self.kubernetes is not None and self.kubernetes is not False

    @property
    def kubernetes_api(self) -> KubernetesApi:
        """How the pool's ``kubernetes`` bindings reach pods (``devicePlugin`` by default)."""
        return kubernetes_api(self.as_json())

    @classmethod
    def stored(cls, value: Mapping[str, Any] | None) -> PoolPolicy:
        """The policy a pool row keeps, read back. A row written before a key was checked as it
        is now keeps the keys that still pass: one bad key costs only itself (a ``maxPending``
        that does not parse reads as the default, as it always did)."""
        try:
            return cls.model_validate(dict(value or {}))  # every row written since: one pass
        except ValidationError:
            pass
        kept: dict[str, Any] = {}
        for key, item in (value or {}).items():
            if key not in cls.model_fields:
                continue
            try:
                cls.model_validate({key: item})
            except ValidationError:
                continue
            kept[key] = item
        return cls.model_validate(kept)


def kubernetes_api(policy: Mapping[str, Any] | None) -> KubernetesApi:
    """``policy.kubernetes.api`` of a stored policy (the JSON a pool row keeps), with its
    default: a pool switches between the two only while nothing live uses it, so the store
    compares the old row's answer with the new one's."""
    value = (policy or {}).get("kubernetes")
    if isinstance(value, Mapping) and value.get("api") == API_DRA:
        return API_DRA
    return API_DEVICE_PLUGIN


def _slots_only(replicas: int, info: ValidationInfo) -> int:
    # The sharing mode is validated first (it comes first): ``sharing`` in a Pool, ``mode`` in
    # a GPUPool's ``sharing``.
    sharing = info.data.get("sharing", info.data.get("mode"))
    if replicas > 1 and sharing not in SLOT_SHARING:
        raise ValueError("replicas are for 'timeslice' and 'mps' pools only")
    return replicas


#: Slots per GPU, for the sharing modes that slice a GPU in time.
Replicas = Annotated[int, Field(ge=1, le=64), AfterValidator(_slots_only)]


class Pool(Model):
    """A pool as the dev configuration writes it (``docs/dev-config.md``)."""

    id: Id
    name: str = ""
    owner: Id
    region: Region
    model: GpuModel | None = None
    sharing: SharingMode = "exclusive"
    replicas: Replicas = 1
    policy: PoolPolicy = PoolPolicy()
    archived: bool = False


class Offer(Model):
    """The pool is offered to the tenant, who may reserve in it besides its owner."""

    pool: Id
    tenant: Id
    onBudgetExceeded: OnBudgetExceeded | None = None


class Quota(Model):
    tenant: Id
    resource: QuotaResource
    limit: QuotaLimit


@dataclass(frozen=True)
class PoolDefinition:
    """A pool with exactly the offers it has and the quotas it sets, as a ``GPUPool`` says."""

    pool: Pool
    offers: tuple[Offer, ...] = ()
    quotas: tuple[Quota, ...] = ()

    @property
    def pool_id(self) -> str:
        return self.pool.id


# --- the GPUPool object's spec (docs/kubernetes.md) --------------------------------------------


class Sharing(Model):
    """How a GPU is shared; a ``GPUPool`` without ``sharing`` is exclusive."""

    mode: SharingMode
    replicas: Replicas = 1


#: Why a GPUPool may no longer carry quotas: the result depended on which pool was applied last.
QUOTAS_MOVED = (
    "quotas moved to GPUQuota objects (one per tenant, kind GPUQuota): write the tenant's"
    " limits there and remove them from the pool"
)


def _no_quotas(value: dict[str, int]) -> dict[str, int]:
    if value:
        raise ValueError(QUOTAS_MOVED)
    return value


#: Kept in the model (and the CRD) only to refuse it with a message, instead of pruning it.
MovedQuotas = Annotated[dict[QuotaResource, QuotaLimit], AfterValidator(_no_quotas)]


class PoolOwner(Model):
    tenant: Id
    quotas: MovedQuotas = {}


class PoolOffer(Model):
    tenant: Id
    onBudgetExceeded: OnBudgetExceeded | None = None
    quotas: MovedQuotas = {}


class QuotaSpec(Model):
    """A ``GPUQuota``'s spec: the tenant's limits, by resource. A resource it does not name
    grants nothing."""

    tenant: Id
    limits: dict[QuotaResource, QuotaLimit]


class SelectorExpression(Model):
    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = []


class LabelSelector(Model):
    """Kubernetes' LabelSelector: which GPUNodes a pool takes, by their labels."""

    matchLabels: dict[str, str] | None = None
    matchExpressions: list[SelectorExpression] | None = None


class PoolSpec(Model):
    """A ``GPUPool``'s spec: the same pool and its offers (quotas are ``GPUQuota``s')."""

    region: Region
    owner: PoolOwner
    model: GpuModel | None = None
    site: str | None = Field(default=None, max_length=128)
    sharing: Sharing = Sharing(mode="exclusive")
    policy: PoolPolicy = PoolPolicy()
    #: Validated here; ``operator.definitions.selects`` reads the object's own.
    nodeSelector: LabelSelector | None = None
    offers: list[PoolOffer] = []
    archived: bool = False

    def definition(self, name: str) -> PoolDefinition:
        pool = Pool(
            id=name,
            name=name,
            owner=self.owner.tenant,
            region=self.region,
            model=self.model,
            sharing=self.sharing.mode,
            replicas=self.sharing.replicas,
            policy=self.policy,
            archived=self.archived,
        )
        offers = tuple(
            Offer(pool=name, tenant=o.tenant, onBudgetExceeded=o.onBudgetExceeded)
            for o in self.offers
        )
        return PoolDefinition(pool=pool, offers=offers)


@dataclass(frozen=True)
class PoolInfo:
    id: str
    owner_tenant_id: str
    region: str
    gpu_model: str | None
    sharing_mode: str
    replicas: int
    archived: bool
    policy: PoolPolicy = field(default_factory=PoolPolicy)
    #: Whether the pool is offered to the tenant asking (owners need no offer).
    offered: bool = False
    on_budget_exceeded: str | None = None

    def visible_to(self, tenant_id: str) -> bool:
        return not self.archived and (self.owner_tenant_id == tenant_id or self.offered)

    @property
    def spot_notice_s(self) -> int:
        """How long preempted running spot work keeps its devices (default 120 s)."""
        spot = self.policy.spot
        return (
            DEFAULT_SPOT_NOTICE_S
            if spot is None or spot.noticeSeconds is None
            else (spot.noticeSeconds)
        )

    @property
    def max_pending_ms(self) -> int:
        value = self.policy.maxPending
        return DEFAULT_MAX_PENDING_MS if value is None else durations.parse_duration_ms(value)

    @property
    def pool_lease(self) -> bool:
        """Whether creates are queued for the pool-lease placer instead of placed inline."""
        return self.policy.placer == "pool-lease"

    @property
    def batch_ms(self) -> int:
        value = self.policy.batchMs
        return DEFAULT_BATCH_MS if value is None else value

    @property
    def max_batch(self) -> int:
        value = self.policy.maxBatch
        return DEFAULT_MAX_BATCH if value is None else value

    @property
    def wants_budget_check(self) -> bool:
        admission = self.policy.admission
        metered = admission is not None and admission.budgetCheck == "meter"
        return metered or self.on_budget_exceeded in (
            "stop-new",
            "drain",
        )

    @property
    def checks_budget_on_extend(self) -> bool:
        """Whether an extend is checked against the budget: only under ``drain``, which refuses
        extends on a spent budget (and ends nothing); ``stop-new`` and ``meter`` stop only
        new reservations. A renew moves a lease inside the booked window: it adds no hours."""
        return self.on_budget_exceeded == "drain"


def check_request(*, request: Mapping[str, Any], pool: PoolInfo, tenant_id: str) -> None:
    """Refuse what this pool cannot serve for this tenant; the order is the guide's.

    ``NOT_FOUND`` when the pool is neither owned by nor offered to the tenant, or archived (the
    same answer as a pool that does not exist); then device classes against the sharing mode;
    then the binding's needs.
    """
    if not pool.visible_to(tenant_id):
        raise errors.not_found("pool")
    wanted = CLASS_FOR_MODE[pool.sharing_mode]
    for i, device in enumerate(request["devices"]):
        if device["class"] != wanted:
            raise errors.invalid_input(
                f"devices[{i}].class",
                f"pool {pool.id} shares its GPUs as '{pool.sharing_mode}', which books class "
                f"'{wanted}', not '{device['class']}'",
            )
    binding = request["binding"]
    if binding == "node" and not pool.policy.tenantRoot:
        raise errors.invalid_input("binding", "binding 'node' needs a pool with tenantRoot")
    if binding == "kubernetes":
        if not pool.policy.takes_kubernetes:
            raise errors.invalid_input(
                "binding",
                f"binding 'kubernetes' needs a pool with policy.kubernetes; {pool.id} has none",
            )
        if pool.owner_tenant_id != tenant_id:
            raise errors.invalid_input(
                "binding",
                "binding 'kubernetes' is for the pool's owner only: the kubelet gives bound GPUs "
                "to any pod of the cluster; book binding 'hold' instead",
            )


def resolve_host(
    request: Mapping[str, Any], *, pool: PoolInfo, hosts_share: Mapping[str, Any] | None
) -> tuple[dict[str, Any], dict[str, int]]:
    """``hosts.resolve`` for this pool: its sharing, its ``policy.perGpu``, and the per-GPU
    share its hosts can give (``hosts_share``, kept by the store with the inventory)."""
    per_gpu = pool.policy.perGpu
    return hosts.resolve(
        request,
        sharing_mode=pool.sharing_mode,
        replicas=pool.replicas,
        per_gpu=per_gpu.model_dump(exclude_none=True) if per_gpu is not None else None,
        hosts=hosts_share,
    )


def demand(*, request: Mapping[str, Any]) -> placement.Demand:
    """The placer's view of a normalised request."""
    labels: dict[str, str] = {}
    if request["binding"] == "kubernetes":
        labels[CAP_BINDING_KUBERNETES] = "*"
    host = hosts.booked(request)
    if host:
        # Only a node agent that enforces limits may run it: anything else would run it unbounded.
        labels[CAP_DEVICES_LIMITS] = "*"
    return placement.Demand(
        devices=tuple(
            placement.DeviceDemand(
                device_class=d["class"],
                count=int(d["count"]),
                topology=d.get("topology", "any"),
                profile=d.get("profile"),
            )
            for d in request["devices"]
        ),
        gang_size=int(request.get("gang", {}).get("size", 1)),
        whole_node=request["binding"] == "node",
        required_labels=labels,
        host=host,
    )
