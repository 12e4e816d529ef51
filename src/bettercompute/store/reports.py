"""Node reports on their allocations: bound, failed, releasing, released.

One entry point for every node, real or simulated. A report is accepted only for an allocation
placed on the reporting node; one naming another node's allocation is ignored exactly like an
unknown one. The report moves the allocation and wakes its reservation's reconcile, which
judges it; nothing here changes a reservation's state.

Signed reports: given ``attest`` (the service's check of the node's signature and
certificate), every report counts only when the check passes, inside the same transaction
that reads the node's revocations: a ``failed`` report re-places or fails a reservation and a
``released`` one frees booked devices, so an unproven one is as dangerous as a forged binding.
A bound report's binding is then what the node signed, marked ``attested``, and the signed
bytes are kept as received; a releasing report's pods and start are the signed ones. A report
that fails the check changes nothing, but for a bound one of an allocation that was bound: that
binding is lost (its reservation shows ``Degraded/BindingLost``). Either way
``reservation.binding-rejected`` is published with the reason. A genuine but old signed report
played again (its ``reportedAt`` before that of the last report accepted for the allocation,
of any phase; or, bound, that same one after the binding was lost) is rejected the same way.
Node leases (binding ``node``) are exempt.

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

#: Checks a report given (reservation id, phase, now, the node's revocations); raises
#: ``AttestationError`` with the reason it does not count.
Attest = Callable[[str, str, datetime, attestation.Revocations], attestation.AttestedReport]
#: A report kind → the phase its node signs.
PHASES = {"bound": "Bound", "failed": "Failed", "releasing": "Releasing", "released": "Released"}


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
        signed: attestation.AttestedReport | None = None
        # Node leases (binding 'node') are bound by the deploy workflow that verified the
        # machine, not by a node's own report: they are exempt, as the guide says.
        if attest is not None and alloc["binding"] != "node":
            now = await clock.current_time(conn)
            pool_id = pool_row["pool_id"]
            try:
                signed = attest(
                    alloc["reservation_id"],
                    PHASES[kind],
                    now,
                    await revocations(conn, node_id=node_id),
                )
            except attestation.AttestationError as e:
                await _reject(conn, alloc, kind=kind, pool_id=pool_id, reason=e.reason)
                return False
            stale = _stale(signed, alloc, kind=kind)
            if stale is not None:
                await _reject(conn, alloc, kind=kind, pool_id=pool_id, reason=stale)
                return False
            details = _signed_details(signed, kind=kind, relayed=details)
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


def _stale(
    signed: attestation.AttestedReport, alloc: Mapping[str, Any], *, kind: str
) -> str | None:
    """Why a genuine signed report is an old one played again, or ``None``: its ``reportedAt``
    is before that of the last report accepted for the allocation (the bound one kept, or the
    last other one), or it is the bound report accepted before a binding lost since."""
    previous = None if alloc["bound_report"] is None else bytes(alloc["bound_report"])
    last_other = (alloc["report"] or {}).get("reportedAt")
    if kind == "bound":
        if attestation.is_replay(signed, previous, lost=alloc["state"] == "lost"):
            return attestation.STALE
        return attestation.STALE if attestation.is_stale(signed.reported_at, last_other) else None
    for then in (attestation.reported_at(previous), last_other):
        if attestation.is_stale(signed.reported_at, then):
            return attestation.STALE_REPORT
    return None


def _signed_details(
    signed: attestation.AttestedReport, *, kind: str, relayed: Mapping[str, Any]
) -> dict[str, Any]:
    """What a checked report says: the signed fields, whatever the relayed copy claims; a
    failed report's ``reason`` is relayed as is (an explanation for people, not signed)."""
    details: dict[str, Any] = {"reportedAt": signed.reported_at}
    if kind == "bound":
        details |= {"cdiDevices": list(signed.cdi_devices), "attested": True}
        if signed.env_file:
            details["envFile"] = signed.env_file
        if signed.cgroup_parent:
            details["cgroupParent"] = signed.cgroup_parent
        if signed.pods:
            details["pods"] = list(signed.pods)
        if signed.intruders:
            details["intruders"] = list(signed.intruders)
    elif kind == "releasing":
        details["pods"] = list(signed.pods)
        if signed.since is not None:
            details["since"] = signed.since
    elif kind == "failed" and relayed.get("reason"):
        details["reason"] = relayed["reason"]
    return details


async def _reject(
    conn: Conn, alloc: Mapping[str, Any], *, kind: str, pool_id: str, reason: str
) -> None:
    """A report that did not check out: it changes nothing (but a bound allocation that gets a
    bad bound report loses its binding), and says so in the outbox."""
    lost = kind == "bound" and alloc["state"] == "bound"
    if kind == "bound":
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
