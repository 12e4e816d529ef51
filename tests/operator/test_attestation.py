"""Attested bindings through the real operator and the API stand-in: whoever can write a
DeviceAllocation's status (a compromised operator path, a stolen service account) still cannot
activate a reservation. Each forged status below is written the way such an attacker would; none
binds, each is published as ``reservation.binding-rejected``; the node's own signed report
does bind, and a forged re-report of an active binding loses it (Degraded/BindingLost).

The node-report authority's Secret: created once, race-safe, read back by every replica.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

import pytest
from cryptography import x509

from bettercompute.core.attestation import CertificateAuthority
from bettercompute.deviceplugin import signing
from bettercompute.deviceplugin.signing import NodeKey
from bettercompute.kube.client import KubeClient, read_kubeconfig
from bettercompute.operator import nodeca
from bettercompute.operator.running import Operator
from bettercompute.service.nodes import NodeService
from tests.operator.conftest import World
from tests.support import kubeworld, nodecerts
from tests.support.kubeobjects import DEVICEALLOCATIONS, RESERVATIONS, SECRETS
from tests.support.kubeserver import KubeApi

NS = kubeworld.OPERATOR_NAMESPACE
REJECTED = "reservation.binding-rejected"


def _state(state: str) -> Any:
    return lambda o: bool(o) and (o.get("status") or {}).get("state") == state


async def _binding(world: World, name: str) -> tuple[str, dict[str, Any], str]:
    """A kubernetes-bound reservation in ``binding``: (its id, its allocation spec, the
    DeviceAllocation's name)."""
    await world.kube.create(kubeworld.reservation(name).gpus(2).kubernetes().obj())
    placed = await world.kube.wait_for(
        RESERVATIONS, "ml", name, lambda o: (o.get("status") or {}).get("id")
    )
    rid = placed["status"]["id"]
    async with asyncio.timeout(5):
        while True:
            seen = world.kube.emulator.revision
            items = [
                o
                for o in await world.kube.list(DEVICEALLOCATIONS, NS)
                if o["spec"]["reservationId"] == rid
            ]
            if items:
                break
            await world.kube.emulator.written(since=seen)
    await world.kube.wait_for(RESERVATIONS, "ml", name, _state("binding"))
    return rid, items[0]["spec"], items[0]["metadata"]["name"]


async def _rejections(world: World, rid: str, count: int) -> list[dict[str, Any]]:
    """The reservation's binding-rejected events, once there are ``count`` of them."""
    async with asyncio.timeout(5):
        while True:
            async with world.db.connection() as conn:
                rows = await (
                    await conn.execute(
                        "SELECT data FROM outbox WHERE subject = %s AND type = %s ORDER BY id",
                        (f"reservation/{rid}", REJECTED),
                    )
                ).fetchall()
            if len(rows) >= count:
                return [r["data"] for r in rows]
            await asyncio.sleep(0.05)


def _signed(
    node: str,
    spec: dict[str, Any],
    at: str,
    *,
    key: NodeKey | None = None,
    certificate: str | None = None,
    **changes: Any,
) -> dict[str, Any]:
    """A Bound status signed by ``key`` (the node's own by default) carrying ``certificate``."""
    own_key, own_certificate = nodecerts.node_identity(node)
    fields: dict[str, Any] = {
        "node_name": node,
        "allocation_id": spec["allocationId"],
        "reservation_id": spec["reservationId"],
        "phase": "Bound",
        "cdi_devices": tuple(f"bcd.dev/gpu={d}" for d in spec["deviceIds"]),
        "env_file": f"/run/bcd/allocations/{spec['allocationId']}.env",
        "reported_at": at,
    }
    fields.update(changes)
    status = kubeworld.bound(node, spec, at=at)
    block = (key or own_key).sign(signing.Report(**fields))
    status["signature"] = {**block, "certificate": certificate or own_certificate}
    return status


async def test_forged_statuses_never_bind_and_a_forged_re_report_loses_the_binding(
    world: World, operator: Operator
) -> None:
    node = world.nodes[0]
    rid, spec, name = await _binding(world, "train")
    now = dt.datetime.now(dt.UTC)

    foreign_ca = CertificateAuthority.generate(now=now, name="bcd test node-report CA")
    foreign_key = NodeKey.generate()
    expired_key = NodeKey.generate()
    revoked_key = NodeKey.generate()
    revoked_certificate = nodecerts.certify(node, revoked_key)
    await NodeService(world.db).revoke_certificate(
        x509.load_pem_x509_certificate(revoked_certificate.encode()).serial_number
    )
    unsigned = kubeworld.bound(node, spec, at="2026-12-02T00:00:01Z")
    del unsigned["signature"]
    attacks: list[tuple[dict[str, Any], str]] = [
        (unsigned, "unsigned report"),
        (
            _signed(
                node,
                spec,
                "2026-12-02T00:00:02Z",
                key=foreign_key,
                certificate=nodecerts.certify(node, foreign_key, authority=foreign_ca),
            ),
            "certificate is not issued by a trusted authority",
        ),
        (
            # The node's genuine signature, over a report about another allocation.
            _signed(node, spec, "2026-12-02T00:00:03Z", allocation_id="alloc_other"),
            "the signed report is not this allocation bound",
        ),
        (
            _signed(
                node,
                spec,
                "2026-12-02T00:00:04Z",
                key=expired_key,
                certificate=nodecerts.certify(
                    node,
                    expired_key,
                    now=now - dt.timedelta(days=2),
                    lifetime=dt.timedelta(days=1),
                ),
            ),
            "certificate expired",
        ),
        (
            _signed(
                node,
                spec,
                "2026-12-02T00:00:05Z",
                key=revoked_key,
                certificate=revoked_certificate,
            ),
            "certificate revoked",
        ),
    ]
    for count, (status, reason) in enumerate(attacks, start=1):
        await world.kube.patch(DEVICEALLOCATIONS, NS, name, {"status": status}, status=True)
        events = await _rejections(world, rid, count)
        assert events[-1]["reason"] == reason
        assert events[-1]["allocationId"] == spec["allocationId"]
        assert events[-1]["nodeId"] == node
        assert world.kube.stored(RESERVATIONS, "ml", "train")["status"]["state"] == "binding"
    async with world.db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT state, bound_at FROM allocations WHERE id = %s", (spec["allocationId"],)
            )
        ).fetchone()
    assert row is not None
    assert (row["state"], row["bound_at"]) == ("desired", None)

    # The node's own report binds: active, attested.
    await world.kube.patch(
        DEVICEALLOCATIONS,
        NS,
        name,
        {"status": _signed(node, spec, "2026-12-02T00:00:06Z")},
        status=True,
    )
    active = await world.kube.wait_for(RESERVATIONS, "ml", "train", _state("active"))
    assert active["status"]["binding"]["attested"] is True

    # A forged re-report of the active binding (the attacker's key under the node's genuine
    # certificate): the binding is lost.
    _, certificate = nodecerts.node_identity(node)
    forged = _signed(
        node, spec, "2026-12-02T00:00:07Z", key=NodeKey.generate(), certificate=certificate
    )
    await world.kube.patch(DEVICEALLOCATIONS, NS, name, {"status": forged}, status=True)
    events = await _rejections(world, rid, len(attacks) + 1)
    assert events[-1]["reason"].startswith("signature.keyId:")
    assert events[-1]["bindingLost"] is True
    degraded = await world.kube.wait_for(
        RESERVATIONS,
        "ml",
        "train",
        lambda o: any(
            c["type"] == "Degraded" and c["reason"] == "BindingLost"
            for c in (o.get("status") or {}).get("conditions") or ()
        ),
    )
    assert degraded["status"]["state"] == "active"


