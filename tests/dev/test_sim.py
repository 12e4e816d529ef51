"""Simulated nodes: the inventory's shape, the files a node writes, and the agent binding and
releasing real reservations through the real service on the test PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from bettercompute.core import pools
from bettercompute.dev import applying
from bettercompute.deviceplugin import devicefiles, signing
from bettercompute.deviceplugin.converging import Converger
from bettercompute.deviceplugin.devicefiles import Allocation, DeviceFileError, DeviceFiles
from bettercompute.deviceplugin.inventory import FileInventory
from bettercompute.iam import policies
from bettercompute.service import backing
from bettercompute.service.nodes import NodeService
from bettercompute.service.reconciling import Reconciler
from bettercompute.service.reservations import ReservationService
from bettercompute.sim import agents, inventories
from bettercompute.store import inventory
from bettercompute.store.budgets import DatabaseBudget
from bettercompute.store.database import Database
from tests.conftest import ROOT, caller
from tests.support import nodecerts
from tests.support.world import World

# --- inventory --------------------------------------------------------------------------------


def test_gpu_uuids_are_stable_per_node_name_and_distinct_across_nodes() -> None:
    a = inventories.node(name="sim-h100-00", pool_id="pool_h100", model="H100")
    again = inventories.node(name="sim-h100-00", pool_id="pool_h100", model="H100")
    b = inventories.node(name="sim-h100-01", pool_id="pool_h100", model="H100")
    assert a.gpus == again.gpus
    assert not set(a.gpus) & set(b.gpus)
    assert len(set(a.gpus)) == 8
    for gpu in a.gpus:
        assert gpu.startswith("GPU-")
        assert uuid.UUID(gpu.removeprefix("GPU-")).version == 5


def test_eight_gpus_make_two_nvlink_domains_of_four_on_two_numa_nodes() -> None:
    node = inventories.node(name="n", pool_id="p", model="H100")
    assert node.id == "node_n"
    assert [a.nvlink_domain for a in node.atoms] == ["n-nvl0"] * 4 + ["n-nvl1"] * 4
    assert [a.numa_node for a in node.atoms] == [0] * 4 + [1] * 4
    assert all(a.kind == "gpu" and a.parent_gpu == a.device_id for a in node.atoms)


def test_no_nvlink_and_uneven_domains() -> None:
    flat = inventories.node(name="n", pool_id="p", model=None, gpus=2, nvlink_domains=0)
    assert [a.nvlink_domain for a in flat.atoms] == [None, None]
    uneven = inventories.node(name="n", pool_id="p", model=None, gpus=6, nvlink_domains=4)
    assert [a.nvlink_domain for a in uneven.atoms] == [
        "n-nvl0", "n-nvl0", "n-nvl1", "n-nvl1", "n-nvl2", "n-nvl2",
    ]  # fmt: skip


def test_mig_instances_hang_off_their_gpu() -> None:
    node = inventories.node(
        name="m", pool_id="p", model="A100", gpus=2, mig={"3g.40gb": 1, "1g.10gb": 4}
    )
    assert len(node.atoms) == 2 * 5
    assert {a.kind for a in node.atoms} == {"mig"}
    for gpu in node.gpus:
        mine = [a for a in node.atoms if a.parent_gpu == gpu]
        assert sorted(a.profile or "" for a in mine) == ["1g.10gb"] * 4 + ["3g.40gb"]
    assert all(a.device_id.startswith("MIG-") for a in node.atoms)
    assert len({a.device_id for a in node.atoms}) == 10
    with pytest.raises(ValueError, match="take 8 of a GPU's 7"):
        inventories.node(name="m", pool_id="p", model="A100", mig={"7g.80gb": 1, "1g.10gb": 1})


def test_time_slice_slots_share_their_gpu() -> None:
    node = inventories.node(name="t", pool_id="p", model="L4", gpus=2, slots=4)
    assert [a.device_id for a in node.atoms[:4]] == [f"{node.gpus[0]}::{k}" for k in range(4)]
    assert {a.kind for a in node.atoms} == {"slot"}


def test_the_sim_advertises_current_daemon_capabilities_unless_told_otherwise() -> None:
    node = inventories.node(name="n", pool_id="p", model="H100")
    assert node.labels == {
        pools.CAP_BINDING_KUBERNETES: "true",
        pools.CAP_DEVICES_LIMITS: "true",
        inventories.MODEL_LABEL: "H100",
    }
    old = inventories.node(name="n", pool_id="p", model=None, labels={})
    assert old.labels == {}
    spec = applying.node_spec(node)
    assert spec.labels[pools.CAP_DEVICES_LIMITS] == ("true", "system")


# --- device files -----------------------------------------------------------------------------


def _allocation(**overrides: Any) -> Allocation:
    values: dict[str, Any] = {
        "allocation_id": "alloc_01abc",
        "reservation_id": "rsv_x",
        "tenant_id": "acme",
        "device_class": "gpu",
        "device_ids": ("GPU-a", "GPU-b"),
        "parent_gpus": ("GPU-a", "GPU-b"),
        "until_ms": 1_790_028_800_000,
    }
    values.update(overrides)
    return Allocation(**values)


@pytest.mark.parametrize("bad", ["../etc/passwd", "a/b", ".hidden", "", "a.b", "x" * 200, "a\n"])
def test_an_allocation_id_that_could_leave_the_directory_is_refused(bad: str) -> None:
    with pytest.raises(DeviceFileError):
        devicefiles.check_allocation_id(bad)


def test_the_cdi_spec_and_env_file_of_an_allocation(tmp_path: Path) -> None:
    files = DeviceFiles(tmp_path)
    files.write(_allocation())
    spec = json.loads((tmp_path / "cdi" / "bcd-alloc_01abc.json").read_text())
    assert spec["cdiVersion"] == "0.6.0"
    assert spec["kind"] == "bcd.dev/gpu"
    assert [d["name"] for d in spec["devices"]] == ["GPU-a", "GPU-b"]
    assert spec["containerEdits"]["env"] == [
        "NVIDIA_VISIBLE_DEVICES=GPU-a,GPU-b",
        "BCD_ALLOCATION_ID=alloc_01abc",
    ]
    env = devicefiles.read_env(tmp_path / "run" / "allocations" / "alloc_01abc.env")
    assert env["BCD_ALLOCATION_ID"] == "alloc_01abc"
    assert env["BCD_RESERVATION_ID"] == "rsv_x"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    # Written through temporary names: none is left behind.
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [
        "alloc_01abc.env",
        "bcd-alloc_01abc.json",
    ]
    assert files.matches(_allocation())
    assert not files.matches(_allocation(until_ms=1))
    files.remove("alloc_01abc")
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_slots_make_their_physical_gpu_visible() -> None:
    slot = _allocation(
        device_class="slot", device_ids=("GPU-a::0", "GPU-a::1"), parent_gpus=("GPU-a", "GPU-a")
    )
    assert slot.visible_devices == ["GPU-a"]
    assert slot.cdi_devices == ["bcd.dev/gpu=GPU-a::0", "bcd.dev/gpu=GPU-a::1"]


def test_a_device_id_unfit_for_a_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DeviceFileError):
        DeviceFiles(tmp_path).write(_allocation(device_ids=("GPU-a\nEVIL=1",)))
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


# --- the agent, against the real service ------------------------------------------------------

CREATE = {
    "tenantId": "acme",
    "poolId": "pool_h100",
    "devices": [{"class": "gpu", "count": 4, "topology": "nvlink-all"}],
    "duration": "8h",
    "idempotencyKey": "train-2026-09-24",
}


async def _world(db: Database) -> inventories.SimNode:
    await (
        World(db)
        .tenant("root", root=True)
        .tenant("acme")
        .pool("pool_h100", owner="acme")
        .quota("acme", "gpu:H100", 16)
        .build()
    )
    node = inventories.node(name="sim-h100-00", pool_id="pool_h100", model="H100")
    await inventory.upsert_node(db, applying.node_spec(node))
    return node


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.fixture
def service(db: Database) -> ReservationService:
    """As ``dev`` runs it: bound reports count only when attested (here by the test authority
    the simulated nodes are certified from)."""
    return ReservationService(
        db=db,
        policy=policies.CedarPolicyEngine.from_text(policies.DEFAULT_POLICIES),
        budget=DatabaseBudget(db),
        root_tenant_id=ROOT,
        attestation=nodecerts.TRUST,
    )


def _agent(
    node: inventories.SimNode, root: Path, db: Database, service: ReservationService
) -> Converger:
    return agents.node_agent(
        node, root=root, desired=NodeService(db), reports=service, authority=nodecerts.AUTHORITY
    )


async def test_the_agent_binds_a_reservation_then_releases_it(
    db: Database, service: ReservationService, tmp_path: Path
) -> None:
    node = await _world(db)
    agent = _agent(node, tmp_path, db, service)
    # It advertises devices.limits, so it enforces them: in a folder laid out like cgroup v2.
    assert agent.cgroups is not None
    assert agent.cgroups.root == tmp_path / "cgroup"
    created = await service.create(caller(), CREATE)
    assert created["state"] == "placed"
    assert (await agent.sync_once()).bound == []  # placed: nothing desired before the start
    await Reconciler(db).run_once()  # the start: placed → binding, allocation desired

    [desired] = await NodeService(db).desired(node.id)
    assert desired["release"] is False
    assert desired["nodeName"] == node.id
    assert desired["reservationId"] == created["id"]
    assert len(desired["deviceIds"]) == 4
    assert set(desired["deviceIds"]) <= set(node.gpus)
    assert desired["parentGpus"] == desired["deviceIds"]

    first = await agent.sync_once()
    assert first.bound == [desired["allocationId"]]
    await Reconciler(db).run_once()
    got = await service.get(caller(), {"tenantId": "acme", "reservationId": created["id"]})
    assert got["state"] == "active"
    assert got["binding"]["attested"] is True  # certified by the authority, and checked
    binding = got["binding"]
    assert binding["nodeId"] == node.id
    assert binding["cdiDevices"] == [f"bcd.dev/gpu={d}" for d in desired["deviceIds"]]
    env_file = Path(binding["envFile"])
    assert env_file == tmp_path / "run" / "allocations" / f"{desired['allocationId']}.env"
    assert devicefiles.read_env(env_file)["BCD_RESERVATION_ID"] == created["id"]
    cdi = tmp_path / "cdi" / f"bcd-{desired['allocationId']}.json"
    assert [d["name"] for d in json.loads(cdi.read_text())["devices"]] == desired["deviceIds"]

    # A restarted agent (a new process: nothing in memory) takes the allocation over from its
    # files as they are, and the reservation stays active.
    again = await _agent(node, tmp_path, db, service).sync_once()
    assert (again.restored, again.removed, again.released) == ([], [], [])
    await Reconciler(db).run_once()
    got = await service.get(caller(), {"tenantId": "acme", "reservationId": created["id"]})
    assert got["state"] == "active"
    # Files that went missing are put back, without a second report.
    devicefiles.DeviceFiles(tmp_path).env_path(desired["allocationId"]).unlink()
    healed = await agent.sync_once()
    assert (healed.bound, healed.restored) == ([], [desired["allocationId"]])
    assert env_file in files_under(tmp_path)

    await service.release(caller(), {"tenantId": "acme", "reservationId": created["id"]})
    [releasing] = await NodeService(db).desired(node.id)
    assert releasing["release"] is True
    done = await agent.sync_once()
    assert done.released == [desired["allocationId"]]
    assert not list((tmp_path / "cdi").iterdir())
    assert not list((tmp_path / "run" / "allocations").iterdir())
    assert await NodeService(db).desired(node.id) == []
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT state FROM allocations WHERE id = %s", (desired["allocationId"],)
            )
        ).fetchone()
    assert row is not None
    assert row["state"] == "released"


async def test_the_agent_removes_files_no_allocation_explains(
    db: Database, service: ReservationService, tmp_path: Path
) -> None:
    node = await _world(db)
    agent = _agent(node, tmp_path, db, service)
    DeviceFiles(tmp_path).write(_allocation(allocation_id="alloc_gone"))
    outcome = await agent.sync_once()
    # Its files name devices of this node: taken over as releasing, then released (no pod
    # holds a simulated device), and its files go.
    assert outcome.released == ["alloc_gone"]
    assert not list((tmp_path / "cdi").iterdir())
    assert not list((tmp_path / "run" / "allocations").iterdir())


async def test_another_nodes_agent_sees_nothing_of_this_node(
    db: Database, service: ReservationService, tmp_path: Path
) -> None:
    await _world(db)
    other = inventories.node(name="sim-h100-01", pool_id="pool_h100", model="H100", gpus=2)
    await inventory.upsert_node(db, applying.node_spec(other))
    await service.create(caller(), CREATE)  # 4 nvlink GPUs: only sim-h100-00 fits
    await Reconciler(db).run_once()
    outcome = await _agent(other, tmp_path, db, service).sync_once()
    assert outcome.bound == []
    assert not list((tmp_path / "cdi").glob("*"))


class RecordingReports:
    """The service's report call, with every report also kept for the test to read."""

    def __init__(self, service: ReservationService) -> None:
        self.service = service
        self.seen: list[dict[str, Any]] = []

    async def report(self, **kw: Any) -> bool:
        self.seen.append(kw)
        return await self.service.report(**kw)


