"""Reservations through kubectl: the real operator against the API stand-in and PostgreSQL."""

from __future__ import annotations

import asyncio
import time

from bettercompute.core import moments, ports
from bettercompute.operator.running import Operator
from tests.operator.conftest import World
from tests.support import kubeworld
from tests.support.kubeobjects import EVENTS, RESERVATIONS
from tests.support.policies import CountingPolicy


def kubeworld_caller() -> ports.Caller:
    return ports.Caller(identity_id="alice@acme", tenant_id="acme")


def _state(state: str):
    return lambda o: bool(o) and (o.get("status") or {}).get("state") == state


def _condition(kind: str, reason: str | None = None):
    def check(o):
        for c in ((o or {}).get("status") or {}).get("conditions") or ():
            if c.get("type") == kind and (reason is None or c.get("reason") == reason):
                return True
        return False

    return check


async def test_an_applied_reservation_is_placed_within_a_second(world: World, operator: Operator):
    started = time.monotonic()
    await world.kube.create(kubeworld.reservation("train").gpus(4).nvlink().obj())
    obj = await world.kube.wait_for(RESERVATIONS, "ml", "train", _state("placed"), timeout=1.0)
    assert time.monotonic() - started < 1.0
    status = obj["status"]
    assert status["id"].startswith("rsv_")
    assert status["tenantId"] == "acme"
    assert (status["gpus"], status["nodes"]) == (4, world.nodes[0])
    assert status["operation"]["state"] == "succeeded"
    assert status["startTime"].endswith("Z")
    assert status["observedGeneration"] == 1
    stored = await operator.runtime.service.snapshot(status["id"])
    assert stored is not None
    # It starts at placement: the reconciler may already have moved it on to binding.
    assert stored["state"] in ("placed", "binding")
    assert stored["ownerIdentityId"] == "alice@acme"


async def test_the_same_manifest_applied_again_changes_nothing(
    world: World, operator: Operator, policy: CountingPolicy
):
    manifest = kubeworld.reservation("train").gpus(2).obj()
    await world.kube.create(manifest)
    first = await world.kube.wait_for(RESERVATIONS, "ml", "train", _state("placed"))
    # kubectl apply of an unchanged manifest: a patch carrying the same spec.
    await world.kube.patch(RESERVATIONS, "ml", "train", {"spec": manifest["spec"]})
    await asyncio.sleep(0.3)  # give a wrongly triggered handler time to act
    again = world.kube.stored(RESERVATIONS, "ml", "train")
    assert again["metadata"]["generation"] == first["metadata"]["generation"]
    assert policy.creates == 1
    listed = await operator.runtime.service.list(
        kubeworld_caller(), {"tenantId": "acme", "scope": "all"}
    )
    assert [r["id"] for r in listed["items"]] == [first["status"]["id"]]


async def test_another_object_with_the_same_key_and_another_spec_is_a_conflict(world: World):
    await world.kube.create(kubeworld.reservation("a").gpus(1).key("shared").obj())
    first = await world.kube.wait_for(RESERVATIONS, "ml", "a", _state("placed"))
    await world.kube.create(kubeworld.reservation("b").gpus(2).key("shared").obj())
    refused = await world.kube.wait_for(RESERVATIONS, "ml", "b", _condition("Refused", "CONFLICT"))
    assert "id" not in refused["status"]  # it is not the other object's reservation
    assert "create:" in refused["status"]["conditions"][0]["message"]
    events = await world.kube.list(EVENTS, "ml")
    assert any(e["reason"] == "Refused" and e["involvedObject"]["name"] == "b" for e in events)
    assert world.kube.stored(RESERVATIONS, "ml", "a")["status"]["id"] == first["status"]["id"]


async def test_kubectl_delete_releases_and_the_object_goes_away(world: World, operator: Operator):
    await world.kube.create(kubeworld.reservation("train").obj())
    placed = await world.kube.wait_for(RESERVATIONS, "ml", "train", _state("placed"))
    assert "bcd.dev/release" in placed["metadata"]["finalizers"]
    await world.kube.delete(RESERVATIONS, "ml", "train")
    await world.kube.wait_for(RESERVATIONS, "ml", "train", lambda o: o is None)
    stored = await operator.runtime.service.snapshot(placed["status"]["id"])
    assert stored is not None
    assert stored["state"] in ("released", "cancelled")


async def test_spec_release_releases_and_keeps_the_object(world: World):
    await world.kube.create(kubeworld.reservation("train").obj())
    await world.kube.wait_for(RESERVATIONS, "ml", "train", _state("placed"))
    await world.kube.patch(RESERVATIONS, "ml", "train", {"spec": {"release": True}})
    obj = await world.kube.wait_for(
        RESERVATIONS, "ml", "train", lambda o: o["status"]["state"] in ("released", "cancelled")
    )
    assert obj["status"]["operation"]["state"] in ("succeeded", "failed")


