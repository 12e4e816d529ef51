"""A small, honest PromQL evaluator for the chart's alert rules, at one instant.

Why: ``promtool test rules`` is not available here (no binaries may be downloaded), and a rule
that only looks right (a regex over its text) can still never fire, or fire on every process.
This evaluates the subset of PromQL the shipped rules use, with Prometheus's semantics, against
synthetic series: instant vector selectors with ``=``, ``!=``, ``=~``, ``!~`` matchers;
``sum``/``max``/``min``/``count`` with ``by``; ``+ - * /`` and the comparison operators
between scalars and vectors (one-to-one matching on every label but the name; comparisons
filter); ``and``; ``time()``; ``absent()``; parentheses and number literals.

What it must never do: guess. Anything outside that subset (a range vector, ``offset``,
``on``/``ignoring``, ``bool``, another function) raises ``Unsupported``, so a rule written
beyond what can be evaluated fails its test instead of passing untested.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

Labels = Mapping[str, str]
#: One sample of an instant vector: its labels (``__name__`` included) and value.
Sample = tuple[dict[str, str], float]
Value = float | list[Sample]


class Unsupported(Exception):
    """The expression uses PromQL this evaluator does not implement."""


_TOKEN = re.compile(
    r"\s*(?:(?P<number>\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
    r"|(?P<string>\"(?:[^\"\\]|\\.)*\")"
    r"|(?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r"|(?P<op>==|!=|>=|<=|=~|!~|[-+*/<>=(){},]))"
)
_AGGREGATIONS: dict[str, Callable[[list[float]], float]] = {
    "sum": sum,
    "max": lambda xs: max((x for x in xs if not math.isnan(x)), default=math.nan),
    "min": lambda xs: min((x for x in xs if not math.isnan(x)), default=math.nan),
    "count": lambda xs: float(len(xs)),
}
_ARITHMETIC: dict[str, Callable[[float, float], float]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: (
        a / b if b else (math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a))
    ),
}


def _divided_by_zero(a: float) -> float:
    return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a)


_COMPARISON: dict[str, Callable[[float, float], bool]] = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
}


def _tokens(text: str) -> list[str]:
    out: list[str] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            raise Unsupported(f"cannot read {text[pos:]!r}")
        out.append(match.group(match.lastgroup or ""))
        pos = match.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str
    value: str

    def matches(self, labels: Labels) -> bool:
        have = labels.get(self.label, "")
        if self.op == "=":
            return have == self.value
        if self.op == "!=":
            return have != self.value
        found = re.fullmatch(self.value, have) is not None
        return found if self.op == "=~" else not found


class _Parser:
    def __init__(self, text: str, series: Sequence[Sample], now: float) -> None:
        self.tokens = _tokens(text)
        self.i = 0
        self.series = series
        self.now = now

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise Unsupported(f"expected {expected!r}, found {token!r}")
        self.i += 1
        return token

    def parse(self) -> Value:
        value = self.or_expr()
        if self.peek() is not None:
            raise Unsupported(f"unexpected {self.peek()!r}")
        return value

    def or_expr(self) -> Value:
        left = self.and_expr()
        if self.peek() in ("or", "unless"):
            raise Unsupported(self.peek())
        return left

    def and_expr(self) -> Value:
        left = self.comparison()
        while self.peek() == "and":
            self.take()
            right = self.comparison()
            if not isinstance(left, list) or not isinstance(right, list):
                raise Unsupported("and between scalars")
            keys = {_key(labels) for labels, _ in right}
            left = [(labels, v) for labels, v in left if _key(labels) in keys]
        return left

    def comparison(self) -> Value:
        left = self.additive()
        while self.peek() in _COMPARISON:
            op = self.take()
            if self.peek() == "bool":
                raise Unsupported("bool")
            left = _compare(op, left, self.additive())
        return left

    def additive(self) -> Value:
        left = self.multiplicative()
        while self.peek() in ("+", "-"):
            op = self.take()
            left = _arithmetic(op, left, self.multiplicative())
        return left

    def multiplicative(self) -> Value:
        left = self.unary()
        while self.peek() in ("*", "/"):
            op = self.take()
            left = _arithmetic(op, left, self.unary())
        return left

    def unary(self) -> Value:
        if self.peek() == "-":
            self.take()
            return _arithmetic("*", -1.0, self.unary())
        return self.primary()

    def primary(self) -> Value:
        token = self.peek()
        if token is None:
            raise Unsupported("unexpected end")
        if token == "(":
            self.take()
            value = self.or_expr()
            self.take(")")
            return value
        if re.fullmatch(r"\d.*", token):
            self.take()
            return float(token)
        if token in _AGGREGATIONS:
            return self.aggregation()
        if token == "time":
            self.take()
            self.take("(")
            self.take(")")
            return self.now
        if token == "absent":
            self.take()
            self.take("(")
            start = self.i
            inner = self.or_expr()
            self.take(")")
            if not isinstance(inner, list):
                raise Unsupported("absent of a scalar")
            if inner:
                return []
            return [(self._equalities(self.tokens[start : self.i - 1]), 1.0)]
        if re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", token):
            return self.selector()
        raise Unsupported(token)

    def aggregation(self) -> list[Sample]:
        name = self.take()
        by: list[str] | None = None
        if self.peek() == "by":
            self.take()
            by = self.label_list()
        elif self.peek() == "without":
            raise Unsupported("without")
        self.take("(")
        inner = self.or_expr()
        self.take(")")
        if self.peek() == "by":
            self.take()
            by = self.label_list()
        if not isinstance(inner, list):
            raise Unsupported(f"{name} of a scalar")
        groups: dict[tuple[tuple[str, str], ...], list[float]] = {}
        for labels, value in inner:
            group = tuple((k, labels[k]) for k in (by or []) if labels.get(k, "") != "")
            groups.setdefault(group, []).append(value)
        return [(dict(group), _AGGREGATIONS[name](values)) for group, values in groups.items()]

    def label_list(self) -> list[str]:
        self.take("(")
        labels = [self.take()]
        while self.peek() == ",":
            self.take()
            labels.append(self.take())
        self.take(")")
        return labels

    def selector(self) -> list[Sample]:
        name = self.take()
        if name in ("by", "without", "on", "ignoring", "offset", "bool", "or", "unless"):
            raise Unsupported(name)
        matchers = [Matcher("__name__", "=", name)]
        if self.peek() == "{":
            matchers += self.matchers()
        if self.peek() == "[":
            raise Unsupported("range vectors")
        return [
            (dict(labels), value)
            for labels, value in self.series
            if all(m.matches(labels) for m in matchers)
        ]

    def matchers(self) -> list[Matcher]:
        self.take("{")
        out: list[Matcher] = []
        while self.peek() != "}":
            label = self.take()
            op = self.take()
            if op not in ("=", "!=", "=~", "!~"):
                raise Unsupported(op)
            raw = self.take()
            out.append(Matcher(label, op, raw[1:-1].encode().decode("unicode_escape")))
            if self.peek() == ",":
                self.take()
        self.take("}")
        return out

    @staticmethod
    def _equalities(tokens: list[str]) -> dict[str, str]:
        """absent()'s labels: the ``=`` matchers of the selector in its argument."""
        out: dict[str, str] = {}
        for i in range(len(tokens) - 2):
            if tokens[i + 1] == "=" and tokens[i + 2].startswith('"'):
                out[tokens[i]] = tokens[i + 2][1:-1]
        return out


