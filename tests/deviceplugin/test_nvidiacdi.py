"""NVIDIA's CDI specs on the node: found in their folders, each GPU and MIG instance named by
whichever strategy wrote the spec, referred to (never copied) by bcd's files, asked for by
Allocate beside bcd's device, and said on the GPUNode; without them, env-only as before."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from bettercompute.deviceplugin import devicefiles, nvidiacdi
from bettercompute.deviceplugin.agent import Agent, started
from bettercompute.deviceplugin.devicefiles import Allocation, DeviceFiles
from bettercompute.deviceplugin.inventory import (
    FileInventory,
    Gpu,
    Inventory,
    MigDevice,
    NvidiaCdi,
    write_inventory_file,
)
from bettercompute.kube.allocations import parse_spec
from tests.deviceplugin import agents
from tests.deviceplugin.conftest import GPU, MIG, NODE, SLOT, Node, allocation_spec, inventory
from tests.support import cdirules
from tests.support.kubeserver import KubeApi


def nvidia_spec(names: Sequence[str], *, kind: str = "nvidia.com/gpu") -> dict[str, Any]:
    """A spec shaped like ``nvidia-ctk cdi generate``'s: a device node per device, and the
    driver's nodes, mounts and hooks in the spec-wide edits."""
    return {
        "cdiVersion": "0.5.0",
        "kind": kind,
        "devices": [
            {"name": name, "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{i}"}]}}
            for i, name in enumerate(names)
        ],
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"}],
            "hooks": [
                {
                    "hookName": "createContainer",
                    "path": "/usr/bin/nvidia-cdi-hook",
                    "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib64"],
                }
            ],
            "mounts": [
                {
                    "hostPath": "/usr/lib64/libcuda.so.570.86.15",
                    "containerPath": "/usr/lib64/libcuda.so.570.86.15",
                    "options": ["ro", "nosuid", "nodev", "bind"],
                }
            ],
        },
    }


def write_yaml(path: Path, document: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


def write_json(path: Path, document: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document), encoding="utf-8")
    return path


ALL_UUIDS = ["GPU-0", "GPU-1", "GPU-2", "GPU-3", "GPU-4", "MIG-4a", "MIG-4b"]


def folders(root: Path) -> tuple[Path, Path]:
    """The node's two CDI folders, as /etc/cdi and /var/run/cdi."""
    return root / "etc-cdi", root / "run-cdi"


def read_with_cdi(root: Path, *, dirs: Sequence[Path] | None = None) -> Inventory:
    path = root / "inventory.yaml"
    if not path.exists():
        write_inventory_file(path=path, inventory=inventory())
    source = nvidiacdi.WithNvidiaCdi(
        FileInventory(path=path, node_name=NODE), dirs=dirs or folders(root)
    )
    return source.read()


# --- finding and naming ---------------------------------------------------------------------


def test_specs_in_both_folders_name_every_gpu_and_mig_instance_by_uuid_first(
    tmp_path: Path,
) -> None:
    etc, run = folders(tmp_path)
    # nvidia-ctk with both strategies: index names and UUID names side by side.
    write_yaml(etc / "nvidia.yaml", nvidia_spec(["0", "1", "2", "3", "GPU-0", "GPU-1", "all"]))
    write_json(run / "nvidia.json", nvidia_spec(["GPU-2", "GPU-3", "GPU-4", "MIG-4a", "MIG-4b"]))

    cdi = read_with_cdi(tmp_path).nvidia_cdi

    assert cdi.files == (str(etc / "nvidia.yaml"), str(run / "nvidia.json"))
    assert dict(cdi.names) == {uuid: f"nvidia.com/gpu={uuid}" for uuid in ALL_UUIDS}
    assert cdi.complete
    assert cdi.missing == ()
    assert cdi.searched == (str(etc), str(run))
    assert cdi.devices_for(["GPU-1", "GPU-1", "MIG-4b", "GPU-9"]) == [
        "nvidia.com/gpu=GPU-1",
        "nvidia.com/gpu=MIG-4b",
    ]


