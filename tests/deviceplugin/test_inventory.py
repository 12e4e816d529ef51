"""The node's GPU inventory: simulated files, NVLink domains, watching, and real NVML."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from bettercompute.deviceplugin import inventory

NODE = "gpu-node-1"


def gpu(index: int, *, peers: tuple[int, ...] = (), **overrides: Any) -> inventory.Gpu:
    fields: dict[str, Any] = {
        "uuid": f"GPU-{index:04d}",
        "index": index,
        "model": "NVIDIA H100 80GB HBM3",
        "memory_mib": 81559,
        "numa_node": index // 4,
        "nvlink_peers": tuple(f"GPU-{p:04d}" for p in peers),
    }
    fields.update(overrides)
    return inventory.Gpu(**fields)


def two_quads_and_a_loner() -> inventory.Inventory:
    """GPUs 0-3 in a ring, 4-7 fully linked, 8 without NVLink."""
    ring = [gpu(i, peers=((i + 1) % 4,)) for i in range(4)]
    mesh = [gpu(i, peers=tuple(p for p in range(4, 8) if p != i)) for i in range(4, 8)]
    return inventory.Inventory(
        node_name=NODE, gpus=(*ring, *mesh, gpu(8)), vcpu=96, memory_gib=1024, hugepages_1gi=8
    )


def write_document(path: Path, document: Any) -> Path:
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


def valid_document() -> dict[str, Any]:
    return {
        "gpus": [
            {"uuid": "GPU-a", "index": 0, "model": "A100", "memoryMiB": 40960},
            {"uuid": "GPU-b", "index": 1, "model": "A100", "memoryMiB": 40960},
        ]
    }


@pytest.mark.parametrize("name", ["node.yaml", "node.json"])
def test_a_written_inventory_reads_back_equal(tmp_path: Path, name: str) -> None:
    original = two_quads_and_a_loner()
    path = tmp_path / name
    inventory.write_inventory_file(path=path, inventory=original)

    read = inventory.FileInventory(path=path, node_name=NODE).read()

    assert read == original
    assert read.vcpu == 96
    assert read.memory_gib == 1024
    assert read.hugepages_1gi == 8
    if name.endswith(".json"):
        assert json.loads(path.read_text())["gpus"][0]["uuid"] == "GPU-0000"


def test_nvlink_domains_are_connected_components_with_stable_ids() -> None:
    domains = two_quads_and_a_loner().nvlink_domains

    assert domains == {
        f"{NODE}-nvl0": ("GPU-0000", "GPU-0001", "GPU-0002", "GPU-0003"),
        f"{NODE}-nvl1": ("GPU-0004", "GPU-0005", "GPU-0006", "GPU-0007"),
    }
    assert not any("GPU-0008" in members for members in domains.values())


def test_domain_ids_follow_the_smallest_gpu_index_not_the_listing_order() -> None:
    gpus = (gpu(5, peers=(6,)), gpu(6), gpu(1, peers=(2,)), gpu(2))

    domains = inventory.Inventory(node_name="n", gpus=gpus).nvlink_domains

    assert domains == {"n-nvl0": ("GPU-0001", "GPU-0002"), "n-nvl1": ("GPU-0005", "GPU-0006")}


def test_a_link_reported_by_one_side_only_still_joins_the_domain(tmp_path: Path) -> None:
    document = valid_document()
    document["gpus"][1]["nvlinkPeers"] = ["GPU-a"]
    path = write_document(tmp_path / "node.yaml", document)

    read = inventory.FileInventory(path=path, node_name="n").read()

    assert read.nvlink_domains == {"n-nvl0": ("GPU-a", "GPU-b")}


def test_mig_devices_are_parsed_with_their_parent(tmp_path: Path) -> None:
    document = valid_document()
    document["gpus"][0]["mig"] = [
        {"uuid": "MIG-1", "profile": "3g.20gb"},
        {"uuid": "MIG-2", "profile": "1g.5gb"},
    ]
    path = write_document(tmp_path / "node.yaml", document)

    read = inventory.FileInventory(path=path, node_name="n").read()

    assert read.gpus[0].mig == (
        inventory.MigDevice(uuid="MIG-1", profile="3g.20gb", parent_uuid="GPU-a"),
        inventory.MigDevice(uuid="MIG-2", profile="1g.5gb", parent_uuid="GPU-a"),
    )
    assert read.gpus[1].mig == ()
    assert read.gpus[0].healthy is True
    assert read.gpus[0].numa_node is None


def test_a_mig_instances_nvml_index_is_kept_when_known(tmp_path: Path) -> None:
    # NVIDIA's CDI specs name MIG instances "<gpu index>:<this index>" (nvidiacdi).
    mig = (
        inventory.MigDevice(uuid="MIG-1", profile="3g.40gb", parent_uuid="GPU-0000", index=2),
        inventory.MigDevice(uuid="MIG-2", profile="3g.40gb", parent_uuid="GPU-0000"),
    )
    original = inventory.Inventory(node_name="n", gpus=(gpu(0, mig=mig),))
    path = tmp_path / "node.yaml"
    inventory.write_inventory_file(path=path, inventory=original)

    assert inventory.FileInventory(path=path, node_name="n").read() == original
    assert yaml.safe_load(path.read_text())["gpus"][0]["mig"] == [
        {"uuid": "MIG-1", "profile": "3g.40gb", "index": 2},
        {"uuid": "MIG-2", "profile": "3g.40gb"},
    ]


def _break(document: dict[str, Any], how: str) -> None:
    gpus = document["gpus"]
    if how == "unknown key":
        gpus[1]["colour"] = "green"
    elif how == "bad type":
        gpus[0]["memoryMiB"] = "lots"
    elif how == "missing uuid":
        del gpus[1]["uuid"]
    elif how == "duplicate uuid":
        gpus[1]["uuid"] = "GPU-a"
    elif how == "unknown peer":
        gpus[0]["nvlinkPeers"] = ["GPU-b", "GPU-zzz"]
    elif how == "bad mig profile":
        gpus[0]["mig"] = [{"uuid": "MIG-1", "profile": "huge"}]


@pytest.mark.parametrize(
    ("how", "where", "reason"),
    [
        ("unknown key", "gpus[1].colour", "Extra inputs are not permitted"),
        ("bad type", "gpus[0].memoryMiB", "Input should be a valid integer"),
        ("missing uuid", "gpus[1].uuid", "Field required"),
        ("duplicate uuid", "gpus[1].uuid", "'GPU-a' is also gpus[0].uuid"),
        ("unknown peer", "gpus[0].nvlinkPeers[1]", "no GPU has uuid 'GPU-zzz'"),
        ("bad mig profile", "gpus[0].mig[0].profile", "String should match pattern"),
    ],
)
def test_an_invalid_file_names_the_file_the_path_and_the_reason(
    tmp_path: Path, how: str, where: str, reason: str
) -> None:
    document = valid_document()
    _break(document, how)
    path = write_document(tmp_path / "node.yaml", document)

    with pytest.raises(inventory.InventoryError) as caught:
        inventory.FileInventory(path=path, node_name="n").read()

    message = str(caught.value)
    assert message.startswith(f"{path}: ")
    assert f"{where}: {reason}" in message


@pytest.mark.parametrize(
    ("name", "text", "reason"),
    [
        ("node.yaml", "gpus: [ {uuid: GPU-a\n", "not valid YAML"),
        ("node.json", '{"gpus": [', "not valid JSON"),
        ("node.yaml", "- just\n- a list\n", "must be a mapping"),
    ],
)
def test_an_unparseable_file_names_the_file_and_the_reason(
    tmp_path: Path, name: str, text: str, reason: str
) -> None:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")

    with pytest.raises(inventory.InventoryError, match=reason) as caught:
        inventory.FileInventory(path=path, node_name="n").read()

    assert str(caught.value).startswith(f"{path}: ")


def test_a_missing_file_is_an_inventory_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"

    with pytest.raises(inventory.InventoryError, match="cannot read") as caught:
        inventory.FileInventory(path=path, node_name="n").read()

    assert str(path) in str(caught.value)


async def _next(stream: AsyncIterator[inventory.Inventory], within: float) -> inventory.Inventory:
    return await asyncio.wait_for(anext(stream), within)


async def test_watch_yields_at_once_then_only_on_change_and_survives_a_bad_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "node.yaml"
    first = inventory.Inventory(node_name="n", gpus=(gpu(0), gpu(1)))
    inventory.write_inventory_file(path=path, inventory=first)
    stream = inventory.watch(inventory.FileInventory(path=path, node_name="n"), interval_s=0.02)
    try:
        assert await _next(stream, within=1.0) == first

        # Nothing changed: several intervals pass without a new inventory.
        pending = asyncio.ensure_future(_next(stream, within=10.0))
        await asyncio.sleep(0.2)
        assert not pending.done()

        # A temporarily invalid file is logged and retried, not fatal, and not yielded.
        path.write_text("gpus: [ {uuid: \n", encoding="utf-8")
        await asyncio.sleep(0.1)
        assert not pending.done()

        second = inventory.Inventory(node_name="n", gpus=(gpu(0), gpu(1, healthy=False)))
        inventory.write_inventory_file(path=path, inventory=second)
        assert await asyncio.wait_for(pending, timeout=2.0) == second
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


async def test_watch_waits_for_a_first_readable_inventory(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    stream = inventory.watch(inventory.FileInventory(path=path, node_name="n"), interval_s=0.02)
    try:
        pending = asyncio.ensure_future(_next(stream, within=10.0))
        await asyncio.sleep(0.1)
        assert not pending.done()

        appeared = inventory.Inventory(node_name="n", gpus=(gpu(3),))
        inventory.write_inventory_file(path=path, inventory=appeared)
        assert await asyncio.wait_for(pending, timeout=2.0) == appeared
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("nvml", "sysfs"),
    [
        ("00000000:3B:00.0", "0000:3b:00.0"),
        (b"00000000:1A:00.0", "0000:1a:00.0"),
        ("0000:c1:00.0", "0000:c1:00.0"),
    ],
)
def test_nvml_bus_ids_compare_in_sysfs_form(nvml: str | bytes, sysfs: str) -> None:
    assert inventory.bus_id(nvml) == sysfs


def test_links_between_gpus_make_them_peers_and_domains() -> None:
    bus_ids = {f"GPU-{i}": f"0000:0{i}:00.0" for i in range(4)}
    # 0<->1 directly; 2<->3 directly; nothing leaves the node.
    remotes = {
        "GPU-0": ["0000:01:00.0"],
        "GPU-1": ["0000:00:00.0"],
        "GPU-2": ["0000:03:00.0", "0000:03:00.0"],
        "GPU-3": [],
    }

    peers = inventory.nvlink_peers(bus_ids=bus_ids, remote_bus_ids=remotes)

    assert peers == {
        "GPU-0": ("GPU-1",),
        "GPU-1": ("GPU-0",),
        "GPU-2": ("GPU-3",),
        "GPU-3": (),
    }


def test_gpus_linked_to_an_nvswitch_form_one_domain() -> None:
    bus_ids = {f"GPU-{i}": f"0000:1{i}:00.0" for i in range(4)}
    switch_ports = ["0000:a0:00.0", "0000:a1:00.0"]
    # GPUs 0-2 reach the switch; GPU 3 has no active link.
    remotes = {"GPU-0": switch_ports, "GPU-1": switch_ports, "GPU-2": switch_ports[:1]}

    peers = inventory.nvlink_peers(bus_ids=bus_ids, remote_bus_ids=remotes)
    gpus = tuple(gpu(i, uuid=f"GPU-{i}", nvlink_peers=peers[f"GPU-{i}"]) for i in range(4))

    assert peers["GPU-0"] == ("GPU-1", "GPU-2")
    assert peers["GPU-3"] == ()
    assert inventory.Inventory(node_name="n", gpus=gpus).nvlink_domains == {
        "n-nvl0": ("GPU-0", "GPU-1", "GPU-2")
    }


def test_nvml_reads_the_real_gpus_where_the_driver_is_present() -> None:
    try:
        found = inventory.NvmlInventory(node_name=NODE).read()
    except inventory.InventoryError as e:
        print(f"no NVML here: {e}")
        pytest.skip(f"no NVML here: {e}")

    assert found.node_name == NODE
    assert len(found.gpus) >= 1
    assert all(g.uuid.startswith("GPU-") for g in found.gpus)
    assert [g.index for g in found.gpus] == list(range(len(found.gpus)))
    assert all(g.memory_mib > 0 for g in found.gpus)
    print(found)


def test_nvml_without_a_driver_is_an_inventory_error_carrying_the_nvml_message() -> None:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        nvml_message = str(e)
    else:
        pynvml.nvmlShutdown()
        print("NVML initialises here, so there is no failure to check")
        pytest.skip("NVML initialises here, so there is no failure to check")

    with pytest.raises(inventory.InventoryError, match="NVML did not initialise") as caught:
        inventory.NvmlInventory(node_name=NODE).read()

    assert nvml_message in str(caught.value)
    assert not isinstance(caught.value, pynvml.NVMLError)
