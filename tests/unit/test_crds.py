"""The CustomResourceDefinitions in crds/: what the API server needs and what the core expects.

The four CRDs of docs/kubernetes.md are checked for their names, scope, version and printer
columns; for being structural schemas; for mirroring the pydantic models the core validates with
(``CreateInput`` for ``Reservation.spec``, ``core.pools``'s ``PoolPolicy``, ``Pool``, ``Offer``
and ``Quota`` for ``GPUPool``), compared generically so that a field or bound added to a model
without the CRD fails here naming its path; and, through ``tests/support/crdschema.py``, for
accepting the contract's samples and refusing (or pruning) bad ones where the core refuses them.

Pure: reads YAML files and pydantic schemas; no cluster, no database. CEL rules are checked for
presence and placement only: nothing here evaluates them.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, Field, ValidationError

from bettercompute.core import pools, requests
from bettercompute.core.errors import ComputeError
from bettercompute.kube import allocations, nodes
from bettercompute.operator import definitions
from tests.support import crdchecking, crdschema

CRDS = Path(__file__).resolve().parents[2] / "crds"
GROUP = "bcd.dev"
VERSION = "v1alpha1"
#: Reservation.spec fields that may change after creation; every other one is immutable.
MUTABLE = ("until", "extendBy", "extendKey", "release")


@dataclass(frozen=True)
class Expected:
    kind: str
    plural: str
    short_names: tuple[str, ...]
    scope: str
    #: (name, type, jsonPath) of each printer column, in order.
    columns: tuple[tuple[str, str, str], ...]


AGE = ("Age", "date", ".metadata.creationTimestamp")
EXPECTED = (
    Expected(
        "Reservation",
        "reservations",
        ("rsv",),
        "Namespaced",
        (
            ("State", "string", ".status.state"),
            ("Ready", "string", '.status.conditions[?(@.type=="Ready")].status'),
            ("GPUs", "integer", ".status.gpus"),
            ("Pool", "string", ".spec.poolId"),
            ("Node(s)", "string", ".status.nodes"),
            # Strings: a date column shows a future start or end as <invalid>.
            ("Start", "string", ".status.window.start"),
            ("End", "string", ".status.window.end"),
            ("Resource", "string", ".status.resourceName"),
            ("Binding", "string", ".spec.binding"),
            ("Lease", "string", ".status.leaseUntil"),
            AGE,
        ),
    ),
    Expected(
        "GPUPool",
        "gpupools",
        ("gpupool", "gp"),
        "Cluster",
        (
            ("Model", "string", ".spec.model"),
            ("Sharing", "string", ".spec.sharing.mode"),
            ("Owner", "string", ".spec.owner.tenant"),
            ("Nodes", "integer", ".status.nodes"),
            ("Free", "integer", ".status.free"),
            ("Total", "integer", ".status.total"),
            AGE,
        ),
    ),
    Expected(
        "GPUNode",
        "gpunodes",
        ("gpunode", "gn"),
        "Cluster",
        (
            ("GPUs", "integer", ".status.gpus"),
            ("Ready", "string", '.status.conditions[?(@.type=="Ready")].status'),
            ("Heartbeat", "date", ".status.heartbeatTime"),
            AGE,
        ),
    ),
    Expected(
        "DeviceAllocation",
        "deviceallocations",
        ("dalloc",),
        "Namespaced",
        (
            ("Node", "string", ".spec.nodeName"),
            ("Reservation", "string", ".spec.reservationId"),
            ("Class", "string", ".spec.class"),
            ("Phase", "string", ".status.phase"),
            AGE,
        ),
    ),
    Expected(
        "GPUQuota",
        "gpuquotas",
        ("gq",),
        "Cluster",
        (
            ("Tenant", "string", ".spec.tenant"),
            ("Ready", "string", '.status.conditions[?(@.type=="Ready")].status'),
            ("GPUs", "string", ".status.summary"),
            AGE,
        ),
    ),
    Expected(
        "EventSubscription",
        "eventsubscriptions",
        ("esub",),
        "Namespaced",
        (
            ("URL", "string", ".spec.url"),
            ("Types", "string", ".status.types"),
            ("Ready", "string", '.status.conditions[?(@.type=="Ready")].status'),
            AGE,
        ),
    ),
)
KINDS = [e.kind for e in EXPECTED]


@pytest.fixture(scope="module")
def crds() -> dict[str, dict[str, Any]]:
    return crdschema.load_crds(CRDS)


def schema(crds: dict[str, dict[str, Any]], kind: str) -> dict[str, Any]:
    return crdschema.schema_of(crds[kind], VERSION)


def node_at(root: dict[str, Any], path: str) -> dict[str, Any]:
    """The schema node at ``spec.offers[].quotas[*]`` ([] items, [*] map values)."""
    node = root
    for part in path.split("."):
        name, suffixes = re.fullmatch(r"([^\[]+)((?:\[\]|\[\*\])*)", part).groups()
        node = node["properties"][name]
        for suffix in re.findall(r"\[\]|\[\*\]", suffixes):
            node = node["items"] if suffix == "[]" else node["additionalProperties"]
    return node


# --- names, scope, version, printer columns ---------------------------------------------------


def test_there_is_one_file_per_kind_named_by_its_plural():
    files = sorted(CRDS.glob("*.yaml"))
    assert [p.name for p in files] == sorted(f"{e.plural}.yaml" for e in EXPECTED)
    for path in files:
        assert yaml.safe_load(path.read_text())["spec"]["names"]["plural"] == path.stem


@pytest.mark.parametrize("expected", EXPECTED, ids=KINDS)
def test_names_scope_and_version(crds, expected: Expected):
    crd = crds[expected.kind]
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == f"{expected.plural}.{GROUP}"
    assert crd["spec"]["group"] == GROUP
    assert crd["spec"]["scope"] == expected.scope
    assert crd["spec"]["names"] == {
        "kind": expected.kind,
        "listKind": f"{expected.kind}List",
        "plural": expected.plural,
        "singular": expected.kind.lower(),
        "shortNames": list(expected.short_names),
        "categories": ["bcd"],  # kubectl get bcd lists them all
    }
    [version] = crd["spec"]["versions"]
    assert (version["name"], version["served"], version["storage"]) == (VERSION, True, True)
    assert version["subresources"] == {"status": {}}


@pytest.mark.parametrize("expected", EXPECTED, ids=KINDS)
def test_printer_columns_point_at_fields_of_their_type(crds, expected: Expected):
    columns = crdschema.version_of(crds[expected.kind], VERSION)["additionalPrinterColumns"]
    assert [(c["name"], c["type"], c["jsonPath"]) for c in columns] == list(expected.columns)
    root = schema(crds, expected.kind)
    for name, kind, json_path in expected.columns:
        if json_path.startswith(".metadata."):
            continue
        path = re.sub(r"\[\?\(.*?\)\]", "[]", json_path.removeprefix("."))
        node = node_at(root, path)
        wanted = {"date": ("string", "date-time"), "string": ("string", None)}.get(kind)
        got = (node.get("type"), node.get("format") if kind == "date" else None)
        assert got == (wanted or (kind, None)), f"{expected.kind} column {name}: {json_path}"


# --- structural schemas -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_schema_is_structural(crds, kind: str):
    found = crdschema.structural_errors(schema(crds, kind))
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("broken", "complaint"),
    [
        ({"properties": {"a": {"type": "string"}}}, "(root): the root must be of type object"),
        ({"type": "object", "properties": {"a": {}}}, "a: every node needs a type"),
        ({"type": "object", "properties": {"a": {"type": "array"}}}, "a: an array needs items"),
        (
            {"type": "object", "properties": {"a": {"type": "array", "properties": {}}}},
            "a: properties are only for type object",
        ),
        (
            {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}}},
            "a: anyOf is not used",
        ),
        ({"type": "object", "properties": {"a": {"type": "integer", "minimun": 1}}}, "'minimun'"),
        (
            {"type": "object", "properties": {"a": {"type": "string", "enum": ["on", False]}}},
            "a: enum value False is not of type string",
        ),
        (
            {
                "type": "object",
                "properties": {"a": {"x-kubernetes-int-or-string": True, "type": "string"}},
            },
            "a: x-kubernetes-int-or-string needs no type",
        ),
        (
            {
                "type": "object",
                "properties": {
                    "metadata": {"type": "object", "properties": {"labels": {"type": "object"}}}
                },
            },
            "metadata: may only restrict name and generateName",
        ),
        (
            {"type": "object", "properties": {"a": {"type": "string", "maximum": 3}}},
            "a: maximum is only for numbers",
        ),
        (
            {
                "type": "object",
                "properties": {
                    "a": {
                        "type": "array",
                        "x-kubernetes-list-type": "map",
                        "x-kubernetes-list-map-keys": ["k"],
                        "items": {"type": "object", "properties": {"k": {"type": "string"}}},
                    }
                },
            },
            "a: list-map key 'k' must be required",
        ),
        (
            {
                "type": "object",
                "properties": {
                    "a": {
                        "type": "array",
                        "items": {
                            "type": "string",
                            "x-kubernetes-validations": [{"rule": "self == oldSelf"}],
                        },
                    }
                },
            },
            "a[]: x-kubernetes-validations[0] uses oldSelf",
        ),
    ],
)
def test_the_structural_check_refuses_what_the_api_server_refuses(broken, complaint: str):
    errors = crdschema.structural_errors(broken)
    assert any(complaint in e for e in errors), errors


# --- the spec mirrors the models --------------------------------------------------------------

#: The keywords a leaf's constraint is made of, compared between a model and a CRD.
CONSTRAINTS = (
    "type",
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "int-or-string",
    "any",
)

#: A model's ``bool | Model`` union (``policy.kubernetes``: ``true`` or ``{api: …}``): a CRD can
#: give a field one type only and compiles no CEL rule for an untyped one, so it keeps the field
#: as written (preserve-unknown-fields, no type) and the operator's model checks it.
ANY = {"any": True}


def model_shape(node: dict[str, Any], defs: dict[str, Any], path: str) -> dict[str, Any]:
    """A pydantic JSON schema node reduced to what a CRD can say, with refs and nulls resolved."""
    node = _resolve(node, defs)
    if "anyOf" in node:
        options = [_resolve(o, defs) for o in node["anyOf"] if o.get("type") != "null"]
        if sorted(o.get("type", "") for o in options) == ["integer", "string"]:
            assert all(set(o) == {"type"} for o in options), f"{path}: a constrained int-or-string"
            return {"int-or-string": True}
        if sorted(o.get("type", "") for o in options) == ["boolean", "object"]:
            return ANY
        assert len(options) == 1, f"{path}: a union a CRD cannot mirror: {node['anyOf']}"
        return model_shape(options[0], defs, path)
    return _shape(node, lambda child, where: model_shape(child, defs, where), path)


def crd_shape(node: dict[str, Any], path: str) -> dict[str, Any]:
    """A CRD schema node reduced to the same terms as ``model_shape``."""
    if node.get("x-kubernetes-int-or-string"):
        return {"int-or-string": True, **{k: node[k] for k in CONSTRAINTS if k in node}}
    if "type" not in node and node.get("x-kubernetes-preserve-unknown-fields"):
        return ANY
    return _shape(node, crd_shape, path)


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = defs[node["$ref"].removeprefix("#/$defs/")]
    return node


def _shape(node: dict[str, Any], child: Any, path: str) -> dict[str, Any]:
    shape = {k: node[k] for k in CONSTRAINTS if k in node}
    if "enum" in shape:
        shape["enum"] = sorted(shape["enum"], key=repr)
    if "properties" in node:
        shape["properties"] = {
            name: child(sub, f"{path}.{name}") for name, sub in node["properties"].items()
        }
        shape["required"] = sorted(node.get("required", []))
    if isinstance(node.get("additionalProperties"), dict):
        shape["values"] = child(node["additionalProperties"], f"{path}[*]")
    if len(node.get("patternProperties") or {}) == 1:
        # A model's constrained keys (``dict[QuotaResource, int]``): a CRD cannot constrain
        # keys (structural schemas have no patternProperties), so the values are compared.
        (values,) = node["patternProperties"].values()
        shape["values"] = child(values, f"{path}[*]")
    if "items" in node:
        shape["items"] = child(node["items"], f"{path}[]")
    return shape


def differences(model: dict[str, Any], crd: dict[str, Any], path: str) -> list[str]:
    """Every way ``crd`` (a ``crd_shape``) fails to mirror ``model`` (a ``model_shape``)."""
    found = []
    for key in CONSTRAINTS:
        if model.get(key) != crd.get(key):
            found.append(
                f"{path}: {key} is {model.get(key)!r} in the model, {crd.get(key)!r} in the CRD"
            )
    model_required, crd_required = set(model.get("required", [])), set(crd.get("required", []))
    if model_required - crd_required:
        found.append(f"{path}: the model requires {sorted(model_required - crd_required)}")
    if crd_required - model_required:
        found.append(f"{path}: the CRD requires {sorted(crd_required - model_required)}")
    model_fields, crd_fields = model.get("properties", {}), crd.get("properties", {})
    for name in sorted(model_fields.keys() - crd_fields.keys()):
        found.append(f"{path}.{name}: in the model, missing from the CRD")
    for name in sorted(crd_fields.keys() - model_fields.keys()):
        found.append(f"{path}.{name}: in the CRD, not in the model")
    for name in sorted(model_fields.keys() & crd_fields.keys()):
        found += differences(model_fields[name], crd_fields[name], f"{path}.{name}")
    for key, suffix in (("items", "[]"), ("values", "[*]")):
        if key in model or key in crd:
            found += differences(model.get(key, {}), crd.get(key, {}), f"{path}{suffix}")
    return found


def shape_of(model: type[BaseModel], path: str, field: str | None = None) -> dict[str, Any]:
    js = model.model_json_schema(by_alias=True)
    return model_shape(js if field is None else js["properties"][field], js.get("$defs", {}), path)


def expected_reservation_spec(model: type[requests.CreateInput]) -> dict[str, Any]:
    """CreateInput as docs/kubernetes.md turns it into Reservation.spec."""
    shape = shape_of(model, "spec")
    fields = dict(shape["properties"])
    for name in ("tenantId", "wait"):
        assert name in fields, f"CreateInput has no {name} any more: revisit the contract"
        del fields[name]
    # Times and durations are strings there (checked by CEL rules), epoch ms and ms here.
    fields["start"] = fields["until"] = fields["extendBy"] = {"int-or-string": True}
    fields["extendKey"] = fields["idempotencyKey"]
    fields["release"] = {"type": "boolean"}
    required = sorted(set(shape["required"]) - {"tenantId", "idempotencyKey"})
    return {**shape, "properties": fields, "required": required}


def reservation_spec_differences(crds, model: type[requests.CreateInput]) -> list[str]:
    crd = crd_shape(node_at(schema(crds, "Reservation"), "spec"), "spec")
    return differences(expected_reservation_spec(model), crd, "spec")


def test_reservation_spec_mirrors_create_input(crds):
    found = reservation_spec_differences(crds, requests.CreateInput)
    assert not found, "\n".join(found)


def test_gpupool_spec_mirrors_core_pool_spec(crds):
    # The operator parses a GPUPool's spec with this model: a field or bound on one side only
    # is a GPUPool the API server and the operator judge differently.
    crd = crd_shape(node_at(schema(crds, "GPUPool"), "spec"), "spec")
    found = differences(shape_of(pools.PoolSpec, "spec"), crd, "spec")
    assert not found, "\n".join(found)


def test_gpuquota_spec_mirrors_core_quota_spec(crds):
    # The operator parses a GPUQuota's spec with this model.
    crd = crd_shape(node_at(schema(crds, "GPUQuota"), "spec"), "spec")
    found = differences(shape_of(pools.QuotaSpec, "spec"), crd, "spec")
    assert not found, "\n".join(found)


def test_pool_policy_mirrors_the_dev_configs_pool_policy(crds):
    crd = crd_shape(node_at(schema(crds, "GPUPool"), "spec.policy"), "spec.policy")
    found = differences(shape_of(pools.PoolPolicy, "spec.policy"), crd, "spec.policy")
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("kind", "path", "model", "field"),
    [
        ("GPUPool", "spec.model", pools.Pool, "model"),
        ("GPUPool", "spec.region", pools.Pool, "region"),
        ("GPUPool", "spec.sharing.mode", pools.Pool, "sharing"),
        ("GPUPool", "spec.sharing.replicas", pools.Pool, "replicas"),
        ("GPUPool", "spec.owner.tenant", pools.Pool, "owner"),
        ("GPUPool", "spec.archived", pools.Pool, "archived"),
        ("GPUPool", "spec.owner.quotas[*]", pools.Quota, "limit"),
        ("GPUPool", "spec.offers[].tenant", pools.Offer, "tenant"),
        ("GPUPool", "spec.offers[].onBudgetExceeded", pools.Offer, "onBudgetExceeded"),
        ("GPUPool", "spec.offers[].quotas[*]", pools.Quota, "limit"),
        ("DeviceAllocation", "spec.class", requests.DeviceRequest, "class"),
    ],
)
def test_other_fields_mirror_their_models(crds, kind, path, model, field):
    crd = crd_shape(node_at(schema(crds, kind), path), path)
    found = differences(shape_of(model, path, field), crd, path)
    assert not found, "\n".join(found)


class _DriftedDevice(requests.DeviceRequest):
    memoryMiB: int = Field(default=0, ge=0)


class _DriftedCreate(requests.CreateInput):
    devices: list[_DriftedDevice] = Field(min_length=1, max_length=32)
    priority: int = Field(default=0, ge=0, le=9)


class _DriftedPolicy(pools.PoolPolicy):
    maxRunning: int | None = None


def test_a_model_change_without_the_crd_is_named_by_its_path(crds):
    drift = reservation_spec_differences(crds, _DriftedCreate)
    assert "spec.priority: in the model, missing from the CRD" in drift
    assert "spec.devices[].memoryMiB: in the model, missing from the CRD" in drift
    assert "spec.devices: maxItems is 32 in the model, 16 in the CRD" in drift
    assert len(drift) == 3, drift
    crd = crd_shape(node_at(schema(crds, "GPUPool"), "spec.policy"), "spec.policy")
    assert differences(shape_of(_DriftedPolicy, "spec.policy"), crd, "spec.policy") == [
        "spec.policy.maxRunning: in the model, missing from the CRD"
    ]


# --- immutability (CEL rules: present and placed, not evaluated) ------------------------------


def test_every_immutable_spec_field_carries_a_transition_rule_and_no_mutable_one_does(crds):
    fields = node_at(schema(crds, "Reservation"), "spec")["properties"]
    assert set(MUTABLE) <= set(fields)
    for name, field in fields.items():
        rules = field.get("x-kubernetes-validations", [])
        if name in MUTABLE:
            assert not any("oldSelf" in r["rule"] for r in rules), name
        else:
            assert {"rule": "self == oldSelf", "message": f"{name} is immutable"} in rules, name


def test_optional_immutable_fields_cannot_be_added_or_removed(crds):
    # A rule on a field runs only when old and new both have it; its parent must catch the rest.
    spec = node_at(schema(crds, "Reservation"), "spec")
    optional = set(spec["properties"]) - set(spec["required"]) - set(MUTABLE)
    guarded = {
        match
        for rule in spec["x-kubernetes-validations"]
        for match in re.findall(r"has\(self\.(\w+)\) == has\(oldSelf\.\1\)", rule["rule"])
    }
    assert guarded == optional


# --- samples ----------------------------------------------------------------------------------

DELETE = object()


def reservation() -> dict[str, Any]:
    return {
        "apiVersion": "bcd.dev/v1alpha1",
        "kind": "Reservation",
        "metadata": {
            "name": "train-1",
            "namespace": "ml",
            "annotations": {"bcd.dev/requested-by": "alice@example.com"},
        },
        "spec": {
            "poolId": "h100-train",
            "devices": [{"class": "gpu", "count": 4, "topology": "nvlink-all"}],
            "duration": "8h",
        },
        "status": {
            "id": "rsv_01k",
            "state": "released",
            "tenantId": "acme",
            "poolId": "h100-train",
            "during": {"start": 1790000000000, "end": 1790028800000},
            "startTime": "2026-09-21T14:13:20Z",
            "endTime": "2026-09-21T22:13:20Z",
            "gpus": 4,
            "nodes": "gpu-node-1",
            "conditions": [
                {
                    "type": "DevicesHeld",
                    "status": "True",
                    "reason": "PodsHoldDevices",
                    "message": "pods on gpu-node-1 still hold its GPUs",
                    "lastTransitionTime": "2026-09-21T20:00:00Z",
                    "observedGeneration": 1,
                },
                {
                    "type": "Refused",
                    "status": "True",
                    "reason": "INVALID_STATE",
                    "message": "",
                    "lastTransitionTime": "2026-09-21T20:00:00Z",
                    "observedGeneration": 2,
                },
                {
                    "type": "Unschedulable",
                    "status": "False",
                    "reason": "Cleared",
                    "message": "no longer so; it was NoCapacity",
                    "lastTransitionTime": "2026-09-21T14:13:20Z",
                    "observedGeneration": 1,
                },
            ],
            "conditionDetails": {
                "DevicesHeld": {
                    "since": "2026-09-21T20:00:00Z",
                    "nodes": ["gpu-node-1"],
                    "pods": ["ml/trainer-0"],
                }
            },
            "binding": {
                "nodeId": "gpu-node-1",
                "cdiDevices": ["bcd.dev/gpu=GPU-1"],
                "envFile": "/run/x",
            },
            "operation": {"id": "rsv_01k", "state": "succeeded"},
            "version": 4,
            "leaseExpiresAt": "2026-09-21T15:13:20Z",
            "extension": {
                "key": "ext-1",
                "extended": True,
                "availableUntil": "2026-09-22T01:20:00Z",
            },
            "renewed": "2026-09-21T15:00:00Z",
            "observedGeneration": 2,
        },
    }


def gpupool() -> dict[str, Any]:
    return {
        "apiVersion": "bcd.dev/v1alpha1",
        "kind": "GPUPool",
        "metadata": {"name": "h100-train"},
        "spec": {
            "model": "H100",
            "region": "eu-west-1",
            "site": "fra-1",
            "sharing": {"mode": "exclusive", "replicas": 1},
            "policy": {
                "kubernetes": True,
                "maxPending": "24h",
                "tenantRoot": False,
                "perGpu": {"vcpu": 16, "memoryGiB": 128, "hugepages1Gi": 0},
                "admission": {"budgetCheck": "off"},
                "hostReserve": {"vcpu": 2},
            },
            "nodeSelector": {
                "matchLabels": {"bcd.dev/pool": "h100-train"},
                "matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}],
            },
            "owner": {"tenant": "acme"},
            "offers": [{"tenant": "globex", "onBudgetExceeded": "stop-new"}],
            "archived": False,
        },
        "status": {"observedGeneration": 1, "nodes": 2, "conditions": []},
    }


def gpunode() -> dict[str, Any]:
    gpu = {
        "uuid": "GPU-0",
        "index": 0,
        "model": "H100",
        "memoryMiB": 81559,
        "numaNode": 0,
        "nvlinkDomain": "gpu-node-1-nvl0",
        "healthy": True,
        "mig": [{"uuid": "MIG-0", "profile": "1g.10gb", "healthy": True}],
    }
    lone = {**gpu, "uuid": "GPU-1", "index": 1, "numaNode": None, "nvlinkDomain": None, "mig": []}
    return {
        "apiVersion": "bcd.dev/v1alpha1",
        "kind": "GPUNode",
        "metadata": {"name": "gpu-node-1", "labels": {"bcd.dev/pool": "h100-train"}},
        "spec": {},
        "status": {
            "inventory": {
                "gpus": [gpu, lone],
                "numaNodes": [{"id": 0, "cpus": "0-63", "memoryGiB": 1024}],
                "host": {"vcpu": 128, "memoryGiB": 2048, "hugepages1Gi": 0},
            },
            "gpus": 2,
            "capabilities": ["binding.kubernetes", "devices.limits"],
            "heartbeatTime": "2026-12-02T14:00:00Z",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "AgentRunning",
                    "message": "",
                    "lastTransitionTime": "2026-12-02T13:00:00.5+01:00",
                }
            ],
        },
    }


def device_allocation() -> dict[str, Any]:
    return {
        "apiVersion": "bcd.dev/v1alpha1",
        "kind": "DeviceAllocation",
        "metadata": {
            "name": "alloc-01k",
            "namespace": "better-compute",
            "labels": {"bcd.dev/node": "gpu-node-1", "bcd.dev/reservation": "rsv_01k"},
        },
        "spec": {
            "allocationId": "alloc_01k",
            "nodeName": "gpu-node-1",
            "reservationId": "rsv_01k",
            "tenantId": "acme",
            "class": "gpu",
            "binding": "kubernetes",
            "deviceIds": ["GPU-0"],
            "parentGpus": ["GPU-0"],
            "until": 1790028800000,
            "limits": {"cpuMillis": 32000, "memoryBytes": 274877906944, "hugepages1Gi": 0},
            "release": False,
        },
        "status": {
            "nodeName": "gpu-node-1",
            "phase": "Releasing",
            "cdiDevices": ["bcd.dev/gpu=GPU-0"],
            "envFile": "/run/bcd/allocations/alloc_01k.env",
            "reason": "",
            "pods": ["ml/trainer-0"],
            "since": 1790001000000,
            "reportedAt": "2026-12-02T14:00:00Z",
            "signature": {
                "keyId": "k1",
                "algorithm": "ed25519",
                "payload": "e30=",
                "value": "AA==",
            },
        },
    }


def gpuquota() -> dict[str, Any]:
    return {
        "apiVersion": "bcd.dev/v1alpha1",
        "kind": "GPUQuota",
        "metadata": {"name": "acme"},
        "spec": {"tenant": "acme", "limits": {"gpu:H100": 16, "vcpu": 256}},
        "status": {
            "observedGeneration": 1,
            "limits": {"gpu:H100": 16, "vcpu": 256},
            "used": {"gpu:H100": 4, "vcpu": 0},
            "summary": "gpu:H100 4/16",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "Applied",
                    "message": "tenant acme's quota",
                    "lastTransitionTime": "2026-12-04T06:00:00Z",
                    "observedGeneration": 1,
                }
            ],
        },
    }


def eventsubscription() -> dict[str, Any]:
    """An EventSubscription as the operator leaves it (``operator/subscribing.py``)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "EventSubscription",
        "metadata": {"name": "hooks", "namespace": "ml"},
        "spec": {
            "url": "https://hooks.example.com/bcd?team=ml",
            "eventTypes": ["reservation.placed", "reservation.released"],
            "secretName": "hooks-signing",
        },
        "status": {
            "observedGeneration": 1,
            "subscriptionId": "sub_01",
            "tenantId": "acme",
            "secretName": "hooks-signing",
            "secretVersion": "42",
            "types": "placed,released",
            "deliveries": {
                "delivered": 3,
                "pending": 0,
                "failing": 1,
                "dead": 0,
                "lastDeliveredAt": "2026-12-04T12:00:00Z",
                "lastError": "HTTP 500",
            },
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "Subscribed",
                    "message": "tenant acme's events are delivered by subscription sub_01",
                    "lastTransitionTime": "2026-12-04T11:00:00Z",
                    "observedGeneration": 1,
                }
            ],
        },
    }


