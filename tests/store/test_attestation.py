"""Attested bindings against the service and the real PostgreSQL: only a bound report signed by
the node's own current, unrevoked certificate from a trusted authority, saying exactly "this
allocation is bound", activates a reservation. Each attack below is tried the way an attacker
with write access to reports would, and each is refused with its reason in the outbox.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from cryptography import x509

from bettercompute.core import attestation
from bettercompute.core.attestation import CertificateAuthority
from bettercompute.deviceplugin.signing import NodeKey, Report, rfc3339
from bettercompute.iam import policies
from bettercompute.service.nodes import NodeService
from bettercompute.service.reservations import ReservationService
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database
from tests.conftest import ROOT, caller
from tests.store.test_lifecycle import (
    K8S_LABEL,
    advance,
    allocations,
    bookings,
    cdi,
    condition,
    conditions,
    create,
    events,
    get,
    now,
    now_ms,
    run,
    world,
)
from tests.support import nodecerts

REJECTED = "reservation.binding-rejected"


@pytest.fixture
def attested(db: Database) -> ReservationService:
    return ReservationService(
        db=db,
        policy=policies.CedarPolicyEngine.from_text(policies.DEFAULT_POLICIES),
        budget=DatabaseBudget(db),
        root_tenant_id=ROOT,
        attestation=nodecerts.TRUST,
    )


class Node:
    """A node's key and certificate, signing reports like the node agent does."""

    def __init__(self, name: str, certificate: str | None = None, key: NodeKey | None = None):
        self.name = name
        self.key = key or NodeKey.generate()
        self.certificate = certificate or nodecerts.certify(name, self.key)

    def signed(self, alloc: dict[str, Any], rid: str, at_ms: int, **changes: Any) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "node_name": self.name,
            "allocation_id": alloc["id"],
            "reservation_id": rid,
            "phase": "Bound",
            "cdi_devices": tuple(cdi(alloc["device_ids"])),
            "env_file": f"/run/bcd/allocations/{alloc['id']}.env",
            "reported_at": rfc3339(at_ms),
        }
        fields.update(changes)
        block: dict[str, Any] = dict(self.key.sign(Report(**fields)))
        block["certificate"] = self.certificate
        return block


#: A report kind → what a node signs with it beside the phase (as the node agent does).
SIGNED_AS = {
    "failed": {"phase": "Failed", "cdi_devices": (), "env_file": None},
    "releasing": {"phase": "Releasing", "cdi_devices": (), "env_file": None},
    "released": {"phase": "Released", "cdi_devices": (), "env_file": None},
}


async def signed_report(
    service: ReservationService,
    node: Node,
    alloc: dict[str, Any],
    rid: str,
    kind: str,
    at_ms: int,
    **details: Any,
) -> bool:
    """A failed, releasing or released report signed by ``node``, as its agent sends it."""
    changes = dict(SIGNED_AS[kind])
    if kind == "releasing":
        changes |= {"pods": tuple(details.get("pods", ())), "since": details.get("since")}
    signature = node.signed(alloc, rid, at_ms, **changes)
    return await service.report(
        node_id=alloc["node_id"],
        allocation_id=alloc["id"],
        kind=kind,
        details={**details, "signature": signature},
    )


async def bound(
    service: ReservationService, alloc: dict[str, Any], signature: dict[str, Any] | None
) -> bool:
    details: dict[str, Any] = {"cdiDevices": cdi(alloc["device_ids"])}
    if signature is not None:
        details["signature"] = signature
    return await service.report(
        node_id=alloc["node_id"], allocation_id=alloc["id"], kind="bound", details=details
    )


async def binding(db: Database, service: ReservationService, key: str) -> tuple[str, dict]:
    await world(db, nodes=1)
    rid = (await create(service, key))["id"]
    await run(db)
    assert (await get(service, rid))["state"] == "binding"
    [alloc] = await allocations(db, rid)
    return rid, alloc


async def rejections(db: Database, rid: str) -> list[dict[str, Any]]:
    return [data for kind, data in await events(db, rid) if kind == REJECTED]


