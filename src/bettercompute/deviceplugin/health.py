"""GPU health from NVML events: a critical XID error makes a GPU unhealthy for a while.

Why it exists: a GPU can fail in ways every NVML read still answers (a double-bit ECC error, a
GPU that fell off the bus and came back, a page-retirement failure); the driver reports them
as critical XID errors, as events, not as failed reads. NVIDIA's own device plugin watches
those events, and so does bcd's: the GPU's devices are advertised ``Unhealthy`` and its GPUNode
entry says ``healthy: false`` with the reason (``Gpu.problem``), so no new work is placed on it.

How, as NVIDIA's plugin does it: an NVML event set, every GPU registered for
``nvmlEventTypeXidCriticalError``, ``nvmlEventSetWait_v2`` in a thread of its own. The XIDs
NVIDIA's plugin skips are skipped too (``SKIPPED_XIDS``: 13, 31, 43, 45, 68 and 109 are the
application's own faults, not the GPU's), and a node can skip more (``--skip-xids``). An event
NVML cannot tie to a GPU, or a failed wait, marks every watched GPU, as NVIDIA's plugin does.
A GPU whose events cannot be registered (too old, or an NVML error) is logged and judged by
its reads alone.

Recovery, where NVIDIA's plugin has none (its GPU stays unhealthy until the plugin restarts):
a marked GPU is healthy again once its inventory reads have succeeded for ``recovery_s`` (5
minutes by default) with no new critical XID. A failed read restarts the wait.

The event source is a small protocol (``XidEventSource``: ``open``, ``wait``, ``close``) with
one real implementation, ``NvmlXidEvents``; tests give ``XidHealth`` a fake one. ``XidHealth``
runs the thread and keeps the marks; ``HealthChecked`` wraps an ``InventorySource`` and applies
the marks to every inventory it reads, so a change travels the path failed reads already take
(``inventory.watch`` → ``Allocations`` → the kubelet and the GPUNode), within one inventory
interval.

What it must never do: stop the agent because events cannot be watched (it logs, retries the
NVML event set every ``retry_s`` and leaves health to the reads meanwhile), block the event
loop (the waits run in their own thread), or let an ``NVMLError`` escape.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from bettercompute.deviceplugin.inventory import Inventory, InventorySource

log = logging.getLogger(__name__)

#: XIDs NVIDIA's device plugin does not count against the GPU: the application's own faults
#: (13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped processing, 45
#: preemptive cleanup, 68 video processor exception, 109 context switch timeout).
SKIPPED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
#: How long a marked GPU's reads must succeed, with no new critical XID, before it is healthy.
RECOVERY_SECONDS = 300.0
#: How long one wait for an event lasts: also how long stopping the thread may take.
WAIT_SECONDS = 1.0
#: How long to wait before opening the event set again after it failed.
RETRY_SECONDS = 30.0
#: ``nvmlEventTypeXidCriticalError``.
XID_CRITICAL_ERROR = 0x8


@dataclasses.dataclass(frozen=True)
class XidEvent:
    """One critical XID error; ``uuid`` None: NVML could not say which GPU had it."""

    xid: int
    uuid: str | None


@dataclasses.dataclass(frozen=True)
class Registration:
    """Which GPUs an opened event source watches, and which it cannot (with why)."""

    watched: tuple[str, ...]
    unsupported: tuple[tuple[str, str], ...] = ()


class EventSourceError(Exception):
    """The event source cannot be opened or waited on; the message says why."""


class XidEventSource(Protocol):
    """Critical XID events of the node's GPUs. ``open`` registers every GPU it can; ``wait``
    returns the next event, or None after ``timeout_s`` without one; ``close`` frees what
    ``open`` took. Failures are ``EventSourceError``."""

    def open(self) -> Registration: ...

    def wait(self, timeout_s: float) -> XidEvent | None: ...

    def close(self) -> None: ...


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class NvmlXidEvents:
    """The real events, from the NVIDIA driver through NVML (``pynvml``, imported lazily)."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._event_set: Any = None

    def open(self) -> Registration:
        try:
            import pynvml
        except ImportError as e:
            raise EventSourceError(f"the pynvml module is missing: {e}") from e
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise EventSourceError(f"NVML did not initialise: {e}") from e
        self._nvml = pynvml
        try:
            self._event_set = pynvml.nvmlEventSetCreate()
            watched: list[str] = []
            unsupported: list[tuple[str, str]] = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
                problem = self._register(handle)
                if problem is None:
                    watched.append(uuid)
                else:
                    unsupported.append((uuid, problem))
        except pynvml.NVMLError as e:
            self.close()
            raise EventSourceError(f"NVML: {e}") from e
        return Registration(watched=tuple(watched), unsupported=tuple(unsupported))

    def _register(self, handle: Any) -> str | None:
        """Register one GPU for critical XIDs; why not, when it cannot be."""
        nvml = self._nvml
        try:
            supported = int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
            if not supported & XID_CRITICAL_ERROR:
                return "the GPU does not report critical XID events"
            nvml.nvmlDeviceRegisterEvents(handle, XID_CRITICAL_ERROR, self._event_set)
        except nvml.NVMLError as e:
            return f"NVML: {e}"
        return None

    def wait(self, timeout_s: float) -> XidEvent | None:
        nvml = self._nvml
        if nvml is None or self._event_set is None:
            raise EventSourceError("the NVML event set is not open")
        try:
            data = nvml.nvmlEventSetWait_v2(self._event_set, max(1, int(timeout_s * 1000)))
        except nvml.NVMLError as e:
            if getattr(e, "value", None) == nvml.NVML_ERROR_TIMEOUT:
                return None
            raise EventSourceError(f"waiting for NVML events: {e}") from e
        if not int(data.eventType) & XID_CRITICAL_ERROR:
            return None
        try:
            uuid: str | None = _text(nvml.nvmlDeviceGetUUID(data.device))
        except nvml.NVMLError:
            uuid = None
        return XidEvent(xid=int(data.eventData), uuid=uuid)

    def close(self) -> None:
        nvml, event_set = self._nvml, self._event_set
        self._nvml = self._event_set = None
        if nvml is None:
            return
        if event_set is not None:
            try:
                nvml.nvmlEventSetFree(event_set)
            except nvml.NVMLError as e:
                log.warning("NVML event set not freed: %s", e)
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as e:
            log.warning("NVML did not shut down cleanly: %s", e)