def _key(labels: Labels) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k != "__name__"))


def _unnamed(labels: Labels) -> dict[str, str]:
    return {k: v for k, v in labels.items() if k != "__name__"}


def _arithmetic(op: str, left: Value, right: Value) -> Value:
    f = _ARITHMETIC[op]
    if not isinstance(left, list) and not isinstance(right, list):
        return f(left, right)
    if isinstance(left, list) and not isinstance(right, list):
        return [(_unnamed(labels), f(v, right)) for labels, v in left]
    if not isinstance(left, list) and isinstance(right, list):
        return [(_unnamed(labels), f(left, v)) for labels, v in right]
    assert isinstance(left, list)
    assert isinstance(right, list)
    by_key = _one_to_one(right)
    return [
        (_unnamed(labels), f(v, by_key[_key(labels)]))
        for labels, v in left
        if _key(labels) in by_key
    ]


def _compare(op: str, left: Value, right: Value) -> Value:
    f = _COMPARISON[op]
    if not isinstance(left, list) and not isinstance(right, list):
        raise Unsupported("a comparison of two scalars needs bool")
    if isinstance(left, list) and not isinstance(right, list):
        return [(labels, v) for labels, v in left if f(v, right)]
    if not isinstance(left, list) and isinstance(right, list):
        return [(labels, v) for labels, v in right if f(left, v)]
    assert isinstance(left, list)
    assert isinstance(right, list)
    by_key = _one_to_one(right)
    return [
        (labels, v) for labels, v in left if _key(labels) in by_key and f(v, by_key[_key(labels)])
    ]


def _one_to_one(samples: list[Sample]) -> dict[tuple[tuple[str, str], ...], float]:
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for labels, v in samples:
        key = _key(labels)
        if key in out:
            raise Unsupported("many-to-one matching")
        out[key] = v
    return out


def evaluate(expr: str, series: Sequence[Sample], *, now: float) -> Value:
    """``expr`` at ``now`` (unix seconds) over ``series``: a scalar or an instant vector."""
    return _Parser(expr, series, now).parse()


def sample(name: str, value: float, **labels: str) -> Sample:
    """One synthetic series' sample."""
    return ({"__name__": name, **labels}, value)
