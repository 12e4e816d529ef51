"""The kopf handlers: a few lines each around the operator's doors and syncs.

``make_registry`` builds a fresh ``kopf.OperatorRegistry`` holding every handler, so each
operator (two in the peering test, one per test elsewhere) has its own and nothing is
registered at import time. Handlers find their services in ``memo.runtime``.

Retry semantics live here and only here: a door answers "try again in N seconds" and the
handler turns it into ``kopf.TemporaryError``; an unexpected exception is left to kopf's
own backoff.

What it must never do: hold logic. Parsing, deciding and projecting live in the modules the
handlers call, which are tested without kopf.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import kopf

from bettercompute.core.egress import EgressPolicy
from bettercompute.core.errors import ComputeError, StoreError
from bettercompute.core.pools import CLASS_FOR_MODE, PoolDefinition
from bettercompute.kube import dra, names, resources
from bettercompute.kube.parsing import ShapeError
from bettercompute.operator import (
    claiming,
    definitions,
    kueuesyncing,
    podaccess,
    podowners,
    quotas,
    statuses,
    subscribing,
    webhooks,
)
from bettercompute.operator.runtime import Runtime

log = logging.getLogger(__name__)

RESERVATIONS = (names.GROUP, names.VERSION, "reservations")
GPUPOOLS = (names.GROUP, names.VERSION, "gpupools")
GPUNODES = (names.GROUP, names.VERSION, "gpunodes")
GPUQUOTAS = (names.GROUP, names.VERSION, "gpuquotas")
EVENT_SUBSCRIPTIONS = (names.GROUP, names.VERSION, "eventsubscriptions")
DEVICE_ALLOCATIONS = (names.GROUP, names.VERSION, "deviceallocations")
CSRS = ("certificates.k8s.io", "v1", "certificatesigningrequests")
PODS = ("", "v1", "pods")


def _node_report_csr(spec: kopf.Spec, **_: Any) -> bool:
    return bool(spec.get("signerName") == names.NODE_REPORT_SIGNER)


def _runtime(memo: Any) -> Runtime:
    runtime: Runtime = memo["runtime"]
    if runtime.stopped:
        # An orphaned timer or daemon of a stopped operator: end its task, do nothing.
        raise asyncio.CancelledError(f"the operator stopped; {runtime.config.namespace}")
    return runtime


def _first(index: Any, key: Any) -> Any:
    """The one value an index holds under ``key`` (kopf indexes keep a collection)."""
    for value in index.get(key, ()):
        return value
    return None


def _retry(delay: float | None) -> None:
    if delay is not None:
        raise kopf.TemporaryError("the core asked to try again later", delay=delay)


#: After the database did not answer, a Reservation's handler runs again in this many seconds
#: (jittered, so a burst cut together does not come back together), not after kopf's own
#: backoff of a minute: the object would sit in ``draft`` that long.
STORE_RETRY_S = (1.0, 4.0)


@contextlib.asynccontextmanager
async def _admitting(runtime: Runtime) -> AsyncIterator[None]:
    """One Reservation event against the store: a share of the pool, and a busy or absent
    database answered by trying again in seconds."""
    async with runtime.admitting:
        try:
            yield
        except StoreError as e:
            raise kopf.TemporaryError(
                f"the database did not answer: {e}", delay=random.uniform(*STORE_RETRY_S)
            ) from e


def make_registry(
    *, node_certificates: bool = True, pool_status_s: float = 5.0, kueue_checks: bool = False
) -> kopf.OperatorRegistry:
    """Every handler; ``node_certificates`` False leaves out the signer of node certificates
    (a cluster that does not grant the operator CertificateSigningRequests); ``kueue_checks``
    adds the watches that wake the Kueue AdmissionCheck controller (only where the API server
    serves Kueue: kopf must not watch a resource that does not exist)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
        return _runtime(memo).login()

    # --- indexes: what handlers need to know about other objects ----------------------------

    @kopf.index("", "v1", "namespaces", id="namespace_labels", registry=registry)
    def namespace_labels(name: str, labels: Mapping[str, str], **_: Any) -> dict[str, Any]:
        return {name: dict(labels)}

    @kopf.index(*GPUPOOLS, id="pool_specs", registry=registry)
    def pool_specs(name: str, spec: kopf.Spec, **_: Any) -> dict[str, Any]:
        return {name: dict(spec)}

    @kopf.index(*GPUNODES, id="node_bodies", registry=registry)
    def node_bodies(
        name: str, labels: Mapping[str, str], status: kopf.Status, **_: Any
    ) -> dict[str, Any]:
        return {name: {"labels": dict(labels), "status": dict(status)}}

    @kopf.index(*GPUQUOTAS, id="quota_claims", registry=registry)
    def quota_claims(body: kopf.Body, spec: kopf.Spec, **_: Any) -> dict[str, Any]:
        return {str(spec.get("tenant") or ""): quotas.claim(body)}

    # --- Reservations ----------------------------------------------------------------------------

    @kopf.on.event(*RESERVATIONS, registry=registry)
    async def reservation_seen(type: str, body: kopf.Body, memo: Any, **_: Any) -> None:
        runtime = _runtime(memo)
        if type == "DELETED":
            runtime.objects.forget(body)
        else:
            await runtime.projector.remember(body)

    @kopf.on.resume(*RESERVATIONS, registry=registry)
    @kopf.on.create(*RESERVATIONS, registry=registry)
    async def reservation_admitted(
        body: kopf.Body, namespace: str | None, memo: Any, **kwargs: Any
    ) -> None:
        labels = _first(kwargs["namespace_labels"], namespace or "")
        runtime = _runtime(memo)
        async with _admitting(runtime):
            _retry(await runtime.door.admit(body, tenant_labels=labels))

    @kopf.on.update(*RESERVATIONS, registry=registry)
    async def reservation_changed(
        body: kopf.Body, namespace: str | None, memo: Any, **kwargs: Any
    ) -> None:
        labels = _first(kwargs["namespace_labels"], namespace or "")
        runtime = _runtime(memo)
        async with _admitting(runtime):
            _retry(await runtime.door.changed(body, tenant_labels=labels))

    @kopf.on.delete(*RESERVATIONS, registry=registry)
    async def reservation_deleted(
        body: kopf.Body, namespace: str | None, memo: Any, **kwargs: Any
    ) -> None:
        labels = _first(kwargs["namespace_labels"], namespace or "")
        runtime = _runtime(memo)
        async with _admitting(runtime):
            await runtime.door.deleted(body, tenant_labels=labels)

    @kopf.on.mutate(*RESERVATIONS, id="stamp", operations=["CREATE", "UPDATE"], registry=registry)
    def reservation_stamped(
        patch: kopf.Patch, userinfo: kopf.UserInfo, body: kopf.Body, **kwargs: Any
    ) -> None:
        # kopf's server does not filter by operation: both are checked here.
        operation = kwargs.get("operation")
        if operation == "CREATE":
            stamped = webhooks.stamps(dict(userinfo))
        elif operation == "UPDATE":
            stamped = webhooks.confirmation_stamp(dict(userinfo), body, kwargs.get("old"))
        else:
            return
        if stamped:
            patch.setdefault("metadata", {}).setdefault("annotations", {}).update(stamped)

    @kopf.on.validate(*RESERVATIONS, id="check", operations=["CREATE", "UPDATE"], registry=registry)
    def reservation_checked(userinfo: kopf.UserInfo, body: kopf.Body, **kwargs: Any) -> None:
        problem = webhooks.refusal(
            operation=kwargs.get("operation"),
            userinfo=dict(userinfo),
            new=body,
            old=kwargs.get("old"),
        )
        if problem is not None:
            raise kopf.AdmissionError(problem, code=422)

    # --- Pods: only a reservation's own pods get its devices (``podaccess``) -----------------

    @kopf.on.mutate(*PODS, id="pod-rewrite", operations=["CREATE"], registry=registry)
    async def pod_rewritten(body: kopf.Body, patch: kopf.Patch, memo: Any, **kwargs: Any) -> None:
        if kwargs.get("operation") != "CREATE":  # kopf's server does not filter by operation
            return
        reservation = await _labelled_reservation(_runtime(memo), body)
        changes = podaccess.rewritten(body, reservation)
        if changes is not None:
            patch.setdefault("metadata", {})["annotations"] = changes["annotations"]
            patch.setdefault("spec", {}).update(changes["spec"])

    @kopf.on.validate(*PODS, id="pod-check", operations=["CREATE", "UPDATE"], registry=registry)
    async def pod_checked(body: kopf.Body, memo: Any, warnings: list[str], **kwargs: Any) -> None:
        operation, old = kwargs.get("operation"), kwargs.get("old")
        runtime, reservation = _runtime(memo), None
        if podaccess.needs_reservation(operation=operation, pod=body, old=old):
            reservation = await _labelled_reservation(runtime, body)
        # Whose each bcd.dev/rsv-… resource is: the store's claims, never a status field.
        owners = await podowners.PodOwners(runtime.service).owners_of(
            podaccess.reservation_resources(body), known=reservation
        )
        problem = podaccess.refusal(
            operation=operation,
            pod=body,
            old=old,
            reservation_named=lambda namespace, name: reservation,
            owner_of=owners.get,
        )
        if problem is not None:
            raise kopf.AdmissionError(problem, code=403)
        if operation == "CREATE":
            pool_specs = kwargs["pool_specs"]
            shared = any(podaccess.shares_devices(_first(pool_specs, p)) for p in pool_specs)
            said = podaccess.warning(body, shared_pool_exists=shared)
            if said is not None:
                warnings.append(said)

    # --- GPUPools and GPUNodes ---------------------------------------------------------------

    @kopf.on.resume(*GPUPOOLS, registry=registry)
    @kopf.on.create(*GPUPOOLS, registry=registry)
    @kopf.on.update(*GPUPOOLS, registry=registry)
    async def pool_applied(
        name: str, spec: kopf.Spec, body: kopf.Body, memo: Any, **kwargs: Any
    ) -> None:
        runtime = _runtime(memo)
        pool_specs, node_bodies = kwargs["pool_specs"], kwargs["node_bodies"]
        try:
            definition = definitions.pool_definition(name, spec)
        except ComputeError as e:
            await _pool_status(runtime, body, ready=False, reason=e.code.value, message=e.message)
            return
        try:
            await runtime.clusters.apply_pool(definition)
        except ComputeError as e:
            # A switch of policy.kubernetes.api while live reservations use the pool: the pool
            # keeps its stored policy, and its status says why until the spec is put back or
            # the reservations end (the next change of the object tries again).
            await _pool_status(runtime, body, ready=False, reason=e.code.value, message=e.message)
            return
        runtime.applied_pools.add(name)
        await _apply_nodes(runtime, pool_specs, node_bodies, override={name: dict(spec)})
        conditions = []
        if definition.pool.policy.kubernetes_api == dra.API_DRA:
            # A dra pool on a cluster without resource.k8s.io/v1: said here, and no claim
            # template is attempted (claiming.ClaimTemplates.follow asks the same question).
            conditions.append(
                claiming.pool_condition(
                    served=await runtime.claims.served(),
                    now=runtime.projector.clock(),
                    previous=(body.get("status") or {}).get("conditions"),
                    generation=int((body.get("metadata") or {}).get("generation") or 0),
                )
            )
        await _pool_status(
            runtime, body, ready=True, nodes=_nodes_taken(runtime, name), more=conditions
        )

    @kopf.on.delete(*GPUPOOLS, registry=registry)
    async def pool_deleted(name: str, memo: Any, **kwargs: Any) -> None:
        runtime = _runtime(memo)
        pool_specs, node_bodies = kwargs["pool_specs"], kwargs["node_bodies"]
        await runtime.clusters.archive_pool(name)
        runtime.applied_pools.discard(name)
        await _apply_nodes(runtime, pool_specs, node_bodies, override={name: None})

    @kopf.on.event(*GPUNODES, registry=registry)
    async def node_seen(type: str, name: str, body: kopf.Body, memo: Any, **kwargs: Any) -> None:
        runtime = _runtime(memo)
        pool_specs = kwargs["pool_specs"]
        before = runtime.applied_nodes.get(name)
        if type == "DELETED":
            runtime.applied_nodes.pop(name, None)
            await runtime.clusters.node_gone(name)
        else:
            pools = {n: _first(pool_specs, n) for n in pool_specs}
            await _apply_node(runtime, name, kwargs["node_bodies"], pools, fallback=body)
        after = runtime.applied_nodes.get(name)
        old_pool = before.pool_id if before is not None else None
        new_pool = after.pool_id if after is not None else None
        if old_pool != new_pool:
            for pool in (old_pool, new_pool):
                if pool is not None and _first(pool_specs, pool) is not None:
                    await _pool_nodes(runtime, pool)

    @kopf.timer(*GPUPOOLS, interval=pool_status_s, registry=registry)
    async def pool_capacity_shown(name: str, body: kopf.Body, memo: Any, **_: Any) -> None:
        # What the pool holds now, for kubectl get gp: written only when it changed.
        runtime = _runtime(memo)
        found = await runtime.clusters.pool_capacity(name)
        if found is None:
            return
        nxt = found.get("nextFreeAt")
        # Free and Total of the class the pool sells (MIG instances, slots or whole GPUs), so
        # that kubectl's columns are right for every kind of pool.
        sold = found["devices"].get(CLASS_FOR_MODE.get(found["sharing"], "gpu")) or {}
        shown = {
            "nodesReady": found["nodesReady"],
            "devices": found["devices"],
            "free": sold.get("free", 0),
            "total": sold.get("total", 0),
            "nextFreeAt": statuses.rfc3339(nxt) if nxt is not None else None,
        }
        status = body.get("status") or {}
        if any(status.get(key) != value for key, value in shown.items()):
            await runtime.kube.patch(resources.GPUPOOLS, name, {"status": shown}, status=True)

    @kopf.timer(*GPUNODES, interval=30.0, idle=30.0, registry=registry)
    async def node_heartbeat_checked(name: str, body: kopf.Body, memo: Any, **kwargs: Any) -> None:
        # An agent that died without a word sends no more events: re-judge its heartbeat.
        pools = {n: _first(kwargs["pool_specs"], n) for n in kwargs["pool_specs"]}
        await _apply_node(_runtime(memo), name, kwargs["node_bodies"], pools, fallback=body)

    # --- GPUQuotas --------------------------------------------------------------------------

    @kopf.on.resume(*GPUQUOTAS, registry=registry)
    @kopf.on.create(*GPUQUOTAS, registry=registry)
    @kopf.on.update(*GPUQUOTAS, registry=registry)
    async def quota_applied(body: kopf.Body, old: Any, memo: Any, **kwargs: Any) -> None:
        runtime = _runtime(memo)
        claims = kwargs["quota_claims"]
        await _quota(runtime, body, claims)
        before = str(((old or {}).get("spec") or {}).get("tenant") or "")
        if before and before != str((body.get("spec") or {}).get("tenant") or ""):
            # Retargeted: the tenant it spoke for falls to its next claimant, or to nothing.
            gone = str((body.get("metadata") or {}).get("name"))
            await _tenant_quota(runtime, before, _claims(claims, before, without=gone))

    @kopf.on.delete(*GPUQUOTAS, registry=registry)
    async def quota_deleted(name: str, spec: kopf.Spec, memo: Any, **kwargs: Any) -> None:
        tenant = str(spec.get("tenant") or "")
        if tenant:
            left = _claims(kwargs["quota_claims"], tenant, without=name)
            await _tenant_quota(_runtime(memo), tenant, left)

    @kopf.timer(*GPUQUOTAS, interval=pool_status_s, registry=registry)
    async def quota_shown(body: kopf.Body, memo: Any, **kwargs: Any) -> None:
        # What is charged moves with every reservation: kubectl get gq shows it within seconds.
        await _quota(_runtime(memo), body, kwargs["quota_claims"])

    # --- EventSubscriptions: webhook subscriptions (``subscribing``) ----------------------------

    @kopf.on.resume(*EVENT_SUBSCRIPTIONS, registry=registry)
    @kopf.on.create(*EVENT_SUBSCRIPTIONS, registry=registry)
    @kopf.on.update(*EVENT_SUBSCRIPTIONS, registry=registry)
    async def subscription_applied(
        body: kopf.Body, namespace: str | None, memo: Any, **kwargs: Any
    ) -> None:
        labels = _first(kwargs["namespace_labels"], namespace or "")
        _retry(await _subscriptions(memo).apply(body, tenant_labels=labels))

    @kopf.on.delete(*EVENT_SUBSCRIPTIONS, registry=registry)
    async def subscription_deleted(body: kopf.Body, memo: Any, **_: Any) -> None:
        await _subscriptions(memo).delete(body)

    @kopf.timer(*EVENT_SUBSCRIPTIONS, interval=pool_status_s, registry=registry)
    async def subscription_shown(body: kopf.Body, memo: Any, **_: Any) -> None:
        # Deliveries move with every event: kubectl get esub -o yaml shows them within seconds.
        await _subscriptions(memo).show(body)

    # --- node certificates ---------------------------------------------------------------------

    if node_certificates:
        _node_certificate_handlers(registry)

    # --- Kueue AdmissionChecks ---------------------------------------------------------------

    if kueue_checks:
        _kueue_handlers(registry)

    # --- DeviceAllocations: the nodes' reports ------------------------------------------------

    @kopf.on.event(*DEVICE_ALLOCATIONS, registry=registry)
    async def allocation_reported(
        type: str, body: kopf.Body, namespace: str | None, memo: Any, **_: Any
    ) -> None:
        runtime = _runtime(memo)
        if namespace != runtime.config.namespace or type == "DELETED":
            return
        rid = await runtime.allocations.relay(body)
        if rid:
            runtime.projector.mark(rid)

    return registry