async def test_a_simulated_node_signs_its_reports_with_its_own_key(
    db: Database, service: ReservationService, tmp_path: Path
) -> None:
    node = await _world(db)
    reports = RecordingReports(service)
    agent = agents.node_agent(node, root=tmp_path, desired=NodeService(db), reports=reports)
    await service.create(caller(), CREATE)
    await Reconciler(db).run_once()
    assert (await agent.sync_once()).bound
    [bound] = reports.seen
    assert bound["kind"] == "bound"
    key = signing.public_key_from_pem(signing.NodeKey.load(tmp_path / "node-key.pem").public_pem())
    signed = signing.verify(signature=bound["details"]["signature"], public_key=key)
    assert signed["nodeName"] == node.id
    assert signed["allocationId"] == bound["allocation_id"]
    assert signed["phase"] == "Bound"
    # Another node's key does not verify it: the signature is this node's.
    other = signing.NodeKey.generate()
    with pytest.raises(signing.SignatureError):
        signing.verify(signature=bound["details"]["signature"], public_key=other.public_key)


@pytest.mark.parametrize(
    "shape",
    [
        {},
        {"mig": {"1g.10gb": 2, "3g.40gb": 1}},
        {"slots": 4},
        {"nvlink_domains": 0},
    ],
    ids=["whole GPUs", "MIG", "time-slice slots", "no NVLink"],
)
def test_the_inventory_file_a_simulated_node_writes_reads_back_as_its_devices(
    shape: dict[str, Any], tmp_path: Path
) -> None:
    node = inventories.node(name="sim-a100-00", pool_id="p", model="A100", **shape)
    path = agents.write_inventory(node, tmp_path / "inventory.json")
    read = FileInventory(path=path, node_name=node.name).read()
    assert [gpu.uuid for gpu in read.gpus] == list(node.gpus)
    assert {m.uuid for gpu in read.gpus for m in gpu.mig} == {
        a.device_id for a in node.atoms if a.kind == "mig"
    }
    # The agent's NVLink domains are the simulator's, under the same names.
    sim_domains: dict[str, set[str]] = {}
    for atom in node.atoms:
        if atom.nvlink_domain is not None:
            sim_domains.setdefault(atom.nvlink_domain, set()).add(atom.parent_gpu)
    assert {k: set(v) for k, v in read.nvlink_domains.items()} == sim_domains