@pytest.fixture
async def client(kube_api: KubeApi) -> AsyncIterator[KubeClient]:
    config, _ = read_kubeconfig(kube_api.kubeconfig)
    async with KubeClient(config) as opened:
        yield opened


async def test_the_authority_is_created_once_and_every_replica_reads_the_same(
    kube_api: KubeApi, client: KubeClient
) -> None:
    await kube_api.create(kubeworld.namespace(NS, tenant=None))
    # Three replicas starting at once: one creates the Secret, the others get 409 and read it.
    made = await asyncio.gather(
        *(nodeca.load_or_create_ca(client, NS, "bcd-node-ca") for _ in range(3))
    )
    assert len({ca.certificate_pem() for ca in made}) == 1
    stored = kube_api.stored(SECRETS, NS, "bcd-node-ca")
    assert stored is not None
    assert stored["type"] == "kubernetes.io/tls"
    assert base64.b64decode(stored["data"]["tls.crt"]) == made[0].certificate_pem()
    again = await nodeca.load_or_create_ca(client, NS, "bcd-node-ca")
    assert again.certificate == made[0].certificate


async def test_an_unusable_or_missing_authority_secret_is_a_clear_error(
    kube_api: KubeApi, client: KubeClient
) -> None:
    await kube_api.create(kubeworld.namespace(NS, tenant=None))
    with pytest.raises(nodeca.NodeAuthorityError, match="not found"):
        await nodeca.load_or_create_ca(client, NS, "provided", create=False)
    bad = nodeca.secret_manifest(nodecerts.AUTHORITY, name="bad", namespace=NS)
    bad["data"]["tls.key"] = base64.b64encode(
        CertificateAuthority.generate(now=dt.datetime.now(dt.UTC)).key_pem()
    ).decode()
    await kube_api.create(bad)
    with pytest.raises(nodeca.NodeAuthorityError, match=f"Secret {NS}/bad: CA key: does not"):
        await nodeca.load_or_create_ca(client, NS, "bad")