SAMPLES = {
    "Reservation": reservation,
    "GPUPool": gpupool,
    "GPUNode": gpunode,
    "DeviceAllocation": device_allocation,
    "GPUQuota": gpuquota,
    "EventSubscription": eventsubscription,
}


def test_eventsubscription_spec_takes_what_subscriptions_create_takes(crds):
    """The URL pattern and the event types are the API's own (``core.requests``)."""
    spec = schema(crds, "EventSubscription")["properties"]["spec"]["properties"]
    assert spec["url"]["pattern"] == requests.WEBHOOK_URL_PATTERN
    assert spec["url"]["maxLength"] == 2048
    assert tuple(spec["eventTypes"]["items"]["enum"]) == requests.EVENT_TYPES
    assert spec["eventTypes"]["maxItems"] == len(requests.EVENT_TYPES)


@pytest.mark.parametrize(
    ("limits", "accepted"),
    [
        ({"gpu:H100": 16, "gpuSlices:A100": 14, "vcpu": 8, "memoryGiB": 64}, True),
        ({"hugepages1Gi": 4}, True),
        ({}, True),
        ({"gpu H100": 4}, False),
        ({"gpus": 4}, False),
    ],
)
def test_gpuquota_limits_keys_are_the_cores_resources(crds, limits, accepted):
    sample = changed(gpuquota(), {"spec.limits": limits})
    checked = crdchecking.check(sample, None, schema(crds, "GPUQuota"), status_only=False)
    try:
        pools.QuotaSpec.model_validate(sample["spec"])
        core = True
    except ValidationError:
        core = False
    assert (not checked.errors, core) == (accepted, accepted), checked.errors