async def assert_refused(
    db: Database, service: ReservationService, rid: str, alloc: dict[str, Any], reason: str
) -> None:
    """Nothing counted: the allocation is not bound, the reservation still binding, and the
    reason is published."""
    await run(db)
    assert (await get(service, rid))["state"] == "binding"
    [after] = await allocations(db, rid)
    assert after["state"] == "desired"
    async with db.connection() as conn:
        row = await (
            await conn.execute("SELECT bound_at FROM allocations WHERE id = %s", (alloc["id"],))
        ).fetchone()
    assert row is not None
    assert row["bound_at"] is None
    [event] = await rejections(db, rid)
    assert event["reason"] == reason
    assert event["allocationId"] == alloc["id"]
    assert event["nodeId"] == alloc["node_id"]


async def test_a_genuine_signed_report_activates_with_what_the_node_signed(
    db: Database, attested: ReservationService
) -> None:
    rid, alloc = await binding(db, attested, "good")
    node = Node(alloc["node_id"])
    signature = node.signed(alloc, rid, await now_ms(db))
    # The relayed, unsigned fields claim other devices: only the signed ones count.
    details = {"cdiDevices": ["bcd.dev/gpu=forged"], "envFile": "/tmp/x", "signature": signature}
    assert await attested.report(
        node_id=alloc["node_id"], allocation_id=alloc["id"], kind="bound", details=details
    )
    await run(db)
    view = await get(attested, rid)
    assert view["state"] == "active"
    assert view["binding"]["attested"] is True
    assert view["binding"]["cdiDevices"] == cdi(alloc["device_ids"])
    assert view["binding"]["envFile"] == f"/run/bcd/allocations/{alloc['id']}.env"
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT bound_report, bound_sig, bound_sig_kid, bound_certificate"
                " FROM allocations WHERE id = %s",
                (alloc["id"],),
            )
        ).fetchone()
    assert row is not None
    import base64

    # Kept exactly as received, so anyone can check the binding again later.
    assert bytes(row["bound_report"]) == base64.b64decode(signature["payload"])
    assert bytes(row["bound_sig"]) == base64.b64decode(signature["value"])
    assert row["bound_sig_kid"] == node.key.key_id
    assert row["bound_certificate"] == node.certificate
    assert await rejections(db, rid) == []


async def test_an_unsigned_report_binds_nothing(db: Database, attested: ReservationService) -> None:
    rid, alloc = await binding(db, attested, "unsigned")
    assert not await bound(attested, alloc, None)
    await assert_refused(db, attested, rid, alloc, "unsigned report")


async def test_a_signature_without_a_certificate_binds_nothing(
    db: Database, attested: ReservationService
) -> None:
    rid, alloc = await binding(db, attested, "nocert")
    signature = Node(alloc["node_id"]).signed(alloc, rid, await now_ms(db))
    del signature["certificate"]
    assert not await bound(attested, alloc, signature)
    await assert_refused(db, attested, rid, alloc, attestation.NO_CERTIFICATE)


async def test_a_report_signed_under_a_self_made_authority_binds_nothing(
    db: Database, attested: ReservationService
) -> None:
    rid, alloc = await binding(db, attested, "foreign")
    # The attacker's own CA, named like ours, certifying the attacker's key for this node.
    forged_ca = CertificateAuthority.generate(
        now=await now(db) - dt.timedelta(days=1), name="bcd test node-report CA"
    )
    key = NodeKey.generate()
    node = Node(
        alloc["node_id"], nodecerts.certify(alloc["node_id"], key, authority=forged_ca), key
    )
    assert not await bound(attested, alloc, node.signed(alloc, rid, await now_ms(db)))
    await assert_refused(
        db, attested, rid, alloc, "certificate is not issued by a trusted authority"
    )


async def test_a_self_signed_leaf_binds_nothing(db: Database, attested: ReservationService) -> None:
    rid, alloc = await binding(db, attested, "selfsigned")
    node = Node(alloc["node_id"])
    # The genuine certificate, but the signature made with a key it does not certify.
    other = NodeKey.generate()
    signature = Node(alloc["node_id"], node.certificate, other).signed(alloc, rid, await now_ms(db))
    assert not await bound(attested, alloc, signature)
    await assert_refused(
        db, attested, rid, alloc, f"signature.keyId: {other.key_id!r} is not this key"
    )


