"""``-o jsonpath=TEMPLATE``: kubectl's JSONPath templates over the objects we print.

Why it exists: scripts written for ``kubectl get -o jsonpath=…`` should work on ``kubectl bcd``.
kubectl's template is text with ``{…}`` expressions; the path inside each is JSONPath relative
to the current object, which ``jsonpath-ng`` (its extended parser) evaluates. The template
language around it is ours and small: literal text, ``{.path}`` (every match, joined by a
space; a map or list as compact JSON, as kubectl prints it), ``{"text"}`` (a quoted literal
with ``\\n``, ``\\t`` escapes), ``{range .path}…{end}`` (the inner template once per match),
``{@}`` (the current object). Filters (``[?(@.status.state=="active")]``), slices, ``[*]`` and
``..`` are jsonpath-ng's.

What it must never do: evaluate anything but JSONPath, or raise anything but ``TemplateError``
(a usage error naming ``--output``) for a template it cannot read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from jsonpath_ng.ext.parser import parse


class TemplateError(ValueError):
    """A template that cannot be read: what is wrong, in one line."""


@dataclass
class _Node:
    """Literal text, a path to print, or a ``range`` with its body."""

    text: str | None = None
    path: Any = None
    body: list[_Node] = field(default_factory=list)
    is_range: bool = False


_EXPRESSION = re.compile(r"\{([^{}]*)\}")


def _path(expr: str) -> Any:
    expr = expr.strip()
    if expr in ("", "@", "$"):
        expr = "$"
    elif expr.startswith("."):
        expr = "$" + expr
    elif expr.startswith("@"):
        expr = "$" + expr[1:]
    elif not expr.startswith("$"):
        raise TemplateError(f"{{{expr}}}: a path starts with . (such as {{.metadata.name}})")
    try:
        return parse(expr)
    except Exception as e:  # jsonpath-ng's lexer and parser raise several kinds
        said = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TemplateError(f"{{{expr.removeprefix('$')}}}: {said}") from None


def compile_template(template: str) -> list[_Node]:
    """The template's nodes; ``TemplateError`` when it cannot be read."""
    root: list[_Node] = []
    stack: list[list[_Node]] = [root]
    at = 0
    for found in _EXPRESSION.finditer(template):
        if found.start() > at:
            stack[-1].append(_Node(text=template[at : found.start()]))
        at = found.end()
        inner = found.group(1).strip()
        if inner.startswith('"') or inner.startswith("'"):
            if len(inner) < 2 or inner[-1] != inner[0]:
                raise TemplateError(f"{{{inner}}}: not a quoted string")
            try:
                text = json.loads('"' + inner[1:-1].replace('"', '\\"') + '"', strict=False)
            except json.JSONDecodeError:
                raise TemplateError(f"{{{inner}}}: not a quoted string") from None
            stack[-1].append(_Node(text=text))
        elif inner == "end":
            if len(stack) == 1:
                raise TemplateError("{end} without a {range …}")
            stack.pop()
        elif inner.startswith("range ") or inner == "range":
            node = _Node(path=_path(inner.removeprefix("range")), is_range=True)
            stack[-1].append(node)
            stack.append(node.body)
        else:
            stack[-1].append(_Node(path=_path(inner)))
    rest = template[at:]
    if "{" in rest or "}" in rest:
        raise TemplateError(f"unbalanced braces in {rest!r}")
    if rest:
        stack[-1].append(_Node(text=rest))
    if len(stack) > 1:
        raise TemplateError("a {range …} without its {end}")
    return root


def _shown(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _render(nodes: list[_Node], data: Any) -> str:
    out: list[str] = []
    for node in nodes:
        if node.text is not None:
            out.append(node.text)
        elif node.is_range:
            for match in node.path.find(data):
                out.append(_render(node.body, match.value))
        else:
            out.append(" ".join(_shown(m.value) for m in node.path.find(data)))
    return "".join(out)


def render(template: str, data: Any) -> str:
    """``data`` through ``template``, as ``kubectl get -o jsonpath=template`` prints it."""
    return _render(compile_template(template), data)
