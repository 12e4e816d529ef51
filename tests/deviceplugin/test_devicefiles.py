"""The CDI specs and env files the node writes: valid by the CDI rules a runtime applies,
self-describing enough to rebuild an allocation, atomic, and never outside their folders."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from bettercompute.deviceplugin import devicefiles
from bettercompute.deviceplugin.devicefiles import Allocation, DeviceFileError, DeviceFiles
from bettercompute.kube.allocations import parse_spec
from bettercompute.kube.parsing import ShapeError
from tests.deviceplugin.conftest import allocation_spec
from tests.support import cdirules

SPECS = {
    "gpu-kubernetes": allocation_spec("alloc_g", ["GPU-0", "GPU-1"]),
    "gpu-hold": allocation_spec("alloc_h", ["GPU-2"], binding="hold"),
    "mig": allocation_spec("alloc_m", ["MIG-4a", "MIG-4b"], device_class="mig"),
    "slot": allocation_spec("alloc_s", ["GPU-2::0", "GPU-2::1"], device_class="slot"),
    "digit-first-name": allocation_spec("alloc_d", ["0"], parentGpus=["0"]),
}


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_generated_specs_follow_the_cdi_rules(spec: dict[str, Any], tmp_path: Path) -> None:
    allocation = Allocation.from_spec(parse_spec(spec))
    files = DeviceFiles(tmp_path)
    files.write(allocation)
    written = json.loads(files.cdi_path(allocation.allocation_id).read_text())

    cdirules.check(written)
    cdirules.check(devicefiles.cdi_spec(allocation, releasing_since_ms=1_790_000_000_000))
    assert written["kind"] == "bcd.dev/gpu"
    assert [d["name"] for d in written["devices"]] == spec["deviceIds"]
    assert written["annotations"][devicefiles.ANNOTATION_BINDING] == spec["binding"]
    assert files.read(allocation.allocation_id) == devicefiles.Written(
        allocation=allocation, releasing_since_ms=None
    )


def test_a_kubernetes_spec_is_marked_for_the_device_plugin_and_leaves_visibility_to_allocate(
    tmp_path: Path,
) -> None:
    kubernetes = devicefiles.cdi_spec(Allocation.from_spec(parse_spec(SPECS["slot"])))
    hold = devicefiles.cdi_spec(Allocation.from_spec(parse_spec(SPECS["gpu-hold"])))

    assert kubernetes["annotations"][devicefiles.ANNOTATION_DEVICE_PLUGIN] == "bcd.dev/gpu.slot"
    assert kubernetes["containerEdits"]["env"] == ["BCD_ALLOCATION_ID=alloc_s"]
    assert devicefiles.ANNOTATION_DEVICE_PLUGIN not in hold["annotations"]
    assert hold["containerEdits"]["env"] == [
        "NVIDIA_VISIBLE_DEVICES=GPU-2",
        "BCD_ALLOCATION_ID=alloc_h",
    ]


BROKEN: dict[str, tuple[Any, str]] = {
    "no-version": (lambda s: s.pop("cdiVersion"), "cdiVersion: required"),
    "unknown-version": (lambda s: s.update(cdiVersion="0.9.1"), "not a known version"),
    "too-old-for-annotations": (lambda s: s.update(cdiVersion="0.5.0"), "at least 0.6.0"),
    "kind-without-class": (lambda s: s.update(kind="bcd.dev"), "no valid class"),
    "kind-vendor-digit": (lambda s: s.update(kind="9bcd.dev/gpu"), "no valid vendor"),
    "class-ends-with-dot": (lambda s: s.update(kind="bcd.dev/gpu."), "no valid class"),
    "unknown-field": (lambda s: s.update(extra=1), "extra: unknown field"),
    "no-devices": (lambda s: s.update(devices=[]), "non-empty"),
    "duplicate-name": (
        lambda s: s["devices"].append(copy.deepcopy(s["devices"][0])),
        "not unique",
    ),
    "bad-device-name": (lambda s: s["devices"][0].update(name="GPU-0/"), "valid device name"),
    "empty-edits": (lambda s: s["devices"][0].update(containerEdits={}), "must not be empty"),
    "bad-env": (lambda s: s["containerEdits"].update(env=["=x"]), "KEY=VALUE"),
    "node-without-path": (
        lambda s: s["devices"][0]["containerEdits"].update(deviceNodes=[{"type": "c"}]),
        "path: required",
    ),
    "bad-annotation-key": (lambda s: s["annotations"].update({"Bad_Prefix/x": "1"}), "prefix"),
    "annotation-not-string": (lambda s: s["annotations"].update({"bcd.dev/n": 1}), "string"),
}


@pytest.mark.parametrize(("break_it", "problem"), BROKEN.values(), ids=BROKEN.keys())
def test_the_checker_catches_each_broken_rule(break_it: Any, problem: str) -> None:
    spec = devicefiles.cdi_spec(Allocation.from_spec(parse_spec(SPECS["gpu-kubernetes"])))
    assert cdirules.problems(spec) == []
    break_it(spec)

    found = cdirules.problems(spec)

    assert any(problem in p for p in found), found


@pytest.mark.parametrize(
    "bad", ["../etc/passwd", "a/b", ".hidden", "", "a.b", "x" * 200, "a\n", "alloc_1/../x"]
)
def test_an_allocation_id_that_could_leave_the_directory_is_refused(
    bad: str, tmp_path: Path
) -> None:
    with pytest.raises((ShapeError, DeviceFileError), match=r"spec\.allocationId"):
        Allocation.from_spec(parse_spec(allocation_spec(bad, ["GPU-0"])))
    with pytest.raises(DeviceFileError):
        DeviceFiles(tmp_path).cdi_path(bad)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"deviceIds": []}, "spec.deviceIds"),
        ({"deviceIds": ["GPU-0", "GPU-0"]}, "spec.deviceIds"),
        ({"deviceIds": ["GPU-" + "x" * 60]}, "spec.deviceIds"),
        ({"deviceIds": [7]}, "spec.deviceIds[0]"),
        ({"parentGpus": ["GPU-0", "GPU-1"]}, "spec.parentGpus"),
        ({"binding": "node"}, "spec.binding"),
        ({"class": None}, "spec.class"),
        ({"tenantId": "acme corp"}, "spec.tenantId"),
        ({"until": True}, "spec.until"),
    ],
)
def test_a_bad_spec_names_its_field(change: dict[str, Any], field: str) -> None:
    # A wrong type is the contract's shape refusing (ShapeError); a value a file name, a CDI
    # name or an env file cannot take is the files' rules refusing (DeviceFileError).
    with pytest.raises((ShapeError, DeviceFileError)) as refused:
        Allocation.from_spec(parse_spec({**allocation_spec("alloc_1", ["GPU-0"]), **change}))
    assert str(refused.value).startswith(field)


def test_writes_are_atomic_and_leave_no_temporary_files(tmp_path: Path) -> None:
    files = DeviceFiles(tmp_path, cdi_dir=tmp_path / "etc-cdi", env_dir=tmp_path / "run")
    allocation = Allocation.from_spec(parse_spec(SPECS["gpu-kubernetes"]))
    files.write(allocation)
    files.write(allocation, releasing_since_ms=5)  # rewritten in place

    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "etc-cdi/bcd-alloc_g.json",
        "run/alloc_g.env",
    ]
    assert files.read("alloc_g") == devicefiles.Written(allocation=allocation, releasing_since_ms=5)
    assert not files.matches(allocation)  # marked as releasing
    assert oct(files.env_path("alloc_g").stat().st_mode & 0o777) == "0o644"


def test_only_our_own_file_names_count_and_foreign_specs_are_not_read(tmp_path: Path) -> None:
    files = DeviceFiles(tmp_path)
    files.cdi_dir.mkdir(parents=True)
    (files.cdi_dir / "nvidia.yaml").write_text("cdiVersion: 0.5.0\n")
    (files.cdi_dir / "bcd-..json").write_text("{}")
    (files.cdi_dir / "bcd-alloc_x.json").write_text(json.dumps({"kind": "nvidia.com/gpu"}))

    assert files.allocation_ids() == {"alloc_x"}
    assert files.read("alloc_x") is None  # ours by name, but not a spec we wrote