def _node_certificate_handlers(registry: kopf.OperatorRegistry) -> None:
    @kopf.on.event(*CSRS, when=_node_report_csr, registry=registry)
    async def node_certificate_requested(type: str, body: kopf.Body, memo: Any, **_: Any) -> None:
        if type != "DELETED":
            await _runtime(memo).signer.handle(body)

    @kopf.on.event(*GPUNODES, id="node_certificates", registry=registry)
    async def node_certificates_revoked(
        type: str, name: str, annotations: Mapping[str, str], memo: Any, **_: Any
    ) -> None:
        signer = _runtime(memo).signer
        if type == "DELETED":
            await signer.node_deleted(name)
        else:
            await signer.node_annotated(name, annotations)


def _kueue_handlers(registry: kopf.OperatorRegistry) -> None:
    # Hints only: the controller reads everything again on each pass (``kueuesyncing``).
    @kopf.on.event(*kueuesyncing.KOPF_WORKLOADS, registry=registry)
    @kopf.on.event(*kueuesyncing.KOPF_ADMISSION_CHECKS, registry=registry)
    def kueue_object_seen(memo: Any, **_: Any) -> None:
        checks = _runtime(memo).kueue
        if checks is not None:
            checks.wake()


def _subscriptions(memo: Any) -> subscribing.SubscriptionDoor:
    runtime = _runtime(memo)
    return subscribing.SubscriptionDoor(
        service=runtime.service,
        kube=runtime.kube,
        clock=runtime.projector.clock,
        # Checked when the operator started (an unparseable list never gets this far).
        allowlist=EgressPolicy.parse(runtime.config.event_webhook_allow),
    )


