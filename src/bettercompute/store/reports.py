"""Node reports on their allocations: bound, failed, releasing, released.

One entry point for every node, real or simulated. A report is accepted only for an allocation
placed on the reporting node; one naming another node's allocation is ignored exactly like an
unknown one. The report moves the allocation and wakes its reservation's reconcile, which
judges it; nothing here changes a reservation's state.

Attested bindings: given ``attest`` (the service's check of the node's signature and
certificate), a bound report counts only when the check passes, inside the same transaction
that reads the node's revocations. Then the binding is what the node signed, marked
``attested``, and the signed bytes are kept as received. A report that fails the check never
binds: in an allocation still binding nothing counts; a bound one is lost (its reservation
shows ``Degraded/BindingLost``); either way ``reservation.binding-rejected`` is published with
the reason. A genuine but old signed report played again (its ``reportedAt`` before the last
one accepted, or that same one after the binding was lost) is rejected the same way. Node
leases (binding ``node``) are exempt. Only bound reports are checked: failed,
releasing and released reports cannot make anything count.

A bound report of a ``kubernetes`` binding names the pods holding its devices (``pods``) and
those outside its Reservation's namespace (``intruders``); the reconcile turns the latter into
``Degraded/PodOutsideNamespace``.

A bound report's ``cgroupParent`` is kept only when it is exactly the slice the node makes for
that allocation (``ids.cgroup_slice``) and the allocation is a ``hold``: a node cannot point a
reservation at another allocation's slice, nor give a ``kubernetes`` binding (whose pods live in
the kubelet's cgroups) a slice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from bettercompute.core import attestation, errors, ids
from bettercompute.store import clock, journal, placing
from bettercompute.store.database import Conn, Database, jsonb

REPORT_KINDS = ("bound", "failed", "releasing", "released")

#: Checks a bound report given (reservation id, now, the node's revocations); raises
#: ``AttestationError`` with the reason it does not count.
Attest = Callable[[str, datetime, attestation.Revocations], attestation.AttestedBinding]


async def report(
    db: Database,
    *,
    node_id: str,
    allocation_id: str,
    kind: str,
    details: Mapping[str, Any],
    attest: Attest | None = None,
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
        signed: attestation.AttestedBinding | None = None
        # Node leases (binding 'node') are bound by the deploy workflow that verified the
        # machine, not by a node's own report: they are exempt, as the guide says.
        if kind == "bound" and attest is not None and alloc["binding"] != "node":
            now = await clock.current_time(conn)
            try:
                signed = attest(
                    alloc["reservation_id"], now, await revocations(conn, node_id=node_id)
                )
            except attestation.AttestationError as e:
                await _reject(conn, alloc, pool_id=pool_row["pool_id"], reason=e.reason)
                return False
            previous = alloc["bound_report"]
            if attestation.is_replay(
                signed,
                None if previous is None else bytes(previous),
                lost=alloc["state"] == "lost",
            ):
                await _reject(conn, alloc, pool_id=pool_row["pool_id"], reason=attestation.STALE)
                return False
            details = {"cdiDevices": list(signed.cdi_devices), "attested": True}
            if signed.env_file:
                details["envFile"] = signed.env_file
            if signed.cgroup_parent:
                details["cgroupParent"] = signed.cgroup_parent
            if signed.pods:
                details["pods"] = list(signed.pods)
            if signed.intruders:
                details["intruders"] = list(signed.intruders)
        details = _kept_details(details, allocation_id=allocation_id, binding=alloc["binding"])
        report_body = {**(alloc["report"] or {}), **details, "kind": kind}
        if kind == "bound" and signed is None:
            report_body.pop("attested", None)
        if kind == "bound":
            # The binding is exactly what this report says: nothing of an earlier one lingers.
            report_body = {k: v for k, v in report_body.items() if k in details or k == "kind"}
        await conn.execute(
            "UPDATE allocations SET state = %s, report = %s, updated_at = compute_now(),"
            " bound_at = CASE WHEN %s = 'bound' THEN compute_now() ELSE bound_at END,"
            " bound_report = CASE WHEN %s THEN %s ELSE bound_report END,"
            " bound_sig = CASE WHEN %s THEN %s ELSE bound_sig END,"
            " bound_sig_kid = CASE WHEN %s THEN %s ELSE bound_sig_kid END,"
            " bound_certificate = CASE WHEN %s THEN %s ELSE bound_certificate END"
            " WHERE id = %s",
            (
                new_state,
                jsonb(report_body),
                new_state,
                *(signed is not None, signed and signed.payload),
                *(signed is not None, signed and signed.signature),
                *(signed is not None, signed and signed.key_id),
                *(signed is not None, signed and signed.certificate_pem),
                allocation_id,
            ),
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


async def revocations(conn: Conn, *, node_id: str) -> attestation.Revocations:
    """The node's revoked certificates: those issued before its cut-off, and revoked serials."""
    before = await (
        await conn.execute(
            "SELECT revoked_before FROM node_certificate_revocations WHERE node_id = %s",
            (node_id,),
        )
    ).fetchone()
    serials = await (await conn.execute("SELECT serial FROM revoked_certificates")).fetchall()
    return attestation.Revocations(
        before=before["revoked_before"] if before else None,
        serials=frozenset(int(row["serial"]) for row in serials),
    )


