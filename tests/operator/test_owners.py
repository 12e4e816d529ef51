"""One stored reservation, one Reservation object: a second object with the same key is refused.

Two objects with the same idempotency key and spec (same namespace tenant, same requester) name
the same stored reservation. The first to claim it owns it; the other shows ``Refused`` with
code ``CONFLICT`` naming the owner, and deleting or releasing it never touches the owner's
reservation. The claim is one row in the database, so operator replicas cannot both win.
"""

from __future__ import annotations

import asyncio
from typing import Any

from bettercompute.core import ports
from bettercompute.operator.running import Operator
from bettercompute.service.owners import ReservationOwners
from tests.operator.conftest import World
from tests.support import kubeworld
from tests.support.kubeobjects import EVENTS, RESERVATIONS

#: The owner's reservation after the refused object went: still held (the reconciler may have
#: moved it on from ``placed``), never released.
LIVE = ("placed", "binding", "active")


def _state(*states: str):
    return lambda o: bool(o) and (o.get("status") or {}).get("state") in states


def _refused(o: dict[str, Any] | None) -> dict[str, Any] | None:
    for c in ((o or {}).get("status") or {}).get("conditions") or ():
        if c.get("type") == "Refused":
            found: dict[str, Any] = c
            return found
    return None


def _manifest(name: str) -> dict[str, Any]:
    return kubeworld.reservation(name).gpus(2).key("shared").obj()


async def _refused_as_conflict(world: World, name: str, *, owner: str) -> dict[str, Any]:
    """``name`` shows Refused/CONFLICT naming ``ml/<owner>``, no reservation, and a Warning."""
    obj = await world.kube.wait_for(
        RESERVATIONS, "ml", name, lambda o: (_refused(o) or {}).get("reason") == "CONFLICT"
    )
    condition = _refused(obj)
    assert condition is not None
    assert f"ml/{owner}" in condition["message"]
    assert "id" not in obj["status"]
    assert "state" not in obj["status"]
    events = await world.kube.list(EVENTS, "ml")
    assert any(
        e["type"] == "Warning"
        and e["reason"] == "Refused"
        and e["involvedObject"]["name"] == name
        and f"ml/{owner}" in e["message"]
        for e in events
    )
    return obj


async def test_a_second_object_with_the_same_key_and_spec_is_refused(world: World):
    await world.kube.create(_manifest("a"))
    first = await world.kube.wait_for(RESERVATIONS, "ml", "a", _state("placed"))
    await world.kube.create(_manifest("b"))
    await _refused_as_conflict(world, "b", owner="a")
    assert world.kube.stored(RESERVATIONS, "ml", "a")["status"]["id"] == first["status"]["id"]


async def test_whichever_object_comes_first_keeps_the_reservation(world: World):
    await world.kube.create(_manifest("b"))
    first = await world.kube.wait_for(RESERVATIONS, "ml", "b", _state("placed"))
    await world.kube.create(_manifest("a"))
    await _refused_as_conflict(world, "a", owner="b")
    assert world.kube.stored(RESERVATIONS, "ml", "b")["status"]["id"] == first["status"]["id"]


async def test_deleting_or_releasing_the_refused_object_leaves_the_owner_placed(
    world: World, operator: Operator
):
    await world.kube.create(_manifest("a"))
    first = await world.kube.wait_for(RESERVATIONS, "ml", "a", _state("placed"))
    rid = first["status"]["id"]
    await world.kube.create(_manifest("b"))
    await _refused_as_conflict(world, "b", owner="a")
    await world.kube.patch(RESERVATIONS, "ml", "b", {"spec": {"release": True}})
    await world.kube.wait_for(
        RESERVATIONS, "ml", "b", lambda o: o["status"].get("observedGeneration") == 2
    )
    await world.kube.delete(RESERVATIONS, "ml", "b")
    await world.kube.wait_for(RESERVATIONS, "ml", "b", lambda o: o is None)
    await asyncio.sleep(0.3)  # give a wrongly sent release time to land
    stored = await operator.runtime.service.snapshot(rid)
    assert stored is not None
    assert stored["state"] in LIVE
    assert world.kube.stored(RESERVATIONS, "ml", "a")["status"]["state"] in LIVE


