"""A custom resource checked as the API server checks it against its CRD: schema, then rules.

Why it exists: the API stand-in (``tests/support/admission.py``) must refuse, prune and keep
exactly what a real API server would for a CRD version's ``openAPIV3Schema``, so that tests of
the operator and the node agent only ever see objects a cluster could hold. ``check`` does it:

- prune what the structural schema does not declare (unknown fields, unless
  ``x-kubernetes-preserve-unknown-fields``; nulls in non-nullable fields); ``apiVersion``,
  ``kind`` and ``metadata`` are never pruned;
- types, required, enums, bounds, lengths, patterns, formats, list sets and maps, as
  ``tests/support/crdschema.py`` checks them, worded as the API server words them
  (``FieldValueRequired``, ``FieldValueTypeInvalid``, ``FieldValueNotSupported``,
  ``FieldValueInvalid``, with the field path);
- ``x-kubernetes-validations`` CEL rules with ``self`` at their node, and ``oldSelf`` for
  transition rules, which run only when the old object has a value there (properties and
  map values by key, items of ``x-kubernetes-list-type: map`` lists by their keys); a rule's
  ``message``, ``messageExpression``, ``reason`` and ``fieldPath``. As the API server, rules do
  not run on an object with a type or required error;
- ratcheting (Kubernetes 1.30+): on update, an error in a value the write did not change is
  dropped (transition rules excepted), so an object stored under an older CRD can still get
  its finalizers;
- ``status_only`` (a ``/status`` write): only ``status`` is pruned and checked.

Not done: ``default``s, the CEL cost budget, Kubernetes' CEL library extensions beyond
cel-python's standard functions (e.g. ``optional`` syntax, ``quantity()``).

What it must never do: change anything but the copy it returns, or do I/O.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import re
from collections.abc import Mapping
from typing import Any

import celpy
from celpy import adapter, celtypes

from tests.support import crdschema

_MISSING = object()  # no value at a path (unlike None, which is JSON null)
_ROOT_FIELDS = ("apiVersion", "kind", "metadata")  # every object has them; never pruned
_RULES_NOT_CHECKED = (
    'Invalid value: "null": some validation rules were not checked because the object was'
    " invalid; correct the existing errors to complete validation"
)
_PATH_PART = re.compile(r"([^.\[\]]+)|\[([^\]]*)\]")


@dataclasses.dataclass(frozen=True)
class FieldError:
    """One cause of a 422, as ``status.details.causes`` lists it."""

    path: str
    reason: str  # a Kubernetes CauseType, e.g. FieldValueInvalid
    message: str
    transition: bool = False  # from a rule naming oldSelf: never ratcheted


@dataclasses.dataclass(frozen=True)
class Checked:
    """What ``check`` found: the object to store, the paths pruned, the errors (none: valid)."""

    obj: dict[str, Any]
    pruned: list[str]
    errors: list[FieldError]


def check(
    obj: dict[str, Any],
    old: dict[str, Any] | None,
    schema: Mapping[str, Any],
    *,
    status_only: bool,
) -> Checked:
    """``obj`` (with ``old`` on update) against a CRD version's ``openAPIV3Schema``."""
    obj = copy.deepcopy(obj)
    if status_only:
        status_schema = schema.get("properties", {}).get("status", {})
        schema = {"type": "object", "properties": {"status": status_schema}}
        checked = {"status": obj["status"]} if "status" in obj else {}
    else:
        checked = obj
    pruned: list[str] = []
    _prune(checked, schema, "", pruned, root=True)
    if status_only:
        obj.pop("status", None)
        obj.update(checked)
    found = crdschema.validate(checked, _with_implicit_root(schema))

    def ratcheted(found: list[FieldError]) -> list[FieldError]:
        # What this write did not change may stay as it was.
        if old is None:
            return found
        return [e for e in found if e.transition or _changed(checked, old, e.path)]

    errors = ratcheted([_from_schema(text, checked) for text in found])
    if any(e.reason in ("FieldValueRequired", "FieldValueTypeInvalid") for e in errors):
        errors.append(FieldError("<nil>", "FieldValueInvalid", _RULES_NOT_CHECKED))
    else:
        errors += ratcheted(_rule_errors(checked, old, schema, ""))
    return Checked(obj=obj, pruned=pruned, errors=errors)