def test_a_gpupool_carrying_quotas_is_refused_by_the_crd_and_the_core(crds):
    for path in ("spec.owner.quotas", "spec.offers[0].quotas"):
        pool = gpupool()
        pool["spec"]["offers"] = [{"tenant": "globex"}]
        sample = changed(pool, {path: {"gpu:H100": 16}})
        checked = crdchecking.check(sample, None, schema(crds, "GPUPool"), status_only=False)
        assert [e for e in checked.errors if "quotas moved to GPUQuota" in e.message], path
        with pytest.raises(ComputeError) as refused:
            definitions.pool_definition("p", sample["spec"])
        assert refused.value.details["field"] == path


def changed(sample: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``sample`` with each ``path`` (``spec.devices[0].count``) set, or deleted."""
    result = copy.deepcopy(sample)
    for path, value in changes.items():
        steps = [int(i) if i else name for name, i in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path)]
        target = result
        for step in steps[:-1]:
            target = target[step]
        if value is DELETE:
            del target[steps[-1]]
        else:
            target[steps[-1]] = copy.deepcopy(value)
    return result


@pytest.mark.parametrize("kind", KINDS)
def test_the_contract_samples_are_accepted_whole(crds, kind: str):
    found = crdschema.validate(SAMPLES[kind](), schema(crds, kind))
    assert not found, "\n".join(found)


def test_the_samples_specs_are_valid_for_the_core():
    requests.parse(requests.CreateInput, core_input(reservation()["spec"]))
    pools.PoolPolicy.model_validate(gpupool()["spec"]["policy"])


@pytest.mark.parametrize(
    ("kind", "changes", "path", "reason"),
    [
        ("Reservation", {"spec.devices[0].count": 0}, "spec.devices[0].count", ">= 1"),
        ("Reservation", {"spec.devices[0].class": "tpu"}, "spec.devices[0].class", "one of"),
        ("Reservation", {"spec.gpuz": 4}, "spec.gpuz", "unknown field, pruned"),
        ("Reservation", {"spec.tenantId": "acme"}, "spec.tenantId", "unknown field, pruned"),
        ("Reservation", {"spec.wait": {"timeoutMs": 5}}, "spec.wait", "unknown field, pruned"),
        ("Reservation", {"spec.poolId": DELETE}, "spec.poolId", "required"),
        ("Reservation", {"spec.gang": None}, "spec.gang", "pruned"),
        (
            "Reservation",
            {"status.conditions[0].status": "Yes"},
            "status.conditions[0].status",
            "one of",
        ),
        ("Reservation", {"status.startTime": "yesterday"}, "status.startTime", "RFC 3339"),
        ("Reservation", {"status.gpus": "4"}, "status.gpus", "type integer"),
        ("Reservation", {"status.binding": "node"}, "status.binding", "type object"),
        ("GPUPool", {"spec.sharing.mode": "shared"}, "spec.sharing.mode", "one of"),
        ("GPUPool", {"spec.owner.quotas": {"gpu:H100": -1}}, "spec.owner.quotas[gpu:H100]", ">= 0"),
        ("GPUPool", {"spec.owner.tenant": DELETE}, "spec.owner.tenant", "required"),
        ("GPUPool", {"spec.region": "EU West"}, "spec.region", "must match"),
        (
            "GPUPool",
            {"spec.nodeSelector.matchExpressions[0].operator": "Like"},
            "spec.nodeSelector.matchExpressions[0].operator",
            "one of",
        ),
        (
            "GPUPool",
            {"spec.nodeSelector.matchLabels": {"a": 1}},
            "spec.nodeSelector.matchLabels[a]",
            "type string",
        ),
        (
            "GPUPool",
            {"spec.offers": [{"tenant": "globex"}, {"tenant": "globex"}]},
            "spec.offers[1]",
            "duplicate",
        ),
        (
            "GPUPool",
            {"spec.policy.maxPending": True},
            "spec.policy.maxPending",
            "integer or a string",
        ),
        ("GPUPool", {"spec.policy.perGpu.gpus": 1}, "spec.policy.perGpu.gpus", "pruned"),
        ("GPUPool", {"status.nodes": "gpu-node-1"}, "status.nodes", "type integer"),
        ("GPUNode", {"spec.anything": 1}, "spec.anything", "pruned"),
        (
            "GPUNode",
            {"status.inventory.gpus[0].memoryMiB": 0},
            "status.inventory.gpus[0].memoryMiB",
            ">= 1",
        ),
        (
            "GPUNode",
            {"status.inventory.gpus[0].uuid": DELETE},
            "status.inventory.gpus[0].uuid",
            "required",
        ),
        ("GPUNode", {"status.heartbeatTime": "now"}, "status.heartbeatTime", "RFC 3339"),
        (
            "GPUNode",
            {"status.capabilities": "binding.kubernetes"},
            "status.capabilities",
            "type array",
        ),
        ("DeviceAllocation", {"spec.class": "tpu"}, "spec.class", "one of"),
        ("DeviceAllocation", {"spec.binding": "node"}, "spec.binding", "one of"),
        ("DeviceAllocation", {"spec.deviceIds": []}, "spec.deviceIds", "at least 1"),
        ("DeviceAllocation", {"spec.until": DELETE}, "spec.until", "required"),
        ("DeviceAllocation", {"status.phase": "Done"}, "status.phase", "one of"),
        ("DeviceAllocation", {"status.since": 2**63}, "status.since", "int64"),
    ],
)
def test_bad_objects_are_refused_naming_the_field(crds, kind, changes, path, reason):
    errors = crdschema.validate(changed(SAMPLES[kind](), changes), schema(crds, kind))
    assert [e for e in errors if e.startswith(f"{path}: ") and reason in e], errors


def test_a_schema_keyword_the_validator_does_not_know_is_an_error_not_a_pass():
    with pytest.raises(ValueError, match="propertyNames"):
        crdschema.validate({"a": 1}, {"type": "object", "propertyNames": {"pattern": "^b$"}})


def test_preserved_fields_are_kept_and_int_or_string_takes_either():
    node = {
        "type": "object",
        "properties": {
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "d": {"x-kubernetes-int-or-string": True},
        },
    }
    assert crdschema.validate({"free": {"any": [1, {"x": None}]}, "d": 5}, node) == []
    assert crdschema.validate({"d": "5h"}, node) == []
    assert crdschema.validate({"d": 1.5}, node) == ["d: must be an integer or a string (got 1.5)"]


# --- the CRD refuses what the core refuses ----------------------------------------------------


def core_input(spec: dict[str, Any]) -> dict[str, Any]:
    """What the operator hands the core for a Reservation.spec: the tenant and a key added,
    and ``start`` read from RFC 3339 (the operator's own conversion, which may refuse)."""
    return definitions.create_request(spec, tenant_id="acme", uid="uid-1")


def crd_errors(crds, sample: dict[str, Any]) -> list[str]:
    """What the API server would refuse (or prune) in ``sample``, CEL rules included."""
    found = crdschema.validate(sample, schema(crds, "Reservation"))
    checked = crdchecking.check(sample, None, schema(crds, "Reservation"), status_only=False)
    return found + [f"{e.path}: {e.message}" for e in checked.errors]


GPU = {"class": "gpu", "count": 1}


@pytest.mark.parametrize(
    ("changes", "path"),
    [
        ({"spec.devices[0].count": 0}, "spec.devices[0].count"),
        ({"spec.devices[0].count": 1025}, "spec.devices[0].count"),
        ({"spec.devices[0].count": "4"}, "spec.devices[0].count"),
        ({"spec.devices[0].count": True}, "spec.devices[0].count"),
        ({"spec.devices[0].class": "tpu"}, "spec.devices[0].class"),
        ({"spec.devices[0].topology": "ring"}, "spec.devices[0].topology"),
        ({"spec.devices[0].colour": "red"}, "spec.devices[0].colour"),
        ({"spec.devices": []}, "spec.devices"),
        ({"spec.devices": [GPU] * 17}, "spec.devices"),
        ({"spec.devices": [{"count": 1}]}, "spec.devices[0].class"),
        (
            {"spec.devices": [{"class": "mig", "count": 1, "profile": "8g.10gb"}]},
            "spec.devices[0].profile",
        ),
        ({"spec.poolId": ""}, "spec.poolId"),
        ({"spec.poolId": "-pool"}, "spec.poolId"),
        ({"spec.poolId": "p" * 129}, "spec.poolId"),
        ({"spec.poolId": 7}, "spec.poolId"),
        ({"spec.duration": True}, "spec.duration"),
        ({"spec.duration": 1.5}, "spec.duration"),
        ({"spec.duration": DELETE}, "spec.duration"),
        ({"spec.start": "soon"}, "spec.start"),
        ({"spec.start": "2026-12-24T08:00:00"}, "spec.start"),
        ({"spec.start": "2026-13-24T08:00:00Z"}, "spec.start"),
        ({"spec.start": "1969-12-31T23:59:59Z"}, "spec.start"),
        ({"spec.gang": {"size": 0}}, "spec.gang.size"),
        ({"spec.gang": {"size": 1025}}, "spec.gang.size"),
        ({"spec.gang": {}}, "spec.gang.size"),
        ({"spec.binding": "vm"}, "spec.binding"),
        ({"spec.resources": {"vcpu": 4097}}, "spec.resources.vcpu"),
        ({"spec.resources": {"memoryGiB": -1}}, "spec.resources.memoryGiB"),
        ({"spec.resources": {"hugepages1Gi": 65537}}, "spec.resources.hugepages1Gi"),
        ({"spec.resources": {"gpus": 1}}, "spec.resources.gpus"),
        ({"spec.spot": "yes"}, "spec.spot"),
        ({"spec.leaseSeconds": 59}, "spec.leaseSeconds"),
        ({"spec.leaseSeconds": 30 * 86_400 + 1}, "spec.leaseSeconds"),
        ({"spec.projectId": "proj 1"}, "spec.projectId"),
        ({"spec.binding": "node", "spec.node": {"profileVersion": 1}}, "spec.node.profileId"),
        (
            {"spec.binding": "node", "spec.node": {"profileId": "p", "profileVersion": -1}},
            "spec.node.profileVersion",
        ),
        ({"spec.idempotencyKey": "has space"}, "spec.idempotencyKey"),
        ({"spec.idempotencyKey": "k" * 257}, "spec.idempotencyKey"),
        # (An empty idempotencyKey, refused by the CRD, never reaches the core: the operator
        # keys such an object by its uid.)
        ({"spec.gpus": 4}, "spec.gpus"),
    ],
)
def test_what_the_core_refuses_the_crd_refuses_at_the_same_field(crds, changes, path):
    spec = changed(reservation(), changes)["spec"]
    with pytest.raises(ComputeError) as refused:
        requests.parse(requests.CreateInput, core_input(spec))
    assert refused.value.details["field"].startswith(path.removeprefix("spec."))
    errors = crd_errors(crds, changed(reservation(), changes))
    assert [e for e in errors if e.startswith(f"{path}: ")], errors


@pytest.mark.parametrize(
    "changes",
    [
        {"spec.duration": "2h30m"},
        {"spec.duration": "1d"},
        {"spec.devices": [{"class": "mig", "count": 2, "profile": "1g.10gb"}]},
        {"spec.devices": [{"class": "slot", "count": 1}], "spec.spot": True},
        {"spec.devices": [{**GPU, "count": 1024}] * 16},
        {"spec.binding": "node", "spec.node": {"profileId": "p1", "profileVersion": 3}},
        {"spec.start": "1970-01-01T00:00:00Z", "spec.leaseSeconds": 60},
        {"spec.start": "2026-12-24T09:00:00.250+01:00"},
        {
            "spec.start": "2026-12-24T08:00:00Z",
            "spec.gang": {"size": 2},
            "spec.binding": "kubernetes",
            "spec.resources": {"vcpu": 32, "memoryGiB": 256, "hugepages1Gi": 0},
            "spec.leaseSeconds": 30 * 86_400,
            "spec.projectId": "proj-1",
            "spec.idempotencyKey": "train-2026-09-24",
        },
        {"spec.until": "2026-12-24T20:00:00Z", "spec.extendKey": "train-1-ext-1"},
        {"spec.extendBy": "4h", "spec.extendKey": "train-1-ext-2"},
        {"spec.extendBy": "90m", "spec.extendKey": "train-1-ext-3", "spec.release": True},
    ],
)
def test_what_the_core_accepts_the_crd_accepts(crds, changes):
    sample = changed(reservation(), changes)
    requests.parse(requests.CreateInput, core_input(sample["spec"]))
    found = crd_errors(crds, sample)
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("changes", "path", "shown"),
    [
        ({"spec.duration": 28_800_000}, "spec.duration", "'8h'"),
        ({"spec.duration": "28800000"}, "spec.duration", "'8h'"),
        ({"spec.duration": "30m2h"}, "spec.duration", "'2h30m'"),
        ({"spec.start": 1790000000000}, "spec.start", "'2026-12-24T08:00:00Z'"),
        ({"spec.start": "tomorrow"}, "spec.start", "'2026-12-24T08:00:00Z'"),
        (
            {"spec.until": 1790040000000, "spec.extendKey": "k"},
            "spec.until",
            "'2026-12-24T08:00:00Z'",
        ),
        ({"spec.extendBy": 14_400_000, "spec.extendKey": "k"}, "spec.extendBy", "'90m'"),
    ],
)
def test_a_number_or_a_wrong_form_is_refused_with_the_right_form_shown(crds, changes, path, shown):
    # The HTTP API takes epoch ms and bare milliseconds; a Reservation takes only the forms a
    # person reads, and the API server's refusal shows one.
    errors = crd_errors(crds, changed(reservation(), changes))
    assert [e for e in errors if e.startswith(f"{path}: ") and shown in e], errors


def test_the_operator_reads_a_start_and_until_the_crd_takes_as_epoch_ms():
    spec = {**reservation()["spec"], "start": "2026-12-24T09:00:00+01:00"}
    assert core_input(spec)["start"] == 1798099200000
    # An object written before the CRD took strings keeps its epoch ms.
    assert core_input({**spec, "start": 1790000000000})["start"] == 1790000000000
    with pytest.raises(ComputeError) as refused:
        core_input({**spec, "start": "2026-12-24 08:00"})
    assert refused.value.details["field"] == "start"
    assert "RFC 3339" in refused.value.message


@pytest.mark.parametrize(
    ("policy", "path"),
    [
        ({"maxPending": True}, "spec.policy.maxPending"),
        ({"perGpu": {"vcpu": 4097}}, "spec.policy.perGpu.vcpu"),
        ({"perGpu": {"memoryGiB": -1}}, "spec.policy.perGpu.memoryGiB"),
        ({"admission": {"budgetCheck": "on"}}, "spec.policy.admission.budgetCheck"),
        ({"hostReserve": {"vcpu": 4097}}, "spec.policy.hostReserve.vcpu"),
        ({"maxRunning": 3}, "spec.policy.maxRunning"),
    ],
)
def test_what_the_dev_config_refuses_in_a_policy_the_crd_refuses(crds, policy, path):
    with pytest.raises(ValidationError):
        pools.PoolPolicy.model_validate(policy)
    errors = crdschema.validate(
        changed(gpupool(), {"spec.policy": policy}), schema(crds, "GPUPool")
    )
    assert [e for e in errors if e.startswith(f"{path}: ")], errors


@pytest.mark.parametrize(
    ("kind", "path", "model"),
    [
        ("DeviceAllocation", "spec", allocations.AllocationSpec),
        ("DeviceAllocation", "status", allocations.AllocationStatus),
        ("GPUNode", "status", nodes.GpuNodeStatus),
    ],
)
def test_the_shapes_the_operator_and_the_node_agent_share_mirror_the_crds(crds, kind, path, model):
    # The operator writes a DeviceAllocation's spec and reads its status and a GPUNode's status
    # with these models, and the node agent the other way round: a field, a bound or a required
    # key on one side only is an object one program writes and the API server or the other
    # program refuses.
    crd = crd_shape(node_at(schema(crds, kind), path), path)
    found = differences(shape_of(model, path), crd, path)
    assert not found, "\n".join(found)
