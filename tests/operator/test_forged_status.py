"""Attack: a tenant writes another reservation's id into its own Reservation's ``status``.

A tenant whose role lets it write the status subresource of its Reservations (nothing stops a
cluster admin from granting it) names a reservation it does not own in ``status.id``. An
operator that believed the field projected the victim's reservation onto the thief's object
(state, window, nodes: everything ``kubectl get`` shows) and, after a restart, claimed the
victim's reservation for the thief's object. The operator now believes an id only when its own
claim in the store names the object (namespace, name and uid).

The real operator (kopf, projector, reconciler) against the API stand-in over HTTP and the
test session's PostgreSQL; the tenant's writes are plain status patches, as ``kubectl patch
--subresource=status`` sends them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from bettercompute.core import ports
from bettercompute.operator.running import Operator
from bettercompute.store.database import Database
from tests.operator.conftest import World, apply_world
from tests.support import kubeworld
from tests.support.kubeobjects import RESERVATIONS
from tests.support.kubeserver import KubeApi

#: The victim's namespace (tenant acme) and the thief's (tenant globex).
VICTIM, THIEF = "ml", "ops"


def _status(obj: dict[str, Any] | None) -> dict[str, Any]:
    return dict((obj or {}).get("status") or {})


def _refused(obj: dict[str, Any] | None) -> bool:
    return any(c.get("type") == "Refused" for c in _status(obj).get("conditions") or ())


async def _thief(kube: KubeApi) -> None:
    """globex's Reservation in its own namespace: refused (the pool is acme's), so no id."""
    await kube.create(kubeworld.reservation("spy", THIEF).by("mallory@globex").gpus(1).obj())
    await kube.wait_for(RESERVATIONS, THIEF, "spy", _refused)


async def _forge(kube: KubeApi, rid: str) -> None:
    await kube.patch(RESERVATIONS, THIEF, "spy", {"status": {"id": rid}}, status=True)


def _shows_nothing_of(obj: dict[str, Any] | None, victim: dict[str, Any]) -> None:
    status = _status(obj)
    for field in ("state", "during", "nodes", "gpus", "tenantId", "operation", "binding"):
        assert field not in status, (field, status)
    assert status.get("id") in (None, victim["id"])


async def test_attack_a_forged_status_id_never_receives_the_victims_projections(
    kube_api: KubeApi, db: Database, operator: Operator
) -> None:
    """The thief names the victim's reservation in its status; then the victim changes its
    reservation outside Kubernetes (over the HTTP API, as the CLI does), so only the
    projector's notification-driven projection carries the change: it must reach the victim's
    object, and nothing of it the thief's."""
    world: World = await apply_world(
        kube_api, db, tenant_namespaces={VICTIM: "acme", THIEF: "globex"}
    )
    await world.kube.create(kubeworld.reservation("train", VICTIM).gpus(4).duration("1h").obj())
    placed = await world.kube.wait_for(
        RESERVATIONS, VICTIM, "train", lambda o: _status(o).get("state") == "placed"
    )
    victim = placed["status"]
    await _thief(world.kube)
    alice = ports.Caller(identity_id="alice@acme", tenant_id="acme")
    target = {"tenantId": "acme", "reservationId": victim["id"]}

    for step, change in enumerate(("extend", "release")):
        await _forge(world.kube, victim["id"])
        await asyncio.sleep(0.3)  # the watch delivers the forged status to the operator
        if change == "extend":
            answer = await operator.runtime.service.extend(
                alice, {**target, "by": "2h", "idempotencyKey": "over-http"}
            )
            wanted = ("during", answer["reservation"]["during"])
        else:
            await operator.runtime.service.release(alice, target)
            wanted = ("state", "released")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while _status(world.kube.stored(RESERVATIONS, VICTIM, "train")).get(wanted[0]) != wanted[1]:
            # The attack, if it works, shows the change on the thief's object instead.
            _shows_nothing_of(world.kube.stored(RESERVATIONS, THIEF, "spy"), victim)
            assert loop.time() < deadline, (step, world.kube.stored(RESERVATIONS, VICTIM, "train"))
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        _shows_nothing_of(world.kube.stored(RESERVATIONS, THIEF, "spy"), victim)
        place = operator.runtime.objects.where(victim["id"])
        assert place is not None
        assert (place.namespace, place.name) == (VICTIM, "train")


async def test_attack_a_forged_status_id_is_not_claimed_at_a_restart(
    kube_api: KubeApi, db: Database, start_operator: Callable[..., Any]
) -> None:
    """A reservation made over the HTTP API has no Reservation object, so no object claims it.
    The thief names it in its status; the restarted operator resumes the thief's object. An
    operator that took the status for an admission claimed the victim's reservation for the
    thief's object and showed it there; now the object is admitted anew from its own spec (and
    refused: globex may not use acme's pool), and the claim stays free."""
    async with start_operator() as first:
        await apply_world(kube_api, db, tenant_namespaces={VICTIM: "acme", THIEF: "globex"})
        made = await first.runtime.service.create(
            ports.Caller(identity_id="bob", tenant_id="acme"),
            {
                "tenantId": "acme",
                "poolId": "h100",
                "devices": [{"class": "gpu", "count": 2}],
                "duration": "1h",
                "idempotencyKey": "over-http",
            },
        )
        assert made["state"] == "placed"
        await _thief(kube_api)
    await _forge(kube_api, made["id"])

    async with start_operator() as restarted:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        # The resume handler ran on the thief's object: it admitted its spec anew, or (the
        # attack) showed the victim's reservation there.
        while restarted.runtime.door.admissions == 0 and "state" not in _status(
            kube_api.stored(RESERVATIONS, THIEF, "spy")
        ):
            assert loop.time() < deadline, kube_api.stored(RESERVATIONS, THIEF, "spy")
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        spy = kube_api.stored(RESERVATIONS, THIEF, "spy")
        _shows_nothing_of(spy, made)
        assert _refused(spy)
        assert await restarted.runtime.door.owners.owner(made["id"]) is None
        assert restarted.runtime.objects.where(made["id"]) is None