# --- CEL --------------------------------------------------------------------------------------


@functools.cache
def _program(expression: str) -> celpy.Runner:
    # Compiling is most of the cost; the same few expressions run on every write.
    environment = celpy.Environment()
    return environment.program(environment.compile(expression))


def evaluate(expression: str, variables: Mapping[str, Any]) -> Any:
    """``expression`` (CEL) with JSON ``variables``, as plain Python; raises on any error."""
    return _evaluated(expression, json.dumps(variables, sort_keys=True))


@functools.lru_cache(maxsize=4096)
def _evaluated(expression: str, variables: str) -> Any:
    # CEL is pure and celpy interprets slowly (a millisecond a rule): an operator rewrites the
    # same spec many times (finalizers, annotations), so the same rule meets the same values.
    activation = {name: adapter.json_to_cel(value) for name, value in json.loads(variables).items()}
    result = _program(expression).evaluate(activation)
    if isinstance(result, celpy.CELEvalError):
        raise result
    return _plain(result)


def _plain(value: Any) -> Any:
    if isinstance(value, celtypes.BoolType):
        return bool(value)
    if isinstance(value, celtypes.IntType | celtypes.UintType):
        return int(value)
    if isinstance(value, celtypes.DoubleType):
        return float(value)
    if isinstance(value, celtypes.StringType):
        return str(value)
    if isinstance(value, celtypes.ListType):
        return [_plain(v) for v in value]
    if isinstance(value, celtypes.MapType):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value


def _rule_errors(value: Any, old: Any, node: Mapping[str, Any], path: str) -> list[FieldError]:
    """The ``x-kubernetes-validations`` of ``node`` and below that ``value`` breaks; ``old``
    is the correlated old value (``_MISSING``/None when there is none)."""
    if value is None or value is _MISSING:
        return []
    old = _MISSING if old is None else old
    errors: list[FieldError] = []
    for rule in node.get("x-kubernetes-validations") or []:
        transition = "oldSelf" in rule["rule"]
        if transition and old is _MISSING:
            continue  # a transition rule needs an old value
        variables = {"self": value} | ({"oldSelf": old} if transition else {})
        where = path + str(rule.get("fieldPath") or "")
        reason = str(rule.get("reason") or "FieldValueInvalid")
        try:
            passed = evaluate(rule["rule"], variables)
        except Exception as e:
            message = f"Invalid value: {_type_name(value)}: rule {rule['rule']!r}: {e}"
            errors.append(FieldError(where or "<nil>", "FieldValueInvalid", message, transition))
            continue
        if passed is True:
            continue
        text = rule.get("message") or f"failed rule: {rule['rule']}"
        if rule.get("messageExpression"):
            # The API server falls back to message when messageExpression fails.
            with contextlib.suppress(Exception):
                text = str(evaluate(rule["messageExpression"], variables))
        message = f"Invalid value: {_type_name(value)}: {text}"
        errors.append(FieldError(where or "<nil>", reason, message, transition))
    if isinstance(value, dict):
        properties = node.get("properties") or {}
        extra = node.get("additionalProperties")
        old_map = old if isinstance(old, dict) else {}
        for name, item in value.items():
            if name in properties:
                child, at = properties[name], _join(path, name)
            elif isinstance(extra, Mapping):
                child, at = extra, f"{path}[{name}]"
            else:
                continue
            errors += _rule_errors(item, old_map.get(name, _MISSING), child, at)
    elif isinstance(value, list) and isinstance(node.get("items"), Mapping):
        keys = node.get("x-kubernetes-list-map-keys") or []
        keyed = node.get("x-kubernetes-list-type") == "map" and isinstance(old, list)
        for i, item in enumerate(value):
            before: Any = _MISSING
            if keyed and isinstance(item, dict):
                key = [item.get(k) for k in keys]
                before = next(
                    (o for o in old if isinstance(o, dict) and [o.get(k) for k in keys] == key),
                    _MISSING,
                )
            errors += _rule_errors(item, before, node["items"], f"{path}[{i}]")
    return errors