def _gpus_with_mig_indexes() -> list[Gpu]:
    return [
        Gpu(uuid="GPU-aa", index=0, model="H100", memory_mib=81559),
        Gpu(
            uuid="GPU-bb",
            index=1,
            model="H100",
            memory_mib=81559,
            mig=(
                MigDevice(uuid="MIG-b0", profile="3g.40gb", parent_uuid="GPU-bb", index=0),
                MigDevice(uuid="MIG-b2", profile="3g.40gb", parent_uuid="GPU-bb", index=2),
            ),
        ),
    ]


@pytest.mark.parametrize(
    ("strategy", "names", "expected"),
    [
        (
            "index",
            ["0", "1:0", "1:2", "all"],
            {"GPU-aa": "0", "MIG-b0": "1:0", "MIG-b2": "1:2"},
        ),
        (
            "type-index",
            ["gpu0", "mig1:0", "mig1:2"],
            {"GPU-aa": "gpu0", "MIG-b0": "mig1:0", "MIG-b2": "mig1:2"},
        ),
        (
            "uuid",
            ["GPU-aa", "MIG-b0", "MIG-b2"],
            {"GPU-aa": "GPU-aa", "MIG-b0": "MIG-b0", "MIG-b2": "MIG-b2"},
        ),
    ],
)
def test_each_of_nvidias_naming_strategies_is_understood(
    tmp_path: Path, strategy: str, names: list[str], expected: dict[str, str]
) -> None:
    spec = write_yaml(tmp_path / f"nvidia-{strategy}.yaml", nvidia_spec(names))
    reader = nvidiacdi.SpecReader([tmp_path])
    files, found, problems = reader.specs()

    cdi = nvidiacdi.resolve(
        gpus=_gpus_with_mig_indexes(), files=files, names=found, searched=[tmp_path]
    )

    assert files == [str(spec)]
    assert problems == []
    assert dict(cdi.names) == {u: f"nvidia.com/gpu={n}" for u, n in expected.items()}
    # NVIDIA names a MIG-enabled GPU (GPU-bb) only by its instances: not missing without.
    assert cdi.missing == ()
    assert cdi.complete


def test_a_spec_written_with_yaml_integers_as_names_still_names_the_gpus(tmp_path: Path) -> None:
    (tmp_path / "hand-written.yaml").write_text(
        "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n"
        "- name: 0\n  containerEdits: {deviceNodes: [{path: /dev/nvidia0}]}\n"
    )
    files, names, _ = nvidiacdi.SpecReader([tmp_path]).specs()

    assert names == {"0"}
    assert len(files) == 1


def test_without_nvidia_specs_the_node_is_env_only_and_says_where_it_looked(
    tmp_path: Path,
) -> None:
    etc, run = folders(tmp_path)
    etc.mkdir()  # one folder empty, the other missing: neither is an error
    cdi = read_with_cdi(tmp_path).nvidia_cdi

    assert (cdi.found, cdi.complete, cdi.names, cdi.problems) == (False, False, (), ())
    assert nvidiacdi.describe(cdi) == (
        f"no NVIDIA CDI spec (kind nvidia.com/gpu) in {etc}, {run}: containers get "
        "NVIDIA_VISIBLE_DEVICES only, which needs the NVIDIA container runtime"
    )
    assert cdi.devices_for(ALL_UUIDS) == []