async def test_devices_missing_from_the_inventory_are_reported_failed_and_signed(
    db: Database, service: ReservationService, tmp_path: Path
) -> None:
    node = await _world(db)
    reports = RecordingReports(service)
    agent = agents.node_agent(node, root=tmp_path, desired=NodeService(db), reports=reports)
    # The machine lost all but one GPU after the store was told about its eight.
    shrunk = inventories.node(
        name=node.name, pool_id=node.pool_id, model="H100", gpus=1, nvlink_domains=0
    )
    agents.write_inventory(shrunk, tmp_path / "inventory.json")
    await service.create(caller(), CREATE)
    await Reconciler(db).run_once()
    [desired] = await NodeService(db).desired(node.id)
    done = await agent.sync_once()
    assert (done.bound, done.failed) == ([], [desired["allocationId"]])
    assert not list((tmp_path / "cdi").glob("*"))
    [failed] = reports.seen
    assert failed["kind"] == "failed"
    assert "is not in this node's inventory" in failed["details"]["reason"]
    key = signing.NodeKey.load(tmp_path / "node-key.pem").public_key
    assert signing.verify(signature=failed["details"]["signature"], public_key=key)["phase"] == (
        "Failed"
    )


async def _listening(db: Database) -> None:
    """Until some session has run ``LISTEN`` (a NOTIFY sent before it would be lost)."""
    async with asyncio.timeout(5):
        while True:
            async with db.connection() as conn:
                row = await (
                    await conn.execute(
                        "SELECT count(*) AS n FROM pg_stat_activity WHERE query LIKE 'LISTEN %'"
                    )
                ).fetchone()
            if row is not None and row["n"]:
                return
            await asyncio.sleep(0.02)


async def test_a_change_wakes_the_agent_of_its_node_without_waiting_for_a_pass(
    db: Database, service: ReservationService, tmp_path: Path
) -> None:
    node = await _world(db)
    # No pass would come for ten minutes: only the wake-up can bind it in time.
    agent = agents.node_agent(
        node,
        root=tmp_path,
        desired=NodeService(db),
        reports=service,
        pass_seconds=600,
        authority=nodecerts.AUTHORITY,
    )
    wakeups = agents.Wakeups(nodes=NodeService(db), agents={node.id: agent})
    tasks = [
        asyncio.create_task(agent.run()),
        asyncio.create_task(wakeups.run()),
        asyncio.create_task(backing.reservation_changes(db, wakeups.changed)),
    ]
    try:
        await _listening(db)
        created = await service.create(caller(), CREATE)
        await Reconciler(db).run_once()  # the start: binding, its allocation desired
        async with asyncio.timeout(2.5):
            while True:
                async with db.connection() as conn:
                    row = await (
                        await conn.execute(
                            "SELECT state FROM allocations WHERE reservation_id = %s",
                            (created["id"],),
                        )
                    ).fetchone()
                if row is not None and row["state"] == "bound":
                    break
                await asyncio.sleep(0.02)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
