"""The seven reservation operations, in the guide's admission sequence.

``create``: validate → pre-check the caller's tenant (before any read) → transaction 1 (draft)
→ exactly one policy decision, outside any transaction → budget check when asked for →
transaction 2 (quota, placement, lifecycle, event, audit) → optional wait. ``extend`` follows the
same sequence against the existing reservation. Decisions are audited by the store in the
transaction that records their outcome. Claims and extend holds name this process's holder
(``store/holding.py``), so they end with the process; with the built-in budget, transaction 2
checks the budget again under the tenant's budget lock, so concurrent creates cannot overrun it.
A refusal a ``@confirm`` policy holds, for an agent acting for a person, is not final: the person
is asked (``store/confirmations.py``) and the agent's retry with the same key finds the answer.

Handlers here are a few lines around store calls; nothing here speaks SQL.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any, TypeVar, cast

from bettercompute import supervising
from bettercompute.core import answers, errors, ids, pools, ports, requests, states
from bettercompute.core import attestation as attestation_
from bettercompute.core import timelines as core_timelines
from bettercompute.core import usage as core_usage
from bettercompute.core.egress import EgressPolicy
from bettercompute.core.errors import ComputeError, ErrorCode, StoreError
from bettercompute.service import batching, webhooks
from bettercompute.service import usage as usage_reports
from bettercompute.store import (
    admission,
    budgets,
    capacity,
    confirmations,
    extending,
    holding,
    outbox,
    previewing,
    queries,
    quotas,
    releasing,
    reports,
    searching,
    stats,
    subscriptions,
    timelines,
    views,
)
from bettercompute.store import pools as store_pools
from bettercompute.store.database import Database
from bettercompute.store.stats import Stats as Stats

log = logging.getLogger(__name__)

#: How long a request waits for a concurrent request with the same key to finish admitting.
SAME_KEY_WAIT_S = 35.0
RESERVATION = "compute-reservation"
#: The shortest start of a reservation id taken for the whole id ("rsv_" and 4 more).
SHORT_ID_MIN = 8
_WithId = TypeVar(
    "_WithId",
    requests.GetInput,
    requests.ReleaseInput,
    requests.CancelInput,
    requests.RenewInput,
    requests.ExtendInput,
)

#: Stands in for the idempotency key a preview may leave out; a preview stores nothing.
PREVIEW_KEY = "capacity-preview"
#: How long a failed request waits for its claim or hold to be given back before it answers:
#: a moment (giving back takes milliseconds), never so long that a 503 comes later than 3 s.
GIVE_BACK_WAIT_S = 0.25
#: How long giving back is retried in the background: the longest age limit (an extend hold's
#: 60 s), after which the claim or hold is free anyway.
GIVE_BACK_FOR_S = 60.0
#: The longest a person is given to confirm what an agent asked (the guide's clamp).
CONFIRMATION_DEADLINE_MAX = dt.timedelta(minutes=30)


#: Events of one tenant, oldest first (``store.outbox.tenant_events_after``'s rows).
EventBatch = list[dict[str, Any]]


class ReservationService:
    """The reservation API, for one database, one policy engine and one budget check."""

    def __init__(
        self,
        *,
        db: Database,
        policy: ports.PolicyEngine,
        budget: ports.BudgetCheck,
        root_tenant_id: str | None = None,
        holder: holding.Holder | None = None,
        attestation: attestation_.Attestation | None = None,
        confirmation_deadline: dt.timedelta = CONFIRMATION_DEADLINE_MAX,
        webhook_allowlist: EgressPolicy | None = None,
    ):
        self.db = db
        # Where event webhooks may go beyond public addresses (the operator's allowlist, as
        # the deliveries use it): a subscription's URL is checked against it when made
        # (``webhooks.check_url``). ``None``: not known here, so only what no allowlist allows.
        self.webhook_allowlist = webhook_allowlist
        if confirmation_deadline <= dt.timedelta(0):
            raise ValueError("confirmation_deadline must be positive")
        # How long a person has to confirm what an agent asked: configurable lower, never more.
        self.confirmation_deadline = min(confirmation_deadline, CONFIRMATION_DEADLINE_MAX)
        self.policy = policy
        self.budget = budget
        self.root_tenant_id = root_tenant_id
        # Attested bindings: with it, a bound report counts only when the node's certificate
        # and signature check out (core.attestation). The operator and ``dev`` always give it;
        # only low-level tests of the lifecycle run without.
        self.attestation = attestation
        # The session that owns this process's claims and extend holds; one per process and
        # database unless given (a test playing a second replica gives its own).
        self.holder = holder or holding.holder_of(db)
        # Concurrent creates with one key in this process wait on the first instead of polling
        # the database; the claim in the idempotency row does the same across replicas.
        self._in_flight: dict[str, asyncio.Event] = {}
        self._observers: list[ports.AdmissionObserver] = []
        # Claims and holds whose giving back the database did not take yet (see _give_back).
        self._giving_back: set[asyncio.Task[None]] = set()
        # Wake-ups shared with this process's pool-lease placer loop (service/batching.py): a
        # queued create wakes it, a committed batch wakes the requests waiting on its pool.
        self.signals = batching.Signals()

    def add_observer(self, observer: ports.AdmissionObserver) -> None:
        """Report decision and placement latencies to ``observer`` too (metrics)."""
        self._observers.append(observer)

    async def _decide(self, request: ports.DecisionRequest) -> ports.Decision:
        """Every policy decision goes through here, so each one is timed and observed."""
        started = time.perf_counter()
        decision = await self.policy.decide(request)
        seconds = time.perf_counter() - started
        for observer in self._observers:
            observer.decided(action=request.action, allowed=decision.allowed, seconds=seconds)
        return decision

    async def close(self) -> None:
        """Give back this process's holder session: claims still held end now."""
        await supervising.cancel(self._giving_back)
        await self.holder.close()

    async def _give_back(self, what: str, give_back: Callable[[], Awaitable[None]]) -> None:
        """Give back a claim or an extend hold after a request that took it failed.

        Why not just once: the request may have failed because the database is away (frozen,
        restarting), and then giving back fails too, while this process's holder session lives
        on, so the claim would block the client's retry until its age limit (30 s, holds 60 s).
        So it is tried at once, waited for a moment, and retried in the background until the
        database takes it or the age limit has freed it anyway. Survives the request being
        cancelled; never raises.
        """
        task = asyncio.create_task(self._keep_giving_back(what, give_back), name=what)
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)
        # Not asyncio.shield: a cancelled request stops waiting here, the task goes on.
        await asyncio.wait({task}, timeout=GIVE_BACK_WAIT_S)

    async def _keep_giving_back(self, what: str, give_back: Callable[[], Awaitable[None]]) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + GIVE_BACK_FOR_S
        backoff = supervising.Backoff(first_s=0.2, max_s=2.0)
        while True:
            try:
                await give_back()
                return
            except StoreError as e:
                if loop.time() > give_up:
                    log.warning(
                        "%s: the database did not take it; its age limit frees it: %s", what, e
                    )
                    return
                await backoff.wait()

    @classmethod
    async def start(
        cls,
        *,
        db: Database,
        policy: ports.PolicyEngine,
        budget: ports.BudgetCheck,
        attestation: attestation_.Attestation | None = None,
        webhook_allowlist: EgressPolicy | None = None,
    ) -> ReservationService:
        """A service for ``db``, with the root tenant as the database names it."""
        return cls(
            db=db,
            policy=policy,
            budget=budget,
            root_tenant_id=await queries.root_tenant(db),
            attestation=attestation,
            webhook_allowlist=webhook_allowlist,
        )

    # --- pre-check -------------------------------------------------------------------------

    def _precheck(self, caller: ports.Caller, tenant_id: str) -> None:
        """The caller's tenant must be the input tenant or the root tenant; answered before the
        database is read, the same whether or not anything exists."""
        if caller.tenant_id != tenant_id and (
            self.root_tenant_id is None or caller.tenant_id != self.root_tenant_id
        ):
            raise errors.access_denied(f"caller is not a member of tenant {tenant_id}")

    # --- create ----------------------------------------------------------------------------

    async def create(
        self,
        caller: ports.Caller,
        data: Mapping[str, Any],
        *,
        aborted: asyncio.Event | None = None,
    ) -> answers.Reservation:
        """``reservations.create``; a ``wait`` also ends when ``aborted`` is set (the HTTP
        door sets it when the client goes away), answering the last read without another."""
        value = requests.parse(requests.CreateInput, data)
        self._precheck(caller, value.tenantId)
        if value.binding == "instance":
            raise ComputeError(
                ErrorCode.UNSUPPORTED,
                "binding 'instance' is not supported: VPS instances are created with "
                "instances.create and book through the capacity port",
                {"field": "binding"},
            )
        request = requests.normalized_request(value)
        request_hash = requests.request_hash(value.tenantId, request)
        rid = ids.draft_id(value.tenantId, caller.identity_id, value.idempotencyKey)
        view = await self._admit_single_flight(caller, value, request, request_hash, rid)
        if value.wait is not None:
            view = await self._wait(view, timeout_ms=value.wait.timeoutMs, aborted=aborted)
        return view

    async def _admit_single_flight(
        self,
        caller: ports.Caller,
        value: requests.CreateInput,
        request: dict[str, Any],
        request_hash: str,
        rid: str,
    ) -> answers.Reservation:
        while (event := self._in_flight.get(rid)) is not None:
            await event.wait()
        event = self._in_flight[rid] = asyncio.Event()
        try:
            return await self._admit(caller, value, request, request_hash, rid)
        finally:
            del self._in_flight[rid]
            event.set()

    async def _admit(
        self,
        caller: ports.Caller,
        value: requests.CreateInput,
        request: dict[str, Any],
        request_hash: str,
        rid: str,
    ) -> answers.Reservation:
        tenant = value.tenantId
        idem = ids.idempotency_id("create", tenant, caller.identity_id, value.idempotencyKey)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + SAME_KEY_WAIT_S
        delay = 0.01
        while True:
            step = await admission.write_draft(
                self.db,
                reservation_id=rid,
                idempotency_id=idem,
                identity_id=caller.identity_id,
                tenant_id=tenant,
                key=value.idempotencyKey,
                request=request,
                request_hash=request_hash,
                duration_ms=value.duration_ms,
                claim=ids.new_id("claim"),
                holder=await self.holder.current(),
            )
            if isinstance(step, admission.Existing):
                stored = await self._view(rid)
                if stored["state"] == states.State.EXPIRED:
                    # Its confirmation's deadline passed (the reconciler saw it first): a late
                    # retry fails as the one that finds the deadline passed does.
                    found = await confirmations.find(
                        self.db, reservation_id=rid, action=ports.CREATE
                    )
                    raise _expired(rid, None if found is None else found.id)
                return stored
            if isinstance(step, admission.Draft):
                break
            # Busy: another replica is admitting this key right now.
            if loop.time() > give_up:
                raise ComputeError(
                    ErrorCode.CONFLICT,
                    "a request with this idempotency key is still in flight",
                    {"reservationId": rid, "reason": "create-in-flight", "retryAfterSeconds": 5},
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)
        draft = step
        decision = await self._decide(
            ports.DecisionRequest(
                principal=caller,
                action=ports.CREATE,
                resource_type=RESERVATION,
                resource_id=rid,
                tenant_id=tenant,
                owner_identity_id=caller.identity_id,
                attributes=draft.attributes,
                pool=_relation(draft.pool),
            )
        )
        context: dict[str, Any] = {
            "decision": "allow" if decision.allowed else "deny",
            "reasons": list(decision.reasons),
            "errors": list(decision.errors),
            "attributes": draft.attributes,
            "requestHash": request_hash,
        }
        if (
            not decision.allowed
            and decision.held_for_confirmation
            and caller.on_behalf_of is not None
        ):
            # Held for the person the agent acts for: returns only once they approved.
            approval = await self._confirmed(caller, draft, tenant, request_hash, context)
            context = {
                **context,
                "decision": "allow",
                "confirmationId": approval.id,
                "approvedBy": approval.decided_by,
            }
        elif not decision.allowed:
            await admission.deny(
                self.db, draft=draft, actor=caller.identity_id, tenant_id=tenant, context=context
            )
            raise errors.access_denied(
                "the request was denied by policy",
                reservationId=rid,
                reasons=list(decision.reasons),
            )
        try:
            budget_hours = None
            if draft.pool.wants_budget_check:
                budget_hours = await self._check_budget(
                    caller, tenant, draft.attributes, draft.pool
                )
            started = time.perf_counter()
            view = await admission.commit(
                self.db,
                draft=draft,
                duration_ms=value.duration_ms,
                actor=caller.identity_id,
                tenant_id=tenant,
                context=context,
                budget_hours=budget_hours,
            )
            # Transaction 2 as a whole: quota, snapshot, the placer and the writes.
            seconds = time.perf_counter() - started
            for observer in self._observers:
                observer.placed(outcome=view["state"], seconds=seconds)
            if draft.pool.pool_lease:
                self.signals.queued(draft.pool.id)
            return _reservation(view)
        except BaseException as e:
            # The draft stays: the same key is decided again on retry (quota, budget, a
            # database that was away, a cancelled request).
            outcome, audited = "abandoned", context
            if isinstance(e, ComputeError):
                outcome, audited = e.code.value, {**context, "error": e.to_dict()}
            await self._give_back(
                f"the claim of {rid}",
                functools.partial(
                    admission.abandon,
                    self.db,
                    draft=draft,
                    actor=caller.identity_id,
                    tenant_id=tenant,
                    outcome=outcome,
                    context=audited,
                ),
            )
            raise

    async def _confirmed(
        self,
        caller: ports.Caller,
        draft: admission.Draft,
        tenant: str,
        request_hash: str,
        context: Mapping[str, Any],
    ) -> confirmations.Found:
        """A refusal the person may lift, for an agent acting for them (we hold the claim).

        Returns the approval when the person gave it before its deadline. Otherwise raises,
        the claim given back: ``CONFIRMATION_REQUIRED`` with a new confirmation (the draft
        awaiting it) or the same one still pending; ``ACCESS_DENIED`` when the person denied
        it (the draft denied); ``INVALID_STATE`` past the deadline (the reservation expired).
        """
        rid = draft.reservation_id
        assert caller.on_behalf_of is not None
        give_back = functools.partial(
            admission.abandon,
            self.db,
            draft=draft,
            actor=caller.identity_id,
            tenant_id=tenant,
            outcome=ErrorCode.CONFIRMATION_REQUIRED.value,
        )
        try:
            found = await confirmations.find(self.db, reservation_id=rid, action=ports.CREATE)
            if found is None:
                opened = await confirmations.open_(
                    self.db,
                    tenant_id=tenant,
                    reservation_id=rid,
                    idempotency_id=draft.idempotency_id,
                    claim=draft.claim,
                    action=ports.CREATE,
                    person_id=caller.on_behalf_of,
                    agent_id=caller.identity_id,
                    request_hash=request_hash,
                    deadline=self.confirmation_deadline,
                    context=context,
                )
                raise _confirmation_required(opened, rid, caller.on_behalf_of)
        except ComputeError:
            raise  # opened (the claim given back with it), or the claim was taken over
        except BaseException:
            await self._give_back(
                f"the claim of {rid}", functools.partial(give_back, context=context)
            )
            raise
        audited = {**context, "confirmationId": found.id}
        if found.request_hash != request_hash:
            # Cannot happen while the key's request hash is fixed; never let an approval cover
            # another request if it ever could.
            await self._give_back(
                f"the claim of {rid}", functools.partial(give_back, context=audited)
            )
            raise ComputeError(
                ErrorCode.CONFLICT,
                "the confirmation was asked for a different request",
                {"reservationId": rid, "confirmationId": found.id},
            )
        if found.state == "denied":
            await admission.deny(
                self.db,
                draft=draft,
                actor=caller.identity_id,
                tenant_id=tenant,
                context={**audited, "deniedBy": found.decided_by},
            )
            raise errors.access_denied(
                f"{found.decided_by} denied this request",
                reservationId=rid,
                confirmationId=found.id,
            )
        if found.past_deadline or found.state == "expired":
            await confirmations.expire_late(
                self.db, reservation_id=rid, idempotency_id=draft.idempotency_id, claim=draft.claim
            )
            raise _expired(rid, found.id)
        if found.state == "pending":
            await self._give_back(
                f"the claim of {rid}", functools.partial(give_back, context=audited)
            )
            raise _confirmation_required(found, rid, caller.on_behalf_of)
        return found

    async def _check_budget(
        self, caller: ports.Caller, tenant: str, attrs: Mapping[str, Any], pool: pools.PoolInfo
    ) -> float | None:
        """``billing.check``, outside any transaction; raises ``SPEND_LIMIT_REACHED``.

        Returns the GPU-hours transaction 2 must check again under the tenant's budget lock
        (the built-in ledger), or ``None`` when the budget lives elsewhere.
        """
        gpu_hours = core_usage.gpu_hours(
            attrs, sharing_mode=pool.sharing_mode, replicas=pool.replicas
        )
        verdict = await self.budget.check(caller=caller, tenant_id=tenant, gpu_hours=gpu_hours)
        if not verdict.allowed:
            raise budgets.spend_limit_reached(verdict)
        return gpu_hours if self.budget.ledger_in_store else None

    async def _wait(
        self,
        view: answers.Reservation,
        *,
        timeout_ms: int,
        aborted: asyncio.Event | None = None,
    ) -> answers.Reservation:
        """Re-read until the operation stops running, backing off 50 ms → 1 s; a timeout
        returns the last read (not an error), and so does the request being aborted
        (``aborted`` set): from then on nothing is read, so an abandoned wait costs the
        database nothing.

        A committed batch of the reservation's pool (``Signals.placed``) cuts a pause short, so
        a queued reservation is answered as soon as its batch decided it: a batch of this
        process hands its view over, one of another replica that names it sends it to read. A
        batch that did not take it costs no read; the back-off's reads go on regardless.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        delay = 0.05
        read_at = loop.time() + delay
        pool, rid = view["poolId"], view["id"]
        with self.signals.watching(rid) as handed:
            while view["operation"]["state"] == "running" and loop.time() < deadline:
                unnamed = self.signals.unnamed_batches(pool)
                next_read = min(read_at, deadline)
                await self._pause(pool, within_s=next_read - loop.time(), aborted=aborted)
                if aborted is not None and aborted.is_set():
                    break
                given = handed()
                if given is not None:
                    view = _reservation(given)
                    continue
                if (
                    loop.time() < next_read
                    and not self.signals.decided_elsewhere(rid)
                    and self.signals.unnamed_batches(pool) == unnamed
                ):
                    continue  # a batch that did not take it: nothing new to read
                view = await self._view(rid)
                delay = min(delay * 2, 1.0)
                read_at = loop.time() + delay
        return view

    async def _pause(self, pool: str, *, within_s: float, aborted: asyncio.Event | None) -> None:
        """Until the pool's next batch commits, ``within_s`` passes, or ``aborted`` is set."""
        if aborted is None:
            await self.signals.wait_placed(pool, within_s=within_s)
            return
        if aborted.is_set():
            return
        placed = asyncio.ensure_future(self.signals.wait_placed(pool, within_s=within_s))
        gone = asyncio.ensure_future(aborted.wait())
        try:
            await asyncio.wait({placed, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            placed.cancel()
            gone.cancel()

    async def _view(self, rid: str) -> answers.Reservation:
        view = await views.get(self.db, rid)
        if view is None:
            raise errors.not_found()
        return _reservation(view)

    # --- reads -----------------------------------------------------------------------------

    async def _visible(
        self, caller: ports.Caller, tenant_id: str, rid: str, action: str
    ) -> answers.AuthorizationRow:
        """The authz row of a reservation the caller may act on. ``NOT_FOUND`` for drafts, for
        another tenant's and for what policy hides: one answer, so nothing leaks."""
        row = await _authorization_row(self.db, rid)
        if row is None or row["tenant_id"] != tenant_id or row["state"] == states.State.DRAFT:
            raise errors.not_found()
        decision = await self._decide(_on_reservation(caller, action, tenant_id, rid, row))
        if not decision.allowed:
            if action == ports.READ:
                raise errors.not_found()
            # It can be read but not changed by this caller: say so, it is no secret it exists.
            if await self._may(caller, tenant_id, rid, row, ports.READ):
                raise errors.access_denied(
                    f"not allowed to {action.rsplit(':', 1)[-1]} this reservation",
                    reservationId=rid,
                )
            raise errors.not_found()
        return row

    async def _may(
        self,
        caller: ports.Caller,
        tenant_id: str,
        rid: str,
        row: answers.AuthorizationRow,
        action: str,
    ) -> bool:
        decision = await self._decide(_on_reservation(caller, action, tenant_id, rid, row))
        return decision.allowed

    async def _full_id(self, caller: ports.Caller, value: _WithId) -> _WithId:
        """``value`` naming its reservation by its full id: a unique start (at least
        ``SHORT_ID_MIN`` characters) of one of the caller's own reservations is read as that
        id; a start shared by several is ``INVALID_INPUT`` listing them; anything else stays
        as given (``NOT_FOUND`` later, as before)."""
        given = value.reservationId
        if len(given) < SHORT_ID_MIN:
            return value
        found = await queries.ids_starting(
            self.db, tenant_id=value.tenantId, owner=caller.identity_id, text=given
        )
        if not found or found[0] == given:
            return value
        if len(found) > 1:
            shown = ", ".join(found[:5]) + (", …" if len(found) > 5 else "")
            raise errors.invalid_input(
                "reservationId", f"'{given}' starts several reservations: {shown}; give more of it"
            )
        return value.model_copy(update={"reservationId": found[0]})

    async def get(self, caller: ports.Caller, data: Mapping[str, Any]) -> answers.Reservation:
        value = requests.parse(requests.GetInput, data)
        self._precheck(caller, value.tenantId)
        value = await self._full_id(caller, value)
        await self._visible(caller, value.tenantId, value.reservationId, ports.READ)
        return await self._view(value.reservationId)

    async def list(self, caller: ports.Caller, data: Mapping[str, Any]) -> answers.ReservationList:
        value = requests.parse(requests.ListInput, data)
        self._precheck(caller, value.tenantId)
        if value.state is not None and value.state not in {s.value for s in states.State}:
            raise errors.invalid_input("state", f"unknown state {value.state!r}")
        await self.read_tenant(caller, value.tenantId, what="list reservations of")
        items, cursor = await queries.list_reservations(
            self.db,
            tenant_id=value.tenantId,
            owner_identity_id=caller.identity_id if value.scope == "mine" else None,
            state=value.state,
            pool_id=value.poolId,
            limit=value.limit,
            cursor=value.cursor,
        )
        return {"items": [_reservation(item) for item in items], "nextCursor": cursor}

    # --- changes ---------------------------------------------------------------------------

    async def release(self, caller: ports.Caller, data: Mapping[str, Any]) -> answers.Reservation:
        value = requests.parse(requests.ReleaseInput, data)
        self._precheck(caller, value.tenantId)
        value = await self._full_id(caller, value)
        await self._visible(caller, value.tenantId, value.reservationId, ports.RELEASE)
        await releasing.release(
            self.db, reservation_id=value.reservationId, actor=caller.identity_id
        )
        return await self._view(value.reservationId)

    async def cancel(self, caller: ports.Caller, data: Mapping[str, Any]) -> answers.Reservation:
        value = requests.parse(requests.CancelInput, data)
        self._precheck(caller, value.tenantId)
        value = await self._full_id(caller, value)
        await self._visible(caller, value.tenantId, value.reservationId, ports.RELEASE)
        await releasing.cancel(
            self.db, reservation_id=value.reservationId, actor=caller.identity_id
        )
        return await self._view(value.reservationId)

    async def renew(self, caller: ports.Caller, data: Mapping[str, Any]) -> answers.Reservation:
        value = requests.parse(requests.RenewInput, data)
        self._precheck(caller, value.tenantId)
        value = await self._full_id(caller, value)
        await self._visible(caller, value.tenantId, value.reservationId, ports.EXTEND)
        await releasing.renew(self.db, reservation_id=value.reservationId)
        return await self._view(value.reservationId)

    async def extend(self, caller: ports.Caller, data: Mapping[str, Any]) -> answers.ExtendResult:
        """Admitted like a create: the pending change (total ``durationHours``) is decided on.

        Answers ``{reservation, extended}`` and, when another booking starts first,
        ``availableUntil``. An ``until`` already reached answers ``extended: false`` without a
        decision. ``extend`` does not wait.
        """
        value = requests.parse(requests.ExtendInput, data)
        self._precheck(caller, value.tenantId)
        value = await self._full_id(caller, value)
        rid = value.reservationId
        row = await _authorization_row(self.db, rid)
        if row is None or row["tenant_id"] != value.tenantId or row["state"] == "draft":
            raise errors.not_found()
        if not await self._may(caller, value.tenantId, rid, row, ports.READ):
            raise errors.not_found()
        key = extending.ExtendKey(
            idempotency_id=ids.idempotency_id(
                "extend", value.tenantId, caller.identity_id, value.idempotencyKey
            ),
            tenant_id=value.tenantId,
            identity_id=caller.identity_id,
            key=value.idempotencyKey,
            request_hash=requests.extend_hash(value),
        )
        replay = await extending.extend_replay(
            self.db, idempotency_id=key.idempotency_id, request_hash=key.request_hash
        )
        if replay is not None:
            return {"reservation": await self._view(rid), "extended": replay.extended}
        hold = ids.new_id("hold")  # server-minted: callers cannot set it
        begun = await extending.extend_begin(
            self.db,
            reservation_id=rid,
            until_ms=value.until,
            by_ms=value.by if isinstance(value.by, int) else None,
            hold=hold,
            holder=await self.holder.current(),
        )
        if isinstance(begun, extending.AlreadyReached):
            return {"reservation": await self._view(rid), "extended": False}
        try:
            decision = await self._decide(
                _on_reservation(
                    caller, ports.EXTEND, value.tenantId, rid, row, attributes=begun.attributes
                )
            )
            if not decision.allowed:
                raise errors.access_denied(
                    "the extension was denied by policy",
                    reservationId=rid,
                    reasons=list(decision.reasons),
                )
            offer = await admission_pool(self.db, row["pool_id"], value.tenantId)
            budget_hours = None
            # Only 'drain' refuses an extend on a spent budget; 'stop-new' stops only creates.
            if offer is not None and offer.checks_budget_on_extend:
                extra = dict(begun.attributes)
                old_hours = float(row["attributes"].get("durationHours", 0))
                extra["durationHours"] = max(0.0, begun.attributes["durationHours"] - old_hours)
                budget_hours = await self._check_budget(caller, value.tenantId, extra, offer)
            outcome = await extending.extend_commit(
                self.db,
                reservation_id=rid,
                start=begun,
                actor=caller.identity_id,
                key=key,
                budget_hours=budget_hours,
            )
        except BaseException:
            # A refusal or an abandon clears the pending change (only when the hold is ours),
            # so a refused lifetime never reaches later decisions on the reservation.
            await self._give_back(
                f"the extend hold of {rid}",
                functools.partial(extending.extend_clear, self.db, reservation_id=rid, hold=hold),
            )
            raise
        answer: answers.ExtendResult = {
            "reservation": await self._view(rid),
            "extended": outcome.extended,
        }
        if outcome.available_until_ms is not None:
            answer["availableUntil"] = outcome.available_until_ms
        return answer

    # --- capacity preview ------------------------------------------------------------------

    async def preview(self, caller: ports.Caller, data: Mapping[str, Any]) -> dict[str, Any]:
        """``capacity.preview``: whether a create would fit and where, booking nothing.

        Takes the create input (``idempotencyKey`` optional: nothing is stored, so nothing is
        keyed). The tenant pre-check, the pool's visibility and its class and binding rules are
        create's; then the placer runs on a snapshot of the requested window. No policy
        decision and no quota: the guide's "no booking, no decision".
        """
        body: Any = data
        if isinstance(data, Mapping) and "idempotencyKey" not in data:
            body = {**data, "idempotencyKey": PREVIEW_KEY}
        value = requests.parse(requests.CreateInput, body)
        self._precheck(caller, value.tenantId)
        _no_instance(value)
        return await previewing.preview(
            self.db,
            tenant_id=value.tenantId,
            request=requests.normalized_request(value),
            duration_ms=value.duration_ms,
        )

    async def whoami(self, caller: ports.Caller, data: Mapping[str, Any]) -> dict[str, Any]:
        """``whoami``: the caller as authenticated: identity, tenant, kind and groups (so a
        client can take its tenant from its token)."""
        requests.parse(requests.WhoamiInput, data)
        return {
            "identityId": caller.identity_id,
            "tenantId": caller.tenant_id,
            "kind": caller.kind,
            "groups": list(caller.groups),
        }

    async def pools(self, caller: ports.Caller, data: Mapping[str, Any]) -> dict[str, Any]:
        """``pools.list``: the tenant's pools (owned or offered) and what they hold right now."""
        value = requests.parse(requests.PoolsInput, data)
        self._precheck(caller, value.tenantId)
        return {"items": await capacity.pools(self.db, tenant_id=value.tenantId)}

    async def timeline(self, caller: ports.Caller, data: Mapping[str, Any]) -> dict[str, Any]:
        """``pools.timeline``: the pool's bookings in a window, the caller's tenant's by name
        and everyone else's as ``busy`` (members of the root tenant see every one by name);
        the pool as ``pools.list`` shows it to the tenant, else ``NOT_FOUND``."""
        value = requests.parse(core_timelines.TimelineInput, data)
        tenant_id = value.tenantId or caller.tenant_id
        await self.read_tenant(caller, tenant_id, what="read the pool timeline of")
        everyone = self.root_tenant_id is not None and caller.tenant_id == self.root_tenant_id
        answer = await timelines.read(self.db, value, tenant_id=tenant_id, everyone=everyone)
        if answer is None:
            raise errors.not_found("pool")
        return answer

    async def history(self, caller: ports.Caller, data: Mapping[str, Any]) -> dict[str, Any]:
        """``reservations.history``: the reservation's transitions and events, read as
        ``get`` reads it (the same ``NOT_FOUND`` for what the caller may not see)."""
        value = requests.parse(core_timelines.HistoryInput, data)
        get = requests.GetInput(tenantId=value.tenantId or caller.tenant_id, reservationId=value.id)
        self._precheck(caller, get.tenantId)
        get = await self._full_id(caller, get)
        await self._visible(caller, get.tenantId, get.reservationId, ports.READ)
        transitions, events = await timelines.history(self.db, reservation_id=get.reservationId)
        return core_timelines.history(transitions, events)

    async def read_tenant(self, caller: ports.Caller, tenant_id: str, *, what: str) -> None:
        """The pre-check, then the policy's ``read`` on the tenant (``reservations.list``,
        ``usage.report``); ``ACCESS_DENIED`` saying what was not allowed."""
        self._precheck(caller, tenant_id)
        decision = await self._decide(
            ports.DecisionRequest(
                principal=caller,
                action=ports.READ,
                resource_type="tenant",
                resource_id=tenant_id,
                tenant_id=tenant_id,
            )
        )
        if not decision.allowed:
            raise errors.access_denied(f"not allowed to {what} {tenant_id}")

    async def usage_report(
        self, caller: ports.Caller, data: Mapping[str, Any]
    ) -> answers.UsageReport:
        """``usage.report``: the tenant's billed usage (``service.usage``), read as
        ``read_tenant`` allows."""
        return await usage_reports.report(self.db, caller, data, may_read=self.read_tenant)

    async def quotas(self, caller: ports.Caller, data: Mapping[str, Any]) -> dict[str, Any]:
        """``quotas.get``: the tenant's quota, per resource its limit and what is charged now
        (a resource without a row grants nothing)."""
        value = requests.parse(requests.QuotasInput, data)
        self._precheck(caller, value.tenantId)
        return {
            "tenantId": value.tenantId,
            "quotas": await quotas.of_tenant(self.db, tenant_id=value.tenantId),
        }

    async def latest_event_id(self) -> int:
        """The newest event's id (0 when none): where a watch "from now" starts."""
        return await outbox.latest_id(self.db)

    async def watch_events(
        self,
        caller: ports.Caller,
        *,
        tenant_id: str,
        after: int | None,
        poll_s: float = 0.5,
    ) -> AsyncGenerator[EventBatch]:
        """The tenant's events as they are committed, in batches, oldest first, forever:
        from the one after ``after`` (an event id: a resumed watch), else from now. A batch may
        be empty (nothing new within ``poll_s``), so a caller is never held longer than that.

        Checks the caller before anything is read. Polls the outbox every ``poll_s`` while
        nothing is new (an indexed read of the newest ids: cheap next to a held connection)."""
        self._precheck(caller, tenant_id)
        last = await outbox.latest_id(self.db) if after is None else after
        while True:
            batch = await outbox.tenant_events_after(self.db, tenant_id=tenant_id, after_id=last)
            if batch:
                last = batch[-1]["id"]
            yield batch
            if not batch:
                await asyncio.sleep(poll_s)

    # --- event subscriptions (webhooks; delivered by service.webhooks) ----------------------

    async def subscriptions_create(
        self, caller: ports.Caller, data: Mapping[str, Any]
    ) -> answers.Subscription:
        """``events.subscriptions.create``: a new subscription, answered with its secret (32
        random bytes as hex), which is never shown again. A URL no delivery could ever reach
        (its host an internal address the allowlist does not take: ``webhooks.check_url``) is
        ``INVALID_INPUT`` on ``url``."""
        value = requests.parse(requests.SubscriptionCreateInput, data)
        self._precheck(caller, value.tenantId)
        webhooks.check_url(value.url, self.webhook_allowlist)
        made = await subscriptions.create(
            self.db,
            tenant_id=value.tenantId,
            url=value.url,
            event_types=value.eventTypes,
            created_by=caller.identity_id,
            secret=secrets.token_hex(32),
        )
        if made is None:
            raise errors.not_found("tenant")
        return made

    async def subscriptions_list(
        self, caller: ports.Caller, data: Mapping[str, Any]
    ) -> answers.SubscriptionList:
        """``events.subscriptions.list``: the tenant's active subscriptions, no secrets."""
        value = requests.parse(requests.SubscriptionListInput, data)
        self._precheck(caller, value.tenantId)
        return {"items": await subscriptions.list_active(self.db, tenant_id=value.tenantId)}

    async def subscriptions_delete(
        self, caller: ports.Caller, data: Mapping[str, Any]
    ) -> answers.Subscription:
        """``events.subscriptions.delete``: disabled, its pending deliveries dead, its log
        kept; ``NOT_FOUND`` for another tenant's or one already deleted."""
        value = requests.parse(requests.SubscriptionDeleteInput, data)
        self._precheck(caller, value.tenantId)
        gone = await subscriptions.disable(
            self.db, tenant_id=value.tenantId, subscription_id=value.subscriptionId
        )
        if gone is None:
            raise errors.not_found("subscription")
        return gone

    async def deliveries_list(
        self, caller: ports.Caller, data: Mapping[str, Any]
    ) -> answers.DeliveryList:
        """``events.deliveries.list``: an active subscription's delivery log, newest first."""
        value = requests.parse(requests.DeliveryListInput, data)
        self._precheck(caller, value.tenantId)
        if not await subscriptions.is_active(
            self.db, tenant_id=value.tenantId, subscription_id=value.subscriptionId
        ):
            raise errors.not_found("subscription")
        items = await subscriptions.deliveries(
            self.db, subscription_id=value.subscriptionId, state=value.state, limit=value.limit
        )
        return {"items": items}

    # --- delegated confirmation -----------------------------------------------------------

    async def confirmations_list(
        self, caller: ports.Caller, data: Mapping[str, Any]
    ) -> answers.ConfirmationList:
        """``confirmations.list``: the confirmations naming the caller, as the person asked or
        as the agent that asked, newest first (``state`` filters)."""
        value = requests.parse(requests.ConfirmationListInput, data)
        self._precheck(caller, value.tenantId)
        items = await confirmations.list_for(
            self.db,
            tenant_id=value.tenantId,
            identity_id=caller.identity_id,
            state=value.state,
            limit=value.limit,
        )
        return {"items": items}

    async def confirmations_approve(
        self, caller: ports.Caller, data: Mapping[str, Any]
    ) -> answers.Confirmation:
        """``confirmations.approve``: the person named says yes; the agent's retry with the
        same key is then placed. Approving twice answers the same; after a denial or past the
        deadline it is ``INVALID_STATE``; anyone but the person is ``ACCESS_DENIED``."""
        return await self._decide_confirmation(caller, data, "approved")

    async def confirmations_deny(
        self, caller: ports.Caller, data: Mapping[str, Any]
    ) -> answers.Confirmation:
        """``confirmations.deny``: the person named says no; the reservation is denied and the
        agent's key stays refused. Denying twice answers the same; after an approval or past
        the deadline it is ``INVALID_STATE``; anyone but the person is ``ACCESS_DENIED``."""
        return await self._decide_confirmation(caller, data, "denied")

    async def _decide_confirmation(
        self, caller: ports.Caller, data: Mapping[str, Any], verdict: confirmations.Verdict
    ) -> answers.Confirmation:
        value = requests.parse(requests.ConfirmationDecisionInput, data)
        self._precheck(caller, value.tenantId)
        decided = await confirmations.decide(
            self.db,
            tenant_id=value.tenantId,
            confirmation_id=value.confirmationId,
            person_id=caller.identity_id,
            verdict=verdict,
        )
        if decided is None:
            # Another tenant's, another person's or none at all: one answer, nothing leaks.
            raise errors.access_denied(
                f"there is no confirmation {value.confirmationId} for you to decide",
                confirmationId=value.confirmationId,
            )
        return decided

    async def search(self, caller: ports.Caller, data: Mapping[str, Any]) -> dict[str, Any]:
        """``capacity.search``: the earliest windows a create would fit in, booking nothing.

        Takes the preview's input without ``start``, plus ``from``, ``horizon`` and ``limit``
        (``requests.SearchInput``). The same pre-checks and pool rules as a preview; each
        window is what a preview at that start would answer.
        """
        value = requests.parse(requests.SearchInput, data)
        self._precheck(caller, value.tenantId)
        _no_instance(value)
        return await searching.search(
            self.db,
            tenant_id=value.tenantId,
            request=requests.normalized_request(value),
            duration_ms=value.duration_ms,
            from_ms=value.from_,
            horizon_ms=value.horizon_ms,
            limit=value.limit,
        )

    async def snapshot(self, reservation_id: str) -> answers.Reservation | None:
        """The stored reservation as the guide's object, unauthorized: for a trusted door that
        projects it (the operator writing ``status``), never for a caller's request. ``None``
        for a draft or an unknown id."""
        view = await views.get(self.db, reservation_id)
        if view is None or view["state"] == states.State.DRAFT.value:
            return None
        return _reservation(view)

    async def counts(self, waits_after: int | None = None) -> Stats:
        """The figures ``/metrics`` shows, read now: reservations, devices and quota, the work
        queue, and the waits that ended after event ``waits_after``."""
        return await stats.read(self.db, waits_after=waits_after)

    # --- node reports ----------------------------------------------------------------------

    async def report(
        self, *, node_id: str, allocation_id: str, kind: str, details: Mapping[str, Any]
    ) -> bool:
        """A node's report (bound, failed, releasing, released) on one of its allocations.

        With attestation on, a report counts only if its signature block verifies for that
        phase (see ``core.attestation.Attestation.verify_report``); one that does not changes
        nothing (a bound binding it contradicts is lost), the reason is published as
        ``reservation.binding-rejected``, and ``False`` returned."""
        attest: reports.Attest | None = None
        if self.attestation is not None:
            attest = functools.partial(
                _verify_report,
                self.attestation,
                details.get("signature"),
                node_id,
                allocation_id,
            )
        return await reports.report(
            self.db,
            node_id=node_id,
            allocation_id=allocation_id,
            kind=kind,
            details=details,
            attest=attest,
        )


def _verify_report(
    trust: attestation_.Attestation,
    signature: Any,
    node_id: str,
    allocation_id: str,
    reservation_id: str,
    phase: str,
    now: dt.datetime,
    revoked: attestation_.Revocations,
) -> attestation_.AttestedReport:
    if signature is not None and not isinstance(signature, Mapping):
        raise attestation_.AttestationError(attestation_.UNSIGNED)
    return trust.verify_report(
        signature,
        phase=phase,
        node_name=node_id,
        allocation_id=allocation_id,
        reservation_id=reservation_id,
        now=now,
        revoked=revoked,
    )


def _confirmation_required(found: confirmations.Found, rid: str, person_id: str) -> ComputeError:
    return ComputeError(
        ErrorCode.CONFIRMATION_REQUIRED,
        f"{person_id} must confirm this request: ask them to run 'better-compute confirmations"
        f" approve {found.id}', then send the same request again with the same idempotency key",
        {"confirmationId": found.id, "expiresAt": found.expires_at_ms, "reservationId": rid},
    )


def _expired(rid: str, confirmation_id: str | None) -> ComputeError:
    details: dict[str, Any] = {"reservationId": rid, "state": states.State.EXPIRED.value}
    if confirmation_id is not None:
        details["confirmationId"] = confirmation_id
    return errors.invalid_state(
        "the request expired: it was not confirmed before its deadline; make a new request"
        " with a new idempotency key",
        **details,
    )


async def admission_pool(db: Database, pool_id: str, tenant_id: str) -> pools.PoolInfo | None:
    async with db.connection() as conn:
        return await store_pools.read_pool(conn, pool_id=pool_id, tenant_id=tenant_id)


def _reservation(view: dict[str, Any]) -> answers.Reservation:
    """The guide's reservation object as ``store.views`` builds it, under its type."""
    return cast(answers.Reservation, view)


async def _authorization_row(db: Database, rid: str) -> answers.AuthorizationRow | None:
    row = await queries.authz_row(db, rid)
    return None if row is None else cast(answers.AuthorizationRow, row)


def _relation(pool: pools.PoolInfo) -> ports.PoolRelation:
    return ports.PoolRelation(
        pool_id=pool.id,
        owner_tenant_id=pool.owner_tenant_id,
        region=pool.region,
        gpu_model=pool.gpu_model or "other",
    )


def _on_reservation(
    caller: ports.Caller,
    action: str,
    tenant_id: str,
    rid: str,
    row: answers.AuthorizationRow,
    *,
    attributes: Mapping[str, Any] | None = None,
) -> ports.DecisionRequest:
    """The decision request on a stored reservation, from its authorization row: the same
    attributes and pool relation for every action (``attributes`` overrides for an extend)."""
    return ports.DecisionRequest(
        principal=caller,
        action=action,
        resource_type=RESERVATION,
        resource_id=rid,
        tenant_id=tenant_id,
        owner_identity_id=row["owner_identity_id"],
        attributes=row["attributes"] if attributes is None else attributes,
        pool=ports.PoolRelation(
            pool_id=row["pool_id"],
            owner_tenant_id=row["owner_tenant_id"],
            region=row["region"],
            gpu_model=row["gpu_model"] or "other",
        ),
    )


def _no_instance(value: requests.CreateInput) -> None:
    """``binding: 'instance'`` books through the capacity port, not here (``UNSUPPORTED``)."""
    if value.binding == "instance":
        raise ComputeError(
            ErrorCode.UNSUPPORTED,
            "binding 'instance' is not supported: VPS instances book through the capacity port",
            {"field": "binding"},
        )