def _type_name(value: Any) -> str:
    # The API server names the type, not the value, in a rule's refusal.
    for kind, name in ((bool, "boolean"), (dict, "object"), (list, "array"), (str, "string")):
        if isinstance(value, kind):
            return f'"{name}"'
    return '"integer"' if isinstance(value, int) else '"number"'


# --- pruning and schema errors ----------------------------------------------------------------


def _prune(
    value: Any, node: Mapping[str, Any], path: str, pruned: list[str], *, root: bool
) -> None:
    """Drop from ``value`` (in place) what the schema does not declare, as the API server
    does for a structural schema; nulls in non-nullable fields go silently, unknown fields are
    listed in ``pruned``."""
    if isinstance(value, dict):
        properties = node.get("properties") or {}
        extra = node.get("additionalProperties")
        preserve = bool(node.get("x-kubernetes-preserve-unknown-fields")) or not node
        for name in list(value):
            if root and name in _ROOT_FIELDS:
                continue  # ObjectMeta has its own validation; the schema never prunes it
            item = value[name]
            child_schema = properties.get(name) if name in properties else extra
            if isinstance(child_schema, Mapping):
                if item is None and not child_schema.get("nullable"):
                    del value[name]
                    continue
                at = _join(path, name) if name in properties else f"{path}[{name}]"
                _prune(item, child_schema, at, pruned, root=False)
            elif not (preserve or extra is True):
                del value[name]
                pruned.append(_join(path, name))
    elif isinstance(value, list) and isinstance(node.get("items"), Mapping):
        for i, item in enumerate(value):
            _prune(item, node["items"], f"{path}[{i}]", pruned, root=False)


def _with_implicit_root(schema: Mapping[str, Any]) -> dict[str, Any]:
    # Every custom resource has apiVersion, kind and metadata, named in its schema or not.
    properties = dict(schema.get("properties", {}))
    for name in _ROOT_FIELDS:
        properties.setdefault(name, {"type": "string" if name != "metadata" else "object"})
    return {**schema, "properties": properties}


def _from_schema(text: str, obj: Any) -> FieldError:
    """A ``crdschema`` error (``"<path>: <reason>"``) as the API server words it."""
    path, _, reason = text.partition(": ")
    if reason == "required":
        return FieldError(path, "FieldValueRequired", "Required value")
    value = _at(obj, path)
    shown = "null" if value is _MISSING else json.dumps(value)
    if reason.startswith("must be of type"):
        return FieldError(path, "FieldValueTypeInvalid", f"Invalid value: {shown}: {reason}")
    if reason.startswith("must be one of"):
        return FieldError(path, "FieldValueNotSupported", f"Unsupported value: {shown}: {reason}")
    return FieldError(path, "FieldValueInvalid", f"Invalid value: {shown}: {reason}")


def _at(obj: Any, path: str) -> Any:
    """The value at a Kubernetes field path (``spec.devices[0].count``, ``quotas[gpu:H100]``)."""
    value = obj
    for name, bracket in _PATH_PART.findall(path):
        if name:
            value = value.get(name, _MISSING) if isinstance(value, dict) else _MISSING
        elif isinstance(value, list) and bracket.isdigit() and int(bracket) < len(value):
            value = value[int(bracket)]
        elif isinstance(value, dict):
            value = value.get(bracket, _MISSING)
        else:
            value = _MISSING
        if value is _MISSING:
            return _MISSING
    return value


def _changed(new: Any, old: Any, path: str) -> bool:
    """Whether the write changed the value at ``path``; for a value it lacks (a required field
    missing), whether it changed the nearest enclosing value it has."""
    parts = [m.group(0) for m in _PATH_PART.finditer(path)]
    while parts:
        at = "".join(p if p.startswith("[") or i == 0 else f".{p}" for i, p in enumerate(parts))
        now = _at(new, at)
        if now is not _MISSING:
            return bool(now != _at(old, at))
        parts.pop()
    return True


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