async def _labelled_reservation(
    runtime: Runtime, pod: Mapping[str, Any]
) -> podaccess.Booked | None:
    """The Reservation a pod's label names in its namespace, read from the API server, with
    its state, devices and resource name from the store (``podowners``: a status field a
    tenant can write is never believed).

    Why not from the watch: its events reach the operator a batching window late, and a
    Reservation released a moment ago must not hand out its devices. A pod that asks bcd
    devices is rare enough for one GET and a few indexed reads each.
    """
    meta = pod.get("metadata") or {}
    label = (meta.get("labels") or {}).get(names.POD_RESERVATION_LABEL)
    namespace = meta.get("namespace")
    if not podaccess.is_object_name(label) or not podaccess.is_object_name(namespace):
        return None  # mutating webhooks see a pod before its labels are validated
    body = await runtime.kube.get(resources.RESERVATIONS, str(label), namespace=str(namespace))
    if body is None:
        return None
    return await podowners.PodOwners(runtime.service).reservation(body)


async def _apply_nodes(
    runtime: Runtime,
    pool_specs: kopf.Index[str, Any],
    node_bodies: kopf.Index[str, Any],
    *,
    override: Mapping[str, Mapping[str, Any] | None],
) -> None:
    """Re-apply every GPUNode after a pool changed.

    ``override`` holds the pool just written (or ``None``: just deleted), since the index may
    not have seen that change yet.
    """
    pools: dict[str, Any] = {n: _first(pool_specs, n) for n in pool_specs}
    for name, spec in override.items():
        if spec is None:
            pools.pop(name, None)
        else:
            pools[name] = spec
    for node in list(node_bodies):  # the index changes while we await
        await _apply_node(runtime, node, node_bodies, pools)


