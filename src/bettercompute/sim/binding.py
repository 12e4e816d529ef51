"""A simulated node's agent: bind and release allocations like a real node does.

Why: ``better-compute dev --sim N`` and the tests need reservations that really go
``placed → binding → active → released`` without hardware. The agent converges, level-triggered,
on what the control plane says its node should hold: every pass it reads the node's desired
allocations, writes the CDI spec and env file of each one to bind and reports ``bound`` with the
CDI device names and the env file's path, removes the files of each one releasing and reports
``released``, and deletes files no allocation of its node explains any more (a re-placement or
a cancel drops allocations outright). It reports through the same service call a real node
uses. Restarting it is harmless: a bound allocation whose files are intact is left alone.

What it must never do: change state except by a report, write outside its root (see
``devicefiles``), or import the store: it sees the control plane through two small ports.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bettercompute.deviceplugin import devicefiles
from bettercompute.deviceplugin.devicefiles import Allocation, DeviceFileError, DeviceFiles

log = logging.getLogger(__name__)

#: How often an agent looks for work. A dev tool: a reservation should be active in well under
#: a second, and a handful of nodes polling a local database costs nothing.
POLL_SECONDS = 0.3


class DesiredState(Protocol):
    """``service.nodes.NodeService``: the allocations a node should hold now."""

    async def desired(self, node_id: str) -> list[dict[str, Any]]: ...


class Reports(Protocol):
    """``service.reservations.ReservationService``: a node's report on one allocation."""

    async def report(
        self, *, node_id: str, allocation_id: str, kind: str, details: Mapping[str, Any]
    ) -> bool: ...


@dataclass
class Pass:
    """What one pass did, by allocation id."""

    bound: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


class NodeAgent:
    """The agent of one simulated node, writing its files under ``root``."""

    def __init__(
        self,
        *,
        node_id: str,
        root: Path,
        desired: DesiredState,
        reports: Reports,
        poll_seconds: float = POLL_SECONDS,
        retry_on: tuple[type[Exception], ...] = (OSError,),
    ):
        self.node_id = node_id
        self.files = DeviceFiles(root)
        self._desired = desired
        self._reports = reports
        self._poll = poll_seconds
        # Failures a pass may meet that the next pass can heal (the database restarting): the
        # composition root names them, since the agent cannot know the store's errors.
        self._retry_on = retry_on

    async def run(self) -> None:
        """Pass after pass until cancelled; a failed pass is logged once and retried."""
        last_problem = ""
        while True:
            try:
                await self.sync_once()
                last_problem = ""
            except self._retry_on as e:
                if str(e) != last_problem:
                    log.warning("node %s: pass failed, retrying: %s", self.node_id, e)
                last_problem = str(e)
            await asyncio.sleep(self._poll)

    async def sync_once(self) -> Pass:
        """One pass: converge the node's files on its desired allocations and report."""
        done = Pass()
        keep: set[str] = set()
        for item in await self._desired.desired(self.node_id):
            allocation_id = str(item["allocationId"])
            if item["state"] == "releasing":
                await self._release(allocation_id, done)
                continue
            keep.add(allocation_id)
            await self._bind(item, done)
        for allocation_id in sorted(self.files.allocation_ids() - keep):
            if allocation_id in done.released:
                continue
            self.files.remove(allocation_id)
            done.removed.append(allocation_id)
            log.info("node %s: removed leftover files of %s", self.node_id, allocation_id)
        return done

    async def _bind(self, item: Mapping[str, Any], done: Pass) -> None:
        allocation_id = str(item["allocationId"])
        try:
            allocation = Allocation.from_desired(item)
            if item["state"] == "bound":
                # Already bound: only put back files that went missing or were changed.
                if not self.files.matches(allocation):
                    self.files.write(allocation)
                    done.restored.append(allocation_id)
                return
            self.files.write(allocation)
        except (DeviceFileError, OSError) as e:
            # A real node refuses what it cannot deliver; the reconciler re-places it.
            await self._reports.report(
                node_id=self.node_id,
                allocation_id=allocation_id,
                kind="failed",
                details={"reason": str(e)},
            )
            done.failed.append(allocation_id)
            log.warning("node %s: cannot bind %s: %s", self.node_id, allocation_id, e)
            return
        details = {
            "cdiDevices": allocation.cdi_devices,
            "envFile": str(self.files.env_path(allocation_id)),
        }
        if await self._reports.report(
            node_id=self.node_id, allocation_id=allocation_id, kind="bound", details=details
        ):
            done.bound.append(allocation_id)
            log.info("node %s: bound %s", self.node_id, allocation_id)

    async def _release(self, allocation_id: str, done: Pass) -> None:
        try:
            devicefiles.check_allocation_id(allocation_id)
        except DeviceFileError:
            pass  # never written, so nothing to remove
        else:
            self.files.remove(allocation_id)
        if await self._reports.report(
            node_id=self.node_id, allocation_id=allocation_id, kind="released", details={}
        ):
            done.released.append(allocation_id)
            log.info("node %s: released %s", self.node_id, allocation_id)
