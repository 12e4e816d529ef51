"""A pydantic validation failure as one problem a person can act on: where, and why.

Why it exists: the dev configuration file and the operator's ``GPUPool`` validate the same pool
models (``core.pools``) and must say the same thing about the same mistake: the path to the bad
value (``pools[1].sharing``, ``spec.owner.tenant``), the reason in words, a "did you mean" for a
misspelt key. Each caller adds its own place (a file and line, an object's ``spec``).

What it must never do: read files, know a caller's format or let a pydantic error escape.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Collection, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ValidationError

#: A path into the validated data: keys and list indexes.
Loc = tuple[str | int, ...]


def first_problem(
    error: ValidationError, model: type[BaseModel], *, tags: Collection[str] = ()
) -> tuple[Loc, str]:
    """The one problem to report of ``error`` from validating ``model``, as (path, reason).

    ``tags`` are union tags pydantic puts in a location that are no part of the data.
    """
    found = error.errors(include_url=False)
    # A misspelt key is also a missing one: name the misspelling, it says more.
    first = next((x for x in found if x["type"] == "extra_forbidden"), found[0])
    loc = tuple(p for p in first["loc"] if p not in tags)
    return loc, _reason(first, loc, model)


def path(loc: Loc, *, under: str = "") -> str:
    """``loc`` as a person writes it (``pools[1].policy.maxPending``), below ``under``."""
    out = under
    for part in loc:
        if part == "[key]":  # pydantic's marker for a bad mapping key; the key itself precedes
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _reason(error: Mapping[str, Any], loc: Loc, model: type[BaseModel]) -> str:
    kind = error.get("type", "")
    if kind == "extra_forbidden":
        allowed = _keys_at(model, loc[:-1])
        key = str(loc[-1])
        hint = difflib.get_close_matches(key, allowed, n=1)
        more = f"; did you mean {hint[0]!r}?" if hint else f" (allowed: {', '.join(allowed)})"
        return f"unknown key {key!r}{more}"
    if kind == "missing":
        return "required"
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    value = error.get("input")
    if isinstance(value, str | int | float | bool):
        return f"{message} (got {value!r})"
    return message


def _keys_at(model: type[BaseModel], loc: Loc) -> list[str]:
    """The keys the model at ``loc`` accepts, for "did you mean"."""
    found: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = found.model_fields.get(part) if _is_model(found) else None
        if field is None:
            return []
        found = _model_of(field.annotation)
    return list(found.model_fields) if _is_model(found) else []


def _is_model(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, BaseModel)


def _model_of(annotation: Any) -> Any:
    """The model class inside ``list[X]``, ``X | None``, ``dict[str, X]`` or ``Annotated``."""
    if _is_model(annotation):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _model_of(typing.get_args(annotation)[0])
    if origin in (list, dict, typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_of(arg)
            if found is not None:
                return found
    return None
