"""``-o jsonpath=TEMPLATE``'s template language (``kubectl/jsonpath.py``), as a pure function:
the cases kubectl's own documentation shows, and templates it refuses."""

from __future__ import annotations

import pytest

from bettercompute.kubectl.jsonpath import TemplateError, render

LISTED = {
    "kind": "List",
    "items": [
        {"metadata": {"name": "a"}, "status": {"state": "active", "gpus": 2, "ok": True}},
        {"metadata": {"name": "b"}, "status": {"state": "released"}},
    ],
}


@pytest.mark.parametrize(
    ("template", "printed"),
    [
        ("{.items[*].metadata.name}", "a b"),
        ("{.items[0].status.gpus}", "2"),
        ("{.items[0].status.ok}", "true"),
        ("{.items[-1:].metadata.name}", "b"),
        ("{.items[0].status}", '{"state":"active","gpus":2,"ok":true}'),
        ("{.items[0].nothing}", ""),
        ("name={.items[1].metadata.name};", "name=b;"),
        (
            r'{range .items[*]}{.metadata.name}{"\t"}{.status.state}{"\n"}{end}',
            "a\tactive\nb\treleased\n",
        ),
        ('{.items[?(@.status.state=="released")].metadata.name}', "b"),
        ("{..name}", "a b"),
        ("{range .items[0]}{@.metadata.name}{end}", "a"),
        ("{$.kind}", "List"),
    ],
)
def test_kubectls_templates_print_as_kubectl_prints_them(template: str, printed: str) -> None:
    assert render(template, LISTED) == printed


@pytest.mark.parametrize(
    ("template", "said"),
    [
        ("{.items[", "unbalanced braces"),
        ("items}", "unbalanced braces"),
        ("{range .items[*]}{.metadata.name}", "without its {end}"),
        ("{end}", "{end} without a {range"),
        ("{metadata.name}", "a path starts with ."),
        ('{"open}', "not a quoted string"),
        ("{.items[?(@.a==)]}", "{.items[?(@.a==)]}"),
    ],
)
def test_a_template_it_cannot_read_is_one_line_saying_why(template: str, said: str) -> None:
    with pytest.raises(TemplateError) as raised:
        render(template, LISTED)
    assert said in str(raised.value)
    assert "\n" not in str(raised.value)