def test_other_files_are_skipped_and_a_broken_spec_is_named_not_fatal(tmp_path: Path) -> None:
    etc, run = folders(tmp_path)
    write_yaml(etc / "nvidia.yaml", nvidia_spec(["GPU-0", "GPU-1"]))
    write_yaml(etc / "management.yaml", nvidia_spec(["GPU-2"], kind="management.nvidia.com/gpu"))
    # bcd's own specs share the folder; even one claiming NVIDIA's kind is never read.
    write_json(etc / "bcd-alloc_x.json", nvidia_spec(["GPU-3"]))
    write_yaml(etc / ".nvidia.yaml.partial", nvidia_spec(["GPU-3"]))
    (etc / "README.txt").write_text("kind: nvidia.com/gpu")
    (run / "nvidia.yaml").parent.mkdir(parents=True)
    (run / "nvidia.yaml").write_text("kind: nvidia.com/gpu\ndevices: [ {name: \n")
    (run / "nvidia-incomplete.json").write_text(json.dumps({"kind": "nvidia.com/gpu"}))

    cdi = read_with_cdi(tmp_path).nvidia_cdi

    assert cdi.files == (str(etc / "nvidia.yaml"),)
    assert dict(cdi.names) == {"GPU-0": "nvidia.com/gpu=GPU-0", "GPU-1": "nvidia.com/gpu=GPU-1"}
    assert cdi.missing == ("GPU-2", "GPU-3", "MIG-4a", "MIG-4b")  # GPU-4: MIG on
    assert not cdi.complete
    assert len(cdi.problems) == 2
    assert cdi.problems[0].startswith(f"{run / 'nvidia-incomplete.json'}: kind nvidia.com/gpu")
    assert cdi.problems[1].startswith(f"{run / 'nvidia.yaml'}: not valid YAML")
    assert "GPU-2, GPU-3, MIG-4a, MIG-4b" in nvidiacdi.describe(cdi)
    assert "nvidia-ctk cdi generate" in nvidiacdi.describe(cdi)


def test_a_spec_is_read_again_when_it_changes_and_forgotten_when_it_goes(tmp_path: Path) -> None:
    spec = write_yaml(tmp_path / "nvidia.yaml", nvidia_spec(["GPU-0"]))
    reader = nvidiacdi.SpecReader([tmp_path])
    assert reader.specs()[1] == {"GPU-0"}

    write_yaml(spec, nvidia_spec(["GPU-0", "GPU-1"]))
    os.utime(spec, ns=(1, 1))  # a new mtime even on a coarse clock
    assert reader.specs()[1] == {"GPU-0", "GPU-1"}

    spec.unlink()
    assert reader.specs() == ([], set(), [])


def test_an_oversized_file_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvidiacdi, "MAX_SPEC_BYTES", 64)
    write_yaml(tmp_path / "nvidia.yaml", nvidia_spec(["GPU-0"]))

    files, names, problems = nvidiacdi.SpecReader([tmp_path]).specs()

    assert (files, names) == ([], set())
    assert "larger than 64 bytes" in problems[0]


# --- bcd's files ----------------------------------------------------------------------------

NVIDIA = ["nvidia.com/gpu=GPU-2"]


def test_a_hold_refers_to_nvidias_devices_in_its_spec_and_env_file(tmp_path: Path) -> None:
    hold = Allocation.from_spec(parse_spec(allocation_spec("alloc_h", ["GPU-2"], binding="hold")))
    files = DeviceFiles(tmp_path)
    files.write(hold, nvidia_devices=NVIDIA)
    written = json.loads(files.cdi_path("alloc_h").read_text())

    cdirules.check(written)
    assert written["annotations"][devicefiles.ANNOTATION_NVIDIA_DEVICES] == NVIDIA[0]
    # Referred to, never copied: bcd's own edits stay environment variables.
    assert written["containerEdits"] == {
        "env": ["NVIDIA_VISIBLE_DEVICES=GPU-2", "BCD_ALLOCATION_ID=alloc_h"]
    }
    env = devicefiles.read_env(files.env_path("alloc_h"))
    assert env["BCD_CDI_DEVICES"] == "bcd.dev/gpu=GPU-2,nvidia.com/gpu=GPU-2"
    assert files.read("alloc_h") == devicefiles.Written(allocation=hold, releasing_since_ms=None)
    assert files.matches(hold, nvidia_devices=NVIDIA)
    assert not files.matches(hold)  # NVIDIA's spec went: the files must say so
    assert files.describes(hold)  # still this allocation's, bound before a restart

    files.write(hold)
    env_only = json.loads(files.cdi_path("alloc_h").read_text())
    assert env_only == devicefiles.cdi_spec(hold)
    assert devicefiles.ANNOTATION_NVIDIA_DEVICES not in env_only["annotations"]
    assert devicefiles.read_env(files.env_path("alloc_h"))["BCD_CDI_DEVICES"] == "bcd.dev/gpu=GPU-2"


