"""Host limits on the node: the real node plugin against the kubelet stand-in (gRPC) and a
temporary folder laid out like a cgroup v2 root.

A ``hold`` with limits runs in its own slice ``bcd-alloc-<id>.slice`` with the right limit files,
named in its CDI spec, env file and signed Bound report; the slice is removed after the release
once no process is left in it, and kept (tried again every pass) while one is; a slice that is
not the node's own is never touched; a hold that does not fit beside the node's other
allocations fails with ``resources-exhausted``; a ``kubernetes`` binding gets no slice but its
limits count; a node without cgroup v2 refuses limits rather than run a workload unbounded.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bettercompute.deviceplugin import devicefiles, signing
from bettercompute.deviceplugin.cgroups import CgroupError, Cgroups
from bettercompute.deviceplugin.converging import Pass
from bettercompute.deviceplugin.inventory import Inventory
from tests.deviceplugin.conftest import GPU, MIG, SLOT, Node, allocation_spec, inventory

GIB = 1 << 30
#: The host of the test node: 16 CPUs, 64 GiB, 4 pages of 1 GiB.
HOST = {"vcpu": 16, "memory_gib": 64, "hugepages_1gi": 4}


def sized_inventory() -> Inventory:
    plain = inventory()
    return Inventory(node_name=plain.node_name, gpus=plain.gpus, **HOST)


def hold(allocation_id: str, devices: list[str], **limits: Any) -> dict[str, Any]:
    return allocation_spec(allocation_id, devices, binding="hold", limits=limits)


@pytest.fixture
async def node(kubelet_node: Node) -> AsyncIterator[Node]:
    """The node plugin running on a host that gives its size, registered for all resources."""
    kubelet_node.set_inventory(sized_inventory())
    kubelet_node.plugin = kubelet_node.make_plugin()
    async with kubelet_node.plugin.running():
        await kubelet_node.kubelet.wait_registered([GPU, MIG, SLOT])
        assert kubelet_node.plugin.allocations.inventory == sized_inventory()
        yield kubelet_node


def slice_files(node: Node, name: str) -> dict[str, str]:
    folder = node.cgroup_root / name
    return {p.name: p.read_text() for p in sorted(folder.iterdir()) if p.is_file()}


async def one_pass(node: Node) -> Pass:
    assert node.plugin is not None
    return await node.plugin.converger.sync_once()


async def test_a_hold_with_limits_runs_in_its_own_slice_named_everywhere(node: Node) -> None:
    node.put(
        hold(
            "alloc_h",
            ["GPU-0", "GPU-1"],
            cpuMillis=4500,
            memoryBytes=8 * GIB,
            hugepages1Gi=2,
            cpus="0-3,8",
            mems="0",
        )
    )
    status = await node.reporter.wait_phase("alloc_h", "Bound")

    name = "bcd-alloc-alloc_h.slice"
    assert status["cgroupParent"] == name
    assert slice_files(node, name) == {
        "cpu.max": "450000 100000\n",  # 4.5 CPUs: 450 ms of every 100 ms period
        "cpuset.cpus": "0-3,8\n",
        "cpuset.mems": "0\n",
        "hugetlb.1GB.max": f"{2 * GIB}\n",
        "memory.max": f"{8 * GIB}\n",
    }
    assert (node.slice_records / name).exists()  # recorded as ours
    spec = json.loads((node.root / "cdi" / "bcd-alloc_h.json").read_text())
    assert spec["annotations"][devicefiles.ANNOTATION_CGROUP_PARENT] == name
    env = devicefiles.read_env(node.root / "env" / "alloc_h.env")
    assert env["BCD_CGROUP_PARENT"] == name
    signed = signing.verify(signature=status["signature"], public_key=node.key.public_key)
    assert signed["cgroupParent"] == name  # signed: a relay cannot change it


async def test_a_hold_without_cpu_or_memory_limits_gets_max_and_no_pages(node: Node) -> None:
    node.put(hold("alloc_m", ["GPU-2"], cpuMillis=0))
    status = await node.reporter.wait_phase("alloc_m", "Bound")
    files = slice_files(node, status["cgroupParent"])
    assert files == {"cpu.max": "max 100000\n", "hugetlb.1GB.max": "0\n", "memory.max": "max\n"}


async def test_a_hold_without_limits_and_a_kubernetes_binding_get_no_slice(node: Node) -> None:
    node.put(allocation_spec("alloc_plain", ["GPU-0"], binding="hold"))
    node.put(allocation_spec("alloc_k8s", ["GPU-1"], limits={"cpuMillis": 2000}))
    for allocation_id in ("alloc_plain", "alloc_k8s"):
        status = await node.reporter.wait_phase(allocation_id, "Bound")
        assert status["cgroupParent"] is None
        spec = json.loads((node.root / "cdi" / f"bcd-{allocation_id}.json").read_text())
        assert devicefiles.ANNOTATION_CGROUP_PARENT not in spec["annotations"]
        env = devicefiles.read_env(node.root / "env" / f"{allocation_id}.env")
        assert "BCD_CGROUP_PARENT" not in env
    assert list(node.cgroup_root.glob("*.slice")) == []
    assert list(node.slice_records.iterdir()) == []


async def test_the_slice_is_kept_while_a_process_is_in_it_and_removed_once_empty(
    node: Node,
) -> None:
    node.put(hold("alloc_r", ["GPU-0"], cpuMillis=1000))
    name = (await node.reporter.wait_phase("alloc_r", "Bound"))["cgroupParent"]
    folder = node.cgroup_root / name
    # The workload manager put a process in the slice and one in a cgroup of its own below.
    (folder / "cgroup.procs").write_text("4242\n")
    (folder / "job-1").mkdir()
    (folder / "job-1" / "cgroup.procs").write_text("4343\n")

    node.release("alloc_r")
    await node.reporter.wait_phase("alloc_r", "Released")
    for _ in range(3):  # kept, pass after pass
        assert name in (await one_pass(node)).slices_kept
    assert folder.is_dir()
    assert (node.slice_records / name).exists()

    (folder / "cgroup.procs").write_text("")
    assert name in (await one_pass(node)).slices_kept  # the child's process is still there
    (folder / "job-1" / "cgroup.procs").write_text("")
    assert (await one_pass(node)).slices_removed == [name]
    assert not folder.exists()
    assert not (node.slice_records / name).exists()
    assert (await one_pass(node)).slices_removed == []


async def test_a_populated_event_keeps_the_slice(node: Node) -> None:
    node.put(hold("alloc_e", ["GPU-0"], cpuMillis=1000))
    name = (await node.reporter.wait_phase("alloc_e", "Bound"))["cgroupParent"]
    (node.cgroup_root / name / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    node.delete("alloc_e")
    await node.reporter.wait_phase("alloc_e", "Released")
    assert name in (await one_pass(node)).slices_kept
    (node.cgroup_root / name / "cgroup.events").write_text("populated 0\nfrozen 0\n")
    assert (await one_pass(node)).slices_removed == [name]


async def test_a_slice_that_is_not_ours_is_never_removed(node: Node) -> None:
    # Another tool's slice, and an empty one named like ours that this node never made.
    for foreign in ("system.slice", "bcd-alloc-alloc_x.slice"):
        (node.cgroup_root / foreign).mkdir()
    node.put(hold("alloc_o", ["GPU-0"], cpuMillis=1000))
    await node.reporter.wait_phase("alloc_o", "Bound")
    node.release("alloc_o")
    await node.reporter.wait_phase("alloc_o", "Released")
    await one_pass(node)
    assert sorted(p.name for p in node.cgroup_root.glob("*.slice")) == [
        "bcd-alloc-alloc_x.slice",
        "system.slice",
    ]
    cgroups = Cgroups(node.cgroup_root, records=node.slice_records)
    with pytest.raises(CgroupError, match="not one this node made"):
        cgroups.remove("bcd-alloc-alloc_x.slice")
    for escape in ("../escape.slice", "system.slice", "bcd-alloc-a-b.slice"):
        with pytest.raises(CgroupError, match="not a slice name"):
            cgroups.path(escape)


async def test_a_hold_that_does_not_fit_beside_the_others_is_resources_exhausted(
    node: Node,
) -> None:
    node.put(hold("alloc_big", ["GPU-0"], cpuMillis=10_000, memoryBytes=40 * GIB))
    # A kubernetes binding gets no slice, but its limits count too.
    node.put(allocation_spec("alloc_pods", ["GPU-1"], limits={"cpuMillis": 6000}))
    await node.reporter.wait_phase("alloc_big", "Bound")
    await node.reporter.wait_phase("alloc_pods", "Bound")

    node.put(hold("alloc_more", ["GPU-2"], cpuMillis=500, memoryBytes=8 * GIB))
    failed = await node.reporter.wait_phase("alloc_more", "Failed")
    assert failed["reason"].startswith("resources-exhausted: ")
    assert "CPU: 500m asked, 0m of 16000m free beside 2 other allocation(s)" in failed["reason"]
    assert "memory" not in failed["reason"]  # 8 of 24 GiB free: memory fits
    assert not (node.cgroup_root / "bcd-alloc-alloc_more.slice").exists()
    assert not (node.root / "cdi" / "bcd-alloc_more.json").exists()

    node.put(hold("alloc_pages", ["GPU-3"], hugepages1Gi=5))
    failed = await node.reporter.wait_phase("alloc_pages", "Failed")
    assert "1 GiB huge pages: 5 asked, 4 of 4 free" in failed["reason"]

    # The control plane places the refused ones again elsewhere, and deletes these objects.
    node.delete("alloc_more")
    node.delete("alloc_pages")
    # Once the big hold is released, what it held is free again.
    node.release("alloc_big")
    await node.reporter.wait_phase("alloc_big", "Released")
    node.put(hold("alloc_after", ["GPU-3"], cpuMillis=10_000, memoryBytes=64 * GIB))
    assert (await node.reporter.wait_phase("alloc_after", "Bound"))["cgroupParent"]


async def test_the_limits_survive_a_restart_in_the_admission_and_the_slice(
    kubelet_node: Node,
) -> None:
    node = kubelet_node
    node.set_inventory(sized_inventory())
    node.put(hold("alloc_s", ["GPU-0"], cpuMillis=12_000))
    node.plugin = node.make_plugin()
    async with node.plugin.running():
        await node.reporter.wait_phase("alloc_s", "Bound")
    # While the agent was down, the slice was removed behind its back.
    name = "bcd-alloc-alloc_s.slice"
    for path in (node.cgroup_root / name).iterdir():
        path.unlink()
    (node.cgroup_root / name).rmdir()
    node.reporter.statuses.clear()
    node.plugin = node.make_plugin()
    restarted = time.monotonic()
    async with node.plugin.running():
        await node.kubelet.wait_registered([GPU, MIG, SLOT], after=restarted)
        bound = await node.reporter.wait_phase("alloc_s", "Bound")
        assert bound["cgroupParent"] == name
        assert slice_files(node, name)["cpu.max"] == "1200000 100000\n"  # made again
        node.put(hold("alloc_t", ["GPU-1"], cpuMillis=8000))
        failed = await node.reporter.wait_phase("alloc_t", "Failed")
        assert "8000m asked, 4000m of 16000m free" in failed["reason"]


@pytest.mark.parametrize(
    ("limits", "reason"),
    [
        ({"cpus": "0-3,x"}, "spec.limits: cpus: not a cpulist: 'x' is not an id"),
        ({"cpus": "9000"}, "spec.limits: cpus: not a cpulist: '9000' names an id above 8191"),
        ({"mems": "3-1"}, "spec.limits: mems: not a cpulist: '3-1' is a range that runs"),
        ({"cpus": ",".join(["1"] * 5000)}, "spec.limits: cpus: not a cpulist: has more than"),
        ({"cpuMillis": -1}, "spec.limits.cpuMillis"),
    ],
)
async def test_bad_limits_are_failed_naming_the_field(
    node: Node, limits: dict[str, Any], reason: str
) -> None:
    node.put(hold("alloc_bad", ["GPU-0"], **limits))
    failed = await node.reporter.wait_phase("alloc_bad", "Failed")
    assert reason in failed["reason"]
    assert list(node.cgroup_root.glob("*.slice")) == []


async def test_without_cgroup_v2_a_hold_with_limits_fails_and_one_without_binds(
    kubelet_node: Node,
) -> None:
    node = kubelet_node
    (node.cgroup_root / "cgroup.controllers").unlink()  # a cgroup v1 host
    node.set_inventory(sized_inventory())
    node.plugin = node.make_plugin()
    assert node.plugin.converger.cgroups is None
    async with node.plugin.running():
        node.put(hold("alloc_l", ["GPU-0"], cpuMillis=1000))
        node.put(allocation_spec("alloc_n", ["GPU-1"], binding="hold"))
        failed = await node.reporter.wait_phase("alloc_l", "Failed")
        assert "does not enforce host limits" in failed["reason"]
        assert (await node.reporter.wait_phase("alloc_n", "Bound"))["cgroupParent"] is None
    assert list(node.cgroup_root.glob("*.slice")) == []


def test_enforcement_needs_cgroup_v2_with_its_controllers(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    cgroups = Cgroups(root, records=tmp_path / "slices")
    assert "no cgroup v2" in (cgroups.enforcement_problem() or "")
    (root / "cgroup.controllers").write_text("cpu io pids\n")
    (root / "cgroup.subtree_control").write_text("")
    assert (
        cgroups.enforcement_problem() == f"cgroup v2 at {root} lacks the controllers cpuset, memory"
    )
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert cgroups.enforcement_problem() is None
    assert cgroups.controllers == {"cpu", "cpuset", "memory"}  # no hugetlb on this host
    assert (tmp_path / "slices").is_dir()