async def test_another_nodes_certificate_binds_nothing(
    db: Database, attested: ReservationService
) -> None:
    rid, alloc = await binding(db, attested, "othernode")
    # A genuine certificate and key of another node, signing a report that names this node.
    intruder = Node("gpu-intruder")
    signature = intruder.signed(alloc, rid, await now_ms(db), node_name=alloc["node_id"])
    assert not await bound(attested, alloc, signature)
    await assert_refused(
        db,
        attested,
        rid,
        alloc,
        f"certificate is for node 'gpu-intruder', not {alloc['node_id']!r}",
    )


@pytest.mark.parametrize(
    "changes",
    [
        {"allocation_id": "alloc_other"},
        {"reservation_id": "rsv_other"},
        {"phase": "Released", "cdi_devices": (), "env_file": None},
    ],
    ids=["other-allocation", "other-reservation", "not-bound"],
)
async def test_a_genuine_signature_over_another_report_binds_nothing(
    db: Database, attested: ReservationService, changes: dict[str, Any]
) -> None:
    rid, alloc = await binding(db, attested, f"replay-{sorted(changes)[0]}")
    node = Node(alloc["node_id"])
    signature = node.signed(alloc, rid, await now_ms(db), **changes)
    assert not await bound(attested, alloc, signature)
    await assert_refused(db, attested, rid, alloc, attestation.NOT_THIS_BINDING)


async def test_an_expired_certificate_counts_within_the_grace_and_not_after(
    db: Database, attested: ReservationService
) -> None:
    rid, alloc = await binding(db, attested, "expired")
    # Issued two hours ago for two minutes: past the validity and the hour of grace after it.
    issued = await now(db) - dt.timedelta(hours=2)
    key = NodeKey.generate()
    short = nodecerts.certify(alloc["node_id"], key, now=issued, lifetime=dt.timedelta(minutes=2))
    node = Node(alloc["node_id"], short, key)
    assert not await bound(attested, alloc, node.signed(alloc, rid, await now_ms(db)))
    await assert_refused(db, attested, rid, alloc, "certificate expired")


async def test_within_the_grace_an_expired_certificate_still_counts(
    db: Database, attested: ReservationService
) -> None:
    rid, alloc = await binding(db, attested, "grace")
    key = NodeKey.generate()
    # Issued 59 minutes ago for a minute: expired 58 minutes ago, still within the hour of grace.
    issued = await now(db) - dt.timedelta(minutes=59)
    short = nodecerts.certify(alloc["node_id"], key, now=issued, lifetime=dt.timedelta(minutes=1))
    node = Node(alloc["node_id"], short, key)
    assert await bound(attested, alloc, node.signed(alloc, rid, await now_ms(db)))
    await run(db)
    assert (await get(attested, rid))["state"] == "active"


async def test_a_revoked_node_certificate_binds_nothing_and_a_new_one_does(
    db: Database, attested: ReservationService
) -> None:
    rid, alloc = await binding(db, attested, "revoked")
    node = Node(alloc["node_id"])
    await NodeService(db).revoke_node_certificates(alloc["node_id"])
    assert not await bound(attested, alloc, node.signed(alloc, rid, await now_ms(db)))
    await assert_refused(db, attested, rid, alloc, "certificate revoked")

    # Re-enrolled later: a certificate issued after the revocation counts.
    await advance(db, 5)
    renewed = Node(alloc["node_id"], key=node.key, certificate=None)
    renewed.certificate = nodecerts.certify(alloc["node_id"], node.key, now=await now(db))
    assert await bound(attested, alloc, renewed.signed(alloc, rid, await now_ms(db)))
    await run(db)
    assert (await get(attested, rid))["state"] == "active"


