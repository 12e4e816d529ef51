"""This node's DeviceAllocation objects: the converger's two ports, kept current by one watch.

Why it exists: ``converging.Converger`` asks for the desired allocations every pass (every
second while anything is releasing) and writes each status change. Listing the API server once a
second from every GPU node would be the cluster's heaviest load, so this adapter does what an
informer does: one list (``labelSelector=bcd.dev/node=<node>`` in the operator's namespace),
then one watch from the list's ``resourceVersion`` that applies every event to an in-memory copy
and wakes the converger. ``desired()`` answers from that copy, so a new allocation is bound as
fast as the watch delivers it, not at the next pass.

- The copy is complete or absent: until the first list succeeds ``desired()`` lists (and
  raises ``KubeError`` if it cannot). While the watch reconnects the copy is the last
  complete state, never a partial one.
- A broken watch reconnects with exponential backoff from the last ``resourceVersion`` it saw
  (bookmarks included); a ``410 Gone`` (the version is too old) lists again.
- ``report()`` merge-patches the object's ``/status``. The object is found by its
  ``spec.allocationId`` in the copy, else by the operator's naming rule (``_`` → ``-``,
  lowercased). "Not found" is ignored (the object was deleted: nobody will read the status),
  as is an answer that can never succeed (400, 422), which is logged; anything else raises
  ``KubeError`` so the converger's next pass reports again.

Who calls it: ``agent`` (the composition root). What it must never do: decide anything about an
allocation (the converger does), write ``spec``, or return a partial list.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from bettercompute.kube import names, resources
from bettercompute.kube.allocations import allocation_name
from bettercompute.kube.client import WATCH_TIMEOUT_SECONDS, KubeClient, KubeError

log = logging.getLogger(__name__)

#: A watch that ends sooner than this without an event counts as a failure (backoff applies).
MIN_WATCH_SECONDS = 1.0


class Backoff:
    """Exponential delays between ``initial_s`` and ``max_s``; ``reset`` after a success."""

    def __init__(self, *, initial_s: float = 0.5, max_s: float = 30.0) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self._next = initial_s

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self._next = self.initial_s


class AllocationObjects:
    """``DesiredAllocations``, ``StatusReporter`` and ``PodWarnings`` over this node's
    DeviceAllocations (and its pods' Events)."""

    def __init__(
        self,
        *,
        client: KubeClient,
        namespace: str,
        node_name: str,
        backoff: Backoff | None = None,
        watch_timeout_s: int = WATCH_TIMEOUT_SECONDS,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.node_name = node_name
        self.backoff = backoff or Backoff()
        self.watch_timeout_s = watch_timeout_s
        self.labels = {names.NODE_LABEL: node_name}
        # Object name -> object, as of ``_version``; None until the first list.
        self._objects: dict[str, dict[str, Any]] | None = None
        self._version: str | None = None
        # A list racing the watch could put an older copy over a newer one: one at a time,
        # and only when there is no copy (desired) or it is known stale (410, in follow).
        self._listing = asyncio.Lock()
        self._last_problem = ""
        #: Watch events applied (for tests and logs).
        self.events = 0

    # --- the converger's ports -------------------------------------------------------------

    async def desired(self) -> list[dict[str, Any]]:
        """Every spec addressed to this node (those with ``release: true`` included)."""
        if self._objects is None:
            async with self._listing:
                if self._objects is None:
                    await self._list()
        assert self._objects is not None
        return [
            copy.deepcopy(obj["spec"])
            for _, obj in sorted(self._objects.items())
            if isinstance(obj.get("spec"), dict)
        ]

    async def report(self, *, allocation_id: str, status: Mapping[str, Any]) -> None:
        """Merge-patch ``status`` onto the allocation's object."""
        name = self._name_of(allocation_id)
        try:
            patched = await self.client.patch(
                resources.DEVICE_ALLOCATIONS,
                name,
                {"status": dict(status)},
                namespace=self.namespace,
                status=True,
            )
        except KubeError as e:
            if e.status in (400, 422):
                # The API refuses this status for good: retrying every pass would only stall
                # the other allocations' reports.
                log.error("%s: the API refused its %s status: %s", allocation_id, status, e)
                return
            raise
        if patched is None:
            log.info("%s: object %s is gone; %s not written", allocation_id, name, status)

    async def warn(self, *, pod: str, reason: str, message: str) -> None:
        """A Warning Event on ``pod`` (``namespace/name``); best effort: a refusal is logged."""
        namespace, _, name = pod.partition("/")
        try:
            await self.client.post_event(
                involved={
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "namespace": namespace},
                },
                type_="Warning",
                reason=reason,
                message=message,
                namespace=namespace,
                component="device-plugin",
            )
        except KubeError as e:
            log.warning("cannot post a Warning Event on pod %s: %s", pod, e)

    def _name_of(self, allocation_id: str) -> str:
        for name, obj in (self._objects or {}).items():
            if (obj.get("spec") or {}).get("allocationId") == allocation_id:
                return name
        return allocation_name(allocation_id)

    # --- the watch -------------------------------------------------------------------------

    async def follow(self, *, wake: Callable[[], None]) -> None:
        """Keep the copy current until cancelled, calling ``wake`` after every change."""
        while True:
            started = time.monotonic()
            applied = 0
            try:
                if self._objects is None or self._version is None:
                    async with self._listing:
                        await self._list()
                    wake()
                assert self._version is not None
                async for kind, obj in self.client.watch(
                    resources.DEVICE_ALLOCATIONS,
                    namespace=self.namespace,
                    labels=self.labels,
                    resource_version=self._version,
                    timeout_s=self.watch_timeout_s,
                ):
                    if self._apply({"type": kind, "object": obj}):
                        applied += 1
                        wake()
                    self.backoff.reset()
                    self._last_problem = ""
            except KubeError as e:
                if e.status != 410:
                    self._say(f"watching DeviceAllocations failed: {e}")
                    await asyncio.sleep(self.backoff.next())
                    continue
                log.info("DeviceAllocation watch: %s; listing again", e.message)
                self._version = None
            if not applied and time.monotonic() - started < MIN_WATCH_SECONDS:
                # A server that ends every watch (or answers 410) at once must not make us spin.
                await asyncio.sleep(self.backoff.next())

    async def _list(self) -> None:
        items, version = await self.client.list_from(
            resources.DEVICE_ALLOCATIONS, namespace=self.namespace, labels=self.labels
        )
        if not version:
            raise KubeError(
                status=0,
                reason="BadAnswer",
                message="the list has no resourceVersion to watch from",
            )
        self._objects = {str(item["metadata"]["name"]): item for item in items if _named(item)}
        self._version = version
        log.info(
            "%d DeviceAllocations for node %s (resourceVersion %s)",
            len(self._objects),
            self.node_name,
            version,
        )

    def _apply(self, event: Mapping[str, Any]) -> bool:
        """Apply one watch event to the copy; whether the copy changed."""
        obj = event["object"]
        meta = obj.get("metadata") or {}
        version = meta.get("resourceVersion")
        if version:
            self._version = str(version)
        kind = event.get("type")
        if kind == "BOOKMARK" or not _named(obj) or self._objects is None:
            return False
        self.events += 1
        if kind == "DELETED":
            return self._objects.pop(str(meta["name"]), None) is not None
        if kind in ("ADDED", "MODIFIED"):
            self._objects[str(meta["name"])] = obj
            return True
        return False

    def _say(self, problem: str) -> None:
        if problem != self._last_problem:
            log.warning("%s (retrying with backoff up to %ss)", problem, self.backoff.max_s)
            self._last_problem = problem


def _named(obj: Mapping[str, Any]) -> bool:
    meta = obj.get("metadata")
    return isinstance(meta, dict) and isinstance(meta.get("name"), str)