async def _apply_node(
    runtime: Runtime,
    name: str,
    node_bodies: kopf.Index[str, Any],
    pools: Mapping[str, Any],
    *,
    fallback: Mapping[str, Any] | None = None,
) -> None:
    """Write one GPUNode's atoms for the pool that takes it.

    Three paths write a node (its events, its heartbeat timer, a pool's change), each awaiting
    the database: one at a time per node, each with the node as the index has it *after* its
    own awaits, so a path that read an older status can never write it over a newer one (a
    node left "not ready" after it became ready). ``fallback`` (the event's body) serves only
    until the index has the node.
    """
    async with runtime.node_lock(name):
        if _first(node_bodies, name) is None and fallback is None:
            return  # deleted meanwhile
        labels, _ = _node_seen(node_bodies, name, fallback)
        pool_name = definitions.pool_for(labels, {n: s for n, s in pools.items() if s})
        pool = None
        if pool_name is not None:
            # An invalid pool takes no nodes; its own status says why.
            with contextlib.suppress(ComputeError):
                pool = definitions.pool_definition(pool_name, pools[pool_name])
        if pool is not None and pool.pool_id not in runtime.applied_pools:
            # The GPUNode's event may come before the GPUPool's handler wrote the pool.
            await runtime.clusters.apply_pool(pool)
            runtime.applied_pools.add(pool.pool_id)
        labels, status = _node_seen(node_bodies, name, fallback)
        if definitions.pool_for(labels, {n: s for n, s in pools.items() if s}) != pool_name:
            return  # relabelled meanwhile: the event that says so applies it
        await _write_node(runtime, name, labels, status, pool)


