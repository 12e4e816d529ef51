"""What the Kubernetes API server would say about our CRDs and the objects written against them.

Why it exists: the unit tests run without a cluster, yet the CustomResourceDefinitions in
``crds/`` must be ones the API server accepts (structural schemas), and an object must be
refused or pruned there exactly where the schema says. This module answers both offline:

- ``structural_errors(schema)`` lists the structural-schema rules a CRD's ``openAPIV3Schema``
  breaks (every node typed, ``properties`` only on objects, ``items`` on every array, no logical
  junctors, ``metadata`` left alone …), plus typos: an unknown keyword is an error, not ignored.
- ``validate(instance, schema)`` lists what the API server would refuse in an object (wrong
  type, enum, bounds, lengths, pattern, required, formats, duplicate list-map keys) and what it
  would silently prune (unknown fields, nulls in non-nullable fields), each as
  ``"<path>: <reason>"`` with a Kubernetes field path such as ``spec.devices[0].count`` or
  ``spec.owner.quotas[gpu:H100]``. Pruned fields say ``pruned``, so a test can tell "refused"
  from "dropped".

Who calls it: ``tests/unit/test_crds.py`` and the Helm chart's tests, which ship the same CRDs.

What it must never do: evaluate CEL. ``x-kubernetes-validations`` rules are not run, so a test
must never claim a rule works because ``validate`` passed. It never applies defaults, never
reaches a cluster, and never silently skips a schema keyword it does not understand:
``validate`` raises ``ValueError`` for one, so a schema cannot pass because part of it was
ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

#: Keywords a structural schema may use here; anything else is a typo or unsupported.
KEYWORDS = frozenset(
    {
        "type",
        "format",
        "description",
        "title",
        "example",
        "default",
        "nullable",
        "enum",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "minLength",
        "maxLength",
        "pattern",
        "minItems",
        "maxItems",
        "uniqueItems",
        "minProperties",
        "maxProperties",
        "properties",
        "additionalProperties",
        "items",
        "required",
        "x-kubernetes-int-or-string",
        "x-kubernetes-preserve-unknown-fields",
        "x-kubernetes-list-type",
        "x-kubernetes-list-map-keys",
        "x-kubernetes-map-type",
        "x-kubernetes-validations",
    }
)
#: Allowed by Kubernetes under strict rules this module does not model, so refused outright.
JUNCTORS = frozenset({"allOf", "anyOf", "oneOf", "not"})
TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean"})
RULE_KEYS = frozenset(
    {"rule", "message", "messageExpression", "reason", "fieldPath", "optionalOldSelf"}
)

_NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_STRINGY = ("minLength", "maxLength", "pattern")
_ARRAYISH = ("minItems", "maxItems", "uniqueItems")
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_DATE_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")


# --- loading ----------------------------------------------------------------------------------


def load_crds(directory: Path) -> dict[str, dict[str, Any]]:
    """Every CRD in ``directory`` (``*.yaml``), by its kind."""
    crds: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.yaml")):
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
        crds[document["spec"]["names"]["kind"]] = document
    return crds


def version_of(crd: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The entry of ``spec.versions`` called ``name``; KeyError names the CRD when it is absent."""
    for version in crd["spec"]["versions"]:
        if version["name"] == name:
            return dict(version)
    raise KeyError(f"{crd['metadata']['name']} has no version {name!r}")