# --- the running node -------------------------------------------------------------------------


@pytest.fixture
async def cdi_node(kubelet_node: Node) -> AsyncIterator[Node]:
    """The node plugin over the inventory file, with NVIDIA's CDI folders under its root."""
    source = nvidiacdi.WithNvidiaCdi(kubelet_node.file_source(), dirs=folders(kubelet_node.root))
    kubelet_node.plugin = kubelet_node.make_plugin(inventory_source=source)
    async with kubelet_node.plugin.running():
        await kubelet_node.kubelet.wait_registered([GPU, MIG, SLOT])
        yield kubelet_node


async def _until(condition: Callable[[], bool], *, within: float = 2.0) -> None:
    """Poll ``condition`` (files: nothing to wait on) until it holds."""
    async with asyncio.timeout(within):
        while True:
            if condition():
                return
            await asyncio.sleep(0.01)


async def test_allocate_asks_for_nvidias_device_beside_bcds(cdi_node: Node) -> None:
    node = cdi_node
    etc, run = folders(node.root)
    write_yaml(etc / "nvidia.yaml", nvidia_spec(["0", "1", "2", "GPU-0", "GPU-1", "GPU-2"]))
    write_json(run / "nvidia.json", nvidia_spec(["MIG-4a", "MIG-4b"]))
    assert node.plugin is not None
    allocations = node.plugin.allocations
    await _until(
        lambda: allocations.inventory is not None and allocations.inventory.nvidia_cdi.found
    )
    node.put(allocation_spec("alloc_gpu", ["GPU-0", "GPU-1"]))
    node.put(allocation_spec("alloc_mig", ["MIG-4a", "MIG-4b"], device_class="mig"))
    node.put(allocation_spec("alloc_slot", ["GPU-2::0", "GPU-2::1"], device_class="slot"))
    await node.stream(SLOT).wait_devices({"GPU-2::0": "Healthy", "GPU-2::1": "Healthy"})
    await node.stream(MIG).wait_devices({"MIG-4a": "Healthy", "MIG-4b": "Healthy"})

    gpu = await node.stream(GPU).allocate(["GPU-1"])
    assert [d.name for d in gpu.cdi_devices] == ["bcd.dev/gpu=GPU-1", "nvidia.com/gpu=GPU-1"]
    assert gpu.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-1"  # kept: it overrides a CUDA image's "all"
    mig = await node.stream(MIG).allocate(["MIG-4b"])
    assert [d.name for d in mig.cdi_devices] == ["bcd.dev/gpu=MIG-4b", "nvidia.com/gpu=MIG-4b"]
    # Two slots of one GPU: NVIDIA's device for that GPU, once.
    slot = await node.stream(SLOT).allocate(["GPU-2::1", "GPU-2::0"])
    assert [d.name for d in slot.cdi_devices] == [
        "bcd.dev/gpu=GPU-2::1",
        "bcd.dev/gpu=GPU-2::0",
        "nvidia.com/gpu=GPU-2",
    ]
    # The report keeps bcd's names: NVIDIA's are the node's business (and in the env file).
    bound = await node.reporter.wait_phase("alloc_gpu", "Bound")
    assert bound["cdiDevices"] == ["bcd.dev/gpu=GPU-0", "bcd.dev/gpu=GPU-1"]
    env = devicefiles.read_env(node.files.env_path("alloc_gpu"))
    assert env["BCD_CDI_DEVICES"] == (
        "bcd.dev/gpu=GPU-0,bcd.dev/gpu=GPU-1,nvidia.com/gpu=GPU-0,nvidia.com/gpu=GPU-1"
    )