def rfc3339(epoch_s: float) -> str:
    moment = datetime.datetime.fromtimestamp(int(epoch_s), tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass
class _Mark:
    """A GPU made unhealthy by an event, and since when its reads have been good."""

    reason: str
    clean_since: float | None = None


class XidHealth:
    """Watches ``source`` in a thread and keeps which GPUs critical XIDs made unhealthy."""

    def __init__(
        self,
        source: XidEventSource,
        *,
        skip: Iterable[int] = SKIPPED_XIDS,
        recovery_s: float = RECOVERY_SECONDS,
        wait_s: float = WAIT_SECONDS,
        retry_s: float = RETRY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.source = source
        self.skip = frozenset(skip)
        self.recovery_s = recovery_s
        self.wait_s = wait_s
        self.retry_s = retry_s
        self.clock = clock
        self.wall_clock = wall_clock
        self._lock = threading.Lock()
        self._marks: dict[str, _Mark] = {}
        self._watched: tuple[str, ...] = ()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        #: The last registration (None: the source is not open), for logs and tests.
        self.registration: Registration | None = None
        #: Events seen, skipped ones included: for tests and the probe.
        self.events_seen = 0

    # --- the thread ---------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="xid-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; it ends within one wait."""
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=self.wait_s + 5.0)

    def _run(self) -> None:
        said = ""
        while not self._stopping.is_set():
            try:
                registration = self.source.open()
            except EventSourceError as e:
                problem = f"cannot watch NVML events, health comes from reads only: {e}"
                if problem != said:  # once per distinct problem, not every retry
                    log.warning("%s; retrying every %gs", problem, self.retry_s)
                    said = problem
                self._stopping.wait(self.retry_s)
                continue
            said = ""
            self._opened(registration)
            try:
                while not self._stopping.is_set():
                    event = self.source.wait(self.wait_s)
                    if event is not None:
                        self._record(event)
            except EventSourceError as e:
                log.warning("%s; marking every watched GPU unhealthy", e)
                self._mark(self._watched, f"the NVML event wait failed: {e}")
            except Exception:
                # A fault of ours, not the GPUs': say so, keep their health, and start again
                # rather than let the thread end unnoticed.
                log.exception("the XID watcher failed; opening the NVML events again")
            finally:
                self.registration = None
                self.source.close()
            self._stopping.wait(self.retry_s)

    def _opened(self, registration: Registration) -> None:
        self.registration = registration
        self._watched = registration.watched
        log.info(
            "watching critical XID events of %d GPUs (skipping XIDs %s)",
            len(registration.watched),
            ", ".join(str(x) for x in sorted(self.skip)) or "none",
        )
        for uuid, why in registration.unsupported:
            log.warning("GPU %s: no XID events (%s); its health comes from reads only", uuid, why)

    def _record(self, event: XidEvent) -> None:
        try:
            self._judge(event)
        finally:
            self.events_seen += 1  # after the mark: whoever sees the count sees the mark

    def _judge(self, event: XidEvent) -> None:
        if event.xid in self.skip:
            log.info("GPU %s: XID %d, an application fault; ignored", event.uuid, event.xid)
            return
        when = rfc3339(self.wall_clock())
        if event.uuid is None:
            log.warning("critical XID %d on a GPU NVML cannot name: all GPUs marked", event.xid)
            self._mark(self._watched, f"critical XID {event.xid} at {when} on an unnamed GPU")
            return
        log.warning("GPU %s: critical XID %d; marked unhealthy", event.uuid, event.xid)
        self._mark([event.uuid], f"critical XID {event.xid} at {when}")

    def _mark(self, uuids: Iterable[str], reason: str) -> None:
        wait = f"; healthy again after {self.recovery_s:g}s of good reads without another"
        with self._lock:
            for uuid in uuids:
                self._marks[uuid] = _Mark(reason=reason + wait)

    # --- the inventory --------------------------------------------------------------------

    def unhealthy(self) -> dict[str, str]:
        """The GPUs events made unhealthy, with why."""
        with self._lock:
            return {uuid: mark.reason for uuid, mark in self._marks.items()}

    def apply(self, inventory: Inventory) -> Inventory:
        """``inventory`` with every marked GPU unhealthy; a GPU whose reads have been good for
        ``recovery_s`` since its last event is unmarked (and healthy, if its read says so)."""
        now = self.clock()
        changed = False
        gpus = []
        with self._lock:
            for gpu in inventory.gpus:
                mark = self._marks.get(gpu.uuid)
                if mark is None:
                    gpus.append(gpu)
                    continue
                if not gpu.healthy:
                    mark.clean_since = None  # a failed read starts the wait again
                    gpus.append(gpu)
                    continue
                if mark.clean_since is None:
                    mark.clean_since = now
                if now - mark.clean_since >= self.recovery_s:
                    del self._marks[gpu.uuid]
                    log.info("GPU %s: healthy again (%s)", gpu.uuid, mark.reason.split(";")[0])
                    gpus.append(gpu)
                    continue
                gpus.append(dataclasses.replace(gpu, healthy=False, problem=mark.reason))
                changed = True
        return dataclasses.replace(inventory, gpus=tuple(gpus)) if changed else inventory


class HealthChecked:
    """An ``InventorySource`` whose GPUs are also judged by ``XidHealth``'s events."""

    def __init__(self, inner: InventorySource, health: XidHealth) -> None:
        self.inner = inner
        self.health = health

    def read(self) -> Inventory:
        return self.health.apply(self.inner.read())