def schema_of(crd: Mapping[str, Any], version: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of one version of a CRD."""
    schema: dict[str, Any] = version_of(crd, version)["schema"]["openAPIV3Schema"]
    return schema


# --- structural schemas -----------------------------------------------------------------------


def structural_errors(schema: Mapping[str, Any]) -> list[str]:
    """The structural-schema rules ``schema`` (a CRD's ``openAPIV3Schema``) breaks; [] when none.

    Paths name schema nodes: ``spec.devices[]`` is the items of ``devices`` and
    ``spec.owner.quotas[*]`` the values of the ``quotas`` map.
    """
    errors: list[str] = []
    if schema.get("type") != "object":
        errors.append("(root): the root must be of type object")
    metadata = schema.get("properties", {}).get("metadata")
    if isinstance(metadata, Mapping):
        errors += _metadata_errors(metadata)
    _check_node(schema, "", errors, correlatable=True)
    return errors


def _metadata_errors(metadata: Mapping[str, Any]) -> list[str]:
    # The API server validates ObjectMeta itself; a CRD may only restrict name and generateName.
    errors = []
    if metadata.get("type") != "object":
        errors.append("metadata: must be of type object")
    extra = set(metadata.get("properties", {})) - {"name", "generateName"}
    extra |= set(metadata) - {"type", "description", "properties"}
    if extra:
        errors.append(f"metadata: may only restrict name and generateName, not {sorted(extra)}")
    return errors


def _check_node(node: Any, path: str, errors: list[str], *, correlatable: bool) -> None:
    where = path or "(root)"
    if not isinstance(node, Mapping):
        errors.append(f"{where}: a schema must be a mapping, not {type(node).__name__}")
        return
    for keyword in sorted(set(node) - KEYWORDS):
        if keyword in JUNCTORS:
            errors.append(f"{where}: {keyword} is not used in these CRDs (a logical junctor)")
        else:
            errors.append(f"{where}: unknown schema keyword {keyword!r}")
    int_or_string = node.get("x-kubernetes-int-or-string")
    preserve = node.get("x-kubernetes-preserve-unknown-fields")
    for flag, value in (("int-or-string", int_or_string), ("preserve-unknown-fields", preserve)):
        if value is not None and value is not True:
            errors.append(f"{where}: x-kubernetes-{flag} must be true when set")
    kind = node.get("type")
    if int_or_string:
        if kind is not None:
            errors.append(f"{where}: x-kubernetes-int-or-string needs no type")
    elif kind is None:
        if not preserve:
            errors.append(f"{where}: every node needs a type")
    elif kind not in TYPES:
        errors.append(f"{where}: unknown type {kind!r}")
    _check_keyword_placement(
        node, kind, int_or_string=bool(int_or_string), where=where, errors=errors
    )
    _check_enum(node, kind, int_or_string=bool(int_or_string), where=where, errors=errors)
    _check_list_and_map_types(node, kind, where=where, errors=errors)
    _check_rules(node, where=where, errors=errors, correlatable=correlatable)
    if "pattern" in node:
        try:
            re.compile(node["pattern"])
        except re.error as e:
            errors.append(f"{where}: pattern does not compile: {e}")
    if "default" in node:
        errors += [f"{where}: default: {e}" for e in validate(node["default"], node)]
    for name, child in node.get("properties", {}).items():
        _check_node(child, _join(path, name), errors, correlatable=correlatable)
    if isinstance(node.get("additionalProperties"), Mapping):
        _check_node(node["additionalProperties"], f"{path}[*]", errors, correlatable=correlatable)
    if "items" in node:
        # The API server pairs old and new items only in lists of type map (by their keys).
        keyed = correlatable and node.get("x-kubernetes-list-type") == "map"
        _check_node(node["items"], f"{path}[]", errors, correlatable=keyed)


def _check_keyword_placement(
    node: Mapping[str, Any], kind: Any, *, int_or_string: bool, where: str, errors: list[str]
) -> None:
    if "properties" in node and kind != "object":
        errors.append(f"{where}: properties are only for type object")
    if "additionalProperties" in node:
        if kind != "object":
            errors.append(f"{where}: additionalProperties is only for type object")
        if "properties" in node:
            errors.append(f"{where}: properties and additionalProperties exclude each other")
        if not isinstance(node["additionalProperties"], Mapping):
            errors.append(f"{where}: additionalProperties must be a schema")
    if kind == "array" and not isinstance(node.get("items"), Mapping):
        errors.append(f"{where}: an array needs items, one schema")
    if "items" in node and kind != "array":
        errors.append(f"{where}: items are only for type array")
    if node.get("uniqueItems") is True:
        errors.append(f"{where}: uniqueItems is forbidden; use x-kubernetes-list-type: set")
    numeric = kind in ("integer", "number") or int_or_string
    stringy = kind == "string" or int_or_string
    for keywords, fits, what in (
        (_NUMERIC, numeric, "numbers"),
        (_STRINGY, stringy, "strings"),
        (_ARRAYISH, kind == "array", "arrays"),
        (("minProperties", "maxProperties"), kind == "object", "objects"),
    ):
        for keyword in keywords:
            if keyword in node and not fits:
                errors.append(f"{where}: {keyword} is only for {what}")
    required = node.get("required", [])
    properties = node.get("properties", {})
    if "required" in node and not isinstance(required, list):
        errors.append(f"{where}: required must be a list of field names")
    elif properties or not node.get("x-kubernetes-preserve-unknown-fields"):
        for name in required:
            if name not in properties:
                errors.append(f"{where}: required names {name!r}, which is not a property")


def _check_enum(
    node: Mapping[str, Any], kind: Any, *, int_or_string: bool, where: str, errors: list[str]
) -> None:
    # Catches YAML's surprises: an unquoted off, yes or 1.0 in an enum of strings.
    if "enum" not in node:
        return
    if not isinstance(node["enum"], list) or not node["enum"]:
        errors.append(f"{where}: enum must be a non-empty list")
        return
    for value in node["enum"]:
        if int_or_string:
            fits = _is_int(value) or isinstance(value, str)
        else:
            fits = kind is None or _has_type(value, kind)
        if not fits:
            errors.append(f"{where}: enum value {value!r} is not of type {kind or 'int-or-string'}")


def _check_list_and_map_types(
    node: Mapping[str, Any], kind: Any, *, where: str, errors: list[str]
) -> None:
    list_type = node.get("x-kubernetes-list-type")
    if list_type is not None:
        if kind != "array":
            errors.append(f"{where}: x-kubernetes-list-type is only for arrays")
        if list_type not in ("atomic", "set", "map"):
            errors.append(f"{where}: x-kubernetes-list-type must be atomic, set or map")
    keys = node.get("x-kubernetes-list-map-keys")
    if list_type == "map" or keys is not None:
        items = node.get("items", {})
        if list_type != "map":
            errors.append(f"{where}: x-kubernetes-list-map-keys needs x-kubernetes-list-type map")
        if not isinstance(keys, list) or not keys:
            errors.append(f"{where}: a list of type map needs x-kubernetes-list-map-keys")
            keys = []
        if items.get("type") != "object":
            errors.append(f"{where}: a list of type map needs items of type object")
        for key in keys:
            key_schema = items.get("properties", {}).get(key)
            if key_schema is None:
                errors.append(f"{where}: list-map key {key!r} is not a property of the items")
            elif key_schema.get("type") not in ("string", "integer", "number", "boolean"):
                errors.append(f"{where}: list-map key {key!r} must be a scalar")
            if key not in items.get("required", []) and "default" not in (key_schema or {}):
                errors.append(f"{where}: list-map key {key!r} must be required or defaulted")
    map_type = node.get("x-kubernetes-map-type")
    if map_type is not None and (kind != "object" or map_type not in ("atomic", "granular")):
        errors.append(f"{where}: x-kubernetes-map-type is atomic or granular, on objects only")


def _check_rules(
    node: Mapping[str, Any], *, where: str, errors: list[str], correlatable: bool
) -> None:
    rules = node.get("x-kubernetes-validations")
    if rules is None:
        return
    if not isinstance(rules, list):
        errors.append(f"{where}: x-kubernetes-validations must be a list")
        return
    for i, rule in enumerate(rules):
        if not isinstance(rule, Mapping) or not isinstance(rule.get("rule"), str):
            errors.append(f"{where}: x-kubernetes-validations[{i}] needs a rule (a string)")
        elif set(rule) - RULE_KEYS:
            unknown = sorted(set(rule) - RULE_KEYS)
            errors.append(f"{where}: x-kubernetes-validations[{i}] has unknown keys {unknown}")
        elif "oldSelf" in rule["rule"] and not correlatable:
            errors.append(
                f"{where}: x-kubernetes-validations[{i}] uses oldSelf where old and new values "
                "cannot be paired (inside a list that is not of type map)"
            )


# --- validating objects -----------------------------------------------------------------------


def validate(instance: Any, schema: Mapping[str, Any]) -> list[str]:
    """What the API server would refuse or prune in ``instance``; [] when it is stored as is.

    At the root, as the API server does, ``metadata`` is only checked to be an object: ObjectMeta
    has its own validation and the CRD's schema never prunes it. CEL rules are not evaluated.
    """
    errors: list[str] = []
    _validate(instance, schema, "", errors, root=True)
    return errors


def _validate(
    value: Any, node: Mapping[str, Any], path: str, errors: list[str], *, root: bool = False
) -> None:
    unknown = set(node) - KEYWORDS
    if unknown:
        raise ValueError(f"{path or '(root)'}: the validator does not support {sorted(unknown)}")
    where = path or "(root)"
    if value is None:
        if not node.get("nullable"):
            errors.append(f"{where}: must not be null")
        return
    if node.get("x-kubernetes-int-or-string"):
        if not (_is_int(value) or isinstance(value, str)):
            errors.append(f"{where}: must be an integer or a string (got {_shown(value)})")
            return
    elif "type" in node and not _has_type(value, node["type"]):
        errors.append(f"{where}: must be of type {node['type']} (got {_shown(value)})")
        return
    if "enum" in node and not any(_same(value, option) for option in node["enum"]):
        allowed = ", ".join(repr(option) for option in node["enum"])
        errors.append(f"{where}: must be one of {allowed} (got {_shown(value)})")
    if _is_int(value) or isinstance(value, float):
        _validate_number(value, node, where, errors)
    elif isinstance(value, str):
        _validate_string(value, node, where, errors)
    elif isinstance(value, list):
        _validate_array(value, node, path, errors)
    elif isinstance(value, dict):
        _validate_object(value, node, path, errors, root=root)


def _validate_number(
    value: int | float, node: Mapping[str, Any], where: str, errors: list[str]
) -> None:
    if "minimum" in node:
        if node.get("exclusiveMinimum") and value <= node["minimum"]:
            errors.append(f"{where}: must be > {node['minimum']} (got {value})")
        elif value < node["minimum"]:
            errors.append(f"{where}: must be >= {node['minimum']} (got {value})")
    if "maximum" in node:
        if node.get("exclusiveMaximum") and value >= node["maximum"]:
            errors.append(f"{where}: must be < {node['maximum']} (got {value})")
        elif value > node["maximum"]:
            errors.append(f"{where}: must be <= {node['maximum']} (got {value})")
    if "multipleOf" in node and value % node["multipleOf"] != 0:
        errors.append(f"{where}: must be a multiple of {node['multipleOf']} (got {value})")
    bounds = _INT_RANGES.get(node.get("format", ""))
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        errors.append(f"{where}: out of the range of {node['format']} (got {value})")


def _validate_string(value: str, node: Mapping[str, Any], where: str, errors: list[str]) -> None:
    if "minLength" in node and len(value) < node["minLength"]:
        errors.append(f"{where}: must be at least {node['minLength']} characters long")
    if "maxLength" in node and len(value) > node["maxLength"]:
        errors.append(f"{where}: must be at most {node['maxLength']} characters long")
    # Kubernetes patterns are unanchored (Go regexp); ours anchor themselves with ^ and $.
    if "pattern" in node and re.search(node["pattern"], value) is None:
        errors.append(f"{where}: must match {node['pattern']} (got {value!r})")
    if node.get("format") == "date-time" and not _DATE_TIME.match(value):
        errors.append(f"{where}: must be an RFC 3339 date-time (got {value!r})")


def _validate_array(
    value: list[Any], node: Mapping[str, Any], path: str, errors: list[str]
) -> None:
    where = path or "(root)"
    if "minItems" in node and len(value) < node["minItems"]:
        errors.append(f"{where}: must have at least {node['minItems']} items (got {len(value)})")
    if "maxItems" in node and len(value) > node["maxItems"]:
        errors.append(f"{where}: must have at most {node['maxItems']} items (got {len(value)})")
    for i, item in enumerate(value):
        _validate(item, node["items"], f"{path}[{i}]", errors)
    list_type = node.get("x-kubernetes-list-type")
    if list_type == "set":
        for i, item in enumerate(value):
            if any(_same(item, earlier) for earlier in value[:i]):
                errors.append(f"{path}[{i}]: duplicate entry in a set")
    elif list_type == "map":
        keys = node["x-kubernetes-list-map-keys"]
        seen: list[tuple[Any, ...]] = []
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                continue
            key = tuple(item.get(k) for k in keys)
            if key in seen:
                shown = ", ".join(f"{k}={v!r}" for k, v in zip(keys, key, strict=True))
                errors.append(f"{path}[{i}]: duplicate entry with {shown}")
            seen.append(key)


def _validate_object(
    value: dict[str, Any], node: Mapping[str, Any], path: str, errors: list[str], *, root: bool
) -> None:
    where = path or "(root)"
    properties: Mapping[str, Any] = node.get("properties", {})
    extra = node.get("additionalProperties")
    preserve = bool(node.get("x-kubernetes-preserve-unknown-fields"))
    for name in node.get("required", []):
        if name not in value or (
            value[name] is None and not properties.get(name, {}).get("nullable")
        ):
            errors.append(f"{_join(path, name)}: required")
    if "minProperties" in node and len(value) < node["minProperties"]:
        errors.append(f"{where}: must have at least {node['minProperties']} fields")
    if "maxProperties" in node and len(value) > node["maxProperties"]:
        errors.append(f"{where}: must have at most {node['maxProperties']} fields")
    for name, item in value.items():
        if name in properties:
            child = _join(path, name)
            if root and name == "metadata":
                if not isinstance(item, dict):
                    errors.append(f"{child}: must be of type object (got {_shown(item)})")
            elif item is None and not properties[name].get("nullable"):
                if name not in node.get("required", []):
                    errors.append(f"{child}: null in a field that is not nullable, pruned")
            else:
                _validate(item, properties[name], child, errors)
        elif isinstance(extra, Mapping):
            _validate(item, extra, f"{path}[{name}]", errors)
        elif not preserve:
            errors.append(f"{_join(path, name)}: unknown field, pruned")


# --- helpers ----------------------------------------------------------------------------------


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _has_type(value: Any, kind: str) -> bool:
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return _is_int(value)
    if kind == "number":
        return _is_int(value) or isinstance(value, float)
    if kind == "boolean":
        return isinstance(value, bool)
    raise ValueError(f"unknown schema type {kind!r}")


def _same(a: Any, b: Any) -> bool:
    # JSON equality: True is not 1, and 1 == 1.0 only between numbers.
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if _is_number(a) and _is_number(b):
        return bool(a == b)
    return type(a) is type(b) and a == b


def _is_number(value: Any) -> bool:
    return _is_int(value) or isinstance(value, float)


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return repr(value)