def _node_seen(
    node_bodies: kopf.Index[str, Any], name: str, fallback: Mapping[str, Any] | None
) -> tuple[Mapping[str, str], Mapping[str, Any]]:
    seen = _first(node_bodies, name)
    if seen is not None:
        return seen.get("labels") or {}, seen.get("status") or {}
    body = fallback or {}
    return (body.get("metadata") or {}).get("labels") or {}, body.get("status") or {}


async def _write_node(
    runtime: Runtime,
    name: str,
    labels: Mapping[str, str],
    status: Mapping[str, Any],
    pool: PoolDefinition | None,
) -> None:
    try:
        spec = definitions.node_spec(
            name, labels=labels, status=status, pool=pool, now_s=time.time()
        )
    except ShapeError as e:
        # A node whose agent wrote a status of another shape takes no new work until it writes
        # a good one; its bookings stay.
        log.warning("GPUNode %s: %s; the node takes no new work until its agent fixes it", name, e)
        last = runtime.applied_nodes.get(name)
        if last is None:
            return
        spec = dataclasses.replace(last, ready=False, connected=False)
    if runtime.applied_nodes.get(name) != spec:
        await runtime.clusters.apply_node(spec)
        runtime.applied_nodes[name] = spec


async def _pool_nodes(runtime: Runtime, pool: str) -> None:
    """Keep a pool's ``status.nodes`` right when a node joins or leaves it."""
    nodes = _nodes_taken(runtime, pool)
    await runtime.kube.patch(resources.GPUPOOLS, pool, {"status": {"nodes": nodes}}, status=True)


