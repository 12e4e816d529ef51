"""The node agent's core: converge the node on its desired DeviceAllocations, and report.

Why it exists: the operator writes one DeviceAllocation per allocation on this node
(docs/kubernetes.md); the node must turn each into a CDI spec, an env file and advertised
devices, and tell the operator how it stands, signed with the node key. This class does that
against two ports, so the Kubernetes adapter (the lead's kopf handlers) stays a thin edge:

- ``DesiredAllocations.desired()``: every DeviceAllocation ``spec`` addressed to this node, as a
  dict in the contract's shape (``kube.allocations.AllocationSpec``, which parses it here).
  Objects with ``release: true`` stay in the list until they are deleted.
- ``StatusReporter.report(allocation_id=…, status=…)``: write the contract's ``status``
  (``kube.allocations.AllocationStatus``, which builds it here) onto the object whose
  ``spec.allocationId`` is that id.

Each pass (``sync_once``) is level-triggered. A spec to bind is checked (ids safe as file names,
devices of its class in this node's inventory, no device owned by another allocation), its files
are written, its devices advertised (a ``kubernetes`` binding) and ``Bound`` reported; a bad spec
(one the contract's shape refuses, or a file or the kubelet would) is reported ``Failed`` with
the field and the reason, and logged once. On ``release: true``, or when an allocation vanished
from the list, its devices stop being advertised at once; then the kubelet's PodResources says
which pods still hold them: while any does, ``Releasing`` with the pods and ``since``; once none
does, the files are removed and ``Released`` reported. A kubelet that does not answer keeps the
allocation ``Releasing``, never free. A status is reported when it changes, not every pass.
A new allocation whose device a releasing allocation still owns waits, unreported, until the
pods let go; one whose device a bound allocation owns is ``Failed``.

Host limits (``spec.limits``): a new allocation with limits is admitted against the node's
CPUs, memory and 1 GiB huge pages beside every allocation that owns its devices
(``Allocations.host_shortfall``); one that does not fit is ``Failed`` with the reason
``resources-exhausted: …``, which makes the control plane place the reservation again. A
``hold`` with limits then gets its cgroup slice (``cgroups``) before its files are written, and
its ``Bound`` report names it (``cgroupParent``); on a node that cannot enforce limits (no
``Cgroups``) such a hold is ``Failed`` rather than run unbounded. A ``kubernetes`` binding gets
no slice (its pods live in the kubelet's cgroups, which enforce their limits), but its limits
count in the admission. Every pass removes the slices of ours that no allocation owns any more,
once no process is left in them.

Whose pods hold the devices (a ``kubernetes`` binding): every pass, and just after each
Allocate, asks the kubelet's PodResources which pods hold a bound allocation's devices and puts
them in its ``Bound`` report (``pods``). With the reservation's own resource and its namespace
known (``spec.reservationNamespace``), a holder of another namespace is an intruder: the report
names it (``intruders``, which the control plane turns into ``Degraded/PodOutsideNamespace``)
and the pod gets one Warning Event (``PodWarnings``). Nothing is taken from a running pod; a
kubelet that does not answer leaves the last known holders in place.

Claims instead of pods (a ``dra`` allocation, ``allocations.is_dra``): its devices reach pods
through ResourceClaims the kubelet prepares (``draserving``), and PodResources does not reliably
say which pods got a claim's devices. Its holders are therefore its prepared claims
(``ClaimHolders``, ``draclaims``), reported in ``pods`` as ``namespace/claim-name``: a release
stays ``Releasing`` until the kubelet has unprepared every one, which it does only once no pod
on the node uses the claim. No intruder check applies (the DRA plugin refuses a claim of
another namespace at prepare) and no pod is warned.

Restart safety: the CDI specs on disk describe their allocations (``devicefiles``), so a new
process rebuilds its state from the desired list plus the files: a bound allocation is adopted
(and its files restored if damaged), a file no desired allocation explains is released like a
vanished allocation (its release time survives in the spec), and a device is never advertised
twice because ``Allocations`` refuses a second owner.

Health: ``follow_inventory`` feeds ``inventory.watch`` into ``Allocations``, so a device whose
GPU turns unhealthy (a failed read, or a critical XID: ``health``) is advertised ``Unhealthy``
and ``Healthy`` again when it recovers. The inventory also says which NVIDIA CDI device each GPU
has (``nvidiacdi``): a bound allocation's files name them, and are written again when they
change.

What it must never do: talk to Kubernetes (only through the ports), write outside ``DeviceFiles``
and ``Cgroups``, free devices a pod may still hold, run a hold with limits without its slice,
remove a slice that is not its own or still has processes, or report anything unsigned.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from bettercompute.deviceplugin import inventory, signing
from bettercompute.deviceplugin.allocations import (
    Allocations,
    Held,
    Phase,
    inventory_problems,
    is_dra,
)
from bettercompute.deviceplugin.cgroups import CgroupError, Cgroups
from bettercompute.deviceplugin.devicefiles import Allocation, DeviceFileError, DeviceFiles
from bettercompute.deviceplugin.podresources import Holdings, KubeletUnreachable, PodHolders
from bettercompute.kube import allocations as shapes
from bettercompute.kube.parsing import ShapeError

log = logging.getLogger(__name__)

PASS_SECONDS = 1.0  # how often a Releasing allocation asks the kubelet again
#: How a refused allocation's reason starts when the host cannot give its limits.
RESOURCES_EXHAUSTED = "resources-exhausted"


class DesiredAllocations(Protocol):
    """The DeviceAllocation specs addressed to this node: every object labelled
    ``bcd.dev/node=<node>``, its ``spec`` as a dict, those with ``release: true`` included
    until the object is deleted.

    The list must be complete: an allocation missing from it is released. When the API cannot
    be read, raise (an exception the composition root names in ``retry_on``), never return a
    partial or empty list.
    """

    async def desired(self) -> Sequence[Mapping[str, Any]]: ...


class StatusReporter(Protocol):
    """Writes ``status`` (the contract's status shape, signature included) onto the object
    whose ``spec.allocationId`` is ``allocation_id``.

    ``allocation_id`` is the spec's value as given, so a ``Failed`` report may carry one that is
    unsafe as a file name. A ``Released`` report may name an object that is already gone (an
    allocation that vanished from the list): ignore "not found". An exception in ``retry_on``
    makes the next pass report again; a status is otherwise reported once per change.
    """

    async def report(self, *, allocation_id: str, status: Mapping[str, Any]) -> None: ...


class ClaimHolders(Protocol):
    """The ResourceClaims prepared on this node that hold an allocation's devices
    (``namespace/name``, sorted): ``draclaims.PreparedClaims``."""

    def holders(self, allocation_id: str) -> list[str]: ...


class PodWarnings(Protocol):
    """Tells a pod's owners something is wrong with it: a Warning Event on the pod
    (``namespace/name``). Failures are the adapter's to log; a warning is best effort."""

    async def warn(self, *, pod: str, reason: str, message: str) -> None: ...


#: The Event reason on a pod that holds devices of another namespace's reservation.
INTRUDER_REASON = "ReservationDevicesOfAnotherNamespace"
#: The Event reason on a pod whose spot reservation is being preempted.
PREEMPTED_REASON = "ReservationPreempted"


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclasses.dataclass
class Pass:
    """What one pass did, by allocation id (for logs and tests)."""

    bound: list[str] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)
    waiting: list[str] = dataclasses.field(default_factory=list)
    releasing: list[str] = dataclasses.field(default_factory=list)
    released: list[str] = dataclasses.field(default_factory=list)
    restored: list[str] = dataclasses.field(default_factory=list)
    removed: list[str] = dataclasses.field(default_factory=list)
    #: cgroup slices removed, and those kept because a process is still in them.
    slices_removed: list[str] = dataclasses.field(default_factory=list)
    slices_kept: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _Status:
    """A report before it is stamped and signed; equal statuses are reported once."""

    phase: shapes.Phase
    reservation_id: str
    cdi_devices: tuple[str, ...] = ()
    env_file: str | None = None
    cgroup_parent: str | None = None
    reason: str = ""
    pods: tuple[str, ...] = ()
    intruders: tuple[str, ...] = ()
    since: int | None = None