async def test_a_gpu_no_spec_names_goes_env_only_and_a_new_spec_reaches_bound_files(
    cdi_node: Node,
) -> None:
    node = cdi_node
    node.put(allocation_spec("alloc_hold", ["GPU-3"], binding="hold"))
    node.put(allocation_spec("alloc_gpu", ["GPU-0"]))
    await node.reporter.wait_phase("alloc_hold", "Bound")
    await node.stream(GPU).wait_devices({"GPU-0": "Healthy"})

    env_only = await node.stream(GPU).allocate(["GPU-0"])
    assert [d.name for d in env_only.cdi_devices] == ["bcd.dev/gpu=GPU-0"]
    path = node.files.cdi_path("alloc_hold")
    assert devicefiles.ANNOTATION_NVIDIA_DEVICES not in json.loads(path.read_text())["annotations"]

    # The GPU operator's toolkit writes its spec after the allocations were bound.
    etc, _ = folders(node.root)
    write_yaml(etc / "nvidia.yaml", nvidia_spec(["GPU-0", "GPU-3"]))

    def annotated() -> bool:
        annotations = json.loads(path.read_text())["annotations"]
        return annotations.get(devicefiles.ANNOTATION_NVIDIA_DEVICES) == "nvidia.com/gpu=GPU-3"

    await _until(annotated)
    with_cdi = await node.stream(GPU).allocate(["GPU-0"])
    assert [d.name for d in with_cdi.cdi_devices] == ["bcd.dev/gpu=GPU-0", "nvidia.com/gpu=GPU-0"]
    assert node.reporter.phases("alloc_hold") == ["Bound"]  # the files changed, not the binding


# --- the GPUNode ----------------------------------------------------------------------------


def _condition(gpunode: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in gpunode["status"]["conditions"] if c["type"] == kind)


async def test_the_gpunode_says_whether_nvidias_specs_or_env_only(
    kube_api: KubeApi, kubelet_node: Node
) -> None:
    etc, run = folders(kubelet_node.root)
    config = agents.agent_config(kube=kube_api, node=kubelet_node, nvidia_cdi_dirs=(etc, run))
    agent: Agent
    async with started(config) as agent:
        assert agent.plugin is not None
        gpunode = await agents.wait_gpunode(kube_api, lambda o: bool(o.get("status")))
        assert gpunode["status"]["capabilities"] == ["binding.kubernetes", "devices.limits"]
        condition = _condition(gpunode, "NvidiaCdi")
        assert (condition["status"], condition["reason"]) == ("False", "EnvOnly")

        write_yaml(etc / "nvidia.yaml", nvidia_spec(ALL_UUIDS))
        gpunode = await agents.wait_gpunode(
            kube_api, lambda o: "cdi.nvidia" in o["status"]["capabilities"]
        )
        condition = _condition(gpunode, "NvidiaCdi")
        assert (condition["status"], condition["reason"]) == ("True", "NvidiaSpecs")
        assert str(etc / "nvidia.yaml") in condition["message"]

        write_yaml(etc / "nvidia.yaml", nvidia_spec(ALL_UUIDS[:-1]))  # MIG-4b reconfigured away
        gpunode = await agents.wait_gpunode(
            kube_api, lambda o: _condition(o, "NvidiaCdi")["reason"] == "Incomplete"
        )
        assert "cdi.nvidia" not in gpunode["status"]["capabilities"]
        assert "MIG-4b" in _condition(gpunode, "NvidiaCdi")["message"]


def test_an_inventory_without_a_look_at_cdi_is_env_only() -> None:
    assert Inventory(node_name="n", gpus=()).nvidia_cdi == NvidiaCdi()
    assert nvidiacdi.describe(NvidiaCdi()).startswith("NVIDIA CDI specs are not looked for")
