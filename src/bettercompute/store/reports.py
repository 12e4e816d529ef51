"""Node reports on their allocations: bound, failed, releasing, released.

One entry point for every node, real or simulated. A report is accepted only for an allocation
placed on the reporting node; one naming another node's allocation is ignored exactly like an
unknown one. The report moves the allocation and wakes its reservation's reconcile, which
judges it; nothing here changes a reservation's state.

A bound report's ``cgroupParent`` is kept only when it is exactly the slice the node makes for
that allocation (``ids.cgroup_slice``) and the allocation is a ``hold``: a node cannot point a
reservation at another allocation's slice, nor give a ``kubernetes`` binding (whose pods live in
the kubelet's cgroups) a slice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bettercompute.core import errors, ids
from bettercompute.store import clock, journal, placing
from bettercompute.store.database import Database, jsonb

REPORT_KINDS = ("bound", "failed", "releasing", "released")


async def report(
    db: Database, *, node_id: str, allocation_id: str, kind: str, details: Mapping[str, Any]
) -> bool:
    """A node's report on one of its allocations; ``False`` when ignored.

    A report is accepted only for an allocation placed on the reporting node: one naming
    another node's allocation is ignored exactly like an unknown one.
    """
    if kind not in REPORT_KINDS:
        raise errors.invalid_input("kind", f"must be one of {', '.join(REPORT_KINDS)}")
    async with db.transaction() as conn:
        pool_row = await (
            await conn.execute(
                "SELECT r.pool_id FROM allocations a JOIN reservations r"
                " ON r.id = a.reservation_id WHERE a.id = %s AND a.node_id = %s",
                (allocation_id, node_id),
            )
        ).fetchone()
        if pool_row is None:
            return False
        await placing.lock_pool(conn, pool_row["pool_id"])
        alloc = await (
            await conn.execute(
                "SELECT a.*, r.state AS reservation_state, r.request ->> 'binding' AS binding"
                "  FROM allocations a JOIN reservations r ON r.id = a.reservation_id"
                " WHERE a.id = %s AND a.node_id = %s FOR UPDATE OF a",
                (allocation_id, node_id),
            )
        ).fetchone()
        if alloc is None:
            return False
        new_state = _next_allocation_state(alloc["state"], kind)
        if new_state is None:
            return False
        kept = _kept_details(details, allocation_id=allocation_id, binding=alloc["binding"])
        report_body = {**(alloc["report"] or {}), **kept, "kind": kind}
        await conn.execute(
            "UPDATE allocations SET state = %s, report = %s, updated_at = compute_now(),"
            " bound_at = CASE WHEN %s = 'bound' THEN compute_now() ELSE bound_at END"
            " WHERE id = %s",
            (new_state, jsonb(report_body), new_state, allocation_id),
        )
        if new_state == "released" and alloc["state"] == "releasing":
            # The node confirmed its devices are free: end the held booking now.
            now = await clock.current_time(conn)
            await conn.execute(
                "DELETE FROM bookings WHERE allocation_id = %s AND lower(during) >= %s",
                (allocation_id, now),
            )
            await conn.execute(
                "UPDATE bookings SET during = tstzrange(lower(during), %s)"
                " WHERE allocation_id = %s AND upper(during) > %s",
                (now, allocation_id, now),
            )
            await journal.wake_pending(conn, pool_id=pool_row["pool_id"])
        await journal.wake(conn, reservation_id=alloc["reservation_id"], at=None, why=kind)
    return True


def _kept_details(
    details: Mapping[str, Any], *, allocation_id: str, binding: str | None
) -> dict[str, Any]:
    """``details`` without a ``cgroupParent`` that is not this hold allocation's own slice."""
    kept = dict(details)
    parent = kept.pop("cgroupParent", None)
    if (binding or "hold") == "hold" and parent == ids.cgroup_slice(allocation_id):
        kept["cgroupParent"] = parent
    return kept


def _next_allocation_state(current: str, kind: str) -> str | None:
    """The allocation's state after a report, or ``None`` to ignore the report."""
    table: dict[tuple[str, str], str] = {
        ("planned", "bound"): "bound",  # early: judged once the start is reached
        ("desired", "bound"): "bound",
        ("lost", "bound"): "bound",
        ("bound", "bound"): "bound",
        ("planned", "failed"): "failed",
        ("desired", "failed"): "failed",
        ("bound", "released"): "lost",
        ("bound", "failed"): "lost",
        ("releasing", "releasing"): "releasing",
        ("releasing", "released"): "released",
    }
    return table.get((current, kind))