async def test_extend_reports_extended_and_moves_the_end(world: World):
    await world.kube.create(kubeworld.reservation("train").duration("1h").obj())
    placed = await world.kube.wait_for(RESERVATIONS, "ml", "train", _state("placed"))
    end = placed["status"]["during"]["end"]
    await world.kube.patch(
        RESERVATIONS, "ml", "train", {"spec": {"extendBy": "2h", "extendKey": "ext-1"}}
    )
    obj = await world.kube.wait_for(
        RESERVATIONS, "ml", "train", lambda o: (o["status"].get("extension") or {}).get("key")
    )
    assert obj["status"]["extension"] == {"key": "ext-1", "extended": True}
    assert obj["status"]["during"]["end"] == end + 2 * 3_600_000


async def test_extend_blocked_by_another_booking_reports_available_until(
    kube_api, db, operator: Operator
):
    from tests.operator.conftest import apply_world

    world = await apply_world(kube_api, db, gpus=1)
    await world.kube.create(kubeworld.reservation("first").duration("1h").obj())
    first = await world.kube.wait_for(RESERVATIONS, "ml", "first", _state("placed"))
    later = first["status"]["during"]["start"] + 2 * 3_600_000
    await world.kube.create(kubeworld.reservation("later").duration("1h").start(later).obj())
    await world.kube.wait_for(RESERVATIONS, "ml", "later", _state("placed"))
    await world.kube.patch(
        RESERVATIONS, "ml", "first", {"spec": {"extendBy": "3h", "extendKey": "ext-1"}}
    )
    obj = await world.kube.wait_for(
        RESERVATIONS, "ml", "first", lambda o: (o["status"].get("extension") or {}).get("key")
    )
    assert obj["status"]["extension"] == {
        "key": "ext-1",
        "extended": False,
        "availableUntil": moments.rfc3339(later),  # a time people read: RFC 3339
    }
    assert obj["status"]["during"]["end"] == first["status"]["during"]["end"]


async def test_the_renew_annotation_renews_a_lease_once_per_value(world: World):
    await world.kube.create(kubeworld.reservation("agent").lease(600).obj())
    placed = await world.kube.wait_for(RESERVATIONS, "ml", "agent", _state("placed"))
    assert moments.parse_ms(placed["status"]["leaseExpiresAt"]) > 0  # RFC 3339
    await world.kube.patch(
        RESERVATIONS, "ml", "agent", {"metadata": {"annotations": {"bcd.dev/renew": "r1"}}}
    )
    renewed = await world.kube.wait_for(
        RESERVATIONS, "ml", "agent", lambda o: o["status"].get("renewed") == "r1"
    )
    assert renewed["status"]["leaseExpiresAt"] >= placed["status"]["leaseExpiresAt"]


async def test_a_renew_without_a_lease_is_refused_with_the_core_code(world: World):
    # Starting in an hour, it stays placed (a reservation binding may be renewed regardless).
    later = int(time.time() * 1000) + 3_600_000
    await world.kube.create(kubeworld.reservation("plain").start(later).obj())
    await world.kube.wait_for(RESERVATIONS, "ml", "plain", _state("placed"))
    await world.kube.patch(
        RESERVATIONS, "ml", "plain", {"metadata": {"annotations": {"bcd.dev/renew": "r1"}}}
    )
    await world.kube.wait_for(RESERVATIONS, "ml", "plain", _condition("Refused", "INVALID_STATE"))


async def test_a_namespace_without_a_tenant_and_an_unstamped_object_are_refused(
    kube_api, db, operator: Operator
):
    from tests.operator.conftest import apply_world

    world = await apply_world(kube_api, db, tenant_namespaces={"ml": "acme", "loose": ""})
    await world.kube.create(kubeworld.reservation("x", namespace="loose").obj())
    refused = await world.kube.wait_for(
        RESERVATIONS, "loose", "x", _condition("Refused", "INVALID_INPUT")
    )
    assert "bcd.dev/tenant" in refused["status"]["conditions"][0]["message"]
    unstamped = kubeworld.reservation("y").obj()
    unstamped["metadata"]["annotations"] = {}
    await world.kube.create(unstamped)
    refused = await world.kube.wait_for(RESERVATIONS, "ml", "y", _condition("Refused"))
    assert "bcd.dev/requested-by" in refused["status"]["conditions"][0]["message"]


async def test_lifecycle_transitions_become_kubernetes_events(world: World):
    await world.kube.create(kubeworld.reservation("train").obj())
    await world.kube.wait_for(RESERVATIONS, "ml", "train", _state("placed"))
    deadline = asyncio.get_running_loop().time() + 2
    while True:
        events = await world.kube.list(EVENTS, "ml")
        placed = [e for e in events if e["reason"] == "Placed"]
        if placed or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    assert placed, [(e["reason"], e["message"]) for e in events]
    assert placed[0]["type"] == "Normal"
    assert placed[0]["involvedObject"]["name"] == "train"
    assert world.nodes[0] in placed[0]["message"]