def _nodes_taken(runtime: Runtime, pool: str) -> int:
    return sum(1 for spec in runtime.applied_nodes.values() if spec.pool_id == pool)


async def _pool_status(
    runtime: Runtime,
    body: Mapping[str, Any],
    *,
    ready: bool,
    nodes: int | None = None,
    reason: str = "Applied",
    message: str = "",
    more: list[dict[str, Any]] | None = None,
) -> None:
    meta = body.get("metadata") or {}
    status: dict[str, Any] = {
        "observedGeneration": meta.get("generation"),
        "conditions": [
            {
                "type": "Ready",
                "status": "True" if ready else "False",
                "reason": reason,
                "message": message,
                "lastTransitionTime": statuses.transition_time(
                    (body.get("status") or {}).get("conditions"),
                    "Ready",
                    str(ready),
                    now=runtime.projector.clock(),
                ),
                "observedGeneration": int(meta.get("generation") or 0),
            },
            *(more or ()),
        ],
    }
    if nodes is not None:
        status["nodes"] = nodes
    await runtime.kube.patch(resources.GPUPOOLS, meta["name"], {"status": status}, status=True)


def _claims(index: Any, tenant: str, *, without: str | None = None) -> list[quotas.Claim]:
    return [c for c in index.get(tenant, ()) if c.name != without]