async def revoke_node_certificates(db: Database, *, node_id: str) -> None:
    """Every certificate issued to ``node_id`` up to now stops counting, for good."""
    async with db.transaction() as conn:
        await conn.execute(
            "INSERT INTO node_certificate_revocations (node_id, revoked_before)"
            " VALUES (%s, compute_now()) ON CONFLICT (node_id) DO UPDATE"
            " SET revoked_before = greatest(node_certificate_revocations.revoked_before,"
            " excluded.revoked_before), updated_at = compute_now()",
            (node_id,),
        )


async def revoke_certificate(db: Database, *, serial: int) -> None:
    """The certificate with ``serial`` stops counting, for good."""
    async with db.transaction() as conn:
        await conn.execute(
            "INSERT INTO revoked_certificates (serial) VALUES (%s) ON CONFLICT DO NOTHING",
            (serial,),
        )


async def _reject(conn: Conn, alloc: Mapping[str, Any], *, pool_id: str, reason: str) -> None:
    """A bound report that did not check out: it never binds, and says so in the outbox."""
    lost = alloc["state"] == "bound"
    await conn.execute(
        "UPDATE allocations SET state = CASE WHEN state = 'bound' THEN 'lost' ELSE state END,"
        " report = CASE WHEN state = 'bound' THEN %s ELSE report END,"
        # The last accepted signed report stays: a replay of it is still told apart.
        " bound_at = NULL, updated_at = compute_now() WHERE id = %s",
        (jsonb({"kind": "rejected", "reason": reason}), alloc["id"]),
    )
    await journal.emit(
        conn,
        "reservation.binding-rejected",
        reservation_id=alloc["reservation_id"],
        data={
            "state": alloc["reservation_state"],
            "poolId": pool_id,
            "allocationId": alloc["id"],
            "nodeId": alloc["node_id"],
            "reason": reason,
            "bindingLost": lost,
        },
    )
    if lost:
        await journal.wake(conn, reservation_id=alloc["reservation_id"], at=None, why="rejected")


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


def _kept_details(
    details: Mapping[str, Any], *, allocation_id: str, binding: str | None
) -> dict[str, Any]:
    """``details`` without a ``cgroupParent`` that is not this hold allocation's own slice,
    and without a bound report's pods unless the binding is ``kubernetes`` (only the kubelet's
    pods can hold devices)."""
    kept = dict(details)
    parent = kept.pop("cgroupParent", None)
    if (binding or "hold") == "hold" and parent == ids.cgroup_slice(allocation_id):
        kept["cgroupParent"] = parent
    if binding != "kubernetes":
        kept.pop("intruders", None)
    return kept
