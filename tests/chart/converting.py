"""The GPUPool and GPUQuota CRDs' spec schemas as the JSON Schema ``values.schema.json`` uses for
``pools`` and ``quotas``.

Why it exists: a pool given as a Helm value must fail ``helm install`` with the field's name
when the API server would refuse it, and must not lose a misspelt field to pruning without a
word. So the chart's values schema carries the CRD's own ``spec`` schema, converted (OpenAPI v3
with Kubernetes extensions → JSON Schema draft 7), with ``additionalProperties: false`` on
every object that lists its properties. ``tests/chart/test_values.py`` fails when the two drift
apart; ``python -m tests.chart.converting`` rewrites that part of ``values.schema.json``.

What it must never do: change anything else in ``values.schema.json``, or drop a constraint it
does not understand (an unknown keyword raises).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
VALUES_SCHEMA = ROOT / "charts" / "better-compute" / "values.schema.json"

#: Kept as they are.
_KEPT = frozenset(
    {
        "description",
        "enum",
        "minimum",
        "maximum",
        "minLength",
        "maxLength",
        "pattern",
        "minItems",
        "maxItems",
        "maxProperties",
        "required",
    }
)
#: Meaningful only to the API server (list and map semantics, CEL): the API server still
#: applies them at install.
_SERVER_ONLY = frozenset(
    {
        "x-kubernetes-validations",
        "x-kubernetes-map-type",
        "x-kubernetes-list-type",
        "x-kubernetes-list-map-keys",
        "format",
    }
)


_EMPTY = "size(self) == 0"


def json_schema(node: Mapping[str, Any], *, where: str = "spec") -> dict[str, Any]:
    """One OpenAPI node as strict JSON Schema."""
    out: dict[str, Any] = {}
    if "type" not in node and node.get("x-kubernetes-preserve-unknown-fields"):
        # A field of any type (``policy.kubernetes``: true or an object): the operator checks it.
        return {k: node[k] for k in ("description",) if k in node}
    for key, value in node.items():
        if key in _KEPT:
            out[key] = value
        elif key == "x-kubernetes-validations":
            # The one rule JSON Schema can say too, so helm refuses it before the API server:
            # an object that must stay empty (a GPUPool's quotas, moved to GPUQuota).
            if any(rule.get("rule") == _EMPTY for rule in value):
                out["maxProperties"] = 0
        elif key in _SERVER_ONLY or key in ("type", "nullable", "x-kubernetes-int-or-string"):
            continue
        elif key == "properties":
            out["properties"] = {
                name: json_schema(child, where=f"{where}.{name}") for name, child in value.items()
            }
        elif key == "items":
            out["items"] = json_schema(value, where=f"{where}[]")
        elif key == "additionalProperties":
            out["additionalProperties"] = json_schema(value, where=f"{where}[*]")
        else:
            raise ValueError(f"{where}: no JSON Schema form for {key!r}")
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    elif "type" in node:
        out["type"] = [node["type"], "null"] if node.get("nullable") else node["type"]
    if "properties" in node and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


def pool_spec_schema() -> dict[str, Any]:
    """The GPUPool CRD's ``spec`` schema, converted."""
    crd = yaml.safe_load((CRDS / "gpupools.yaml").read_text(encoding="utf-8"))
    (version,) = crd["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return json_schema(spec)


def quota_spec_schema() -> dict[str, Any]:
    """The GPUQuota CRD's ``spec`` schema, converted."""
    crd = yaml.safe_load((CRDS / "gpuquotas.yaml").read_text(encoding="utf-8"))
    (version,) = crd["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return json_schema(spec)


def main() -> None:
    schema = json.loads(VALUES_SCHEMA.read_text(encoding="utf-8"))
    schema["definitions"]["poolSpec"] = pool_spec_schema()
    schema["definitions"]["quotaSpec"] = quota_spec_schema()
    VALUES_SCHEMA.write_text(json.dumps(schema, indent=2) + "\n", encoding="utf-8")
    sys.stdout.write(f"wrote definitions.poolSpec and quotaSpec in {VALUES_SCHEMA}\n")


if __name__ == "__main__":
    main()
