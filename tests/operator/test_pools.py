"""GPUPools and GPUNodes: what the platform team and the nodes write becomes what can be booked.

Why it exists: ``docs/kubernetes.md`` says how a GPUPool selects GPUNodes, what a node's
inventory turns into for each sharing mode, when a node takes no new work and what a pool's
offers and deletion mean. Each test applies the objects to the API stand-in, lets the real
operator write the store, and checks both the store (``db``) and what a Reservation gets.

What it must never do: write the store itself; the objects are the only input (one test
holds row locks, and writes nothing, to make a timing window certain).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from bettercompute.operator.running import Operator
from bettercompute.store.database import Database
from tests.operator.conftest import World, apply_world
from tests.support import kubeworld
from tests.support.kubeobjects import GPUNODES, GPUPOOLS, GPUQUOTAS, RESERVATIONS
from tests.support.kubeserver import KubeApi

Row = dict[str, Any]


# --- helpers ---------------------------------------------------------------------------------


async def _rows_until(
    db: Database,
    sql: str,
    params: tuple[Any, ...],
    predicate: Callable[[list[Row]], bool],
    *,
    within_s: float = 5.0,
) -> list[Row]:
    """The rows of ``sql`` once ``predicate`` holds (the store is written by handlers that
    the stand-in's watch drives, so there is no event to wait on here: a deadline poll)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        async with db.connection() as conn:
            rows = [dict(r) for r in await (await conn.execute(sql, params)).fetchall()]
        if predicate(rows):
            return rows
        if loop.time() > deadline:
            pytest.fail(f"the store did not come to hold what was expected: {sql} -> {rows}")
        await asyncio.sleep(0.02)


NODE = "SELECT id, pool_id, ready, connected FROM nodes WHERE id = %s"
ATOMS = (
    "SELECT device_id, kind, parent_gpu, profile FROM atoms"
    " WHERE node_id = %s AND NOT retired ORDER BY device_id"
)
POOL = "SELECT id, archived, sharing_mode, replicas FROM pools WHERE id = %s"


def _state(state: str) -> Callable[[Any], bool]:
    return lambda o: bool(o) and (o.get("status") or {}).get("state") == state


def _condition(kind: str, reason: str | None = None) -> Callable[[Any], bool]:
    def check(o: Any) -> bool:
        for c in ((o or {}).get("status") or {}).get("conditions") or ():
            if c.get("type") == kind and (reason is None or c.get("reason") == reason):
                return True
        return False

    return check


def _ready_condition(pool: dict[str, Any] | None) -> dict[str, Any] | None:
    for c in ((pool or {}).get("status") or {}).get("conditions") or ():
        if c.get("type") == "Ready":
            found: dict[str, Any] = c
            return found
    return None


def _limits(obj: Any) -> dict[str, int] | None:
    return ((obj or {}).get("status") or {}).get("limits")


def _applied(generation: int) -> Callable[[Any], bool]:
    """The pool's handler acted on ``generation``."""
    return lambda o: bool(o) and (o.get("status") or {}).get("observedGeneration") == generation


def mig_status(name: str, *, gpus: int = 2, profiles: tuple[str, ...] = ("1g.10gb",) * 7) -> dict:
    """A GPUNode status for a node whose GPUs are split into MIG instances."""
    status = kubeworld.gpunode_status(name, gpus=gpus)
    for gpu in status["inventory"]["gpus"]:
        gpu["model"] = "A100"
        gpu["mig"] = [
            {"uuid": f"MIG-{gpu['uuid']}-{k}", "profile": profile, "healthy": True}
            for k, profile in enumerate(profiles)
        ]
    return status


async def _node(
    kube: KubeApi, name: str, *, labels: dict[str, str], status: dict[str, Any]
) -> None:
    node = kubeworld.gpunode(name, pool="unused")
    node["metadata"]["labels"] = labels
    await kube.create(node)
    await kube.patch(GPUNODES, None, name, {"status": status}, status=True)


async def _pool(kube: KubeApi, pool: dict[str, Any], *, nodes: int) -> dict[str, Any]:
    """Create ``pool`` and wait until it is Ready with ``nodes`` nodes."""
    name = pool["metadata"]["name"]
    await kube.create(pool)
    ready = await kube.wait_for(
        GPUPOOLS,
        None,
        name,
        lambda o: (
            (_ready_condition(o) or {}).get("status") == "True"
            and o["status"].get("nodes") == nodes
        ),
    )
    assert ready is not None
    return ready


# --- pools and the nodes they select ---------------------------------------------------------


async def test_a_pool_is_ready_with_the_nodes_it_selects(
    kube_api: KubeApi, db: Database, operator: Operator
):
    world = await apply_world(kube_api, db, nodes=2, gpus=4)
    pool = kube_api.stored(GPUPOOLS, None, "h100")
    assert pool is not None
    assert pool["status"]["nodes"] == 2
    assert pool["status"]["observedGeneration"] == pool["metadata"]["generation"]
    ready = _ready_condition(pool)
    assert ready is not None
    assert (ready["status"], ready["reason"]) == ("True", "Applied")
    assert ready["lastTransitionTime"].endswith("Z")
    for name in world.nodes:
        [node] = await _rows_until(db, NODE, (name,), bool)
        assert (node["pool_id"], node["ready"], node["connected"]) == ("h100", True, True)
        atoms = await _rows_until(db, ATOMS, (name,), lambda rows: len(rows) == 4)
        assert {a["kind"] for a in atoms} == {"gpu"}
        assert [a["device_id"] for a in atoms] == [kubeworld.gpu_uuid(name, i) for i in range(4)]
    [stored] = await _rows_until(db, POOL, ("h100",), bool)
    assert (stored["archived"], stored["sharing_mode"]) == (False, "exclusive")


async def test_nodes_arriving_while_the_pool_applies_do_not_break_it(
    kube_api: KubeApi, db: Database, operator: Operator
):
    """GPUNodes created while the pool's handler walks the nodes it knows (a rack coming up
    as the pool is applied): the pool still becomes Ready at once, and every node is taken.

    The window is made certain, not hoped for: the test holds the first rack's rows locked, so
    the pool's handler waits inside its walk while the second rack arrives.
    """
    await kube_api.create(kubeworld.namespace("ml", tenant="acme"))

    async def arrive(name: str) -> None:
        status = kubeworld.gpunode_status(name, gpus=2)
        await _node(kube_api, name, labels={"bcd.dev/pool": "h100"}, status=status)

    first = [f"rack-a-{i}" for i in range(2)]
    then = [f"rack-b-{i}" for i in range(2)]
    for name in first:
        await arrive(name)
        await _rows_until(db, NODE, (name,), bool)
    async with db.transaction() as conn:
        await conn.execute("SELECT id FROM nodes WHERE id = ANY(%s) FOR UPDATE", (first,))
        await kube_api.create(kubeworld.gpuquota("acme", {"gpu:H100": 64}))
        await kube_api.create(kubeworld.gpupool("h100"))
        await _rows_until(db, POOL, ("h100",), bool)  # its handler now waits on the lock
        for name in then:
            await arrive(name)
            await _rows_until(db, ATOMS, (name,), lambda rows: len(rows) == 2)
    await kube_api.wait_for(
        GPUPOOLS, None, "h100", lambda o: (_ready_condition(o) or {}).get("status") == "True"
    )
    for name in first + then:
        await _rows_until(db, ATOMS, (name,), lambda rows: len(rows) == 2)


async def test_an_invalid_pool_is_not_ready_and_takes_no_nodes(
    kube_api: KubeApi, db: Database, operator: Operator
):
    await kube_api.create(kubeworld.namespace("ml", tenant="acme"))
    await _node(
        kube_api,
        "loose-node-0",
        labels={"bcd.dev/pool": "loose"},
        status=kubeworld.gpunode_status("loose-node-0"),
    )
    invalid = kubeworld.gpupool("loose")
    del invalid["spec"]["owner"]["tenant"]
    # Past admission: the CRD's schema requires the tenant, so a real cluster holds such a pool
    # only when it was written under an older CRD; the operator must still refuse it.
    kube_api.emulator.put_raw(GPUPOOLS, invalid)
    pool = await kube_api.wait_for(
        GPUPOOLS, None, "loose", lambda o: (_ready_condition(o) or {}).get("status") == "False"
    )
    ready = _ready_condition(pool)
    assert ready is not None
    assert ready["reason"] == "INVALID_INPUT"
    assert "spec.owner.tenant" in ready["message"]
    assert "nodes" not in pool["status"]
    [node] = await _rows_until(db, NODE, ("loose-node-0",), bool)
    assert node["pool_id"] is None
    assert await _rows_until(db, ATOMS, ("loose-node-0",), lambda rows: True) == []
    assert await _rows_until(db, POOL, ("loose",), lambda rows: True) == []


async def test_a_node_no_pool_selects_books_nothing_until_its_labels_match(
    world: World, db: Database
):
    kube = world.kube
    await _node(
        kube,
        "spare-0",
        labels={"bcd.dev/pool": "other"},
        status=kubeworld.gpunode_status("spare-0"),
    )
    [node] = await _rows_until(db, NODE, ("spare-0",), bool)
    assert node["pool_id"] is None
    assert await _rows_until(db, ATOMS, ("spare-0",), lambda rows: True) == []

    await kube.create(kubeworld.reservation("first").gpus(8).obj())
    first = await kube.wait_for(RESERVATIONS, "ml", "first", _state("placed"))
    assert first["status"]["nodes"] == world.nodes[0]
    await kube.create(kubeworld.reservation("second").gpus(8).obj())
    second = await kube.wait_for(RESERVATIONS, "ml", "second", _condition("Unschedulable"))
    assert second["status"]["state"] == "pending"

    # Relabelled into the pool: the node's GPUs become the pool's, and the waiting booking
    # (woken by the new capacity) is placed there.
    await kube.patch(GPUNODES, None, "spare-0", {"metadata": {"labels": {"bcd.dev/pool": "h100"}}})
    await _rows_until(db, NODE, ("spare-0",), lambda rows: rows[0]["pool_id"] == "h100")
    await _rows_until(db, ATOMS, ("spare-0",), lambda rows: len(rows) == 8)
    second = await kube.wait_for(RESERVATIONS, "ml", "second", _state("placed"))
    assert second["status"]["nodes"] == "spare-0"


async def test_the_pool_status_counts_nodes_that_join_and_leave_later(world: World):
    """``status.nodes`` is how many GPUNodes the pool takes, not how many it took when its
    own spec was last applied."""
    kube = world.kube
    await _node(
        kube, "spare-0", labels={"bcd.dev/pool": "h100"}, status=kubeworld.gpunode_status("spare-0")
    )
    await kube.wait_for(GPUPOOLS, None, "h100", lambda o: o["status"].get("nodes") == 2)
    await kube.patch(GPUNODES, None, "spare-0", {"metadata": {"labels": {"bcd.dev/pool": "x"}}})
    await kube.wait_for(GPUPOOLS, None, "h100", lambda o: o["status"].get("nodes") == 1)


async def test_a_node_that_is_not_ready_takes_no_new_work(world: World, db: Database):
    kube, name = world.kube, world.nodes[0]
    not_ready = kubeworld.gpunode_status(name, ready=False)
    await kube.patch(GPUNODES, None, name, {"status": not_ready}, status=True)
    await _rows_until(db, NODE, (name,), lambda rows: rows[0]["ready"] is False)
    await kube.create(kubeworld.reservation("train").gpus(1).obj())
    obj = await kube.wait_for(RESERVATIONS, "ml", "train", _condition("Unschedulable"))
    assert obj["status"]["state"] == "pending"
    assert obj["status"].get("nodes") is None

    # Ready again: it takes work again.
    await kube.patch(GPUNODES, None, name, {"status": kubeworld.gpunode_status(name)}, status=True)
    await _rows_until(db, NODE, (name,), lambda rows: rows[0]["ready"] is True)
    await kube.create(kubeworld.reservation("later").gpus(1).obj())
    await kube.wait_for(RESERVATIONS, "ml", "later", _state("placed"))


async def test_a_node_reporting_foreign_gpu_exposure_is_marked_and_cleared(
    world: World, db: Database
):
    kube, name = world.kube, world.nodes[0]
    exposed = kubeworld.gpunode_status(name)
    message = "another path hands this node's GPUs to pods: Node resources nvidia.com/gpu=8"
    exposed["conditions"].append(
        {
            "type": "ForeignGpuExposure",
            "status": "True",
            "reason": "ForeignPath",
            "message": message,
            "lastTransitionTime": "2026-12-02T00:00:00Z",
        }
    )
    await kube.patch(GPUNODES, None, name, {"status": exposed}, status=True)
    sql = "SELECT ready, foreign_exposure FROM nodes WHERE id = %s"
    [node] = await _rows_until(db, sql, (name,), lambda rows: rows[0]["foreign_exposure"])
    assert node == {"ready": True, "foreign_exposure": message}  # it still takes work

    await kube.patch(GPUNODES, None, name, {"status": kubeworld.gpunode_status(name)}, status=True)
    await _rows_until(db, sql, (name,), lambda rows: rows[0]["foreign_exposure"] is None)


async def test_a_deleted_node_is_not_ready_in_the_store(world: World, db: Database):
    kube, name = world.kube, world.nodes[0]
    await kube.delete(GPUNODES, None, name)
    [node] = await _rows_until(db, NODE, (name,), lambda rows: rows[0]["ready"] is False)
    assert node["connected"] is False
    assert node["pool_id"] == "h100"  # its history stays where it was
    await kube.create(kubeworld.reservation("train").gpus(1).obj())
    await kube.wait_for(RESERVATIONS, "ml", "train", _condition("Unschedulable"))


# --- sharing modes ---------------------------------------------------------------------------


async def test_a_mig_pool_books_mig_instances_by_profile(
    kube_api: KubeApi, db: Database, operator: Operator
):
    await kube_api.create(kubeworld.namespace("ml", tenant="acme"))
    pool = kubeworld.gpupool("a100-mig", model="A100", mode="mig")
    await kube_api.create(kubeworld.gpuquota("acme", {"gpuSlices:A100": 14}))
    profiles = ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")
    await _node(
        kube_api,
        "mig-0",
        labels={"bcd.dev/pool": "a100-mig"},
        status=mig_status("mig-0", gpus=2, profiles=profiles),
    )
    await _pool(kube_api, pool, nodes=1)
    atoms = await _rows_until(db, ATOMS, ("mig-0",), lambda rows: len(rows) == 8)
    assert {a["kind"] for a in atoms} == {"mig"}
    assert sorted(a["profile"] for a in atoms) == sorted(profiles * 2)
    assert {a["parent_gpu"] for a in atoms} == {kubeworld.gpu_uuid("mig-0", i) for i in (0, 1)}

    manifest = kubeworld.reservation("slice").pool("a100-mig").obj()
    manifest["spec"]["devices"] = [{"class": "mig", "count": 2, "profile": "1g.10gb"}]
    await kube_api.create(manifest)
    placed = await kube_api.wait_for(RESERVATIONS, "ml", "slice", _state("placed"))
    assert (placed["status"]["gpus"], placed["status"]["nodes"]) == (2, "mig-0")
    booked = await _booked(db, placed["status"]["id"])
    assert len(booked) == 2
    assert {b["profile"] for b in booked} == {"1g.10gb"}
    # kubectl's Free and Total columns count MIG instances here, not the 2 whole GPUs.
    shown = await kube_api.wait_for(
        GPUPOOLS, None, "a100-mig", lambda o: ((o or {}).get("status") or {}).get("free") == 6
    )
    assert shown["status"]["total"] == 8

    # Only two 3g.40gb instances exist: asking for three does not fit.
    manifest = kubeworld.reservation("big").pool("a100-mig").obj()
    manifest["spec"]["devices"] = [{"class": "mig", "count": 3, "profile": "3g.40gb"}]
    await kube_api.create(manifest)
    await kube_api.wait_for(RESERVATIONS, "ml", "big", _condition("Unschedulable"))


async def test_a_timeslice_pool_books_slots(kube_api: KubeApi, db: Database, operator: Operator):
    await kube_api.create(kubeworld.namespace("ml", tenant="acme"))
    pool = kubeworld.gpupool("shared", mode="timeslice", replicas=4)
    await kube_api.create(kubeworld.gpuquota("acme", {"gpuSlices:H100": 16}))
    await _node(
        kube_api,
        "shared-0",
        labels={"bcd.dev/pool": "shared"},
        status=kubeworld.gpunode_status("shared-0", gpus=2),
    )
    await _pool(kube_api, pool, nodes=1)
    atoms = await _rows_until(db, ATOMS, ("shared-0",), lambda rows: len(rows) == 8)
    assert {a["kind"] for a in atoms} == {"slot"}
    gpu0 = kubeworld.gpu_uuid("shared-0", 0)
    assert [a["device_id"] for a in atoms if a["parent_gpu"] == gpu0] == [
        f"{gpu0}::{k}" for k in range(4)
    ]
    [stored] = await _rows_until(db, POOL, ("shared",), bool)
    assert (stored["sharing_mode"], stored["replicas"]) == ("timeslice", 4)

    # kubectl's Free and Total columns count slots here: 4 on each of the 2 GPUs.
    def slots(o):
        status = (o or {}).get("status") or {}
        return (status.get("free"), status.get("total")) == (8, 8)

    await kube_api.wait_for(GPUPOOLS, None, "shared", slots)

    manifest = kubeworld.reservation("notebook").pool("shared").obj()
    manifest["spec"]["devices"] = [{"class": "slot", "count": 3}]
    await kube_api.create(manifest)
    placed = await kube_api.wait_for(RESERVATIONS, "ml", "notebook", _state("placed"))
    assert (placed["status"]["gpus"], placed["status"]["nodes"]) == (3, "shared-0")
    booked = await _booked(db, placed["status"]["id"])
    assert len(booked) == 3
    assert all("::" in b["device_id"] for b in booked)


async def _booked(db: Database, rid: str) -> list[Row]:
    sql = (
        "SELECT a.device_id, a.profile FROM bookings b JOIN atoms a ON a.id = b.atom_id"
        " WHERE b.reservation_id = %s"
    )
    return await _rows_until(db, sql, (rid,), bool)


# --- deletion and offers ---------------------------------------------------------------------


async def test_a_deleted_pool_is_archived_and_refuses_new_work(world: World, db: Database):
    kube = world.kube
    await kube.delete(GPUPOOLS, None, "h100")
    await kube.wait_for(GPUPOOLS, None, "h100", lambda o: o is None)
    await _rows_until(db, POOL, ("h100",), lambda rows: rows[0]["archived"] is True)
    await kube.create(kubeworld.reservation("late").obj())
    refused = await kube.wait_for(RESERVATIONS, "ml", "late", _condition("Refused", "NOT_FOUND"))
    assert "id" not in refused["status"]


async def test_an_offer_lets_another_tenant_book_until_it_is_withdrawn(
    kube_api: KubeApi, db: Database, operator: Operator
):
    world = await apply_world(kube_api, db, tenant_namespaces={"ml": "acme", "research": "globex"})
    kube = world.kube
    await kube.patch(GPUQUOTAS, None, "globex", {"spec": {"limits": {"gpu:H100": 4}}})
    await kube.wait_for(GPUQUOTAS, None, "globex", lambda o: _limits(o) == {"gpu:H100": 4})
    offers = [{"tenant": "globex"}]
    patched = await kube.patch(GPUPOOLS, None, "h100", {"spec": {"offers": offers}})
    await kube.wait_for(GPUPOOLS, None, "h100", _applied(patched["metadata"]["generation"]))

    await kube.create(_by_gina("probe", gpus=2))
    placed = await kube.wait_for(RESERVATIONS, "research", "probe", _state("placed"))
    assert (placed["status"]["tenantId"], placed["status"]["poolId"]) == ("globex", "h100")

    # The offer's quota holds: 2 more fit, 3 more do not.
    await kube.create(_by_gina("too-many", gpus=3))
    await kube.wait_for(
        RESERVATIONS, "research", "too-many", _condition("Refused", "QUOTA_EXCEEDED")
    )

    patched = await kube.patch(GPUPOOLS, None, "h100", {"spec": {"offers": []}})
    await kube.wait_for(GPUPOOLS, None, "h100", _applied(patched["metadata"]["generation"]))
    await kube.create(_by_gina("after", gpus=1))
    refused = await kube.wait_for(
        RESERVATIONS, "research", "after", _condition("Refused", "NOT_FOUND")
    )
    assert "id" not in refused["status"]
    # The owner still books as before.
    await kube.create(kubeworld.reservation("owner").obj())
    await kube.wait_for(RESERVATIONS, "ml", "owner", _state("placed"))


def _by_gina(name: str, *, gpus: int) -> dict[str, Any]:
    """A Reservation in globex's namespace, stamped for one of its members."""
    return kubeworld.reservation(name, namespace="research").by("gina@globex").gpus(gpus).obj()


async def test_the_pool_status_shows_free_and_booked_devices_within_seconds(
    kube_api: KubeApi, db: Database, operator: Operator
):
    await apply_world(kube_api, db, nodes=2, gpus=4)

    def devices(free: int, booked: int):
        def check(o):
            gpu = ((o or {}).get("status") or {}).get("devices", {}).get("gpu") or {}
            return (gpu.get("free"), gpu.get("booked"), gpu.get("total")) == (free, booked, 8)

        return check

    await kube_api.wait_for(GPUPOOLS, None, "h100", devices(8, 0), timeout=5)
    await kube_api.create(kubeworld.reservation("train").gpus(3).obj())
    pool = await kube_api.wait_for(GPUPOOLS, None, "h100", devices(5, 3), timeout=5)
    assert pool is not None
    assert pool["status"]["nodesReady"] == 2
    assert pool["status"].get("nextFreeAt") is None  # some are free now
    # The Free and Total columns: the class this (exclusive) pool sells, whole GPUs.
    assert (pool["status"]["free"], pool["status"]["total"]) == (5, 8)


async def test_a_dra_pool_where_resource_v1_is_not_served_says_so_and_makes_no_template(
    kube_api: KubeApi, db: Database, operator: Operator
):
    # The stand-in serves no resource.k8s.io (as a cluster before 1.34): discovery says so.
    await apply_world(kube_api, db, kubernetes={"api": "dra"})
    pool = await kube_api.wait_for(
        GPUPOOLS, None, "h100", _condition("DraAvailable", "ResourceApiMissing")
    )
    (shown,) = [c for c in pool["status"]["conditions"] if c["type"] == "DraAvailable"]
    assert shown["status"] == "False"
    assert "resource.k8s.io/v1" in shown["message"]
    assert _ready_condition(pool)["status"] == "True"  # the pool itself works
    await kube_api.create(kubeworld.reservation("train").gpus(2).kubernetes().obj())
    placed = await kube_api.wait_for(
        RESERVATIONS,
        "ml",
        "train",
        lambda o: bool(o) and (o.get("status") or {}).get("state") in ("placed", "binding"),
    )
    assert "claimTemplate" not in placed["status"]
    asked = [r.url.path for r in kube_api.emulator if "resourceclaimtemplates" in r.url.path]
    assert asked == [], "no template is attempted where the API is not served"