class Converger:
    """One node's agent core. ``run`` forever, or ``sync_once`` step by step in tests."""

    def __init__(
        self,
        *,
        node_name: str,
        allocations: Allocations,
        files: DeviceFiles,
        inventory_source: inventory.InventorySource,
        pods: PodHolders,
        desired: DesiredAllocations,
        reporter: StatusReporter,
        key: signing.NodeKey,
        certificate: Callable[[], str | None] | None = None,
        clock: Callable[[], int] = wall_clock_ms,
        pass_seconds: float = PASS_SECONDS,
        retry_on: tuple[type[Exception], ...] = (OSError,),
        cgroups: Cgroups | None = None,
        no_limits_reason: str = "this node does not enforce host limits",
        warnings: PodWarnings | None = None,
        claims: ClaimHolders | None = None,
    ) -> None:
        self.node_name = node_name
        #: Who holds a ``dra`` allocation's devices; None (DRA off): nobody can, as no claim
        #: is prepared here.
        self.claims = claims
        self.warnings = warnings
        # Pods already warned, per allocation: one Event per intruder, not one per pass.
        self._warned: dict[str, set[str]] = {}
        # This pass's PodResources answer (or why there is none), asked once it is needed.
        self._holdings: Holdings | KubeletUnreachable | None = None
        #: The node's cgroup slices; None where limits cannot be enforced (``no_limits_reason``).
        self.cgroups = cgroups
        self.no_limits_reason = no_limits_reason
        self.allocations = allocations
        self.files = files
        self.inventory_source = inventory_source
        self.pods = pods
        self.desired = desired
        self.reporter = reporter
        self.key = key
        # The node's current certificate (PEM) for ``key``, sent with each signature so the
        # control plane can check the key belongs to this node; whoever enrols the node (the
        # certificate request flow) sets or replaces it. None: reports go without one, and the
        # control plane does not count their bindings.
        self.certificate = certificate
        self.clock = clock
        self.pass_seconds = pass_seconds
        # Failures the next pass can heal (the API server restarting): the composition root
        # names them, since this class cannot know the adapter's errors.
        self.retry_on = retry_on
        self._retryable: tuple[type[Exception], ...] = (*retry_on, inventory.InventoryError)
        self._reported: dict[str, _Status] = {}
        self._wake = asyncio.Event()
        # Passes interleaving at their awaits could bind one allocation twice.
        self._one_pass_at_a_time = asyncio.Lock()
        self._logged: dict[str, str] = {}

    # --- driving ------------------------------------------------------------------------

    def wake(self) -> None:
        """Run a pass now: the adapter calls this whenever a DeviceAllocation changes."""
        self._wake.set()

    def report_again(self) -> None:
        """Sign and send every allocation's report again at the next pass (now): the node has
        a new certificate, and reports sent without it, or with an older one, may not count."""
        self._reported.clear()
        self._wake.set()

    async def run(self) -> None:
        """Pass after pass until cancelled: at once when woken, else every ``pass_seconds``."""
        while True:
            self._wake.clear()
            try:
                await self.sync_once()
            except self._retryable as e:
                self._log_once("pass", f"pass failed, retrying: {e}")
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can hang when it is
            # cancelled just as the event is set (its inner task is never reaped).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.pass_seconds):
                    await self._wake.wait()

    async def follow_inventory(self, *, interval_s: float = 5.0) -> None:
        """Keep ``Allocations``' inventory (and so the devices' health) current."""
        async for current in inventory.watch(self.inventory_source, interval_s=interval_s):
            self.allocations.set_inventory(current)
            self.wake()

    async def sync_once(self) -> Pass:
        """One pass over the desired list, the held allocations and the files on disk."""
        async with self._one_pass_at_a_time:
            return await self._sync()

    async def _sync(self) -> Pass:
        self._holdings = None  # who holds what is asked again each pass
        if self.allocations.inventory is None:
            self.allocations.set_inventory(await asyncio.to_thread(self.inventory_source.read))
        done = Pass()
        to_bind: dict[str, Mapping[str, Any]] = {}
        to_release: dict[str, Mapping[str, Any] | None] = {}
        # Which object a spec is and whether it is being released are read before the spec is
        # parsed: a spec the shape refuses is still reported on (Failed) or released.
        for spec in await self.desired.desired():
            allocation_id = spec.get("allocationId") if isinstance(spec, Mapping) else None
            if not isinstance(allocation_id, str):
                self._log_once(repr(spec)[:80], f"ignoring a spec without allocationId: {spec!r}")
                continue
            if spec.get("nodeName") not in (None, self.node_name):
                self._log_once(allocation_id, f"{allocation_id}: spec.nodeName is another node")
                continue
            (to_release if spec.get("release") is True else to_bind)[allocation_id] = spec
        for held in self.allocations.all():
            allocation_id = held.allocation.allocation_id
            if allocation_id not in to_bind and allocation_id not in to_release:
                to_release[allocation_id] = None  # vanished: release it all the same
        on_disk = await asyncio.to_thread(self.files.allocation_ids)
        for allocation_id in sorted(on_disk - to_bind.keys()):
            if self.allocations.get(allocation_id) is None:
                await self._adopt_leftover(allocation_id, to_release.get(allocation_id), done)
                to_release.setdefault(allocation_id, None)
        for allocation_id, spec in to_bind.items():
            await self._bind(allocation_id, spec, done)
        for allocation_id, released_spec in to_release.items():
            await self._release(allocation_id, released_spec, done)
        await self._sweep_slices(done)
        # A desired allocation that stayed unbound (refused or waiting) is not "reported" any
        # more once it vanishes; forget its last status too.
        for allocation_id in list(self._reported):
            if allocation_id not in to_bind and allocation_id not in to_release:
                del self._reported[allocation_id]
        if done.waiting and done.released:
            self.wake()  # freed devices may be what a waiting allocation needs
        return done

    # --- binding ------------------------------------------------------------------------

    async def _bind(self, allocation_id: str, spec: Mapping[str, Any], done: Pass) -> None:
        try:
            allocation = Allocation.from_spec(shapes.parse_spec(spec))
        except (ShapeError, DeviceFileError) as e:
            reservation = spec.get("reservationId")
            await self._fail(allocation_id, str(reservation or ""), str(e), done)
            return
        held = self.allocations.get(allocation_id)
        if held is not None and held.phase is not Phase.RELEASED:
            if held.allocation.device_ids != allocation.device_ids:
                await self._fail(
                    allocation_id,
                    allocation.reservation_id,
                    "spec.deviceIds changed after the allocation was bound",
                    done,
                )
                return
            await self._keep_bound(held, allocation, done)
            return
        if held is not None:  # released, then desired again: bind afresh
            self.allocations.forget(allocation_id)
        assert self.allocations.inventory is not None
        problems = inventory_problems(inventory=self.allocations.inventory, allocation=allocation)
        # Bound before a restart with its files intact: adopted even if a GPU went missing
        # meanwhile; the device is then advertised Unhealthy rather than silently dropped.
        already_written = await asyncio.to_thread(self.files.describes, allocation)
        if problems and not already_written:
            await self._fail(allocation_id, allocation.reservation_id, "; ".join(problems), done)
            return
        if allocation.cgroup_parent is not None and self.cgroups is None:
            await self._fail(
                allocation_id,
                allocation.reservation_id,
                f"spec.limits: {self.no_limits_reason}",
                done,
            )
            return
        conflicts = self.allocations.conflicts(allocation)
        if conflicts:
            if all(c.owner_phase is Phase.RELEASING for c in conflicts):
                # Pods of a released allocation still hold a device: bind once they let go.
                self._log_once(
                    allocation_id,
                    f"{allocation_id}: waiting for {sorted({c.owner for c in conflicts})} "
                    "to be released",
                )
                done.waiting.append(allocation_id)
                return
            taken = ", ".join(f"{c.device_id} (allocation {c.owner})" for c in conflicts)
            await self._fail(
                allocation_id, allocation.reservation_id, f"devices already bound: {taken}", done
            )
            return
        if not already_written:  # admitted before a restart: it keeps its place
            shortfall = self.allocations.host_shortfall(allocation)
            if shortfall is not None:
                await self._fail(
                    allocation_id,
                    allocation.reservation_id,
                    f"{RESOURCES_EXHAUSTED}: {shortfall}",
                    done,
                )
                return
        slice_owner = self.allocations.slice_owner(allocation)
        if slice_owner is not None:
            await self._fail(
                allocation_id,
                allocation.reservation_id,
                f"its cgroup slice {allocation.cgroup_parent} is allocation {slice_owner}'s",
                done,
            )
            return
        self.allocations.start_binding(allocation)
        try:
            await self._make_slice(allocation)
        except CgroupError as e:
            self.allocations.forget(allocation_id)
            await self._fail(allocation_id, allocation.reservation_id, str(e), done)
            return
        try:
            await self._write_files(allocation)
        except OSError as e:
            self.allocations.forget(allocation_id)
            await self._fail(
                allocation_id, allocation.reservation_id, f"cannot write its files: {e}", done
            )
            return
        self.allocations.mark_bound(allocation_id)
        done.bound.append(allocation_id)
        log.info("%s: bound %s", allocation_id, list(allocation.device_ids))
        held = self.allocations.get(allocation_id)
        assert held is not None
        await self._report(allocation_id, await self._bound_status(held))

    async def _keep_bound(self, held: Held, allocation: Allocation, done: Pass) -> None:
        """An allocation we hold that is still desired: heal its files, advertise it again if
        its release had begun (the operator bound it again), report it if not yet reported."""
        allocation_id = allocation.allocation_id
        held.allocation = allocation  # same devices; only e.g. the end may have moved
        nvidia = self._nvidia_devices(allocation)
        if not await asyncio.to_thread(self.files.matches, allocation, nvidia_devices=nvidia):
            with contextlib.suppress(CgroupError):  # the files say the slice; try next pass
                await self._make_slice(allocation)
            await asyncio.to_thread(self.files.write, allocation, nvidia_devices=nvidia)
            done.restored.append(allocation_id)
        elif (
            allocation.cgroup_parent is not None
            and self.cgroups is not None
            and not await asyncio.to_thread(self.cgroups.exists, allocation.cgroup_parent)
        ):
            with contextlib.suppress(CgroupError):  # removed behind our back: make it again
                await self._make_slice(allocation)
                done.restored.append(allocation_id)
        if held.phase is not Phase.BOUND:
            held.releasing_since_ms = None
            self.allocations.mark_bound(allocation_id)
            done.bound.append(allocation_id)
        await self._report(allocation_id, await self._bound_status(held))

    def _nvidia_devices(self, allocation: Allocation) -> list[str]:
        """NVIDIA's CDI devices for the allocation's GPUs, where the node's specs name them."""
        inventory = self.allocations.inventory
        if inventory is None:
            return []
        return inventory.nvidia_cdi.devices_for(allocation.visible_devices)

    async def _write_files(self, allocation: Allocation) -> None:
        """Write the allocation's files unless they already say what they should (NVIDIA's
        devices included, which follow the node's NVIDIA specs)."""
        nvidia = self._nvidia_devices(allocation)
        if not await asyncio.to_thread(self.files.matches, allocation, nvidia_devices=nvidia):
            await asyncio.to_thread(self.files.write, allocation, nvidia_devices=nvidia)

    async def _bound_status(self, held: Held) -> _Status:
        allocation = held.allocation
        pods, intruders = await self._holders(held)
        return _Status(
            phase="Bound",
            reservation_id=allocation.reservation_id,
            cdi_devices=tuple(allocation.cdi_devices),
            env_file=str(self.files.env_path(allocation.allocation_id)),
            cgroup_parent=allocation.cgroup_parent,
            pods=pods,
            intruders=intruders,
        )

    # --- whose pods hold the devices ----------------------------------------------------

    async def _pods_holding(self, allocation: Allocation) -> list[str]:
        """The pods holding ``allocation``'s devices, from one PodResources ``List`` per pass
        (``KubeletUnreachable`` for every allocation of a pass where it did not answer).
        A ``dra`` allocation's holders are its prepared claims instead."""
        if is_dra(allocation):
            return [] if self.claims is None else self.claims.holders(allocation.allocation_id)
        if self._holdings is None:
            try:
                self._holdings = await self.pods.holdings()
            except KubeletUnreachable as e:
                self._holdings = e
        if isinstance(self._holdings, KubeletUnreachable):
            raise self._holdings
        return self._holdings.holders(devices={allocation.resource_name: allocation.device_ids})

    async def _holders(self, held: Held) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The pods holding a bound ``kubernetes`` allocation's devices, and the intruders
        among them (pods outside its Reservation's namespace, in pod access ``reservation``),
        each warned once. The kubelet not answering keeps the last known holders."""
        allocation = held.allocation
        if allocation.binding != "kubernetes":
            return (), ()
        if is_dra(allocation):  # claims, not pods: nobody to warn, no namespace to check
            held.pods = tuple(await self._pods_holding(allocation))
            return held.pods, ()
        try:
            found = await self._pods_holding(allocation)
            held.pods = tuple(sorted(found))
            self._logged.pop(f"holders:{allocation.allocation_id}", None)
        except KubeletUnreachable as e:
            self._log_once(
                f"holders:{allocation.allocation_id}",
                f"{allocation.allocation_id}: cannot tell which pods hold its devices: {e}",
            )
        if allocation.preempt_at is not None:
            await self._warn_preempted(allocation, held.pods)
        namespace = allocation.namespace
        if allocation.own_resource is None or namespace is None:
            return held.pods, ()  # pod access 'shared': any pod may, the report says which
        intruders = tuple(p for p in held.pods if p.split("/", 1)[0] != namespace)
        warned = self._warned.setdefault(allocation.allocation_id, set())
        for pod in intruders:
            if pod in warned:
                continue
            message = (
                f"pod {pod} holds devices {', '.join(allocation.device_ids)} of reservation "
                f"{allocation.reservation_id} (namespace {namespace}) on node {self.node_name}; "
                "only that namespace's pods may use them"
            )
            log.warning("%s: %s", allocation.allocation_id, message)
            if self.warnings is not None:
                await self.warnings.warn(pod=pod, reason=INTRUDER_REASON, message=message)
            warned.add(pod)
        warned.intersection_update(intruders)  # one that comes back is warned again
        return held.pods, intruders

    # --- cgroup slices ------------------------------------------------------------------

    async def _make_slice(self, allocation: Allocation) -> None:
        """The slice of a ``hold`` with limits, with its limits written; nothing for others."""
        name = allocation.cgroup_parent
        if name is None or allocation.limits is None:
            return
        if self.cgroups is None:
            raise CgroupError(f"spec.limits: {self.no_limits_reason}")
        await asyncio.to_thread(self.cgroups.create, name, allocation.limits)

    async def _sweep_slices(self, done: Pass) -> None:
        """Remove our slices that no allocation owns any more, once they are empty."""
        if self.cgroups is None:
            return
        in_use = self.allocations.slices_in_use()
        for name in sorted(await asyncio.to_thread(self.cgroups.ours) - in_use):
            try:
                gone = await asyncio.to_thread(self.cgroups.remove, name)
            except (CgroupError, OSError) as e:
                self._log_once(name, f"cannot remove cgroup slice {name}: {e}")
                done.slices_kept.append(name)
                continue
            if gone:
                done.slices_removed.append(name)
                self._logged.pop(name, None)
                log.info("removed cgroup slice %s", name)
            else:
                done.slices_kept.append(name)
                self._log_once(name, f"cgroup slice {name} still has processes; kept for now")

    async def _fail(self, allocation_id: str, reservation_id: str, reason: str, done: Pass) -> None:
        self._log_once(allocation_id, f"{allocation_id}: cannot bind: {reason}")
        done.failed.append(allocation_id)
        await self._report(
            allocation_id, _Status(phase="Failed", reservation_id=reservation_id, reason=reason)
        )

    # --- releasing ----------------------------------------------------------------------

    async def _adopt_leftover(
        self, allocation_id: str, spec: Mapping[str, Any] | None, done: Pass
    ) -> None:
        """Files of an allocation this process does not hold and nobody wants bound: take it
        over as releasing, so its devices stay owned until no pod holds them."""
        written = await asyncio.to_thread(self.files.read, allocation_id)
        allocation = None if written is None else written.allocation
        since = None if written is None else written.releasing_since_ms
        if allocation is None and spec is not None:
            with contextlib.suppress(ShapeError, DeviceFileError):  # a damaged file: trust the spec
                allocation = Allocation.from_spec(shapes.parse_spec(spec))
        if allocation is None or self.allocations.conflicts(allocation):
            # Nothing says which devices it had (or they are another's now): nothing to wait
            # for, so the files only need to go.
            await asyncio.to_thread(self.files.remove, allocation_id)
            done.removed.append(allocation_id)
            log.info("%s: removed leftover files", allocation_id)
            return
        self.allocations.start_binding(allocation)
        self.allocations.start_release(
            allocation_id, since_ms=since if since is not None else self.clock()
        )

    async def _warn_preempted(self, allocation: Allocation, pods: Sequence[str]) -> None:
        """Each pod holding a preempted spot reservation's devices is told once, with when."""
        told = self._warned.setdefault(f"preempt:{allocation.allocation_id}", set())
        when = signing.rfc3339(allocation.preempt_at or 0)
        for pod in pods:
            if pod in told:
                continue
            message = (
                f"spot reservation {allocation.reservation_id} is preempted: its devices "
                f"{', '.join(allocation.device_ids)} on node {self.node_name} go at {when}"
            )
            log.warning("%s: %s: %s", allocation.allocation_id, pod, message)
            if self.warnings is not None:
                await self.warnings.warn(pod=pod, reason=PREEMPTED_REASON, message=message)
            told.add(pod)

    async def _release(
        self, allocation_id: str, spec: Mapping[str, Any] | None, done: Pass
    ) -> None:
        held = self.allocations.get(allocation_id)
        if held is None:
            if spec is not None:  # never bound here, or its files are gone: nothing is held
                reservation = str(spec.get("reservationId") or "")
                await self._report(allocation_id, _Status("Released", reservation))
                done.released.append(allocation_id)
            return
        if held.phase is Phase.RELEASED:
            if spec is None:
                self.allocations.forget(allocation_id)
                self._reported.pop(allocation_id, None)
            else:
                await self._report(
                    allocation_id, _Status("Released", held.allocation.reservation_id)
                )
            return
        if held.phase is not Phase.RELEASING:
            since = self.clock()
            self.allocations.start_release(allocation_id, since_ms=since)
            log.info("%s: release started, devices no longer advertised", allocation_id)
            with contextlib.suppress(OSError):  # only remembers since across a restart
                await asyncio.to_thread(
                    self.files.write,
                    held.allocation,
                    releasing_since_ms=since,
                    nvidia_devices=self._nvidia_devices(held.allocation),
                )
        allocation = held.allocation
        since_ms = held.releasing_since_ms
        reason = ""
        if allocation.binding == "kubernetes":
            try:
                pods = await self._pods_holding(allocation)
            except KubeletUnreachable as e:
                pods = list(held.pods)  # the last we knew; the devices stay held
                reason = f"kubelet unreachable, devices kept: {e}"
            held.pods = tuple(pods)
            if pods or reason:
                done.releasing.append(allocation_id)
                await self._report(
                    allocation_id,
                    _Status(
                        "Releasing",
                        allocation.reservation_id,
                        reason=reason,
                        pods=tuple(sorted(pods)),
                        since=since_ms,
                    ),
                )
                return
        await asyncio.to_thread(self.files.remove, allocation_id)
        self.allocations.mark_released(allocation_id)
        self._warned.pop(allocation_id, None)
        self._warned.pop(f"preempt:{allocation_id}", None)
        done.released.append(allocation_id)
        log.info("%s: released", allocation_id)
        await self._report(allocation_id, _Status("Released", allocation.reservation_id))
        if spec is None:  # vanished: nobody will read a status, and nothing more to do
            self.allocations.forget(allocation_id)

    # --- reporting ----------------------------------------------------------------------

    async def _report(self, allocation_id: str, status: _Status) -> None:
        if self._reported.get(allocation_id) == status:
            return
        now = self.clock()
        report = signing.Report(
            node_name=self.node_name,
            allocation_id=allocation_id,
            reservation_id=status.reservation_id,
            phase=status.phase,
            cdi_devices=status.cdi_devices,
            env_file=status.env_file,
            cgroup_parent=status.cgroup_parent,
            pods=status.pods,
            intruders=status.intruders,
            since=status.since,
            reported_at=signing.rfc3339(now),
        )
        await self.reporter.report(
            allocation_id=allocation_id,
            status=shapes.AllocationStatus(
                nodeName=self.node_name,
                phase=status.phase,
                cdiDevices=list(status.cdi_devices),
                envFile=status.env_file,
                cgroupParent=status.cgroup_parent,
                reason=status.reason,
                pods=list(status.pods),
                intruders=list(status.intruders),
                since=status.since,
                reportedAt=report.reported_at,
                signature=shapes.Signature.model_validate(self._sign(report)),
            ).document(),
        )
        self._reported[allocation_id] = status

    def _sign(self, report: signing.Report) -> dict[str, str]:
        block = self.key.sign(report)
        certificate = self.certificate() if self.certificate is not None else None
        if certificate:
            block["certificate"] = certificate
        return block

    def _log_once(self, key: str, message: str) -> None:
        if self._logged.get(key) != message:
            log.warning("%s", message)
            self._logged[key] = message