async def _tenant_quota(runtime: Runtime, tenant: str, claims: list[quotas.Claim]) -> None:
    """The tenant's rows as its speaker says (limits of 0 when none is left)."""
    speaker = quotas.speaker(claims)
    wanted = dict(quotas.parse(speaker.spec).limits) if speaker is not None else {}
    if quotas.differs(wanted, await runtime.clusters.quotas_of(tenant)):
        await runtime.clusters.apply_quota(tenant, wanted)


async def _quota(runtime: Runtime, body: Mapping[str, Any], index: Any) -> None:
    """Apply one GPUQuota if it speaks for its tenant, and show the outcome in its status."""
    meta = body.get("metadata") or {}
    generation = int(meta.get("generation") or 0)
    own = quotas.claim(body)
    rows: list[dict[str, Any]] = []
    try:
        parsed = quotas.parse(own.spec)
    except ComputeError as e:
        ready, reason, message = False, e.code.value, e.message
    else:
        # The index may not have this object's latest event yet: count it as it is now.
        claims = [*_claims(index, parsed.tenant, without=own.name), own]
        speaker = quotas.speaker(claims)
        if speaker is not None and speaker.name == own.name:
            await _tenant_quota(runtime, parsed.tenant, claims)
            rows = await runtime.clusters.quotas_of(parsed.tenant)
            ready, reason = True, quotas.APPLIED
            message = f"tenant {parsed.tenant}'s quota"
        else:
            ready, reason = False, quotas.CONFLICT
            other = speaker.name if speaker is not None else "another GPUQuota"
            message = (
                f"GPUQuota {other} already sets tenant {parsed.tenant}'s quota (the older one"
                " applies); delete one of them"
            )
    shown = quotas.status(
        rows,
        generation=generation,
        ready=ready,
        reason=reason,
        message=message,
        previous=body.get("status"),
        now=runtime.projector.clock(),
    )
    status = body.get("status") or {}
    if any(status.get(k) != v for k, v in shown.items()):
        await runtime.kube.patch(
            resources.GPUQUOTAS, str(meta["name"]), {"status": shown}, status=True
        )