async def test_deleting_the_owner_releases_and_the_refused_object_does_not_adopt_it(
    world: World, operator: Operator
):
    await world.kube.create(_manifest("a"))
    first = await world.kube.wait_for(RESERVATIONS, "ml", "a", _state("placed"))
    rid = first["status"]["id"]
    await world.kube.create(_manifest("b"))
    await _refused_as_conflict(world, "b", owner="a")
    await world.kube.delete(RESERVATIONS, "ml", "a")
    await world.kube.wait_for(RESERVATIONS, "ml", "a", lambda o: o is None)
    stored = await operator.runtime.service.snapshot(rid)
    assert stored is not None
    assert stored["state"] in ("released", "cancelled")
    # A change to the refused object is a new chance to admit it: still refused, not adopted.
    await world.kube.patch(RESERVATIONS, "ml", "b", {"metadata": {"labels": {"touched": "1"}}})
    await world.kube.patch(RESERVATIONS, "ml", "b", {"spec": {"release": True}})
    await world.kube.wait_for(
        RESERVATIONS, "ml", "b", lambda o: o["status"].get("observedGeneration") == 2
    )
    await _refused_as_conflict(world, "b", owner="a")


async def test_an_object_recreated_under_its_own_name_keeps_its_key(world: World):
    await world.kube.create(_manifest("a"))
    first = await world.kube.wait_for(RESERVATIONS, "ml", "a", _state("placed"))
    await world.kube.delete(RESERVATIONS, "ml", "a")
    await world.kube.wait_for(RESERVATIONS, "ml", "a", lambda o: o is None)
    await world.kube.create(_manifest("a"))  # a new uid, the same namespace and name
    again = await world.kube.wait_for(RESERVATIONS, "ml", "a", _state("released", "cancelled"))
    assert again["status"]["id"] == first["status"]["id"]
    assert _refused(again) is None


async def test_two_objects_applied_at_once_one_owns_the_reservation(world: World):
    await asyncio.gather(world.kube.create(_manifest("a")), world.kube.create(_manifest("b")))

    def settled(o: dict[str, Any] | None) -> bool:
        return bool(o) and (_state("placed")(o) or _refused(o) is not None)

    objs = [await world.kube.wait_for(RESERVATIONS, "ml", n, settled) for n in ("a", "b")]
    owners = [o for o in objs if _state("placed")(o)]
    assert len(owners) == 1, [o["status"] for o in objs]
    owner = owners[0]["metadata"]["name"]
    refused = "b" if owner == "a" else "a"
    await _refused_as_conflict(world, refused, owner=owner)


async def test_concurrent_claims_from_replicas_have_one_winner(world: World, operator: Operator):
    caller = ports.Caller(identity_id="alice@acme", tenant_id="acme")
    view = await operator.runtime.service.create(
        caller,
        {
            "tenantId": "acme",
            "poolId": "h100",
            "devices": [{"class": "gpu", "count": 1}],
            "duration": "1h",
            "idempotencyKey": "race",
        },
    )
    # Two operator replicas are two services over one database: the row decides, not a listing.
    replicas = [ReservationOwners(world.db), ReservationOwners(world.db)]
    claims = await asyncio.gather(
        *(
            replicas[i % 2].claim(
                view["id"], object_uid=f"uid-{i}", namespace="ml", name=f"object-{i}"
            )
            for i in range(16)
        )
    )
    assert len({(c.object_uid, c.namespace, c.name) for c in claims}) == 1
    winner = claims[0]
    assert winner.name == f"object-{winner.object_uid.removeprefix('uid-')}"


async def test_an_object_showing_another_objects_reservation_never_releases_it(
    world: World, operator: Operator
):
    # A status written before owners were recorded may name another object's reservation.
    await world.kube.create(_manifest("a"))
    first = await world.kube.wait_for(RESERVATIONS, "ml", "a", _state("placed"))
    rid = first["status"]["id"]
    await world.kube.create(kubeworld.reservation("b").gpus(1).key("own").obj())
    await world.kube.wait_for(RESERVATIONS, "ml", "b", _state("placed"))
    await asyncio.sleep(0.3)  # let b's own projections land before its status is rewritten
    await world.kube.patch(
        RESERVATIONS, "ml", "b", {"status": {"id": rid, "state": "placed"}}, status=True
    )
    await asyncio.sleep(0.3)
    assert world.kube.stored(RESERVATIONS, "ml", "b")["status"]["id"] == rid
    await world.kube.delete(RESERVATIONS, "ml", "b")
    await world.kube.wait_for(RESERVATIONS, "ml", "b", lambda o: o is None)
    stored = await operator.runtime.service.snapshot(rid)
    assert stored is not None
    assert stored["state"] in LIVE