async def test_a_reservation_that_can_never_fit_says_so_in_its_condition(
    world: World, operator: Operator
):
    # The pool's nodes have 8 GPUs each: 9 on one node can never fit, however long it waits.
    await world.kube.create(kubeworld.reservation("huge").gpus(9).obj())
    obj = await world.kube.wait_for(
        RESERVATIONS, "ml", "huge", _condition("Unschedulable", "NoFit")
    )
    assert obj is not None
    assert obj["status"]["state"] == "pending"
    [condition] = [c for c in obj["status"]["conditions"] if c["type"] == "Unschedulable"]
    assert condition["message"].startswith("never fits this pool: even with every device free")


async def test_spot_work_preempted_before_it_starts_shows_it_with_a_warning_event(
    world: World, operator: Operator
):
    later = 4_000_000_000_000  # both in the same future window
    spot = kubeworld.reservation("spot").gpus(8).start(later).obj()
    spot["spec"]["spot"] = True
    await world.kube.create(spot)
    await world.kube.wait_for(RESERVATIONS, "ml", "spot", _state("placed"))
    await world.kube.create(kubeworld.reservation("regular").gpus(8).start(later).obj())
    await world.kube.wait_for(RESERVATIONS, "ml", "regular", _state("placed"))
    shown = await world.kube.wait_for(
        RESERVATIONS, "ml", "spot", _condition("Unschedulable", "SpotPreempted")
    )
    assert shown is not None
    assert shown["status"]["state"] == "pending"

    deadline = asyncio.get_running_loop().time() + 5
    while True:  # the outbox's event reaches the operator a moment later
        events = await world.kube.list(EVENTS, "ml")
        warned = [
            e
            for e in events
            if e["involvedObject"]["name"] == "spot" and e["reason"] == "Preempted"
        ]
        if warned or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    assert warned, [(e["reason"], e["message"]) for e in events]
    assert warned[0]["type"] == "Warning"


def _ready(o) -> str | None:
    """What ``kubectl wait --for=condition=Ready`` reads: the Ready condition's status."""
    for c in ((o or {}).get("status") or {}).get("conditions") or ():
        if c.get("type") == "Ready":
            return str(c.get("status"))
    return None


async def test_a_start_written_as_rfc3339_books_that_window_and_ready_waits_for_active(
    world: World,
):
    start_ms = (int(time.time()) + 3 * 3600) * 1000  # whole seconds: as a person writes it
    manifest = kubeworld.reservation("later").duration("2h").obj()
    manifest["spec"]["start"] = moments.rfc3339(start_ms)
    await world.kube.create(manifest)
    placed = await world.kube.wait_for(RESERVATIONS, "ml", "later", _state("placed"))
    status = placed["status"]
    assert status["during"] == {"start": start_ms, "end": start_ms + 2 * 3_600_000}
    assert status["window"]["start"] == moments.shown(start_ms)
    conditions = {c["type"]: c for c in status["conditions"]}
    # kubectl wait --for=condition=Ready keeps waiting: booked, not yet active.
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("False", "Placed")
    assert conditions["Placed"]["status"] == "True"
    for condition in conditions.values():
        assert condition["observedGeneration"] == placed["metadata"]["generation"]
    assert _ready(placed) == "False"

    # Extended to an RFC 3339 end: the window follows, the extension is acknowledged.
    until_ms = start_ms + 5 * 3_600_000
    await world.kube.patch(
        RESERVATIONS,
        "ml",
        "later",
        {"spec": {"until": moments.rfc3339(until_ms), "extendKey": "ext-1"}},
    )
    extended = await world.kube.wait_for(
        RESERVATIONS,
        "ml",
        "later",
        lambda o: (o["status"].get("extension") or {}).get("key") == "ext-1",
    )
    assert extended["status"]["extension"]["extended"] is True
    assert extended["status"]["during"]["end"] == until_ms

    # Released: Ready is False with the state as its reason, Placed goes False (not away).
    await world.kube.patch(RESERVATIONS, "ml", "later", {"spec": {"release": True}})
    gone = await world.kube.wait_for(
        RESERVATIONS, "ml", "later", lambda o: o["status"].get("state") == "released"
    )
    conditions = {c["type"]: c for c in gone["status"]["conditions"]}
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == (
        "False",
        "Released",
    )
    assert (conditions["Placed"]["status"], conditions["Placed"]["reason"]) == (
        "False",
        "Released",
    )


async def test_a_create_refused_at_once_still_shows_ready_false_for_kubectl_wait(world: World):
    await world.kube.create(kubeworld.reservation("huge").gpus(1000).obj())
    refused = await world.kube.wait_for(RESERVATIONS, "ml", "huge", _condition("Refused"))
    conditions = {c["type"]: c for c in refused["status"]["conditions"]}
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("False", "Refused")
    assert conditions["Placed"]["status"] == "False"
    assert all(c["observedGeneration"] == 1 for c in conditions.values())
