"""The CRDs as ``kubectl explain`` and ``kubectl get`` show them to a platform team.

- Every field has a description, so ``kubectl explain reservation.status.window`` says what it
  is (the root ``metadata`` is the one exception: Kubernetes describes ObjectMeta itself).
- A time people read is an RFC 3339 string (``format: date-time``). The fields that stay epoch
  milliseconds are listed below with why: the HTTP API's own shape, or the operator's protocol
  with the node agent (which the agent signs), each with an RFC 3339 sibling or not for people.
- Every status ``conditions`` list has the ``metav1.Condition`` shape.
- GPUPool's Free and Total columns count the class the pool sells, which the operator writes.

Pure: reads the YAML files of ``crds/`` (the chart's copies are checked to be identical).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from bettercompute.core import pools

ROOT = Path(__file__).resolve().parents[2]
CRDS = sorted((ROOT / "crds").glob("*.yaml"))
CONDITION = {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}
#: Integer times that stay epoch ms, and why.
EPOCH_MS = {
    # The HTTP API's ``during``, mirrored; startTime and endTime are the same moments in RFC 3339.
    ("Reservation", ".status.during.start"),
    ("Reservation", ".status.during.end"),
    # The operator's instructions to the node agent and the agent's signed report: a protocol
    # between programs, read by neither people nor kubectl's columns.
    ("DeviceAllocation", ".spec.until"),
    ("DeviceAllocation", ".spec.preemptAt"),
    ("DeviceAllocation", ".status.since"),
}
#: Names that make a field a time: these, or one ending in Time, At or Until.
TIME_NAMES = ("since", "until", "start", "end")


def _crd(path: Path) -> dict[str, Any]:
    crd: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    return crd


def _fields(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every property below ``schema``, with its path (``.spec.devices[].count``)."""
    for name, sub in (schema.get("properties") or {}).items():
        here = f"{path}.{name}"
        yield here, sub
        yield from _fields(sub, here)
    if isinstance(schema.get("items"), dict):
        yield from _fields(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _fields(schema["additionalProperties"], f"{path}{{}}")


def _schemas() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in CRDS:
        crd = _crd(path)
        for version in crd["spec"]["versions"]:
            yield crd["spec"]["names"]["kind"], version["schema"]["openAPIV3Schema"]


SCHEMAS = list(_schemas())


@pytest.mark.parametrize(("kind", "schema"), SCHEMAS, ids=[k for k, _ in SCHEMAS])
def test_every_field_has_a_description(kind: str, schema: dict[str, Any]) -> None:
    assert schema.get("description"), kind
    missing = [
        path
        for path, sub in _fields(schema)
        if path != ".metadata" and not str(sub.get("description") or "").strip()
    ]
    assert missing == [], f"{kind}: fields without a description: {missing}"


@pytest.mark.parametrize(("kind", "schema"), SCHEMAS, ids=[k for k, _ in SCHEMAS])
def test_times_people_read_are_rfc3339(kind: str, schema: dict[str, Any]) -> None:
    for path, sub in _fields(schema):
        name = path.rsplit(".", 1)[-1].rstrip("[]{}")
        is_time = name in TIME_NAMES or name.endswith(("Time", "At", "Until"))
        if sub.get("type") == "integer" and is_time:
            assert (kind, path) in EPOCH_MS, f"{kind}{path}: an epoch-ms time; make it RFC 3339"
        if sub.get("format") == "date-time":
            assert sub.get("type") == "string", f"{kind}{path}"
    # The listed exceptions exist, and each says what it is.
    for listed_kind, listed in EPOCH_MS:
        if listed_kind == kind:
            found = dict(_fields(schema))[listed]
            assert found["type"] == "integer"
            assert "epoch" in found["description"], (kind, listed)


@pytest.mark.parametrize(("kind", "schema"), SCHEMAS, ids=[k for k, _ in SCHEMAS])
def test_every_status_condition_is_a_metav1_condition(kind: str, schema: dict[str, Any]) -> None:
    conditions = (schema["properties"].get("status") or {}).get("properties", {}).get("conditions")
    if conditions is None:
        assert kind == "DeviceAllocation"  # its status is the node's report, with phase
        return
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    item = conditions["items"]
    assert set(item["properties"]) == CONDITION, kind
    # metav1.Condition's required fields (observedGeneration is optional there).
    assert {"type", "status", "reason", "message", "lastTransitionTime"} <= set(item["required"])
    assert item["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert item["properties"]["lastTransitionTime"] == {
        **item["properties"]["lastTransitionTime"],
        "type": "string",
        "format": "date-time",
    }
    assert item["properties"]["observedGeneration"]["type"] == "integer"


def test_gpupool_free_and_total_columns_count_the_class_the_pool_sells() -> None:
    crd = _crd(ROOT / "crds" / "gpupools.yaml")
    version = crd["spec"]["versions"][0]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert columns["Free"]["jsonPath"] == ".status.free"
    assert columns["Total"]["jsonPath"] == ".status.total"
    assert columns["Sharing"]["jsonPath"] == ".spec.sharing.mode"
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["free"]["type"] == status["total"]["type"] == "integer"
    # Each sharing mode sells a class the status counts.
    assert set(pools.CLASS_FOR_MODE.values()) <= set(status["devices"]["properties"])


def test_the_charts_crds_are_the_repositorys() -> None:
    chart = ROOT / "charts" / "better-compute" / "crds"
    for path in CRDS:
        assert (chart / path.name).read_bytes() == path.read_bytes(), path.name