async def test_a_revoked_serial_binds_nothing(db: Database, attested: ReservationService) -> None:
    rid, alloc = await binding(db, attested, "serial")
    node = Node(alloc["node_id"])
    serial = x509.load_pem_x509_certificate(node.certificate.encode()).serial_number
    await NodeService(db).revoke_certificate(serial)
    await NodeService(db).revoke_certificate(serial)  # twice: still one revocation
    assert not await bound(attested, alloc, node.signed(alloc, rid, await now_ms(db)))
    await assert_refused(db, attested, rid, alloc, "certificate revoked")


async def test_a_forged_re_report_of_an_active_binding_loses_it(
    db: Database, attested: ReservationService
) -> None:
    rid, alloc = await binding(db, attested, "forged-active")
    node = Node(alloc["node_id"])
    assert await bound(attested, alloc, node.signed(alloc, rid, await now_ms(db)))
    await run(db)
    assert (await get(attested, rid))["state"] == "active"

    # Someone rewrites the status: a new report, signed with the attacker's own key.
    await advance(db, 10)
    forged = node.signed(alloc, rid, await now_ms(db), cdi_devices=("bcd.dev/gpu=elsewhere",))
    forged["value"] = NodeKey.generate().sign(
        Report(
            node_name=alloc["node_id"], allocation_id=alloc["id"], reservation_id=rid, phase="Bound"
        )
    )["value"]
    assert not await bound(attested, alloc, forged)
    await run(db)
    view = await get(attested, rid)
    assert view["state"] == "active"
    assert conditions(view) == [("Degraded", "BindingLost")]
    assert [a["state"] for a in await allocations(db, rid)] == ["lost"]
    [event] = await rejections(db, rid)
    assert event["reason"] == "signature.value: does not verify over the payload"
    assert event["bindingLost"] is True

    # The genuine node reports again: bound, and the condition clears.
    await advance(db, 10)
    assert await bound(attested, alloc, node.signed(alloc, rid, await now_ms(db)))
    await run(db)
    view = await get(attested, rid)
    assert view["conditions"] == []
    assert view["binding"]["attested"] is True


async def test_an_old_genuine_report_played_again_binds_nothing(
    db: Database, attested: ReservationService
) -> None:
    rid, alloc = await binding(db, attested, "replay")
    node = Node(alloc["node_id"])
    first = node.signed(alloc, rid, await now_ms(db))
    assert await bound(attested, alloc, first)
    # The same report relayed again (an operator restart) while bound changes nothing.
    assert await bound(attested, alloc, first)
    await run(db)
    assert (await get(attested, rid))["state"] == "active"

    # The node loses its devices and says so; then the old Bound report is played again.
    await advance(db, 10)
    assert await signed_report(attested, node, alloc, rid, "released", await now_ms(db))
    assert not await bound(attested, alloc, first)
    await run(db)
    view = await get(attested, rid)
    assert conditions(view) == [("Degraded", "BindingLost")]
    [event] = await rejections(db, rid)
    assert event["reason"] == attestation.STALE

    # And one from before it, genuinely signed, is just as stale.
    older = node.signed(alloc, rid, await now_ms(db) - 60_000)
    assert not await bound(attested, alloc, older)
    assert [a["state"] for a in await allocations(db, rid)] == ["lost"]

    # The node's report of now binds again.
    await advance(db, 10)
    assert await bound(attested, alloc, node.signed(alloc, rid, await now_ms(db)))
    await run(db)
    assert conditions(await get(attested, rid)) == []


# --- every report that changes what is booked is proven, not only Bound ----------------------


