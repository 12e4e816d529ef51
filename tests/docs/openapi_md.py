"""The HTTP API reference page, written from the server's own OpenAPI document.

Why it exists: ``bettercompute.api.openapi.document()`` is built from the models the server
validates with, so it is what the server accepts and answers. This module turns that document
into a page a person reads: each operation with its request body's fields (type, required,
default, description), its answer's fields and its error statuses. A test fails when the
committed page differs from what this makes of the current document, so the page cannot drift.

What it must never do: start a server, read anything but the document it is given, or add a
claim of its own about a field: every word about a field comes from the document.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tests.docs import mdtext

Schema = Mapping[str, Any]

_COMPONENT = "#/components/{kind}/"
#: Patterns longer than this are left out of the type column; the description says the form.
MAX_PATTERN = 40


def render(document: Mapping[str, Any], *, title: str, intro: str, source: str) -> str:
    """The reference page of ``document`` (an OpenAPI 3.1 document as a dict)."""
    return _Page(document).render(title=title, intro=intro, source=source)


class _Page:
    def __init__(self, document: Mapping[str, Any]) -> None:
        self.document = document
        components = document.get("components") or {}
        self.schemas: Mapping[str, Schema] = components.get("schemas") or {}
        self.responses: Mapping[str, Any] = components.get("responses") or {}
        self.parameters: Mapping[str, Any] = components.get("parameters") or {}
        self.operations = list(_operations(document))
        self.errors = self._error_statuses()
        # The answers' objects get sections of their own, linked from every field that holds
        # one; the request bodies' nested objects are written out inside their operation.
        roots = [name for _, _, op in self.operations if (name := _answer_of(op)) is not None]
        roots += [
            name
            for response in self.responses.values()
            if (name := _ref_name(_json_schema(response) or {})) is not None
        ]
        self.sections = self._reachable(roots)

    # --- the page -------------------------------------------------------------------------

    def render(self, *, title: str, intro: str, source: str) -> str:
        info = self.document.get("info") or {}
        blocks = [mdtext.GENERATED.format(source=source), f"# {title}", intro]
        if info.get("description"):
            blocks.append(mdtext.text(info["description"]))
        blocks.append("## Operations")
        blocks.append(
            mdtext.table(
                ["Operation", "What it does"],
                (
                    [f"[{mdtext.code(_title(m, p))}](#{_slug(_title(m, p))})", _summary(op)]
                    for p, m, op in self.operations
                ),
            )
        )
        blocks.extend(self._headers())
        for path, method, op in self.operations:
            blocks.extend(self._operation(path, method, op))
        blocks.extend(self._error_section())
        blocks.append("## Answer objects")
        blocks.append(
            "The objects the operations answer with, inside `data`, and the error envelope."
            " A field whose *Always there* is no may be missing from an answer."
        )
        for name in self.sections:
            blocks.extend(self._object(name))
        return mdtext.page(blocks)

    def _headers(self) -> list[str]:
        if not self.parameters:
            return []
        rows = [
            [
                mdtext.code(str(p.get("name"))),
                "yes" if p.get("required") else "no",
                mdtext.cell(str(p.get("description") or "")),
            ]
            for p in self.parameters.values()
            if p.get("in") == "header"
        ]
        schemes = (self.document.get("components") or {}).get("securitySchemes") or {}
        bearer = any(s.get("scheme") == "bearer" for s in schemes.values())
        if bearer:
            rows.insert(
                0,
                [
                    mdtext.code("Authorization"),
                    "yes",
                    mdtext.cell("Bearer <token>: for every operation that needs the bearer token."),
                ],
            )
        return ["## Headers", mdtext.table(["Header", "Required", "Description"], rows)]

    def _operation(self, path: str, method: str, op: Mapping[str, Any]) -> list[str]:
        blocks = [f"## {mdtext.code(_title(method, path))}"]
        if op.get("summary"):
            blocks.append(_sentence(mdtext.text(str(op["summary"]))))
        facts = []
        if op.get("operationId"):
            facts.append(f"Operation {mdtext.code(str(op['operationId']))}.")
        security = op.get("security")
        if security == []:
            facts.append("No token needed.")
        elif security:
            facts.append("Needs the bearer token.")
        shared = [
            self.parameters[name]
            for p in op.get("parameters") or ()
            if (name := _ref_name(p, kind="parameters")) in self.parameters
        ]
        if shared:
            named = ", ".join(
                mdtext.code(str(h.get("name"))) + (" (required)" if h.get("required") else "")
                for h in shared
            )
            facts.append(f"Headers: {named}; see [Headers](#headers).")
        if facts:
            blocks.append(" ".join(facts))
        if op.get("description"):
            blocks.append(mdtext.text(str(op["description"])))
        own = [p for p in op.get("parameters") or () if "$ref" not in p]
        if own:
            blocks.append("**Parameters**:")
            blocks.append(
                mdtext.table(
                    ["Parameter", "In", "Type", "Required", "Description"],
                    (
                        [
                            mdtext.code(str(p.get("name"))),
                            str(p.get("in") or ""),
                            self._type(p.get("schema") or {}),
                            "yes" if p.get("required") else "no",
                            mdtext.cell(str(p.get("description") or "")),
                        ]
                        for p in own
                    ),
                )
            )
        body = (op.get("requestBody") or {}).get("content") or {}
        body_schema = (body.get("application/json") or {}).get("schema")
        if body_schema is not None:
            blocks.extend(self._request(body_schema))
        blocks.extend(self._answers(op))
        return blocks

    def _request(self, schema: Schema) -> list[str]:
        name = _ref_name(schema)
        resolved = self._resolve(schema)
        head = "**Request body**"
        if name:
            head += f" ({mdtext.code(name)})"
        blocks = [head + ":"]
        words = []
        if resolved.get("description"):
            words.append(mdtext.text(str(resolved["description"])))
        if resolved.get("additionalProperties") is False:
            words.append("Other fields are refused.")
        if words:
            blocks.append(" ".join(words))
        rows = list(self._fields(resolved, prefix="", expand=True))
        if rows:
            blocks.append(
                mdtext.table(["Field", "Type", "Required", "Default", "Description"], rows)
            )
        return blocks

    def _answers(self, op: Mapping[str, Any]) -> list[str]:
        blocks = []
        responses = op.get("responses") or {}
        for status in sorted(responses, key=str):
            response = responses[status]
            if "$ref" in response:
                continue  # an error answer: listed below
            for content_type, content in sorted((response.get("content") or {}).items()):
                schema = content.get("schema") or {}
                data = ((schema.get("properties") or {}).get("data")) or None
                if data is not None:
                    said = mdtext.cell(str(response.get("description") or ""))
                    blocks.append(f"**Answer** ({status}): {said} `data` is {self._type(data)}.")
                else:
                    said = _sentence(mdtext.cell(str(response.get("description") or "")))
                    blocks.append(
                        f"**Answer** ({status}, {mdtext.code(content_type)}):"
                        f" {self._type(schema)}. {said}".rstrip()
                    )
        errors = [str(s) for s in sorted(responses, key=str) if "$ref" in responses[s]]
        if errors:
            listed = ", ".join(f"[{s}](#{_slug(f'Status {s}')})" for s in errors)
            blocks.append(f"**Errors**: {listed}.")
        return blocks

    def _error_section(self) -> list[str]:
        if not self.errors:
            return []
        blocks = [
            "## Errors",
            "Every refusal answers the error envelope, [`Error`](#error): a code, a message and"
            " details. The statuses an operation may answer, and the codes each carries:",
        ]
        for status, name in self.errors:
            response = self.responses.get(name) or {}
            blocks.append(f"### Status {status}")
            blocks.append(
                f"{mdtext.code(name)}: {mdtext.text(str(response.get('description') or ''))}"
            )
        return blocks

    def _object(self, name: str) -> list[str]:
        schema = self.schemas[name]
        blocks = [f"### {mdtext.code(name)}"]
        if schema.get("description"):
            blocks.append(mdtext.text(str(schema["description"])))
        rows = [
            [row[0], row[1], row[2], row[4]]
            for row in self._fields(schema, prefix="", expand=False)
        ]
        if rows:
            blocks.append(mdtext.table(["Field", "Type", "Always there", "Description"], rows))
        else:
            blocks.append(f"{self._type(schema).capitalize()}.")
        return blocks

    # --- fields ---------------------------------------------------------------------------

    def _fields(self, schema: Schema, *, prefix: str, expand: bool) -> Iterator[list[str]]:
        """One row per field; with ``expand``, the fields of nested objects follow their parent
        as ``parent.field`` (``parent[].field`` for a list of objects)."""
        required = set(schema.get("required") or ())
        for field, prop in (schema.get("properties") or {}).items():
            name = prefix + field
            yield [
                mdtext.code(name),
                self._type(prop),
                "yes" if field in required else "no",
                _default(prop),
                mdtext.cell(self._description(prop)),
            ]
            if not expand:
                continue
            nested, marker = self._nested(prop)
            if nested is not None:
                yield from self._fields(nested, prefix=f"{name}{marker}.", expand=True)

    def _nested(self, prop: Schema) -> tuple[Schema | None, str]:
        """The object schema a request field holds (itself, or as the items of a list)."""
        for option in [prop, *(prop.get("anyOf") or ()), *(prop.get("oneOf") or ())]:
            if option.get("type") == "array" and isinstance(option.get("items"), Mapping):
                inner = self._resolve(option["items"])
                if inner.get("properties"):
                    return inner, "[]"
            resolved = self._resolve(option)
            if resolved.get("properties") and resolved is not prop:
                return resolved, ""
        return None, ""

    def _description(self, prop: Schema) -> str:
        if prop.get("description"):
            return str(prop["description"])
        options = [*(prop.get("oneOf") or ()), *(prop.get("anyOf") or ())]
        said = [f"{self._base(o)}: {o['description']}" for o in options if o.get("description")]
        if said:
            return " ".join(said)
        name = _ref_name(prop)
        if name and name not in self.sections:
            return str(self.schemas.get(name, {}).get("description") or "")
        return ""

    # --- types ----------------------------------------------------------------------------

    def _type(self, schema: Schema) -> str:
        options = schema.get("oneOf") or schema.get("anyOf")
        if options and "type" not in schema:
            parts = list(dict.fromkeys(self._type(option) for option in options))
            return " or ".join(parts)
        base = self._base(schema)
        limits = _limits(schema)
        return f"{base} ({limits})" if limits else base

    def _base(self, schema: Schema) -> str:
        name = _ref_name(schema)
        if name is not None:
            return f"[{mdtext.code(name)}](#{_slug(name)})" if name in self.sections else "object"
        if "const" in schema:
            return mdtext.code(json.dumps(schema["const"]))
        if "enum" in schema:
            return "one of " + ", ".join(mdtext.code(_literal(v)) for v in schema["enum"])
        kinds = schema.get("type")
        names = kinds if isinstance(kinds, list) else [kinds]
        return " or ".join(self._kind(kind, schema) for kind in names)

    def _kind(self, kind: Any, schema: Schema) -> str:
        if kind == "array":
            items = schema.get("items")
            inner = self._type(items) if isinstance(items, Mapping) else "value"
            return f"list of {inner}s" if inner in ("object", "value") else f"list of {inner}"
        if kind == "object":
            extra = schema.get("additionalProperties")
            if isinstance(extra, Mapping) and extra:
                return "map of names to " + self._type(extra)
            fields = [
                f"{mdtext.code(name)} ({self._type(prop)})"
                for name, prop in (schema.get("properties") or {}).items()
            ]
            return "object with " + ", ".join(fields) if fields else "object"
        if kind is None:
            return "any value"
        return str(kind)

    # --- the document ---------------------------------------------------------------------

    def _resolve(self, schema: Schema) -> Schema:
        name = _ref_name(schema)
        return self.schemas.get(name, {}) if name is not None else schema

    def _reachable(self, roots: Sequence[str]) -> list[str]:
        """``roots`` and every schema they refer to, in the order first met."""
        found: list[str] = []
        todo = list(roots)
        while todo:
            name = todo.pop(0)
            if name in found or name not in self.schemas:
                continue
            found.append(name)
            todo.extend(_refs(self.schemas[name]))
        return found

    def _error_statuses(self) -> list[tuple[str, str]]:
        seen: dict[str, str] = {}
        for _, _, op in self.operations:
            for status, response in (op.get("responses") or {}).items():
                name = _ref_name(response, kind="responses")
                if name is not None:
                    seen.setdefault(str(status), name)
        return sorted(seen.items())


def _operations(document: Mapping[str, Any]) -> Iterator[tuple[str, str, Mapping[str, Any]]]:
    for path, item in (document.get("paths") or {}).items():
        for method, op in item.items():
            if method in ("get", "put", "post", "delete", "patch"):
                yield path, method, op


def _answer_of(op: Mapping[str, Any]) -> str | None:
    ok = (op.get("responses") or {}).get("200") or {}
    schema = _json_schema(ok) or {}
    return _ref_name(((schema.get("properties") or {}).get("data")) or {})


def _json_schema(response: Mapping[str, Any]) -> Schema | None:
    content = (response.get("content") or {}).get("application/json") or {}
    schema = content.get("schema")
    return schema if isinstance(schema, Mapping) else None


def _refs(node: Any) -> Iterator[str]:
    """Every schema name ``node`` refers to, in document order."""
    if isinstance(node, Mapping):
        name = _ref_name(node)
        if name is not None:
            yield name
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _ref_name(node: Mapping[str, Any], *, kind: str = "schemas") -> str | None:
    ref = node.get("$ref")
    prefix = _COMPONENT.format(kind=kind)
    if isinstance(ref, str) and ref.startswith(prefix):
        return ref[len(prefix) :]
    return None


def _limits(schema: Schema) -> str:
    parts = []
    for low, high, unit in (
        ("minimum", "maximum", ""),
        ("minLength", "maxLength", " characters"),
        ("minItems", "maxItems", " items"),
    ):
        lo, hi = schema.get(low), schema.get(high)
        if lo is not None and hi is not None:
            parts.append(f"{lo} to {hi}{unit}")
        elif lo is not None:
            parts.append(f"at least {lo}{unit}")
        elif hi is not None:
            parts.append(f"at most {hi}{unit}")
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and len(pattern) <= MAX_PATTERN:
        parts.append(f"matching {mdtext.code(pattern)}")
    return ", ".join(parts)


def _default(schema: Schema) -> str:
    if "default" not in schema or schema["default"] is None:
        return ""
    return mdtext.code(json.dumps(schema["default"]))


def _literal(value: Any) -> str:
    return "null" if value is None else str(value)


def _sentence(said: str) -> str:
    """``said`` ending in a full stop, unless it is empty."""
    return said if not said or said.endswith((".", "!", "?")) else said + "."


def _summary(op: Mapping[str, Any]) -> str:
    return mdtext.cell(str(op.get("summary") or ""))


def _title(method: str, path: str) -> str:
    return f"{method.upper()} {path}"


def _slug(heading: str) -> str:
    """The id the site (and GitHub) gives a heading: the anchor of a link to it."""
    words = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", words)
