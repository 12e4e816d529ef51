"""The node agent reads the kernel's isolated CPUs into its inventory and publishes them on its
GPUNode (``inventory.host.isolatedCpus``), so the control plane never reserves them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bettercompute.deviceplugin import inventory, publishing
from bettercompute.kube import nodes

GPU = {"uuid": "GPU-0", "index": 0, "model": "H100", "memoryMiB": 81920, "numaNode": 0}


def test_a_simulated_inventory_carries_isolated_cpus(tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    path.write_text(
        json.dumps({"gpus": [GPU], "vcpu": 16, "memoryGiB": 64, "isolatedCpus": "0-1,8"})
    )
    read = inventory.FileInventory(path=path, node_name="n1").read()
    assert read.isolated_cpus == "0-1,8"
    assert inventory.inventory_document(read)["isolatedCpus"] == "0-1,8"
    status = publishing.gpunode_status(
        inventory=read, capabilities=(), heartbeat="2026-01-01T00:00:00Z", ready_since="x"
    )
    parsed = nodes.parse_status(status)
    assert parsed.inventory.host is not None
    assert parsed.inventory.host.isolatedCpus == "0-1,8"


def test_a_broken_isolated_list_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    path.write_text('{"gpus": [], "isolatedCpus": "0-1;rm"}')
    with pytest.raises(inventory.InventoryError, match="isolatedCpus"):
        inventory.FileInventory(path=path, node_name="n1").read()


def test_the_kernel_list_is_read_within_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolated = tmp_path / "isolated"
    monkeypatch.setattr(inventory, "SYSFS_ISOLATED_CPUS", isolated)
    assert inventory._host_isolated_cpus() is None  # no such file
    isolated.write_text("\n")
    assert inventory._host_isolated_cpus() is None  # none isolated
    isolated.write_text("2-5,9\n")
    assert inventory._host_isolated_cpus() == "2-5,9"