async def test_attack_unsigned_failed_reports_never_fail_a_reservation(
    db: Database, attested: ReservationService
) -> None:
    """Whoever can write a DeviceAllocation's status wrote ``Failed`` three times: each one
    re-placed the reservation, and the third failed it. Unproven, none may count."""
    rid, first = await binding(db, attested, "failed-thrice")
    for _ in range(3):
        [alloc] = await allocations(db, rid)
        details = {"reason": "resources-exhausted"}
        assert not await attested.report(
            node_id=alloc["node_id"], allocation_id=alloc["id"], kind="failed", details=details
        )
        await run(db)
    view = await get(attested, rid)
    assert view["state"] == "binding", view
    assert view["conditions"] == []
    [alloc] = await allocations(db, rid)
    assert (alloc["id"], alloc["state"]) == (first["id"], "desired")
    found = await rejections(db, rid)
    assert [(e["reason"], e["bindingLost"]) for e in found] == [("unsigned report", False)] * 3
    assert {e["allocationId"] for e in found} == {first["id"]}

    # Nor does the node's genuine signature over another phase, or over another allocation.
    node = Node(alloc["node_id"])
    for changes, reason in (
        ({}, "the signed report is not this allocation failed"),  # its Bound report
        ({**SIGNED_AS["failed"], "allocation_id": "alloc_other"}, None),
    ):
        signature = node.signed(alloc, rid, await now_ms(db), **changes)
        assert not await attested.report(
            node_id=alloc["node_id"],
            allocation_id=alloc["id"],
            kind="failed",
            details={"reason": "forged", "signature": signature},
        )
        last = (await rejections(db, rid))[-1]
        assert last["reason"] == (reason or "the signed report is not this allocation failed")
    await run(db)
    assert (await get(attested, rid))["state"] == "binding"

    # The node's own signed Failed report is judged as before: re-placed at once.
    assert await signed_report(
        attested, node, alloc, rid, "failed", await now_ms(db), reason="resources-exhausted"
    )
    await run(db)
    view = await get(attested, rid)
    assert condition(view, "BindTimeout")["reason"] == "NodeRejectedBinding"
    [again] = await allocations(db, rid)
    assert again["id"] != first["id"]


async def test_attack_an_unsigned_released_report_never_frees_devices_still_held(
    db: Database, attested: ReservationService
) -> None:
    """A reservation released while its pods still hold all 8 GPUs keeps them booked until
    the node confirms. A forged ``Released`` freed them, and the next reservation was placed
    on the devices the pods were still using. Unproven, it changes nothing."""
    await world(db, nodes=1, policy={"kubernetes": True}, labels={K8S_LABEL: ("true", "system")})
    rid = (await create(attested, "held", count=8, duration="8h", binding="kubernetes"))["id"]
    await run(db)
    [alloc] = await allocations(db, rid)
    node = Node(alloc["node_id"])
    assert await bound(attested, alloc, node.signed(alloc, rid, await now_ms(db)))
    await run(db)
    assert (await get(attested, rid))["state"] == "active"
    await advance(db, 60)
    await attested.release(caller(), {"tenantId": "acme", "reservationId": rid})
    assert await signed_report(
        attested, node, alloc, rid, "releasing", await now_ms(db), pods=["ml/train-0"]
    )
    since = await now(db)

    # The forgeries: unsigned, and the node's genuine Releasing report relabelled Released.
    assert not await attested.report(
        node_id=alloc["node_id"], allocation_id=alloc["id"], kind="released", details={}
    )
    relabelled = node.signed(alloc, rid, await now_ms(db), **SIGNED_AS["releasing"])
    assert not await attested.report(
        node_id=alloc["node_id"],
        allocation_id=alloc["id"],
        kind="released",
        details={"signature": relabelled},
    )
    # And a genuine Released report older than the Releasing one accepted: played again.
    assert not await signed_report(
        attested, node, alloc, rid, "released", await now_ms(db) - 120_000
    )
    assert [e["reason"] for e in await rejections(db, rid)] == [
        "unsigned report",
        "the signed report is not this allocation released",
        attestation.STALE_REPORT,
    ]
    await run(db)
    assert [a["state"] for a in await allocations(db, rid)] == ["releasing"]
    assert all(b["end_at"] > since for b in await bookings(db, rid))
    view = await get(attested, rid)
    assert [c["type"] for c in view["conditions"]] == ["DevicesHeld"]
    # The devices are still the pods': another reservation cannot have them.
    other = await create(attested, "next", count=8, binding="kubernetes")
    assert other["state"] == "pending", other

    # The node's own signed Released report frees them, and the waiting one is placed.
    assert await signed_report(attested, node, alloc, rid, "released", await now_ms(db))
    await run(db)
    assert [a["state"] for a in await allocations(db, rid)] == ["released"]
    assert (await get(attested, other["id"]))["state"] in ("placed", "binding")
